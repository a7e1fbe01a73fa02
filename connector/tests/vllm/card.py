"""The emulated card of the engine tests: a userspace target on a backing file, and the corruption control."""

from __future__ import annotations

from pathlib import Path

from adp_connector.nvmeof.host import Controller, HostConfig
from adp_connector.store import PageStore, StoreConfig
from adp_emulator.target import TargetSettings, UserspaceTarget


def start_card(backing: Path, port: int = 0) -> UserspaceTarget:
    """A 1 GiB userspace target on ``backing`` (pages survive a restart on the same file)."""
    return UserspaceTarget(TargetSettings(port=port, capacity_bytes=1 << 30, backing_path=str(backing))).start()


def corrupt_all_pages(tgt: UserspaceTarget) -> int:
    """Flip bytes in the middle of every stored page's payload (header intact: only the checksum can tell)."""
    ctrl = Controller.connect(HostConfig(traddr="127.0.0.1", trsvcid=tgt.address[1]))
    try:
        store = PageStore(ctrl, StoreConfig(writer=False))
        extents = store.payload_extents()
        for _key, offset, length in extents:
            tgt.faults.corrupt(offset + length // 2, 64)
        store.close()
        return len(extents)
    finally:
        ctrl.close()
