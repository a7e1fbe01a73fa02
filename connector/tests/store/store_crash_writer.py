"""Child process of the SIGKILL crash test: saves pages into a file-backed device until killed.

Prints ``ok <i>`` once page ``i`` is committed. Usage: store_crash_writer.py PATH CAPACITY START
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from memdevice import FileBacking, MemDevice

from adp_connector.store import KeyNamespace, PageStore, StoreConfig

NS = KeyNamespace("crash-model", "bf16", "L", 16)
WRITER = b"crash-writer-id!"


def key_of(i: int) -> bytes:
    """Key of page ``i``."""
    return NS.key_for_block_hash(i.to_bytes(8, "little"))


def payload_of(i: int) -> bytes:
    """Deterministic payload of page ``i`` (sizes 1 B .. ~300 KB)."""
    n = (i * 7919) % 300_000 + 1
    pat = i.to_bytes(4, "little") + b"\xa5\x5a\x00\xff"
    return (pat * (n // 8 + 1))[:n]


def open_store(path: str, capacity: int) -> PageStore:
    """Open the store the way both the child and the verifying parent do."""
    dev = MemDevice(capacity, 512, 64 << 10, backing=FileBacking(path, capacity))
    return PageStore(dev, StoreConfig(claim_settle_s=0.01, heartbeat_interval_s=0, partitions=2,
                                      avg_page_bytes=64 << 10, writer_id=WRITER, inline_bytes=64 << 10))


def main() -> None:
    path, capacity, start = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    store = open_store(path, capacity)
    i = start
    while True:
        ids = list(range(i, i + 4))
        res = store.save_batch([key_of(j) for j in ids], [payload_of(j) for j in ids]).wait()
        for j, r in zip(ids, res, strict=True):
            if r.ok:
                print("ok", j, flush=True)
        i += 4


if __name__ == "__main__":
    main()
