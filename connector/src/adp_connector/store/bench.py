"""Store vs raw-device throughput on any BlockDevice (the numbers for docs/benchmarks.md).

``python -m adp_connector.store.bench`` runs it on an in-memory device; the lead calls :func:`run_benchmark`
with the NVMe/TCP client to compare ``store save/load GB/s`` against raw ``submit_write/submit_read`` in one run.
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import Future

from ..device import BlockDevice
from .keys import KeyNamespace
from .store import PageStore, StoreConfig


def _raw(dev: BlockDevice, base: int, bufs: list[bytearray], write: bool) -> float:
    t0 = time.perf_counter()
    futs: list[Future[None]] = []
    off = base
    for b in bufs:
        mv = memoryview(b)
        futs.append(dev.submit_write(off, mv) if write else dev.submit_read(off, mv))
        off += len(b)
    for f in futs:
        f.result()
    if write:
        dev.flush()
    return time.perf_counter() - t0


def run_benchmark(dev: BlockDevice, page_bytes: int = 2 << 20, pages: int = 64, batch: int = 16,
                  config: StoreConfig | None = None) -> dict[str, float]:
    """Save+load ``pages`` pages through a fresh store, and the same bytes raw; returns GB/s (1e9 B/s) figures.

    Formats ``dev`` (destroys its content). The raw pass writes from the data area of segment 1 on.
    """
    PageStore.format(dev, partitions=2, avg_page_bytes=page_bytes)
    store = PageStore(dev, config or StoreConfig(heartbeat_interval_s=0, claim_settle_s=0.05))
    ns = KeyNamespace("bench", "bf16", "bench", 16)
    keys = ns.keys_for_block_hashes(i.to_bytes(8, "little") for i in range(pages))
    data = [bytearray(os.urandom(page_bytes)) for _ in range(pages)]
    outs = [bytearray(page_bytes) for _ in range(pages)]
    total = page_bytes * pages
    t0 = time.perf_counter()
    for i in range(0, pages, batch):
        assert store.save_batch(keys[i:i + batch], data[i:i + batch]).ok_count() == len(keys[i:i + batch])
    t_save = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(0, pages, batch):
        assert store.load_batch(keys[i:i + batch], outs[i:i + batch]).ok_count() == len(keys[i:i + batch])
    t_load = time.perf_counter() - t0
    assert outs == data
    store.close()
    g = store.geometry
    base = g.data_start_lba(min(1, g.segments - 1)) * g.lba_size
    aligned = [bytearray(-(-page_bytes // g.lba_size) * g.lba_size) for _ in range(pages)]
    t_rw = t_rr = 0.0
    for i in range(0, pages, batch):
        t_rw += _raw(dev, base + i * len(aligned[0]), aligned[i:i + batch], True)
    for i in range(0, pages, batch):
        t_rr += _raw(dev, base + i * len(aligned[0]), aligned[i:i + batch], False)
    return {"bytes": total, "store_save_gbps": total / t_save / 1e9, "store_load_gbps": total / t_load / 1e9,
            "raw_write_gbps": total / t_rw / 1e9, "raw_read_gbps": total / t_rr / 1e9}


def _main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--page-mib", type=float, default=2.0)
    ap.add_argument("--pages", type=int, default=64)
    args = ap.parse_args()
    from concurrent.futures import ThreadPoolExecutor

    class _Mem:  # minimal in-memory device so the module runs stand-alone
        lba_size, max_transfer_bytes = 4096, 1 << 20

        def __init__(self, cap: int) -> None:
            self.capacity_bytes, self.buf, self.pool = cap, bytearray(cap), ThreadPoolExecutor(4)

        def submit_read(self, off: int, buf: memoryview) -> Future[None]:
            return self.pool.submit(lambda: buf.__setitem__(slice(None), self.buf[off:off + len(buf)]))

        def submit_write(self, off: int, data: memoryview) -> Future[None]:
            return self.pool.submit(lambda: self.buf.__setitem__(slice(off, off + len(data)), data))

        def read_into(self, off: int, buf: memoryview, timeout: float | None = None) -> None:
            self.submit_read(off, buf).result()

        def write(self, off: int, data: memoryview, timeout: float | None = None) -> None:
            self.submit_write(off, memoryview(data)).result()

        def flush(self, timeout: float | None = None) -> None: ...

        def deallocate(self, off: int, n: int, timeout: float | None = None) -> None:
            self.buf[off:off + n] = bytes(n)

        def close(self) -> None: ...

    page = int(args.page_mib * (1 << 20))
    res = run_benchmark(_Mem(4 * page * args.pages + (64 << 20)), page, args.pages)  # type: ignore[arg-type]
    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()))


if __name__ == "__main__":
    _main()
