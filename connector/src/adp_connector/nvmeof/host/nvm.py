"""The NVM command set of the host controller: reads, writes, Flush, Write Zeroes and Dataset Management.

:class:`NvmCommands` is the half of :class:`~adp_connector.nvmeof.host.controller.Controller` that turns byte
ranges into NVM commands: split at the transfer limit, grouped per send, spread over the I/O queues, and gathered
into one future per call. The association itself (queues, Connect, enable, keep-alive, reconnect, admin commands)
stays in ``controller.py``.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING

from adp_wire import sqe as S
from adp_wire.constants import IoOpcode

from ...device import Buffer, DeviceError, DeviceUnavailable, ScatterList, check_aligned

if TYPE_CHECKING:
    from .controller import HostConfig, HostStats
    from .queue import QueuePair

MAX_NLB = 0x10000  # the most blocks one Read/Write/Write Zeroes command names (NLB is 0's based, 16 bits)
_SEND_GROUP = 8  # commands of one transfer sent together on one queue


class _Gather:
    """Completes ``future`` once ``n`` part futures finished; the first error wins."""

    __slots__ = ("error", "future", "lock", "remaining")

    def __init__(self, n: int) -> None:
        self.remaining = n
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.future: Future[None] = Future()

    def part_done(self, error: BaseException | None = None) -> None:
        with self.lock:
            if error is not None and self.error is None:
                self.error = error
            self.remaining -= 1
            last = self.remaining == 0
        if last:
            if self.error is not None:
                self.future.set_exception(self.error)
            else:
                self.future.set_result(None)


class NvmCommands:
    """Byte-addressed NVM I/O over the controller's I/O queues (a mixin of ``Controller``, which provides the
    namespace, the limits, the statistics and the queue choice)."""

    config: HostConfig
    stats: HostStats
    nsid: int
    lba_size: int
    capacity_bytes: int
    max_transfer_bytes: int

    def _io_queue(self) -> QueuePair:
        raise NotImplementedError

    def _submit_rw(self, opcode: int, offset: int, buf: memoryview | ScatterList,
                   timeout: float | None) -> Future[None]:
        lba = self.lba_size
        check_aligned(offset, len(buf), lba, self.capacity_bytes)
        t = timeout or self.config.command_timeout
        step = self.max_transfer_bytes
        n = len(buf)
        parts = max(1, -(-n // step))
        gather = _Gather(parts)
        if n == 0:
            gather.part_done()
            return gather.future
        is_read = opcode == IoOpcode.READ
        nsid, done = self.nsid, gather.part_done
        # Up to _SEND_GROUP commands of one transfer go to one queue in one send (fewer system calls per byte:
        # on loopback each send also runs the target's TCP receive); larger transfers spread over the queues.
        for g in range(0, parts, _SEND_GROUP):
            specs = []
            for i in range(g, min(parts, g + _SEND_GROUP)):
                start = i * step
                chunk = buf[start : start + step]
                specs.append(((offset + start) // lba, len(chunk) // lba, chunk))
            try:
                failed = self._io_queue().submit_rw_many(opcode, nsid, specs, t, done)
            except DeviceError as e:
                failed = len(specs)
                for _ in range(failed):
                    done(e)
            if failed:
                self.stats.errors += 1
                for _ in range(parts - g - len(specs)):
                    done(DeviceUnavailable("an earlier part of this transfer failed"))
                break
        self.stats.commands += parts
        if is_read:
            self.stats.bytes_read += n
        else:
            self.stats.bytes_written += n
        return gather.future

    @staticmethod
    def _bytes_view(buf: Buffer) -> memoryview:
        mv = memoryview(buf)
        return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")

    def submit_read(self, offset: int, buf: memoryview) -> Future[None]:
        mv = self._bytes_view(buf)
        if mv.readonly:
            raise ValueError("read buffer must be writable")
        return self._submit_rw(IoOpcode.READ, offset, mv, None)

    def submit_readv(self, offset: int, bufs: list[Buffer]) -> Future[None]:
        """Read ``sum(len(b))`` bytes at ``offset`` into ``bufs`` in order, split only at the MDTS (one command
        per MDTS-sized span, whatever the buffer boundaries)."""
        views = [self._bytes_view(b) for b in bufs]
        if any(v.readonly for v in views):
            raise ValueError("read buffers must be writable")
        return self._submit_rw(IoOpcode.READ, offset, ScatterList(views), None)

    def submit_write(self, offset: int, data: Buffer) -> Future[None]:
        return self._submit_rw(IoOpcode.WRITE, offset, self._bytes_view(data), None)

    def _wait(self, fut: Future[None], timeout: float | None) -> None:
        t = (timeout or self.config.command_timeout) + 5
        try:
            fut.result(t)
        except DeviceError:
            self.stats.errors += 1
            raise
        except TimeoutError as e:
            raise DeviceError(f"I/O did not complete within {t} s") from e

    def read_into(self, offset: int, buf: memoryview, timeout: float | None = None) -> None:
        self._wait(self.submit_read(offset, buf), timeout)

    def read(self, offset: int, length: int, timeout: float | None = None) -> bytes:
        buf = bytearray(length)
        self.read_into(offset, memoryview(buf), timeout)
        return bytes(buf)

    def write(self, offset: int, data: Buffer, timeout: float | None = None) -> None:
        self._wait(self.submit_write(offset, data), timeout)

    def flush(self, timeout: float | None = None) -> None:
        t = timeout or self.config.command_timeout
        self._io_queue().submit(S.flush_cmd(self.nsid), what="Flush", timeout=t).result(t + 5)

    def write_zeroes(self, offset: int, length: int, deallocate: bool = False, timeout: float | None = None) -> None:
        lba = self.lba_size
        check_aligned(offset, length, lba, self.capacity_bytes)
        t = timeout or self.config.command_timeout
        futs = []
        slba, left = offset // lba, length // lba
        while left:
            nlb = min(left, MAX_NLB)
            futs.append(self._io_queue().submit(S.write_zeroes_cmd(self.nsid, slba, nlb, deallocate),
                                                what="Write Zeroes", timeout=t))
            slba += nlb
            left -= nlb
        for f in futs:
            f.result(t + 5)

    def deallocate(self, offset: int, length: int, timeout: float | None = None) -> None:
        lba = self.lba_size
        check_aligned(offset, length, lba, self.capacity_bytes)
        if not length:
            return
        t = timeout or self.config.command_timeout
        ranges, slba, left = [], offset // lba, length // lba
        while left:
            nlb = min(left, 0xFFFFFFFF)
            ranges.append((slba, nlb))
            slba += nlb
            left -= nlb
        for i in range(0, len(ranges), 256):
            batch = ranges[i : i + 256]
            sqe = S.dsm_cmd(self.nsid, len(batch))
            self._io_queue().submit(sqe, data=memoryview(S.dsm_ranges(batch)), what="Dataset Management",
                                    timeout=t).result(t + 5)
