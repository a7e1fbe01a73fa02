"""Data-path benchmark: NVMe/TCP client read/write throughput vs a plain loopback TCP stream.

For each (operation, pattern, request size, I/O queues, outstanding requests) it runs the ONE host
client against a target for a fixed time and reports GB/s and IOPS; in the same run it measures
plain Python loopback TCP streams with the same number of connections (the ceiling) and prints the
ratio. Against the local userspace emulator by default (``--target-workers`` I/O worker processes),
or ``--target ADDR:PORT --nqn NQN``. ``--into pinned|gpu`` reads into page-locked memory, and for
``gpu`` copies each landed read on into GPU memory before its buffer is reused (torch + CUDA).
``--processes N`` runs the client as the connector does with ``load_processes``: N client processes,
each with its own controller of ``--queues`` I/O queues, driving the same point at the same time (the
ceiling then has N x queues streams). Every row has the client's and (local target) the target's
core-seconds per GB, and the ceiling's receiver and sender core-seconds per GB of the same run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import resource
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any

from adp_connector.nvmeof.host import Controller

from .. import options as O
from ..sizes import format_size, parse_size, positive_size, size_list
from ..targets import LocalTarget, connect_existing, refuse_to_destroy
from .restore import cpu_seconds
from .stream import StreamServer

PATTERNS = ("seq", "rand")
OPS = ("read", "write")
PRESETS = {
    "quick": dict(sizes=["128K", "1M", "4M"], queues=[1, 2], depths=[1, 16], patterns=["seq"],
                  ops=["read", "write"], seconds=0.5),
    "full": dict(sizes=["64K", "128K", "256K", "1M", "4M"], queues=[1, 2, 4, 8], depths=[1, 4, 16, 64],
                 patterns=["seq", "rand"], ops=["read", "write"], seconds=1.0),
}


@dataclass
class Row:
    mdts: int
    target_workers: int
    into: str
    op: str
    pattern: str
    size: int
    queues: int
    depth: int
    seconds: float
    bytes: int
    gbps: float
    iops: float
    ceiling_gbps: float
    ratio: float
    processes: int = 1
    client_cpu_s_per_gb: float = 0.0  # every client process, all threads (user + system)
    target_cpu_s_per_gb: float | None = None  # the local target's processes; None for --target
    ceiling_receiver_cpu_s_per_gb: float = 0.0
    ceiling_sender_cpu_s_per_gb: float = 0.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    p.add_argument("--sizes", type=size_list, help="comma-separated request sizes (e.g. 64K,1M)")
    p.add_argument("--queues", type=O.list_of(O.int_in(1, 128), "I/O queue counts (1-128)"),
                   help="comma-separated I/O queue counts")
    p.add_argument("--depths", type=O.list_of(O.int_in(1, 128), "outstanding-request counts (1-128)"),
                   help="comma-separated outstanding-request counts")
    p.add_argument("--patterns", type=O.choice_list(PATTERNS), help="seq,rand")
    p.add_argument("--ops", type=O.choice_list(OPS), help="read,write")
    p.add_argument("--seconds", type=O.seconds, help="time per point")
    p.add_argument("--working-set", type=positive_size, default=parse_size("256M"), help="bytes of the namespace used")
    p.add_argument("--mdts", type=size_list, default=size_list("128K"),
                   help="emulator MDTS, comma-separated for several targets (local only)")
    O.add_target_options(p, "ADDR:PORT of an existing target (a real card), the connector's traddr:trsvcid, "
                            "instead of the local emulator. The benchmark WRITES to it (refused when it holds data, "
                            "unless --yes-destroy)")
    p.add_argument("--yes-destroy", action="store_true",
                   help="with --target: overwrite the namespace even if it holds data or a page store")
    p.add_argument("--target-workers", type=O.list_of(O.int_in(0, 256), "worker counts (0-256)"), default=[0],
                   help="emulator I/O worker processes, comma-separated for several targets (local only)")
    p.add_argument("--processes", type=O.int_in(1, 64), default=1,
                   help="client processes, each with its own controller of --queues I/O queues, driving every "
                        "point together (the connector's load_processes); 1: the client runs in this process")
    p.add_argument("--into", choices=["host", "pinned", "gpu"], default="host",
                   help="where reads land: plain host memory, page-locked memory, or on into GPU memory")
    O.add_json_option(p, "the rows and the summary")


def _list(value: list | None, default: list, conv=str) -> list:
    return list(value) if value else [conv(x) for x in default]


class _GpuSink:
    """Page-locked buffers whose landed reads are copied on into GPU memory on a side stream."""

    def __init__(self, size: int, depth: int, to_gpu: bool) -> None:
        import torch

        self.torch = torch
        self.host = torch.empty((depth, size), dtype=torch.uint8, pin_memory=True)
        self.host.numpy()[:] = 1  # fault the pages in before timing
        self.bufs = [memoryview(self.host[i].numpy()) for i in range(depth)]
        self.to_gpu = to_gpu
        if to_gpu:
            self.dev = torch.empty((depth, size), dtype=torch.uint8, device="cuda")
            self.stream = torch.cuda.Stream()
            self.events: list = [None] * depth

    def landed(self, i: int) -> None:
        if self.to_gpu:
            with self.torch.cuda.stream(self.stream):
                self.dev[i].copy_(self.host[i], non_blocking=True)
                ev = self.torch.cuda.Event()
                ev.record(self.stream)
            self.events[i] = ev

    def reuse(self, i: int) -> None:
        if self.to_gpu and self.events[i] is not None:
            self.events[i].synchronize()  # the copy out of this buffer must finish before new data lands

    def drain(self) -> None:
        if self.to_gpu:
            self.stream.synchronize()


def run_point(ctrl: Controller, op: str, pattern: str, size: int, depth: int, seconds: float,
              working_set: int, into: str = "host") -> tuple[int, float]:
    """Keep ``depth`` requests of ``size`` outstanding for ``seconds``; returns (bytes, elapsed)."""
    slots = max(1, working_set // size)
    rng = random.Random(size * 31 + depth)
    sink = _GpuSink(size, depth, into == "gpu") if into != "host" and op == "read" else None
    if sink is not None:
        bufs = sink.bufs
    else:
        bufs = [memoryview(bytearray(os.urandom(64)) * (size // 64)) for _ in range(depth)]
    inflight: deque[tuple[Future[None], int]] = deque()
    submit = ctrl.submit_read if op == "read" else ctrl.submit_write
    nxt = 0
    done_bytes = 0
    t0 = time.perf_counter()
    deadline = t0 + seconds
    free = list(range(depth))
    while True:
        now = time.perf_counter()
        while free and now < deadline:
            i = free.pop()
            slot = nxt % slots if pattern == "seq" else rng.randrange(slots)
            nxt += 1
            if sink is not None:
                sink.reuse(i)
            inflight.append((submit(slot * size, bufs[i]), i))
        if not inflight:
            break
        fut, i = inflight.popleft()
        fut.result(60)
        if sink is not None:
            sink.landed(i)
        done_bytes += size
        free.append(i)
    if sink is not None:
        sink.drain()
    return done_bytes, time.perf_counter() - t0


def _own_cpu_s() -> float:
    """User + system CPU seconds of this process, every thread."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _client_main(addr: str, port: int, nqn: str | None, queues: int, start: Any, conn: Any) -> None:
    """A client process: one controller, then points run on request (None ends it)."""
    with connect_existing(addr, port, nqn, io_queues=queues, queue_depth=128) as ctrl:  # type: ignore[attr-defined]
        conn.send(ctrl.capacity_bytes)
        while (job := conn.recv()) is not None:
            start.wait()
            c0 = _own_cpu_s()
            t0 = time.perf_counter()
            n, dt = run_point(ctrl, *job)
            conn.send((n, t0, t0 + dt, _own_cpu_s() - c0))


class ClientProcesses:
    """``count`` client processes (spawned), each connected with ``queues`` I/O queues, run points together."""

    def __init__(self, count: int, addr: str, port: int, nqn: str | None, queues: int) -> None:
        ctx = mp.get_context("spawn")
        self.start = ctx.Barrier(count)
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        for _ in range(count):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_client_main, args=(addr, port, nqn, queues, self.start, theirs), daemon=True)
            proc.start()
            self.procs.append(proc)
            self.conns.append(mine)
        for c in self.conns:
            if not c.poll(60):
                raise RuntimeError("a client process did not connect within 60 s")
            c.recv()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def run(self, *job: Any) -> tuple[int, float, float]:
        """Run one point (``run_point``'s arguments after the controller) in every process at once;
        returns (bytes in all, seconds from the first start to the last end, the processes' CPU seconds)."""
        for c in self.conns:
            c.send(job)
        got = [c.recv() for c in self.conns]
        return (sum(g[0] for g in got), max(g[2] for g in got) - min(g[1] for g in got),
                sum(g[3] for g in got))

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def main(args: argparse.Namespace) -> int:
    preset = PRESETS[args.preset]
    sizes = _list(args.sizes, preset["sizes"], parse_size)
    queues = _list(args.queues, preset["queues"], int)
    depths = _list(args.depths, preset["depths"], int)
    patterns = _list(args.patterns, preset["patterns"])
    ops = _list(args.ops, preset["ops"])
    seconds = args.seconds or preset["seconds"]
    ws = args.working_set
    rows: list[Row] = []
    ceilings: dict[tuple[str, int, int], float] = {}
    mdts_list = [0] if args.target else list(args.mdts)
    workers_list = [0] if args.target else list(args.target_workers)
    point = dict(queues=queues, ops=ops, sizes=sizes, patterns=patterns, depths=depths, seconds=seconds, ws=ws,
                 into=args.into, processes=args.processes)
    with StreamServer("127.0.0.1") as stream:
        for mdts in mdts_list:
            if args.target:
                host, _, port = args.target.rpartition(":")
                _run_target(host, int(port), args.nqn, 0, 0, stream, ceilings, rows, **point,
                            guard=lambda ctrl, where: refuse_to_destroy(ctrl, where, "testbed bench datapath",
                                                                        args.yes_destroy))
                continue
            for nw in workers_list:
                with LocalTarget(capacity=max(ws * 2, 1 << 30), mdts=mdts, io_workers=nw) as got:
                    _run_target(got.traddr, got.trsvcid, got.subnqn, mdts, nw, stream, ceilings, rows, **point,
                                target_pid=got.proc.pid)
    summary = summarize(rows)
    for line in summary_lines(summary):
        print(line)
    O.emit_json(args, {"rows": [asdict(r) for r in rows], "summary": summary, "threads": threading.active_count()})
    return 0


def summary_lines(summary: dict) -> list[str]:
    """The summary as text (the JSON document has it under "summary")."""
    out = []
    if "one_queue_read_best" in summary:
        b = summary["one_queue_read_best"]
        out.append(f"best one-queue read: {b['gbps']:.3f} GB/s = {b['ratio']:.2f} x the loopback TCP ceiling "
                   f"({b['ceiling_gbps']:.3f} GB/s), {format_size(b['size'])} requests, depth {b['depth']}")
    if summary.get("read_gbps_by_queues"):
        out.append("best read GB/s by I/O queues: " + ", ".join(
            f"{q}: {g:.3f}" for q, g in sorted(summary["read_gbps_by_queues"].items())))
    if "write_best" in summary:
        b = summary["write_best"]
        out.append(f"best write: {b['gbps']:.3f} GB/s ({b['ratio']:.2f} x ceiling), {format_size(b['size'])} "
                   f"requests, {b['queues']} queue(s), depth {b['depth']}")
    return out


def _run_target(addr: str, port: int, nqn: str | None, mdts: int, workers: int, stream: StreamServer,
                ceilings: dict, rows: list[Row], *, queues: list[int], ops: list[str], sizes: list[int],
                patterns: list[str], depths: list[int], seconds: float, ws: int, into: str, processes: int = 1,
                guard: Callable[[Controller, str], None] | None = None, target_pid: int | None = None) -> None:
    for q in queues:
        with connect_existing(addr, port, nqn, io_queues=q, queue_depth=128) as ctrl:  # type: ignore[attr-defined]
            if guard is not None:
                guard(ctrl, f"{addr}:{port}")
                guard = None  # checked once: the first pass writes
            ws_eff = min(ws, ctrl.capacity_bytes)
            if "read" in ops:  # make reads hit written data (never-written memory costs page faults)
                fill = memoryview(bytearray(os.urandom(1 << 20)) * 4)
                for off in range(0, ws_eff - len(fill) + 1, len(fill)):
                    ctrl.write(off, fill)
            print(f"# target {addr}:{port} {ctrl.config.subnqn}: max transfer {format_size(ctrl.max_transfer_bytes)}"
                  f", {processes} client process(es) x {q} I/O queue(s), {workers} target I/O worker(s), reads into "
                  f"{into}", file=sys.stderr)
            clients = ClientProcesses(processes, addr, port, nqn, q) if processes > 1 else None
            try:
                for op in ops:
                    for size in sizes:
                        key = (op, q * processes, size)
                        if key not in ceilings:
                            total = max(256 << 20, size * q * processes * 8)
                            ceilings[key] = max((stream.measure_cpu(q * processes, total, min(size, 1 << 20), op)
                                                 for _ in range(2)), key=lambda c: c.gbps)
                        ceil = ceilings[key]
                        for pattern in patterns:
                            for depth in depths:
                                t0 = cpu_seconds([target_pid]) if target_pid else 0.0
                                if clients is not None:
                                    n, dt, ccpu = clients.run(op, pattern, size, depth, seconds, ws_eff, into)
                                else:
                                    c0 = _own_cpu_s()
                                    n, dt = run_point(ctrl, op, pattern, size, depth, seconds, ws_eff, into)
                                    ccpu = _own_cpu_s() - c0
                                tcpu = cpu_seconds([target_pid]) - t0 if target_pid else None
                                gbps = n / dt / 1e9
                                gb = max(n, 1) / 1e9
                                r = Row(mdts or ctrl.max_transfer_bytes, workers, into if op == "read" else "host",
                                        op, pattern, size, q, depth, round(dt, 3), n,
                                        round(gbps, 3), round(n / size / dt), round(ceil.gbps, 3),
                                        round(gbps / ceil.gbps, 3), processes, round(ccpu / gb, 3),
                                        None if tcpu is None else round(tcpu / gb, 3),
                                        round(ceil.receiver_cpu_s_per_gb, 3), round(ceil.sender_cpu_s_per_gb, 3))
                                rows.append(r)
                                tpart = "" if tcpu is None else f" target {r.target_cpu_s_per_gb:.3f}"
                                print(f"mdts {format_size(r.mdts):>5} w={workers} {op:5} {pattern:4} "
                                      f"{format_size(size):>5} p={processes} q={q} "
                                      f"qd={depth:<3} {gbps:7.3f} GB/s {r.iops:9.0f} IOPS  "
                                      f"ceiling {r.ceiling_gbps:6.3f}"
                                      f"  ratio {r.ratio:5.2f}  core-s/GB client {r.client_cpu_s_per_gb:.3f}{tpart}"
                                      f" ceiling recv {r.ceiling_receiver_cpu_s_per_gb:.3f} send "
                                      f"{r.ceiling_sender_cpu_s_per_gb:.3f}", flush=True)
            finally:
                if clients is not None:
                    clients.close()


def summarize(rows: list[Row]) -> dict:
    """Best read ratio with one queue, and read GB/s per queue count (does it scale?)."""
    out: dict = {}
    reads1 = [r for r in rows if r.op == "read" and r.queues == 1]
    if reads1:
        best = max(reads1, key=lambda r: r.ratio)
        out["one_queue_read_best"] = {"gbps": best.gbps, "ceiling_gbps": best.ceiling_gbps, "ratio": best.ratio,
                                      "size": best.size, "depth": best.depth}
    by_q: dict[int, float] = {}
    by_wq: dict[str, dict[int, float]] = {}
    for r in rows:
        if r.op == "read":
            by_q[r.queues] = max(by_q.get(r.queues, 0.0), r.gbps)
            d = by_wq.setdefault(str(r.target_workers), {})
            d[r.queues] = max(d.get(r.queues, 0.0), r.gbps)
    out["read_gbps_by_queues"] = by_q
    out["read_gbps_by_target_workers_and_queues"] = by_wq
    wr = [r for r in rows if r.op == "write"]
    if wr:
        best = max(wr, key=lambda r: r.gbps)
        out["write_best"] = {"gbps": best.gbps, "ratio": best.ratio, "size": best.size, "queues": best.queues,
                             "depth": best.depth}
    return out
