"""`testbed demo`: the end-to-end job on an embedded default, no arguments needed.

By default: the restart A/B of `testbed bench restart --preset cpu-smoke` — a tiny random-weight
model served by vLLM (CPU) with and without the ADP connector; prompts cold, engine restarted, same
prompts warm; TTFT and prefix-cache hits side by side. The verdict compares the warm outputs token by
token with a local prefix-cache hit's and every restored page byte for byte with the saved page
(``--corrupt-card``: the negative control, which must fail).

``--datapath`` (no vLLM needed) shows the layers below the connector instead:

1. Start the userspace ADP emulator (file-backed namespace, any free loopback port).
2. Find its subsystem through the discovery controller and connect the NVMe/TCP host client.
3. Write random data in mixed sizes across several I/O queues, read it back, compare bytes.
4. Stop the target, start it again over the same backing file, and read everything back again:
   the data survived the restart, byte for byte.
5. Print a results table (and JSON with ``--json``).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import tempfile
import time
from pathlib import Path

from adp_connector.nvmeof.host import Controller, HostConfig

from . import options as O
from .sizes import format_size
from .targets import LocalTarget

SIZES = [4096, 64 << 10, 128 << 10, 1 << 20, 3 << 20, 4 << 20]


def _layout(total: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    out, off = [], 0
    while off < total:
        n = min(rng.choice(SIZES), total - off)
        out.append((off, n))
        off += n
    return out


def _connect(addr: str, port: int) -> Controller:
    return Controller.connect(HostConfig(traddr=addr, trsvcid=port, subnqn=None, io_queues=4, queue_depth=64))


def run(total: int = 64 << 20) -> dict:
    results: dict = {"bytes": total}
    with tempfile.TemporaryDirectory(prefix="adp-kv-demo-") as tmp:
        backing = Path(tmp) / "namespace.img"
        layout = _layout(total)
        data = memoryview(bytearray(os.urandom(total)))
        digest = hashlib.blake2b(data).hexdigest()
        with LocalTarget(capacity=1 << 30, backing=str(backing)) as tgt:
            results["target"] = f"{tgt.traddr}:{tgt.trsvcid}"
            with _connect(tgt.traddr, tgt.trsvcid) as dev:
                results["subnqn"] = dev.config.subnqn
                results["mdts"] = dev.max_transfer_bytes
                results["lba_size"] = dev.lba_size
                t0 = time.perf_counter()
                futs = [dev.submit_write(off, data[off : off + n]) for off, n in layout]
                for f in futs:
                    f.result(60)
                dev.flush()
                results["write_gbps"] = round(total / (time.perf_counter() - t0) / 1e9, 3)
                back = memoryview(bytearray(total))
                t0 = time.perf_counter()
                futs = [dev.submit_read(off, back[off : off + n]) for off, n in layout]
                for f in futs:
                    f.result(60)
                results["read_gbps"] = round(total / (time.perf_counter() - t0) / 1e9, 3)
                results["identical"] = hashlib.blake2b(back).hexdigest() == digest
                results["commands"] = dev.stats.commands
        # The target process is gone; a new one serves the same backing file.
        with LocalTarget(capacity=1 << 30, backing=str(backing)) as tgt2, _connect(tgt2.traddr, tgt2.trsvcid) as dev:
            back = memoryview(bytearray(total))
            dev.read_into(0, back)
            results["identical_after_restart"] = hashlib.blake2b(back).hexdigest() == digest
    results["requests"] = len(layout)
    return results


#: Options of `testbed demo` that only the vLLM demo (not --datapath) uses: passed on to `bench restart`.
PASSED_ON = ("target", "nqn", "yes_destroy", "vllm_python")


def main(args: argparse.Namespace) -> int:
    if not getattr(args, "datapath", False):
        return restart_ab(args)
    used = [n for n in PASSED_ON if getattr(args, n, None)]
    if used or getattr(args, "corrupt_card", False):
        raise O.UsageError(f"testbed demo --datapath runs its own local target; "
                           f"--{(used or ['corrupt_card'])[0].replace('_', '-')} is for the vLLM demo")
    return datapath_demo(args)


def restart_ab(args: argparse.Namespace) -> int:
    """The restart scenario, both arms, on the CPU preset; exit status 0 only if its acceptance holds."""
    from .bench import restart

    p = O.OneLineParser(prog="testbed demo")
    restart.add_arguments(p)
    argv = ["--preset", "cpu-smoke"]
    if getattr(args, "json", None):
        argv += ["--json", args.json]
    if getattr(args, "corrupt_card", False):
        argv.append("--corrupt-card")
    if getattr(args, "target", None):
        argv += ["--target", args.target]
    if getattr(args, "nqn", None):
        argv += ["--nqn", args.nqn]
    if getattr(args, "yes_destroy", False):
        argv.append("--yes-destroy")
    if getattr(args, "vllm_python", None):
        argv += ["--vllm-python", args.vllm_python]
    print("ADP KV demo: vLLM (CPU, tiny random-weight model) with and without the ADP connector;\n"
          "prompts cold -> engine restart -> same prompts warm (takes a few minutes: engine starts dominate).\n"
          "Verdict: warm outputs equal to a local prefix-cache hit's, and every restored page byte-identical to "
          "the page saved")
    inner = p.parse_args(argv)
    O.resolve_target(inner)
    inner.json_stream = getattr(args, "json_stream", None)
    rc = restart.main(inner)
    print("RESULT:", "PASS" if rc == 0 else "FAIL")
    return rc


def datapath_demo(args: argparse.Namespace) -> int:
    print("ADP KV demo: userspace NVMe/TCP emulator + host client, write / read / restart / read")
    r = run()
    rows = [
        ("target", r["target"]),
        ("subsystem", r["subnqn"]),
        ("LBA size / max transfer", f"{r['lba_size']} / {format_size(r['mdts'])}"),
        ("data", f"{format_size(r['bytes'])} in {r['requests']} requests ({r['commands']} NVMe commands)"),
        ("write", f"{r['write_gbps']:.3f} GB/s"),
        ("read", f"{r['read_gbps']:.3f} GB/s"),
        ("read back identical", r["identical"]),
        ("identical after target restart", r["identical_after_restart"]),
    ]
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{w}}  {v}")
    O.emit_json(args, r)
    ok = r["identical"] and r["identical_after_restart"]
    print("RESULT:", "PASS" if ok else "FAIL")
    return 0 if ok else 1
