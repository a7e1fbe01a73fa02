"""Restore-path benchmark: the connector's page-restore machinery without vLLM, in one run.

A local userspace target (``--target-workers`` I/O worker processes) gets ``--gb`` of pages saved
through a :class:`StoreGroup` of writer helpers from the shared staging arena, ``--slabs`` batches in
flight, once per writer count in ``--save-processes`` (the connector's ``save_processes``; the card is
formatted afresh before each, so every point writes every page; an untimed pass first faults the card's
memory in); reported per save point: GB/s, the CPU seconds of the writers and the target, and the ratio
to the first count's rate in the same run. Then, for each helper count in
``--helpers``, a :class:`StoreGroup` (one writer
helper + read-only helpers, as the connector's ``load_processes``) loads them back into a shared
staging arena in batches of ``--batch-mb``, ``--slabs`` batches in flight, through the connector's own
restore pipeline (:class:`adp_connector.pipeline.RestorePipeline`). ``--into gpu`` scatters each landed
slab into a GPU block tensor (the connector's host -> device copy on a side stream) before the slab is
reused. Reported per point: GB/s, and the CPU seconds (and core-seconds per GB) the
target and the helpers spent (where the cycles go); the loopback stream ceiling with as many connections is
measured in the same run, with its receivers' and its sender's core-seconds per GB (what a bare ``recv_into``
loop costs on this host: the floor for the helpers' CPU). ``--python-load`` repeats each restore beside a thread
running bytecode in the bench's process, as vLLM's step loop runs beside the connector's restore driver, once per
interpreter switch interval given (how long a thread waits for the lock before its holder must let go).

The client runs as the connector runs inside vLLM by default: the pipeline's driver thread moves landed batches and
the caller collects finished restores once per ``--step-ms`` (``--driver poll``: the caller polls in a loop, this
bench's mode before); ``--restore-gb`` restores the pages as restores of that size one after another, as an engine
whose KV cache is full starts one when a request frees its blocks (GPU run 23: 1 GB restores, 1.1 in flight); and
``--layers`` scatters into that many layer tensors of vLLM's attention layout (K and V halves).
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adp_connector.nvmeof.host import Controller, HostConfig
from adp_connector.store import PageStatus, PageStore, StoreConfig
from adp_connector.store.api import Store
from adp_connector.store.keys import KeyNamespace
from adp_connector.store.process import SharedArena, StoreGroup, StoreProcess

from .. import options as O
from ..hostinfo import host_info
from ..sizes import parse_size, positive_size
from ..targets import LocalTarget, refuse_to_overwrite_file
from .stream import StreamServer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gb", type=O.positive_number, default=1.0, help="GB of pages saved, then restored at every point")
    p.add_argument("--page-size", type=positive_size, default=parse_size("2M"), help="bytes per page")
    p.add_argument("--helpers", default="1,2,4", help="comma-separated helper-process counts (load_processes)")
    p.add_argument("--save-processes", default="1",
                   help="comma-separated writer-helper counts for the save phase (save_processes); the card is "
                        "formatted before each, the restores read what the last one saved")
    p.add_argument("--queues", type=O.int_in(1, 128), default=4, help="NVMe/TCP I/O queues per helper")
    p.add_argument("--io-threads", type=O.int_in(1, 256), default=4, help="concurrent batches per helper")
    p.add_argument("--batch-mb", type=O.int_in(1, 1 << 16), default=64, help="MiB per load batch (one staging slab)")
    p.add_argument("--slabs", type=O.int_in(1, 1 << 16), default=32, help="batches in flight (staging = slabs x batch)")
    p.add_argument("--target-workers", default="0", help="emulator I/O worker processes, comma-separated")
    p.add_argument("--mdts", default="1M", help="emulator MDTS, comma-separated for several targets")
    p.add_argument("--target-reads", type=O.choice_list(("splice", "copy")), default=["splice"],
                   help="how the emulator sends read data, comma-separated: splice (sendfile from the namespace's "
                        "pages, its default), copy (sendmsg of a copy)")
    p.add_argument("--backing", help="file backing the card (default: RAM); it is FORMATTED, so a file holding "
                                     "data is refused unless --yes-destroy")
    p.add_argument("--yes-destroy", action="store_true", help="with --backing: format a file that holds data")
    p.add_argument("--into", choices=["host", "gpu"], default="host")
    p.add_argument("--driver", choices=["thread", "poll"], default="thread",
                   help="who moves landed batches: thread (the connector's restore driver thread, woken as batches "
                        "land, with the caller collecting finished restores every --step-ms, as vLLM's engine step "
                        "does) or poll (the caller polls in a loop, 0.2 ms apart)")
    p.add_argument("--step-ms", type=float, default=20.0,
                   help="with --driver thread: how often finished restores are collected (an engine step's length)")
    p.add_argument("--restore-gb", type=float, default=0.0,
                   help="GB per restore, restored one after another (each starts when the one before it finished, as "
                        "an engine with a full KV cache starts one when a request frees its blocks); 0: all pages in "
                        "one restore")
    p.add_argument("--layers", type=int, default=1,
                   help="with --into gpu: layer tensors the pages scatter into, each holding a K and a V half of its "
                        "share of a page (vLLM's attention layout: two runs per layer; an 8B model has 32)")
    p.add_argument("--python-load", type=_switch_intervals, default=[], metavar="SECONDS",
                   help="comma-separated interpreter switch intervals: each helper count is also restored with a "
                        "thread running bytecode in this process (as vLLM's step loop runs beside the connector), "
                        "once per interval (default: none)")
    O.add_json_option(p, "the rows")


def _switch_intervals(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) <= 0:
        raise argparse.ArgumentTypeError(f"positive seconds, comma-separated, got {text!r}")
    return out


class PythonLoad:
    """A thread running bytecode until stopped (it holds the interpreter lock between switch intervals, as an
    engine's Python step loop does), at ``interval`` (``sys.setswitchinterval``) while it runs."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.loops = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="python-load", daemon=True)
        self._saved = sys.getswitchinterval()

    def _run(self) -> None:
        while not self._stop.is_set():
            x = 0
            for i in range(2000):
                x += i
            self.loops += 1

    def __enter__(self) -> PythonLoad:
        sys.setswitchinterval(self.interval)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._saved)


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` and their live descendants (Linux /proc)."""
    return sum(cpu_split(pids))


def cpu_split(pids: list[int]) -> tuple[float, float]:
    """(user, system) CPU seconds of ``pids`` and their live descendants (Linux /proc): system time is the kernel's
    work for them (socket copies, syscalls, page faults), user time their own code (Python, checksums)."""
    tick = os.sysconf("SC_CLK_TCK")
    kids: dict[int, list[int]] = {}
    cpu: dict[int, tuple[float, float]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        kids.setdefault(int(fields[1]), []).append(int(d))
        cpu[int(d)] = (int(fields[11]) / tick, int(fields[12]) / tick)
    user = system = 0.0
    todo, seen = list(pids), set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        u, s_ = cpu.get(p, (0.0, 0.0))
        user, system = user + u, system + s_
        todo += kids.get(p, [])
    return user, system


class DiscardSink:
    """``--into host``: restored pages stay in the staging slab (the pipeline's I/O alone is measured)."""

    def scatter(self, gid: int, block_ids: list[int], pages: Any) -> None:
        return None

    def gather(self, gid: int, block_ids: list[int]) -> Any:
        raise NotImplementedError("no audit in the benchmark")

    def zero(self, gid: int, block_id: int) -> None:
        return None


@dataclass
class RestoreRun:
    """One restore point: its wall time and each restore's own time (seconds), and the milliseconds a mean restore
    spent in each of the pipeline's phases (``RESTORE_PHASES``: queued, io, copy, step_wait; slab_wait within io)."""

    seconds: float
    restore_seconds: list[float]
    phase_ms: dict[str, float]


def layer_share_error(page: int, layers: int) -> str | None:
    """Why ``layers`` layer tensors cannot hold a page of ``page`` bytes in K and V halves, or None."""
    if layers < 1 or page % layers or (page // layers) % 2:
        return f"--layers {layers} must split a page of {page} bytes into an even share per layer"
    return None


def gpu_sink(ring: int, page: int, layers: int, device: str = "cuda") -> Any:
    """A GPU block tensor set of ``ring`` blocks in vLLM's attention layout: ``layers`` tensors of shape (2, blocks,
    n) whose K and V halves hold ``page / layers`` bytes of each page (two runs per layer), as block-major views."""
    import torch

    from adp_connector.pipeline import PagedKV

    why = layer_share_error(page, layers)
    if why is not None:
        raise ValueError(why)
    share = page // layers
    rows = [(f"layer{i}", torch.zeros((2, ring, share // 2), dtype=torch.int8, device=device).transpose(0, 1), share)
            for i in range(layers)]
    return PagedKV({0: rows})


def restore_point(group: Store, arena: SharedArena, keys: list[bytes], page: int, per_batch: int, slabs: int,
                  into: str, *, driver: str = "thread", step_s: float = 0.02, per_restore: int = 0,
                  layers: int = 1) -> RestoreRun:
    """Restore every key once through the connector's restore pipeline (``slabs`` staging slabs carved from
    ``arena``; ``into`` gpu: scattered into GPU block tensors of ``slabs x per_batch`` pages, as the connector
    scatters into the KV cache), ``per_restore`` keys per restore (0: one restore of all), one after another.
    ``driver`` thread: the pipeline's driver thread moves landed batches and this caller collects finished restores
    every ``step_s``, as the connector runs in vLLM; poll: this caller polls in a loop."""
    import torch

    from adp_connector.pipeline import Counters, LoadJob, RestorePipeline, StagingPool
    from adp_connector.pipeline.restore import PHASE_COUNTER_PREFIX, RESTORE_PHASES

    slab = per_batch * page
    host = torch.frombuffer(arena.map, dtype=torch.int8)[:slab * slabs]
    pool = StagingPool(slab, 0, pinned=into == "gpu", arena=host)
    ring = slabs * per_batch
    sink: Any = gpu_sink(ring, page, layers) if into == "gpu" else DiscardSink()
    counters = Counters()
    pipe = RestorePipeline(sink, pool, {0: page}, counters, timeout_s=3600.0)
    if driver == "thread":
        pipe.run_driver(lambda: group, (lambda: torch.cuda.set_device(0)) if into == "gpu" else None)
    each = per_restore or len(keys)
    took: list[float] = []
    failed = ""
    t0 = time.perf_counter()
    try:
        for j0 in range(0, len(keys), each):
            part = keys[j0:j0 + each]
            job = LoadJob(f"bench-{j0}", [(0, (j0 + i) % ring, k) for i, k in enumerate(part)], [], time.monotonic())
            s0 = time.perf_counter()
            pipe.start(job, group)  # with the driver thread: queued for it, applied in its next pass
            finished: list[LoadJob] = []
            while not finished:
                if driver == "thread":
                    time.sleep(step_s)
                    finished = pipe.poll(group)
                elif not (finished := pipe.poll(group)):
                    time.sleep(0.0002)
            if into == "gpu":
                torch.cuda.synchronize()
            took.append(time.perf_counter() - s0)
            if job.failed:
                failed = job.failed
                break
        dt = time.perf_counter() - t0
    finally:
        pipe.stop_driver()
        if pool.pinned:
            torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
    if failed:
        raise RuntimeError(f"restore failed: {failed}")
    counters.drain()
    totals = counters.snapshot_totals()
    return RestoreRun(dt, took, {p: round(1e3 * totals.get(PHASE_COUNTER_PREFIX + p, 0.0) / len(took), 1)
                                 for p in RESTORE_PHASES})


def save_point(group: Store, arena: SharedArena, keys: list[bytes], page: int, per_batch: int, slabs: int) -> float:
    """Save every key once through ``group`` from the arena's ``slabs`` staging slabs (as many batches in flight,
    a slab reused once its batch is done, as the connector's save path); returns seconds. Raises when a page is not
    saved (a fresh card: every page must be written, none ``exists``)."""
    slab = per_batch * page
    view = memoryview(arena.map)
    inflight: deque[Any] = deque()

    def finish(h: Any) -> None:
        bad = [r for r in h.wait(600) if r.status is not PageStatus.OK]
        if bad:
            raise RuntimeError(f"save failed: {len(bad)} page(s), first {bad[0].status.value}: {bad[0].detail}")

    try:
        t0 = time.perf_counter()
        for n, i in enumerate(range(0, len(keys), per_batch)):
            if len(inflight) >= slabs:
                finish(inflight.popleft())
            base = (n % slabs) * slab
            ks = keys[i:i + per_batch]
            inflight.append(group.save_batch(ks, [view[base + j * page:base + (j + 1) * page]
                                                  for j in range(len(ks))]))
        while inflight:
            finish(inflight.popleft())
        return time.perf_counter() - t0
    finally:
        view.release()


def wait_arena_populated(group: Store, members: int, timeout: float = 120.0) -> None:
    """Wait until every helper of ``group`` has faulted its arena mapping in (its start-up populate; the connector's
    helpers do it while the engine loads), so a timed point does not pay a one-time cost per helper."""
    deadline = time.monotonic() + timeout
    while group.stats().get("arena_populate_done", members) < members:  # type: ignore[attr-defined]
        if time.monotonic() > deadline:
            print(f"warning: helpers' arena populate not done after {timeout:.0f} s", file=sys.stderr)
            return
        time.sleep(0.05)


def staging_landing(arena: mmap.mmap, streams: int, chunk: int) -> memoryview:
    """Where the landing streams receive: the arena (pre-faulted, as the helpers see it), or, when it is smaller than
    one chunk per stream, a buffer of that size."""
    if len(arena) >= streams * chunk:
        return memoryview(arena)
    return memoryview(bytearray(streams * chunk))


def main(args: argparse.Namespace) -> int:
    refuse_to_overwrite_file(args.backing, "testbed bench restore-path", args.yes_destroy)
    try:
        import torch  # noqa: F401  (the connector's restore pipeline stages through torch tensors)
    except ImportError:
        print("error: testbed bench restore-path needs torch (the connector's restore pipeline); "
              "run it from the vLLM environment", file=sys.stderr)
        return 2
    try:
        helpers = [int(x) for x in args.helpers.split(",")]
        savers = [int(x) for x in args.save_processes.split(",")]
    except ValueError:
        print("error: --helpers and --save-processes take comma-separated integers", file=sys.stderr)
        return 2
    if min(helpers) < 1 or min(savers) < 1 or max(savers) > 16:
        print("error: --helpers must be >= 1 and --save-processes within 1..16", file=sys.stderr)
        return 2
    page = args.page_size
    if args.restore_gb < 0 or args.step_ms <= 0 or args.layers < 1:
        print("error: --restore-gb must be >= 0, --step-ms > 0 and --layers >= 1", file=sys.stderr)
        return 2
    if args.layers > 1 and args.into != "gpu":
        print("error: --layers describes the GPU block tensors: use it with --into gpu", file=sys.stderr)
        return 2
    if (why := layer_share_error(page, args.layers)) is not None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    per_batch = max(1, (args.batch_mb << 20) // page)
    per_restore = max(1, int(args.restore_gb * 1e9) // page) if args.restore_gb else 0
    shape = {"driver": args.driver, "step_s": args.step_ms / 1e3, "per_restore": per_restore, "layers": args.layers}
    n_pages = max(per_batch, int(args.gb * 1e9) // page)
    rows: list[dict[str, Any]] = []
    env = host_info()  # where it ran (GPU, cores, memory, kernel), in every row
    ns = KeyNamespace("bench-restore", "bf16", "bench", 16)
    keys = ns.keys_for_block_hashes(i.to_bytes(8, "little") for i in range(n_pages))
    # pages twice over, plus a few segments per writer slot (each writer claims its own)
    capacity = (int(2 * n_pages * (page + 8192) * 1.2) + (512 << 20) + max(savers) * (256 << 20)) // (1 << 20) \
        * (1 << 20)
    slots = max(savers) + 2  # the save writers, then the restore group's writer
    arena = SharedArena(per_batch * page * args.slabs)
    pattern = os.urandom(per_batch * page)
    for i in range(args.slabs):  # page contents, and the staging faulted in before timing (the connector pins it)
        arena.map[i * len(pattern):(i + 1) * len(pattern)] = pattern
    with StreamServer("127.0.0.1") as stream:
        for mdts, workers, reads in [(parse_size(m), int(w), r) for m in args.mdts.split(",")
                                     for w in args.target_workers.split(",") for r in args.target_reads]:
            with LocalTarget(capacity=capacity, mdts=mdts, io_workers=workers, backing=args.backing,
                             copy_reads=reads == "copy") as t:
                hc = HostConfig(traddr=t.traddr, trsvcid=t.trsvcid, subnqn=t.subnqn, io_queues=args.queues,
                                queue_depth=64, command_timeout=120.0)
                saves: list[dict[str, Any]] = []
                # an untimed first pass writes every page once: a RAM-backed card's memory (or a backing file's
                # page cache) is faulted in before any timed point, so the first count is not charged for it
                for warm, w_count in [(True, savers[0]), *((False, w) for w in savers)]:
                    with Controller.connect(hc) as ctrl:
                        PageStore.format(ctrl, partitions=slots, avg_page_bytes=page)
                    scfg = StoreConfig(writer_id=b"bench-restore-w1", io_threads=args.io_threads,
                                       heartbeat_interval_s=0, claim_settle_s=0.1, io_timeout_s=120.0)
                    sgroup = StoreGroup.start(Controller.connect, (hc,), scfg, arena, readers=0, writers=w_count,
                                              timeout=60)
                    try:
                        wait_arena_populated(sgroup, len(sgroup.pids))
                        c0t, c0w = cpu_seconds([t.proc.pid]), cpu_seconds(sgroup.pids)
                        dt = save_point(sgroup, arena, keys, page, per_batch, args.slabs)
                        tcpu, wcpu = cpu_seconds([t.proc.pid]) - c0t, cpu_seconds(sgroup.pids) - c0w
                        per_writer = [int(m.stats()["pages_saved"]) for m in sgroup.writers]
                    finally:
                        sgroup.close()
                    if warm:
                        continue
                    gb = n_pages * page / 1e9
                    srow = {"save_processes": w_count, "queues_per_writer": args.queues, "bytes": n_pages * page,
                            "seconds": round(dt, 3), "gbps": round(gb / dt, 2), "writers_cpu_s": round(wcpu, 2),
                            "target_cpu_s": round(tcpu, 2), "writers_cpu_s_per_gb": round(wcpu / gb, 3),
                            "target_cpu_s_per_gb": round(tcpu / gb, 3), "pages_per_writer": per_writer}
                    srow["vs_first"] = round(srow["gbps"] / saves[0]["gbps"], 3) if saves else 1.0
                    saves.append(srow)
                    print(f"MDTS {mdts >> 10}K target workers {workers} save processes {w_count} x {args.queues} "
                          f"queues: save {srow['gbps']:6.2f} GB/s ({srow['vs_first']:.2f}x {savers[0]} writer(s) in "
                          f"this run); CPU s writers {wcpu:.1f} target {tcpu:.1f} over {dt:.2f} s; pages per writer "
                          f"{per_writer}", flush=True)
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
                    measured: list[tuple[float | None, RestoreRun, tuple[float, float], tuple[float, float], dict,
                                         dict, float, float]] = []
                    try:
                        wait_arena_populated(group, len(pids))
                        warm = keys[:per_batch * 2]
                        restore_point(group, arena, warm, page, per_batch, args.slabs, args.into, **shape)
                        for interval in [None, *args.python_load]:
                            load = PythonLoad(interval) if interval is not None else None
                            c0t, c0h = cpu_split([t.proc.pid]), cpu_split(pids)
                            r0 = group.thread_cpu()
                            p0 = sum(os.times()[:2])  # this process: the restore driver, the copies' launches
                            with load if load is not None else contextlib.nullcontext():
                                run = restore_point(group, arena, keys, page, per_batch, args.slabs, args.into,
                                                    **shape)
                            c1t, c1h = cpu_split([t.proc.pid]), cpu_split(pids)
                            r1 = group.thread_cpu()
                            own = sum(os.times()[:2]) - p0
                            diff_t = (c1t[0] - c0t[0], c1t[1] - c0t[1])
                            diff_h = (c1h[0] - c0h[0], c1h[1] - c0h[1])
                            measured.append((interval, run, diff_t, diff_h, r0, r1,
                                             load.loops / run.seconds if load is not None else 0.0, own))
                    finally:
                        group.close()
                    conns = h_count * args.queues
                    moved, chunk = max(1 << 30, conns * (64 << 20)), 1 << 20
                    ceiling = stream.measure_cpu(conns, moved, chunk, "read")
                    # the same streams landing their bytes across the staging arena itself (idle now), as the
                    # helpers' receives do: what a TCP receive into staging costs at the least
                    landing = stream.measure_cpu(conns, moved, chunk, "read",
                                                 land=staging_landing(arena.map, conns, chunk))
                    gb = n_pages * page / 1e9
                    for interval, run, (t_user, t_sys), (h_user, h_sys), r0, r1, loops, own in measured:
                        tcpu, hcpu, dt = t_user + t_sys, h_user + h_sys, run.seconds
                        each = sorted(run.restore_seconds)
                        gbps = gb / dt
                        row = {"environment": env, "mdts": mdts, "target_workers": workers, "target_reads": reads,
                               "helpers": h_count,
                               "queues_per_helper": args.queues, "io_threads": args.io_threads, "into": args.into,
                               "python_load_switch_interval_s": interval,
                               "python_load_loops_per_s": round(loops, 1) if interval is not None else None,
                               "driver": args.driver, "step_s": shape["step_s"], "layers": args.layers,
                               "restores": len(each), "restore_bytes": min(per_restore or n_pages, n_pages) * page,
                               "restore_s_mean": round(sum(each) / len(each), 4),
                               "restore_s_max": round(each[-1], 4),
                               "restore_phase_ms": run.phase_ms,  # a mean restore's time by pipeline phase
                               # the bench's own process (the restore driver and the copy launches, the connector's
                               # share inside vLLM); with a Python load it also holds the load's thread: not given
                               "driver_process_cpu_s_per_gb": round(own / gb, 3) if interval is None else None,
                               "bytes": n_pages * page,
                               "seconds": round(dt, 3), "gbps": round(gbps, 2), **ceiling.as_row(),
                               **landing.as_row("landing_"),
                               "ratio": round(gbps / ceiling.gbps, 3), "target_cpu_s": round(tcpu, 2),
                               "helpers_cpu_s": round(hcpu, 2), "helpers_cpu_s_per_gb": round(hcpu / gb, 3),
                               "target_cpu_s_per_gb": round(tcpu / gb, 3),
                               # where the CPU goes: user = Python and checksums, system = the kernel (socket copies)
                               "helpers_user_s_per_gb": round(h_user / gb, 3),
                               "helpers_sys_s_per_gb": round(h_sys / gb, 3),
                               "target_user_s_per_gb": round(t_user / gb, 3),
                               "target_sys_s_per_gb": round(t_sys / gb, 3),
                               # the helpers' CPU by thread role (rx: queue receive loops, batch: checksums, ...)
                               "helpers_by_thread_s_per_gb": {
                                   role: {"user": round((u - r0.get(role, (0.0, 0.0))[0]) / gb, 3),
                                          "system": round((sy - r0.get(role, (0.0, 0.0))[1]) / gb, 3)}
                                   for role, (u, sy) in sorted(r1.items())},
                               "fill_gbps": saves[-1]["gbps"], "saves": saves}
                        rows.append(row)
                        load_text = "" if interval is None else \
                            f" beside a Python thread (switch interval {interval * 1e3:g} ms, {loops:.0f} loops/s)"
                        shape_text = (f", {len(each)} restores of up to {row['restore_bytes'] / 1e9:.3g} GB one after "
                                      f"another ({row['restore_s_mean'] * 1e3:.0f} ms each)" if len(each) > 1 else "")
                        print(f"MDTS {mdts >> 10}K target workers {workers} ({reads} reads) helpers {h_count} x "
                              f"{args.queues} queues{load_text}, driver {args.driver}{shape_text}: restore "
                              f"{row['gbps']:6.2f} GB/s into {args.into} ({row['ratio']:.2f}x the {conns}-stream "
                              f"ceiling {row['ceiling_gbps']:.1f}); CPU s target {row['target_cpu_s']:.1f} helpers "
                              f"{row['helpers_cpu_s']:.1f} over {row['seconds']:.2f} s; core-s/GB helpers "
                              f"{row['helpers_cpu_s_per_gb']:.3f} (user {row['helpers_user_s_per_gb']:.3f} system "
                              f"{row['helpers_sys_s_per_gb']:.3f}) target {row['target_cpu_s_per_gb']:.3f} (user "
                              f"{row['target_user_s_per_gb']:.3f})"
                              + ("" if row["driver_process_cpu_s_per_gb"] is None else
                                 f" driver process {row['driver_process_cpu_s_per_gb']:.3f}")
                              + ", the ceiling's "
                              f"receivers {row['ceiling_receiver_cpu_s_per_gb']:.3f} sender "
                              f"{row['ceiling_sender_cpu_s_per_gb']:.3f} (landing across the staging: "
                              f"{row['landing_gbps']:.1f} GB/s, receivers {row['landing_receiver_cpu_s_per_gb']:.3f})"
                              "; helpers by thread (user+system core-s/GB) "
                              + " ".join(f"{k} {v['user'] + v['system']:.3f}"
                                         for k, v in row["helpers_by_thread_s_per_gb"].items())
                              + "; a restore's ms by phase " + " ".join(f"{k} {v:g}" for k, v in run.phase_ms.items()),
                              flush=True)
    arena.close()
    O.emit_json(args, rows)
    return 0
