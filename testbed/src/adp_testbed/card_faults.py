"""Simulated media corruption of an emulated card: the negative control of ``bench restart`` and ``demo``.

Bytes in the middle of every stored page's payload are flipped, while page headers and commit records stay intact,
so only a payload checksum or a byte comparison of the restored pages can tell. The bytes are written into the
emulator's backing file, which the target (and its I/O workers) map shared, so the running target serves them.
Only a local emulator's backing file is ever touched; a card at an address never is.
"""

from __future__ import annotations

import os
from pathlib import Path

from adp_connector.nvmeof.host import Controller, HostConfig
from adp_connector.store import PageStore, StoreConfig


def corrupt_payloads(backing: str | os.PathLike[str], traddr: str, trsvcid: int, subnqn: str | None,
                     nbytes: int = 64, keys: set[bytes] | None = None) -> int:
    """Flip ``nbytes`` in the middle of each stored page's payload in ``backing`` (only the pages of ``keys``
    when given); returns the pages corrupted."""
    ctrl = Controller.connect(HostConfig(traddr=traddr, trsvcid=trsvcid, subnqn=subnqn))
    try:
        store = PageStore(ctrl, StoreConfig(writer=False, create=False))
        try:
            extents = [e for e in store.payload_extents() if keys is None or bytes(e[0]) in keys]
        finally:
            store.close()
    finally:
        ctrl.close()
    with open(Path(backing), "r+b") as f:
        for _key, offset, length in extents:
            n = min(nbytes, length)
            at = offset + (length - n) // 2
            f.seek(at)
            flipped = bytes(b ^ 0xFF for b in f.read(n))
            f.seek(at)
            f.write(flipped)
        f.flush()
        os.fsync(f.fileno())
    return len(extents)
