"""Restore-path benchmark: the connector's page-restore machinery without vLLM, in one run.

A local userspace target (``--target-workers`` I/O worker processes) gets ``--gb`` of pages saved
through the store; then, for each helper count in ``--helpers``, a :class:`StoreGroup` (one writer
helper + read-only helpers, as the connector's ``load_processes``) loads them back into a shared
staging arena in batches of ``--batch-mb``, ``--slabs`` batches in flight, the way a restore streams
through the connector's staging. ``--into gpu`` copies each landed slab on into GPU memory (torch, a
side stream) before the slab is reused. Reported per point: GB/s, and the CPU seconds the target
and the helpers spent (where the cycles go); the loopback stream ceiling with as many connections is
measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from adp_connector.nvmeof.host import Controller, HostConfig
from adp_connector.store import PageStore, StoreConfig
from adp_connector.store.keys import KeyNamespace
from adp_connector.store.process import SharedArena, StoreGroup, StoreProcess

from .. import options as O
from ..sizes import parse_size
from ..targets import LocalTarget, refuse_to_overwrite_file
from .stream import StreamServer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gb", type=float, default=1.0, help="GB of pages saved, then restored at every point")
    p.add_argument("--page-size", type=parse_size, default=parse_size("2M"), help="bytes per page")
    p.add_argument("--helpers", default="1,2,4", help="comma-separated helper-process counts (load_processes)")
    p.add_argument("--queues", type=int, default=4, help="NVMe/TCP I/O queues per helper")
    p.add_argument("--io-threads", type=int, default=4, help="concurrent batches per helper")
    p.add_argument("--batch-mb", type=int, default=64, help="MiB per load batch (one staging slab)")
    p.add_argument("--slabs", type=int, default=32, help="batches in flight (staging = slabs x batch)")
    p.add_argument("--target-workers", default="0", help="emulator I/O worker processes, comma-separated")
    p.add_argument("--mdts", default="1M", help="emulator MDTS, comma-separated for several targets")
    p.add_argument("--backing", help="file backing the card (default: RAM); it is FORMATTED, so a file holding "
                                     "data is refused unless --yes-destroy")
    p.add_argument("--yes-destroy", action="store_true", help="with --backing: format a file that holds data")
    p.add_argument("--into", choices=["host", "gpu"], default="host")
    O.add_json_option(p, "the rows")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` and their live descendants (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    kids: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        kids.setdefault(int(fields[1]), []).append(int(d))
        cpu[int(d)] = (int(fields[11]) + int(fields[12])) / tick
    total, todo, seen = 0.0, list(pids), set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        total += cpu.get(p, 0.0)
        todo += kids.get(p, [])
    return total


class _GpuSlabs:
    def __init__(self, arena: SharedArena, slab: int, slabs: int) -> None:
        import torch

        self.torch = torch
        host = torch.frombuffer(arena.map, dtype=torch.uint8)
        if torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), 0) != 0:
            print("warning: cudaHostRegister failed; copies from pageable memory", file=sys.stderr)
        self.host = host
        self.dev = torch.empty(slab * slabs, dtype=torch.uint8, device="cuda")
        self.stream = torch.cuda.Stream()
        self.slab = slab

    def copy(self, i: int) -> Any:
        t, s = self.torch, self.slab
        with t.cuda.stream(self.stream):
            self.dev[i * s:(i + 1) * s].copy_(self.host[i * s:(i + 1) * s], non_blocking=True)
            ev = t.cuda.Event()
            ev.record(self.stream)
        return ev


def restore_point(group: StoreGroup | StoreProcess, arena: SharedArena, keys: list[bytes], page: int,
                  per_batch: int, slabs: int, gpu: _GpuSlabs | None) -> float:
    """Load every key once through ``slabs`` staging slabs; returns seconds."""
    view = memoryview(arena.map)
    slab = per_batch * page
    batches = [keys[i:i + per_batch] for i in range(0, len(keys), per_batch)]
    free = list(range(slabs))
    busy: list[tuple[int, Any, Any]] = []  # (slab, handle, copy event)
    nxt = 0
    t0 = time.perf_counter()
    while nxt < len(batches) or busy:
        while free and nxt < len(batches):
            i = free.pop()
            ks = batches[nxt]
            nxt += 1
            bufs = [view[i * slab + j * page:i * slab + (j + 1) * page] for j in range(len(ks))]
            busy.append((i, group.load_batch(ks, bufs), None))
        still: list[tuple[int, Any, Any]] = []
        progressed = False
        for i, h, ev in busy:
            if ev is None and h.done():
                res = h.wait(0)
                bad = [r for r in res if not r.ok]
                if bad:
                    raise RuntimeError(f"restore failed: {bad[0]}")
                if gpu is None:
                    free.append(i)
                    progressed = True
                    continue
                ev = gpu.copy(i)
            if ev is not None and ev.query():
                free.append(i)
                progressed = True
                continue
            still.append((i, h, ev))
        busy = still
        if not progressed:
            time.sleep(0.0002)
    if gpu is not None:
        gpu.stream.synchronize()
    dt = time.perf_counter() - t0
    view.release()
    return dt


def main(args: argparse.Namespace) -> int:
    refuse_to_overwrite_file(args.backing, "testbed bench restore-path", args.yes_destroy)
    page = args.page_size
    per_batch = max(1, (args.batch_mb << 20) // page)
    n_pages = max(per_batch, int(args.gb * 1e9) // page)
    helpers = [int(x) for x in args.helpers.split(",")]
    rows: list[dict[str, Any]] = []
    ns = KeyNamespace("bench-restore", "bf16", "bench", 16)
    keys = ns.keys_for_block_hashes(i.to_bytes(8, "little") for i in range(n_pages))
    capacity = (int(2 * n_pages * (page + 8192) * 1.2) + (512 << 20)) // (1 << 20) * (1 << 20)  # 2 partitions
    arena = SharedArena(per_batch * page * args.slabs)
    zeros = bytes(per_batch * page)
    for i in range(args.slabs):  # fault the staging in before timing (the connector pins it at start-up)
        arena.map[i * len(zeros):(i + 1) * len(zeros)] = zeros
    gpu = _GpuSlabs(arena, per_batch * page, args.slabs) if args.into == "gpu" else None
    with StreamServer("127.0.0.1") as stream:
        for mdts, workers in [(parse_size(m), int(w)) for m in args.mdts.split(",")
                              for w in args.target_workers.split(",")]:
            with LocalTarget(capacity=capacity, mdts=mdts, io_workers=workers, backing=args.backing) as t:
                hc = HostConfig(traddr=t.traddr, trsvcid=t.trsvcid, subnqn=t.subnqn, io_queues=args.queues,
                                queue_depth=64, command_timeout=120.0)
                with Controller.connect(hc) as ctrl:  # fill the card once through an in-process writer
                    PageStore.format(ctrl, partitions=2, avg_page_bytes=page)
                    store = PageStore(ctrl, StoreConfig(writer_id=b"bench-restore-w1", io_threads=4,
                                                        heartbeat_interval_s=0, claim_settle_s=0.05))
                    data = memoryview(bytearray(os.urandom(per_batch * page)))
                    t0 = time.perf_counter()
                    for i in range(0, n_pages, per_batch):
                        ks = keys[i:i + per_batch]
                        h = store.save_batch(ks, [data[j * page:(j + 1) * page] for j in range(len(ks))])
                        assert h.ok_count(300) == len(ks), "save failed"
                    save_s = time.perf_counter() - t0
                    store.close()
                cfg = StoreConfig(writer_id=b"bench-restore-w2", io_threads=args.io_threads, heartbeat_interval_s=0,
                                  claim_settle_s=0.05, io_timeout_s=120.0)
                for h_count in helpers:
                    if h_count > 1:
                        group: StoreGroup | StoreProcess = StoreGroup.start(
                            Controller.connect, (hc,), cfg, arena, readers=h_count - 1, timeout=60)
                        pids = [m.pid for m in [group.writer, *group.readers]]  # type: ignore[union-attr]
                    else:
                        group = StoreProcess.start(Controller.connect, (hc,), cfg, arena, timeout=60)
                        pids = [group.pid]
                    try:
                        restore_point(group, arena, keys[:per_batch * 2], page, per_batch, args.slabs, gpu)  # warm
                        c0t, c0h = cpu_seconds([t.proc.pid]), cpu_seconds(pids)
                        dt = restore_point(group, arena, keys, page, per_batch, args.slabs, gpu)
                        tcpu, hcpu = cpu_seconds([t.proc.pid]) - c0t, cpu_seconds(pids) - c0h
                    finally:
                        group.close()
                    conns = h_count * args.queues
                    ceiling = stream.measure(conns, max(1 << 30, conns * (64 << 20)), 1 << 20, "read")
                    gbps = n_pages * page / dt / 1e9
                    row = {"mdts": mdts, "target_workers": workers, "helpers": h_count,
                           "queues_per_helper": args.queues, "io_threads": args.io_threads, "into": args.into,
                           "bytes": n_pages * page,
                           "seconds": round(dt, 3), "gbps": round(gbps, 2), "ceiling_gbps": round(ceiling, 2),
                           "ratio": round(gbps / ceiling, 3), "target_cpu_s": round(tcpu, 2),
                           "helpers_cpu_s": round(hcpu, 2), "fill_gbps": round(n_pages * page / save_s / 1e9, 2)}
                    rows.append(row)
                    print(f"MDTS {mdts >> 10}K target workers {workers} helpers {h_count} x {args.queues} queues: "
                          f"restore "
                          f"{row['gbps']:6.2f} GB/s into {args.into} ({row['ratio']:.2f}x the {conns}-stream ceiling "
                          f"{row['ceiling_gbps']:.1f}); CPU s target {row['target_cpu_s']:.1f} helpers "
                          f"{row['helpers_cpu_s']:.1f} over {row['seconds']:.2f} s", flush=True)
    arena.close()
    O.emit_json(args, rows)
    return 0
