"""The restore's last step alone: pinned host pages scattered into an 8B-shaped KV cache, with the GPU idle or busy.

    python3 scripts/gpu/scatter_bench.py --gb 16 --out scatter.json   # on the H200 (validate.sh scatter)
    python3 scripts/gpu/scatter_bench.py --gb 0.25 --device cpu       # a smoke run without a GPU

Each point moves ``--gb`` of 2 MiB pages (32 layers x K/V x 16 tokens x 8 heads x 128 dims, bf16: the Llama-3.1-8B
shape of the GPU runs, each layer laid out as vLLM's FlashAttention cache ``(2, blocks, ...)``) from 64 MiB slabs of a
``cudaHostRegister``-pinned ``memfd`` (as the connector's staging arena) through ``PagedKV.scatter`` into random
blocks of the layers, recycling a slab when its copy event has fired, as the restore pipeline's driver thread does.
Points: the page copy ``per_layer`` (tensor calls per layer) and ``fused`` (one Triton launch per batch), each with
the GPU idle, with a GPU load (bf16 matmuls queued on the default stream by another thread, as a prefill step queues
its kernels) and with a Python load (another thread running bytecode, holding the interpreter lock the way the
engine's scheduler does between its tensor calls), the last once per ``--switch-intervals`` value (Python's switch
interval: how long a thread that wants the lock waits before the holder must drop it; each tensor call releases the
lock and takes it back, so a launch-bound copy pays that wait per call). Reported: GB/s into the KV cache, the driver
thread's CPU seconds per GB, and the load's own rate during the scatter against alone (what the scatter takes from the
engine). A point stops after ``--max-seconds`` and reports the bytes it moved (``cut_short``): a starved path can take
minutes.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import sys
import threading
import time
from typing import Any

import torch

from adp_connector.pipeline import PagedKV

LAYERS, TOKENS, HEADS, DIM = 32, 16, 8, 128
SLAB_PAGES = 32  # 64 MiB slabs, as the connector's
ARENA_SLABS = 32


class ComputeLoad:
    """Square bf16 matmuls queued on this thread's default stream until stopped; counts those completed."""

    def __init__(self, device: torch.device, n: int) -> None:
        self.a = torch.randn((n, n), dtype=torch.bfloat16, device=device)
        self.b = torch.randn((n, n), dtype=torch.bfloat16, device=device)
        self.c = torch.empty_like(self.a)
        self.done = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        cuda = self.a.device.type == "cuda"
        while not self.stop.is_set():
            for _ in range(32):
                torch.matmul(self.a, self.b, out=self.c)
            if cuda:
                torch.cuda.current_stream().synchronize()
            self.done += 32

    def rate(self, seconds: float) -> float:
        """Matmuls per second over ``seconds`` (counted from now)."""
        start = self.done
        time.sleep(seconds)
        return (self.done - start) / seconds


class PythonLoad:
    """Bytecode in a loop until stopped (the interpreter lock held between switch intervals); counts the loops."""

    def __init__(self) -> None:
        self.done = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            x = 0
            for i in range(2000):
                x += i
            self.done += 1

    def rate(self, seconds: float) -> float:
        start = self.done
        time.sleep(seconds)
        return (self.done - start) / seconds


def scatter_point(kv: PagedKV, arena: torch.Tensor, page: int, blocks: int, total: int,
                  max_s: float = float("inf")) -> tuple[float, float, int]:
    """Scatter ``total`` bytes of pages, or what ``max_s`` seconds allow: (seconds, driver CPU seconds, bytes)."""
    slab = SLAB_PAGES * page
    slabs = arena.numel() // slab
    events: list[Any] = [None] * slabs
    gen = torch.Generator().manual_seed(1)
    n = total // slab
    t0, c0 = time.perf_counter(), time.thread_time()
    done = 0
    while done < n and (done == 0 or time.perf_counter() - t0 < max_s):
        s = done % slabs
        while events[s] is not None and not events[s].query():  # the slab's previous copy has run: it takes the
            time.sleep(0.0005)                                      # next batch (polled, as the restore driver does)
        ids = torch.randperm(blocks, generator=gen)[:SLAB_PAGES].tolist()
        events[s] = kv.scatter(0, ids, arena[s * slab:(s + 1) * slab].view(SLAB_PAGES, page))
        done += 1
    for e in events:
        if e is not None:
            e.synchronize()
    return time.perf_counter() - t0, time.thread_time() - c0, done * slab


def pinned_arena(nbytes: int, pin: bool) -> tuple[torch.Tensor, Any]:
    """A ``memfd`` mapping as an int8 tensor, page-locked with ``cudaHostRegister`` when ``pin``."""
    fd = os.memfd_create("scatter-bench")
    os.ftruncate(fd, nbytes)
    mem = mmap.mmap(fd, nbytes)
    os.close(fd)
    t = torch.frombuffer(mem, dtype=torch.int8)
    t.fill_(7)
    if pin and torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0) != 0:
        raise SystemExit("scatter_bench: cudaHostRegister of the arena failed")
    return t, mem


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=16.0, help="bytes scattered per point, in GB")
    ap.add_argument("--max-seconds", type=float, default=20.0,
                    help="a point stops after this long and reports what it moved (a starved path can take minutes)")
    ap.add_argument("--blocks", type=int, default=4096, help="KV-cache blocks per layer")
    ap.add_argument("--matmul", type=int, default=8192, help="side of the compute load's square matmuls")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--switch-intervals", default=str(sys.getswitchinterval()),
                    help="comma-separated interpreter switch intervals (s) for the Python-load points")
    ap.add_argument("--out", help="write the results JSON here")
    args = ap.parse_args()
    try:
        intervals = [float(x) for x in args.switch_intervals.split(",")]
        if not intervals or min(intervals) <= 0:
            raise ValueError
    except ValueError:
        ap.error(f"--switch-intervals: positive seconds, comma-separated, got {args.switch_intervals!r}")
    default_interval = sys.getswitchinterval()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("scatter_bench: no CUDA device (--device cpu runs the smoke test)")
    shape = (2, args.blocks, TOKENS, HEADS, DIM)
    layers = [(f"layer{i}", torch.zeros(shape, dtype=torch.bfloat16, device=dev).transpose(0, 1),
               2 * TOKENS * HEADS * DIM * 2) for i in range(LAYERS)]
    page = sum(nb for _, _, nb in layers)
    arena, mem = pinned_arena(ARENA_SLABS * SLAB_PAGES * page, cuda)
    total = max(SLAB_PAGES * page, int(args.gb * 1e9))

    def new_load(kind: str) -> ComputeLoad | PythonLoad:
        return PythonLoad() if kind == "python" else ComputeLoad(dev, args.matmul if cuda else 256)

    alone = {}
    for kind in ("gpu", "python"):
        load = new_load(kind)
        load.thread.start()
        alone[kind] = load.rate(2.0 if cuda else 0.5)
        load.stop.set()
        load.thread.join()
    points = []
    runs = [("idle", default_interval), ("gpu", default_interval)] + [("python", si) for si in intervals]
    for kind, interval in runs:
        for page_copy in ("per_layer", "fused"):
            sys.setswitchinterval(interval)
            kv = PagedKV({0: layers}, page_copy=page_copy)
            scatter_point(kv, arena, page, args.blocks, SLAB_PAGES * page * 4)  # warm-up: stream, allocator, JIT
            load = new_load(kind)
            if kind != "idle":
                load.thread.start()
                time.sleep(0.5)
            m0 = load.done
            seconds, cpu, moved = scatter_point(kv, arena, page, args.blocks, total, args.max_seconds)
            m1 = load.done
            load.stop.set()
            if kind != "idle":
                load.thread.join()
            sys.setswitchinterval(default_interval)
            row = {"page_copy": page_copy, "copy_path": kv.copy_paths.get(0), "load": kind,
                   "switch_interval_s": interval, "bytes": moved,
                   "cut_short": moved < total // (SLAB_PAGES * page) * SLAB_PAGES * page,
                   "seconds": round(seconds, 4), "gbps": round(moved / seconds / 1e9, 2),
                   "driver_cpu_s_per_gb": round(cpu / (moved / 1e9), 4),
                   "stream_priority": kv.restore_stream(dev).priority if cuda else None}
            if kind != "idle":
                row["load_rate"] = round((m1 - m0) / seconds, 1)
                row["load_rate_alone"] = round(alone[kind], 1)
                row["load_share_kept"] = round((m1 - m0) / seconds / alone[kind], 3) if alone[kind] else None
            print(json.dumps(row), flush=True)
            points.append(row)
    result = {"gpu": torch.cuda.get_device_name(dev) if cuda else None, "host_cores": os.cpu_count(),
              "host": platform.node(), "torch": torch.__version__, "page_bytes": page, "slab_bytes": SLAB_PAGES * page,
              "blocks": args.blocks, "matmul": args.matmul, "points": points}
    if cuda:
        torch.cuda.cudart().cudaHostUnregister(arena.data_ptr())
    del arena
    mem.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
