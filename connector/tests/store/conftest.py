"""Fixtures of the page-store tests: devices and store configs tuned for fast tests."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from memdevice import FileBacking, MemDevice
from store_testutil import PROCESS_NQN


@pytest.fixture(params=["mem", "file", "nvme"])
def device_factory(request: pytest.FixtureRequest, tmp_path) -> Iterator[Callable[..., MemDevice]]:
    """Make devices of one kind; ``reopen=True`` returns a new device over the same state (a target restart).

    ``nvme``: the real host client against a real, file-backed userspace target over loopback TCP;
    ``reopen=True`` then restarts the target process object over the same file.
    """
    kind = request.param
    made: list[MemDevice] = []
    state: dict[str, object] = {}
    targets: list = []

    def make(capacity: int = 8 << 20, lba_size: int = 512, max_transfer: int = 128 << 10,
             reopen: bool = False) -> MemDevice:
        if kind == "nvme":
            from nvmedevice import NvmeTarget, NvmeTestDevice

            if reopen:
                made[-1].close()
                targets[-1].restart()
            else:
                targets.append(NvmeTarget(tmp_path / f"ns{len(targets)}.img", capacity, lba_size, max_transfer))
            dev = NvmeTestDevice(targets[-1], max_transfer)
        elif kind == "mem":
            if reopen:
                old = made[-1]
                dev = MemDevice(capacity, lba_size, max_transfer)
                dev.backing.buf[:] = old.image()
            else:
                dev = MemDevice(capacity, lba_size, max_transfer)
        else:
            path = state.setdefault("path", str(tmp_path / "ns.img"))
            if not reopen and os.path.exists(path):  # type: ignore[arg-type]
                os.unlink(path)  # type: ignore[arg-type]
            dev = MemDevice(capacity, lba_size, max_transfer, backing=FileBacking(path, capacity))  # type: ignore[arg-type]
        made.append(dev)
        return dev

    yield make
    for d in made:
        if not d.closed:
            d.close()
    for t in targets:
        t.stop()



@pytest.fixture
def target(tmp_path):
    """A 64 MiB file-backed userspace target (the store-process tests' card), stopped after the test."""
    target_mod = pytest.importorskip("adp_emulator.target", reason="the userspace target package is not installed")
    t = target_mod.UserspaceTarget(target_mod.TargetSettings(
        port=0, subnqn=PROCESS_NQN, capacity_bytes=64 << 20, lba_size=512, mdts_bytes=128 << 10,
        backing_path=str(tmp_path / "ns.img")))
    t.start()
    yield t
    t.stop()

