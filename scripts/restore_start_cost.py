"""What starting restores and read-aheads costs the caller's thread while other restores are in flight.

In vLLM the connector's ``start_load_kv`` runs on the engine's thread every step: for each request it starts a
restore (``RestorePipeline.start``) or reads one ahead (``RestorePipeline.read_ahead``), beside the restore driver
thread that moves landed batches, and beside the store proxies' reader threads. This script runs that pattern on the
CPU with the real pipeline, the real store helpers and a local emulated card: a new request every third step of
``--step-ms``, read ahead at once and started two steps later, ``--pages`` pages each, ``--requests`` requests per
round. It reports the caller's time in each call (mean, p90, max, total), the driver's passes, the process's CPU
time and the wall time of all rounds.

    .venv-vllm/bin/python scripts/restore_start_cost.py --json docs/results/restore-start-cost-devvm-1.json

The card lives in RAM for the run only; nothing else is touched.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from adp_connector.nvmeof.host import Controller, HostConfig
from adp_connector.store import PageStore, StoreConfig
from adp_connector.store.keys import KeyNamespace
from adp_connector.store.process import SharedArena, StoreGroup
from adp_testbed.bench.restore import DiscardSink, save_point, wait_arena_populated
from adp_testbed.hostinfo import host_info
from adp_testbed.targets import LocalTarget


def _summary(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"n": len(s), "mean_ms": round(1e3 * statistics.mean(s), 3), "p90_ms": round(1e3 * s[int(0.9 * len(s))], 3),
            "max_ms": round(1e3 * s[-1], 3), "total_s": round(sum(s), 3)}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=1875, help="pages per request (a 30k-token history at 16 tokens a "
                    "block: 1,875)")
    ap.add_argument("--requests", type=int, default=8, help="requests per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--page-kib", type=int, default=128, help="KiB per page")
    ap.add_argument("--batch-pages", type=int, default=32, help="pages per staging slab")
    ap.add_argument("--slabs", type=int, default=64)
    ap.add_argument("--helpers", type=int, default=2, help="store helpers the restores are spread over")
    ap.add_argument("--step-ms", type=float, default=20.0, help="the caller's step (an engine step's length)")
    ap.add_argument("--no-driver", action="store_true", help="no driver thread: the caller's polls move the batches")
    ap.add_argument("--json", metavar="PATH", help="also write the results here")
    return ap


def main() -> int:
    a = build_parser().parse_args()
    import torch  # the restore pipeline stages through torch tensors (not needed to read the options)

    from adp_connector.pipeline import Counters, LoadJob, RestorePipeline, StagingPool

    if min(a.pages, a.requests, a.rounds, a.page_kib, a.batch_pages, a.slabs, a.helpers) < 1 or a.step_ms <= 0:
        print("error: every count must be >= 1 and --step-ms > 0", file=sys.stderr)
        return 2
    page = a.page_kib << 10
    n_pages = a.pages * a.requests
    keys = KeyNamespace("start-cost", "bf16", "bench", 16).keys_for_block_hashes(
        i.to_bytes(8, "little") for i in range(n_pages))
    arena = SharedArena(a.batch_pages * page * a.slabs)
    pattern = os.urandom(a.batch_pages * page)
    for i in range(a.slabs):
        arena.map[i * len(pattern):(i + 1) * len(pattern)] = pattern
    capacity = (int(2 * n_pages * (page + 8192) * 1.2) + (1 << 30)) // (1 << 20) * (1 << 20)
    calls: dict[str, list[float]] = {"start": [], "read_ahead": [], "poll": []}
    with LocalTarget(capacity=capacity, mdts=1 << 20, io_workers=1) as t:
        hc = HostConfig(traddr=t.traddr, trsvcid=t.trsvcid, subnqn=t.subnqn, io_queues=2, queue_depth=64,
                        command_timeout=120.0)
        with Controller.connect(hc) as ctrl:
            PageStore.format(ctrl, partitions=4, avg_page_bytes=page)
        wcfg = StoreConfig(writer_id=b"start-cost-save1", io_threads=4, heartbeat_interval_s=0, claim_settle_s=0.1,
                           io_timeout_s=120.0)
        saver = StoreGroup.start(Controller.connect, (hc,), wcfg, arena, readers=0, writers=1, timeout=60)
        try:
            wait_arena_populated(saver, len(saver.pids))
            save_point(saver, arena, keys, page, a.batch_pages, a.slabs)
        finally:
            saver.close()
        rcfg = StoreConfig(writer_id=b"start-cost-load1", io_threads=4, heartbeat_interval_s=0, claim_settle_s=0.05,
                           io_timeout_s=120.0)
        group = StoreGroup.start(Controller.connect, (hc,), rcfg, arena, readers=a.helpers - 1, timeout=60)
        try:
            wait_arena_populated(group, len(group.pids))
            host = torch.frombuffer(arena.map, dtype=torch.int8)[:a.batch_pages * page * a.slabs]
            pool = StagingPool(a.batch_pages * page, 0, pinned=False, arena=host)
            pipe = RestorePipeline(DiscardSink(), pool, {0: page}, Counters(), timeout_s=3600.0)
            pipe.ahead_max_bytes = a.batch_pages * page * a.slabs // 2
            passes = [0]
            move = pipe._move

            def counted_move(store: Any, now: float) -> None:
                passes[0] += 1
                move(store, now)

            pipe._move = counted_move  # type: ignore[method-assign]
            if not a.no_driver:
                pipe.run_driver(lambda: group)

            def timed(name: str, fn: Any, *args: Any) -> Any:
                s = time.perf_counter()
                out = fn(*args)
                calls[name].append(time.perf_counter() - s)
                return out

            cpu0, t0 = os.times(), time.perf_counter()
            ring = a.slabs * a.batch_pages
            for rnd in range(a.rounds):
                waiting, ahead_at, step, running = list(range(a.requests)), {}, 0, 0
                while waiting or ahead_at or running:
                    if waiting and step % 3 == 0:
                        r = waiting.pop(0)
                        rid = f"r{rnd}-{r}"
                        timed("read_ahead", pipe.read_ahead, rid,
                              [(0, keys[r * a.pages + i]) for i in range(a.pages)], group)
                        ahead_at[rid] = (r, step)
                    for rid, (r, s0) in list(ahead_at.items()):
                        if step - s0 >= 2:
                            job = LoadJob(rid, [(0, i % ring, keys[r * a.pages + i]) for i in range(a.pages)], [],
                                          time.monotonic())
                            timed("start", pipe.start, job, group)
                            del ahead_at[rid]
                            running += 1
                    running -= len(timed("poll", pipe.poll, group))
                    time.sleep(a.step_ms / 1e3)
                    step += 1
            wall = time.perf_counter() - t0
            cpu1 = os.times()
            pipe.stop_driver()
        finally:
            group.close()
    gb = n_pages * page * a.rounds / 1e9
    out = {"params": vars(a), "environment": host_info(), "calls": {k: _summary(v) for k, v in calls.items()},
           "driver_passes": passes[0], "process_cpu_s": round(cpu1[0] + cpu1[1] - cpu0[0] - cpu0[1], 3),
           "wall_s": round(wall, 3), "gb": round(gb, 3)}
    for name, s in out["calls"].items():
        print(f"{name:10s} {s['n']:4d} calls: mean {s['mean_ms']:8.3f} ms  p90 {s['p90_ms']:8.3f}  max "
              f"{s['max_ms']:8.3f}  total {s['total_s']:.3f} s")
    print(f"driver passes {out['driver_passes']}; process CPU {out['process_cpu_s']} s; {gb:.2f} GB in "
          f"{out['wall_s']} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
