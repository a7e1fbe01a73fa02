"""Store benchmark: page-store save/load GB/s vs the raw NVMe/TCP client on the same target, in one run."""

from __future__ import annotations

import argparse
import json

from adp_connector.nvmeof.host import Controller, HostConfig
from adp_connector.store.bench import run_benchmark

from ..sizes import format_size, parse_size
from ..targets import LocalTarget


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--page-size", type=parse_size, default=parse_size("2M"), help="bytes per KV page")
    p.add_argument("--pages", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="pages per save/load batch")
    p.add_argument("--queues", type=int, default=4)
    p.add_argument("--mdts", default="128K", help="emulator MDTS, comma-separated for several runs")
    p.add_argument("--target", help="ADDR:PORT of an existing target (a real card); its namespace is FORMATTED")
    p.add_argument("--nqn", help="subsystem NQN with --target")
    p.add_argument("--json", help="write results to this file")


def _one(addr: str, port: int, nqn: str | None, args: argparse.Namespace) -> dict:
    cfg = HostConfig(traddr=addr, trsvcid=port, subnqn=nqn, io_queues=args.queues, queue_depth=64)
    with Controller.connect(cfg) as ctrl:
        r = run_benchmark(ctrl, args.page_size, args.pages, args.batch)
        r["max_transfer"] = ctrl.max_transfer_bytes
    r["save_vs_raw_write"] = r["store_save_gbps"] / r["raw_write_gbps"]
    r["load_vs_raw_read"] = r["store_load_gbps"] / r["raw_read_gbps"]
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}


def main(args: argparse.Namespace) -> int:
    results = []
    if args.target:
        host, _, port = args.target.rpartition(":")
        results.append(_one(host, int(port), args.nqn, args))
    else:
        for mdts in [parse_size(x) for x in args.mdts.split(",")]:
            need = args.page_size * args.pages * 3 + (256 << 20)
            with LocalTarget(capacity=need, mdts=mdts) as t:
                results.append(_one(t.traddr, t.trsvcid, t.subnqn, args))
    for r in results:
        print(f"max transfer {format_size(r['max_transfer']):>5}  pages {args.pages} x {format_size(args.page_size)}  "
              f"store save {r['store_save_gbps']:.3f} GB/s vs raw write {r['raw_write_gbps']:.3f} "
              f"({r['save_vs_raw_write']:.2f}x)  store load {r['store_load_gbps']:.3f} GB/s vs raw read "
              f"{r['raw_read_gbps']:.3f} ({r['load_vs_raw_read']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
