"""Store benchmark: page-store save/load GB/s vs the raw NVMe/TCP client on the same target, in one run."""

from __future__ import annotations

import argparse

from adp_connector.store.bench import run_benchmark
from adp_connector.store.format import align_up

from .. import options as O
from ..sizes import format_size, parse_size, positive_size, size_list
from ..targets import LocalTarget, connect_existing, refuse_to_destroy


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--page-size", type=positive_size, default=parse_size("2M"), help="bytes per KV page")
    p.add_argument("--pages", type=O.int_in(1, 1 << 20), default=64)
    p.add_argument("--batch", type=O.int_in(1, 4096), default=16, help="pages per save/load batch")
    p.add_argument("--queues", type=O.int_in(1, 128), default=4)
    p.add_argument("--mdts", type=size_list, default=size_list("128K"),
                   help="emulator MDTS, comma-separated for several runs")
    O.add_target_options(p, "ADDR:PORT of an existing target (a real card), the connector's traddr:trsvcid, "
                            "instead of the local emulator; a page store is written into it (refused when it holds "
                            "data, unless --yes-destroy)")
    p.add_argument("--yes-destroy", action="store_true",
                   help="with --target: format the namespace even if it holds data or a page store")
    O.add_json_option(p, "the results")


def _one(addr: str, port: int, nqn: str | None, args: argparse.Namespace, external: bool = False) -> dict:
    ctrl = connect_existing(addr, port, nqn, io_queues=args.queues, queue_depth=64)
    with ctrl:  # type: ignore[attr-defined]
        if external:
            refuse_to_destroy(ctrl, f"{addr}:{port}", "testbed bench store", args.yes_destroy)
        r = run_benchmark(ctrl, args.page_size, args.pages, args.batch)
        r["max_transfer"] = ctrl.max_transfer_bytes
    r["save_vs_raw_write"] = r["store_save_gbps"] / r["raw_write_gbps"]
    r["load_vs_raw_read"] = r["store_load_gbps"] / r["raw_read_gbps"]
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}


def main(args: argparse.Namespace) -> int:
    results = []
    if args.target:
        host, _, port = args.target.rpartition(":")
        results.append(_one(host, int(port), args.nqn, args, external=True))
    else:
        for mdts in args.mdts:
            need = align_up(args.page_size * args.pages * 3, 4096) + (256 << 20)  # whole 4 KiB blocks
            with LocalTarget(capacity=need, mdts=mdts) as t:
                results.append(_one(t.traddr, t.trsvcid, t.subnqn, args))
    for r in results:
        print(f"max transfer {format_size(r['max_transfer']):>5}  pages {args.pages} x {format_size(args.page_size)}  "
              f"store save {r['store_save_gbps']:.3f} GB/s vs raw write {r['raw_write_gbps']:.3f} "
              f"({r['save_vs_raw_write']:.2f}x)  store load {r['store_load_gbps']:.3f} GB/s vs raw read "
              f"{r['raw_read_gbps']:.3f} ({r['load_vs_raw_read']:.2f}x)")
    O.emit_json(args, results)
    return 0
