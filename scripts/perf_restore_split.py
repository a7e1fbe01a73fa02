"""Where the restore helpers' CPU goes, kernel included: ``perf script`` output -> share of samples per category.

    perf record -F 499 -a -g -o perf.data -- .venv-vllm/bin/testbed bench restore-path --gb 2 --helpers 2 \\
        --queues 2 --target-workers 1 --mdts 1M
    perf script -i perf.data -F pid,tid,time,ip,sym,dso -G > perf.script
    python3 scripts/perf_restore_split.py perf.script            # [--pids 8001,8020]

The restore helpers are found as the processes whose samples hold both socket receive copies (``_copy_to_iter``)
and page checksums (``XXH3``), more receives than sends (the save path's writers send; the target receives but
takes no checksum). Only their samples inside the receive window (first to last receive copy) count. Categories
are matched on the sampled symbol, first match wins (the table below, in order).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

CATEGORIES = [
    ("socket receive copy", r"_copy_to_iter|copy_user|rep_movs|memcpy_orig"),
    ("page checksum (XXH3)", r"XXH"),
    ("TCP/IP stack and softirq", r"tcp_|skb|softirq|ip_|__netif|net_rx|sock_|inet_|__dev_queue|loopback|napi|recvmsg|"
                                 r"release_sock|lock_sock"),
    ("wakeups, locks, scheduling", r"spin_|futex|schedule|finish_task_switch|try_to_wake|wake_up|pthread_|sem_"),
    ("Python interpreter and objects", r"libpython|_Py|Py[A-Z]"),
    ("memory management", r"page_fault|unmap|clear_page|folio|filemap|mmap|madvise|zap_|pte|mm_fault|get_user_pages"),
]


def parse(lines: list[str]) -> list[tuple[str, float, str]]:
    """(pid, time, symbol and dso) per sample of ``perf script -F pid,tid,time,ip,sym,dso -G``."""
    out = []
    for line in lines:
        parts = line.split()
        if len(parts) < 4 or "/" not in parts[0]:
            continue
        try:
            t = float(parts[1].rstrip(":"))
        except ValueError:
            continue
        out.append((parts[0].split("/")[0], t, " ".join(parts[3:])))
    return out


def helper_pids(samples: list[tuple[str, float, str]]) -> set[str]:
    """Processes that receive pages and checksum them (see the module docstring)."""
    rx, tx, xxh = collections.Counter(), collections.Counter(), collections.Counter()
    for pid, _, sym in samples:
        rx[pid] += "_copy_to_iter" in sym
        tx[pid] += "_copy_from_iter" in sym
        xxh[pid] += "XXH" in sym
    return {p for p in rx if rx[p] and xxh[p] and rx[p] > tx[p]}


def split(samples: list[tuple[str, float, str]], pids: set[str]) -> tuple[collections.Counter, int, float]:
    """Samples per category of ``pids`` inside their receive window; (counts, total, window seconds)."""
    mine = [(t, sym) for pid, t, sym in samples if pid in pids]
    rx = [t for t, sym in mine if "_copy_to_iter" in sym]
    if not rx:
        return collections.Counter(), 0, 0.0
    t0, t1 = min(rx), max(rx)
    counts: collections.Counter = collections.Counter()
    total = 0
    for t, sym in mine:
        if t0 <= t <= t1:
            total += 1
            counts[next((name for name, rx_ in CATEGORIES if re.search(rx_, sym)), "other")] += 1
    return counts, total, t1 - t0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("script", help="perf script output (-F pid,tid,time,ip,sym,dso -G)")
    ap.add_argument("--pids", help="comma-separated helper pids (default: found as the docstring says)")
    return ap


def main() -> int:
    args = build_parser().parse_args()
    with open(args.script, errors="replace") as f:
        samples = parse(f.readlines())
    pids = set(args.pids.split(",")) if args.pids else helper_pids(samples)
    if not pids:
        print("perf_restore_split: no process both receives pages and checksums them", file=sys.stderr)
        return 1
    counts, total, window = split(samples, pids)
    print(f"helpers {','.join(sorted(pids))}: {total} samples in a {window:.3f} s receive window")
    print("| category | samples | share |\n|---|---|---|")
    for name in [c for c, _ in CATEGORIES] + ["other"]:
        print(f"| {name} | {counts[name]} | {100 * counts[name] / max(total, 1):.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
