"""The page-store tests' "nvme" device: the real host client talking to a real userspace target over TCP.

:class:`NvmeTestDevice` is a :class:`~adp_connector.device.BlockDevice` (it delegates to
:class:`~adp_connector.nvmeof.host.Controller`) plus the subset of ``MemDevice``'s fault hooks that map
onto the target's own fault injection (delay, fail-next, drop/restore, the raw image). Hooks that
have no NVMe equivalent (tearing one write at a byte offset, dying after N writes) skip the test for
this device: they are covered by the in-memory device, which is a unit test of the store alone.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path

import pytest

from adp_connector.device import Buffer
from adp_connector.nvmeof.host import Controller, HostConfig

target_mod = pytest.importorskip("adp_emulator.target", reason="the userspace target package is not installed")

NQN = "nqn.2026-11.io.awide:store-tests"


def _mdts_for(max_transfer: int) -> int:
    """Largest 4 KiB x 2^n not above ``max_transfer`` (the target's MDTS must be of that form)."""
    m = 4096
    while m * 2 <= max_transfer:
        m *= 2
    return m


class NvmeTarget:
    """A file-backed userspace target that can be restarted over the same file (a target restart)."""

    def __init__(self, path: Path, capacity: int, lba_size: int, max_transfer: int) -> None:
        self.path = path
        self.settings = dict(port=0, subnqn=NQN, capacity_bytes=capacity, lba_size=lba_size,
                             mdts_bytes=_mdts_for(max(max_transfer, 4096)), backing_path=str(path))
        self.target = self._start()

    def _start(self):
        t = target_mod.UserspaceTarget(target_mod.TargetSettings(**self.settings))
        t.start()
        return t

    def restart(self) -> None:
        self.target.stop()
        self.target = self._start()

    def stop(self) -> None:
        self.target.stop()


class NvmeTestDevice:
    """BlockDevice over NVMe/TCP with MemDevice-style fault hooks."""

    def __init__(self, tgt: NvmeTarget, max_transfer: int) -> None:
        self.tgt = tgt
        host, port = tgt.target.address
        self.ctrl = Controller.connect(HostConfig(traddr=host, trsvcid=port, subnqn=NQN, io_queues=2, queue_depth=32,
                                                  max_transfer_bytes=max_transfer, reconnect_delay=0.1,
                                                  command_timeout=20))
        self.closed = False
        self._delay = 0.0

    # ---- BlockDevice
    @property
    def lba_size(self) -> int:
        return self.ctrl.lba_size

    @property
    def capacity_bytes(self) -> int:
        return self.ctrl.capacity_bytes

    @property
    def max_transfer_bytes(self) -> int:
        return self.ctrl.max_transfer_bytes

    def submit_read(self, offset: int, buf: memoryview) -> Future[None]:
        return self.ctrl.submit_read(offset, buf)

    def submit_write(self, offset: int, data: Buffer) -> Future[None]:
        return self.ctrl.submit_write(offset, data)

    def read_into(self, offset: int, buf: memoryview, timeout: float | None = None) -> None:
        self.ctrl.read_into(offset, buf, timeout)

    def write(self, offset: int, data: Buffer, timeout: float | None = None) -> None:
        self.ctrl.write(offset, data, timeout)

    def flush(self, timeout: float | None = None) -> None:
        self.ctrl.flush(timeout)

    def deallocate(self, offset: int, length: int, timeout: float | None = None) -> None:
        self.ctrl.deallocate(offset, length, timeout)

    def close(self) -> None:
        self.closed = True
        self.ctrl.close()

    # ---- fault hooks (the target's own fault injection)
    @property
    def delay_s(self) -> float:
        return self._delay

    @delay_s.setter
    def delay_s(self, seconds: float) -> None:
        self._delay = seconds
        self.tgt.target.faults.set_delay(seconds)

    def fail_next(self, n: int, kinds: tuple[str, ...] = ("read", "write", "flush")) -> None:
        if set(kinds) != {"read", "write", "flush"} and n:
            pytest.skip("the target fails the next N I/O commands of any kind; kind-specific failures are "
                        "covered by the in-memory device")
        self.tgt.target.faults.fail_next_io(n, "INTERNAL_ERROR")

    def drop(self) -> None:
        """Drop every connection and keep the client from reconnecting until :meth:`restore`."""
        self.ctrl.config.auto_reconnect = False
        self.tgt.target.faults.drop_connections()
        deadline = time.monotonic() + 5
        while self.ctrl.connected and time.monotonic() < deadline:
            time.sleep(0.005)

    def restore(self) -> None:
        self.tgt.target.faults.clear()
        self.ctrl.reconnect()
        self.ctrl.config.auto_reconnect = True

    def image(self) -> bytes:
        ns = self.tgt.target.namespaces[1]
        return bytes(ns.view[: self.capacity_bytes])

    def tear_next_write(self, prefix_bytes: int) -> None:
        pytest.skip("a write torn at a byte offset cannot be injected over NVMe/TCP (in-memory device covers it)")

    def crash_after(self, n_writes: int, tear_bytes: int | None = None) -> None:
        pytest.skip("dying after N writes is an in-memory-device fault (the fault matrix kills real targets)")

    @property
    def max_command_bytes(self) -> int:
        pytest.skip("per-command sizes are checked by the client's own tests")
        return 0
