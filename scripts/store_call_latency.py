"""Round-trip time of a page-store helper's synchronous calls (``StoreProcess.contains``), alone and beside a thread
that runs Python bytecode without pause, at given interpreter switch intervals.

The connector's scheduler asks the card which keys it holds every engine step that fills a block (``_plan_saves``) and
for each waiting request every ``LOOKUP_REUSE_S`` (``get_num_new_matched_tokens``). Beside a thread that holds the
interpreter lock, each blocking system call of the call (the request's send, the answer's receive) waits up to the
switch interval (5 ms by default) to take the lock back.

    .venv/bin/python scripts/store_call_latency.py                       # alone, then beside a thread at 5 and 0.5 ms
    .venv/bin/python scripts/store_call_latency.py --keys 1,2500 --calls 50 --switch-intervals 0.005 --json

A userspace target in a temporary file and one writer helper; nothing else is touched.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

from adp_connector.nvmeof.host import Controller, HostConfig
from adp_connector.store import StoreConfig
from adp_connector.store.process import SharedArena, StoreProcess
from adp_emulator.target import TargetSettings, UserspaceTarget

NQN = "nqn.2026-11.io.awide:call-latency"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def measure(sp: StoreProcess, keys_per_call: list[int], calls: int) -> dict[int, dict[str, float]]:
    """Median and 90th percentile of ``contains`` for each key count (ms), after a few calls not counted."""
    out = {}
    for n in keys_per_call:
        keys = [os.urandom(32) for _ in range(n)]
        for _ in range(max(1, calls // 10)):
            sp.contains(keys)
        ts = []
        for _ in range(calls):
            t0 = time.perf_counter()
            sp.contains(keys)
            ts.append(time.perf_counter() - t0)
        ts.sort()
        out[n] = {"median_ms": round(statistics.median(ts) * 1e3, 3),
                  "p90_ms": round(ts[min(len(ts) - 1, int(len(ts) * 0.9))] * 1e3, 3)}
    return out


def _spin(stop: threading.Event) -> None:
    """Run bytecode until ``stop`` (a thread that holds the interpreter lock whenever it can)."""
    x = 0
    while not stop.is_set():
        for _ in range(1000):
            x += 1


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=_ints, default=[1, 64, 512, 2500], help="keys per call, comma-separated")
    ap.add_argument("--calls", type=int, default=200, help="timed calls per key count")
    ap.add_argument("--switch-intervals", type=_floats, default=[0.005, 0.0005],
                    help="switch intervals (s) to run beside a bytecode thread at, comma-separated (empty: none)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.calls < 1 or not a.keys or min(a.keys) < 1:
        ap.error("--calls and every --keys count must be at least 1")
    rows = []
    with tempfile.TemporaryDirectory(prefix="adp-call-latency-") as d:
        target = UserspaceTarget(TargetSettings(port=0, subnqn=NQN, capacity_bytes=64 << 20, lba_size=512,
                                                mdts_bytes=128 << 10, backing_path=os.path.join(d, "ns.img")))
        target.start()
        arena = SharedArena(1 << 20)
        host, port = target.address
        sp = StoreProcess.start(Controller.connect, (HostConfig(traddr=host, trsvcid=port, subnqn=NQN),),
                                StoreConfig(writer=True, writer_id=b"w" * 16, partitions=2, avg_page_bytes=64 << 10),
                                arena)
        default = sys.getswitchinterval()
        try:
            rows.append({"beside": "nothing", "switch_interval_s": default, "calls": measure(sp, a.keys, a.calls)})
            for si in a.switch_intervals:
                stop = threading.Event()
                sys.setswitchinterval(si)
                th = threading.Thread(target=_spin, args=(stop,), daemon=True)
                th.start()
                try:
                    rows.append({"beside": "a bytecode thread", "switch_interval_s": si,
                                 "calls": measure(sp, a.keys, a.calls)})
                finally:
                    stop.set()
                    th.join()
                    sys.setswitchinterval(default)
        finally:
            sp.close()
            target.stop()
            arena.close()
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            cells = "  ".join(f"{n} keys {c['median_ms']:.3f} ms (p90 {c['p90_ms']:.3f})"
                              for n, c in r["calls"].items())
            print(f"beside {r['beside']:<17} switch {r['switch_interval_s'] * 1e3:.1f} ms: {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
