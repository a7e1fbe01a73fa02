"""Test BlockDevices for the page store: in-memory, sparse and file-backed, with fault injection.

Requests are split at ``max_transfer_bytes`` like a real host client would split at MDTS; every piece is one
"command" for fault injection and counting. Faults:

* :meth:`MemDevice.fail_next` -- the next N commands (reads/writes/flushes) raise :class:`DeviceError`;
* :meth:`MemDevice.tear_next_write` -- the next write command stores only a prefix, then raises;
* :meth:`MemDevice.crash_after` -- after N more write commands (the last one optionally torn) the device is dead:
  nothing more is stored and everything raises :class:`DeviceUnavailable` (a killed writer / lost target);
* :meth:`MemDevice.drop` / :meth:`MemDevice.restore` -- connection lost (DeviceUnavailable) and back;
* ``delay_s`` -- per-command latency.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from adp_connector.device import Buffer, DeviceError, DeviceUnavailable, check_aligned


class BytearrayBacking:
    """Plain in-memory image."""

    def __init__(self, capacity: int, image: bytes | None = None) -> None:
        self.buf = bytearray(image) if image is not None else bytearray(capacity)
        self.buf.extend(bytes(capacity - len(self.buf)))

    def read(self, off: int, mv: memoryview) -> None:
        mv[:] = self.buf[off:off + len(mv)]

    def write(self, off: int, data: memoryview) -> None:
        self.buf[off:off + len(data)] = data

    def zero(self, off: int, n: int) -> None:
        self.buf[off:off + n] = bytes(n)

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass


class SparseBacking:
    """Chunked dict image: namespaces of terabytes cost only what is written."""

    CHUNK = 1 << 20

    def __init__(self, capacity: int) -> None:
        self.chunks: dict[int, bytearray] = {}
        self.capacity = capacity

    def _pieces(self, off: int, n: int):
        pos = 0
        while pos < n:
            c, o = divmod(off + pos, self.CHUNK)
            k = min(n - pos, self.CHUNK - o)
            yield c, o, pos, k
            pos += k

    def read(self, off: int, mv: memoryview) -> None:
        for c, o, pos, k in self._pieces(off, len(mv)):
            ch = self.chunks.get(c)
            mv[pos:pos + k] = ch[o:o + k] if ch is not None else bytes(k)

    def write(self, off: int, data: memoryview) -> None:
        for c, o, pos, k in self._pieces(off, len(data)):
            ch = self.chunks.setdefault(c, bytearray(self.CHUNK))
            ch[o:o + k] = data[pos:pos + k]

    def zero(self, off: int, n: int) -> None:
        for c, o, _pos, k in self._pieces(off, n):
            if k == self.CHUNK:
                self.chunks.pop(c, None)
            elif c in self.chunks:
                self.chunks[c][o:o + k] = bytes(k)

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass


class FileBacking:
    """A sparse file (the "target process" state that survives a restart)."""

    def __init__(self, path: str | os.PathLike[str], capacity: int, fsync: bool = False) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        if os.fstat(self.fd).st_size < capacity:
            os.ftruncate(self.fd, capacity)
        self.fsync = fsync

    def read(self, off: int, mv: memoryview) -> None:
        got = os.preadv(self.fd, [mv], off)
        if got < len(mv):
            mv[got:] = bytes(len(mv) - got)

    def write(self, off: int, data: memoryview) -> None:
        pos = 0
        while pos < len(data):
            pos += os.pwrite(self.fd, data[pos:], off + pos)

    def zero(self, off: int, n: int) -> None:
        step = 1 << 20
        for pos in range(0, n, step):
            k = min(step, n - pos)
            os.pwrite(self.fd, bytes(k), off + pos)

    def sync(self) -> None:
        if self.fsync:
            os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)


class MemDevice:
    """A thread-safe :class:`~adp_connector.device.BlockDevice` over a backing store, with fault injection."""

    def __init__(self, capacity: int, lba_size: int = 512, max_transfer: int = 128 << 10,
                 backing: BytearrayBacking | SparseBacking | FileBacking | None = None, workers: int = 2,
                 delay_s: float = 0.0) -> None:
        if capacity % lba_size:
            raise ValueError("capacity must be a multiple of the LBA size")
        self._lba = lba_size
        self._cap = capacity
        self._mdts = max_transfer
        self.backing = backing if backing is not None else BytearrayBacking(capacity)
        self.delay_s = delay_s
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="memdev")
        self._mu = threading.Lock()      # fault state and counters
        self._data_mu = threading.Lock()  # the image (one command applies atomically w.r.t. others)
        self._fail = 0
        self._fail_kinds: tuple[str, ...] = ()
        self._tear: int | None = None
        self._crash_in: int | None = None
        self._crash_tear: int | None = None
        self.dead = False
        self.dropped = False
        self.closed = False
        self.write_hook: Callable[[int, bytes], None] | None = None
        self.commands = {"read": 0, "write": 0, "flush": 0, "deallocate": 0}
        self.max_command_bytes = 0

    # ---- BlockDevice
    @property
    def lba_size(self) -> int:
        return self._lba

    @property
    def capacity_bytes(self) -> int:
        return self._cap

    @property
    def max_transfer_bytes(self) -> int:
        return self._mdts

    def submit_read(self, offset: int, buf: memoryview) -> Future[None]:
        mv = memoryview(buf).cast("B")
        check_aligned(offset, len(mv), self._lba, self._cap)
        return self._pool.submit(self._run, "read", offset, mv)

    def submit_write(self, offset: int, data: Buffer) -> Future[None]:
        mv = memoryview(data).cast("B")
        check_aligned(offset, len(mv), self._lba, self._cap)
        return self._pool.submit(self._run, "write", offset, mv)

    def read_into(self, offset: int, buf: memoryview, timeout: float | None = None) -> None:
        self.submit_read(offset, buf).result(timeout)

    def write(self, offset: int, data: Buffer, timeout: float | None = None) -> None:
        self.submit_write(offset, data).result(timeout)

    def flush(self, timeout: float | None = None) -> None:
        self._gate("flush")
        self.backing.sync()

    def deallocate(self, offset: int, length: int, timeout: float | None = None) -> None:
        check_aligned(offset, length, self._lba, self._cap)
        self._gate("deallocate")
        with self._data_mu:
            self.backing.zero(offset, length)

    def close(self) -> None:
        self.closed = True
        self._pool.shutdown(wait=True)
        self.backing.close()

    # ---- faults
    def fail_next(self, n: int, kinds: tuple[str, ...] = ("read", "write", "flush")) -> None:
        """The next ``n`` commands of ``kinds`` raise DeviceError."""
        with self._mu:
            self._fail, self._fail_kinds = n, kinds

    def tear_next_write(self, prefix_bytes: int) -> None:
        """The next write command stores only ``prefix_bytes`` bytes, then raises DeviceError."""
        with self._mu:
            self._tear = prefix_bytes

    def crash_after(self, n_writes: int, tear_bytes: int | None = None) -> None:
        """Die after ``n_writes`` more write commands; with ``tear_bytes`` the next one lands only partly."""
        with self._mu:
            self._crash_in, self._crash_tear = n_writes, tear_bytes

    def drop(self) -> None:
        """Lose the connection: every command raises DeviceUnavailable until :meth:`restore`."""
        self.dropped = True

    def restore(self) -> None:
        """Reconnect after :meth:`drop`."""
        self.dropped = False

    def image(self) -> bytes:
        """Copy of the whole image (bytearray backing only)."""
        assert isinstance(self.backing, BytearrayBacking)
        with self._data_mu:
            return bytes(self.backing.buf)

    # ---- internals
    def _gate(self, kind: str) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)
        with self._mu:
            self.commands[kind] = self.commands.get(kind, 0) + 1
            if self.closed or self.dead or self.dropped:
                raise DeviceUnavailable(f"{kind}: device unavailable")
            if self._fail and kind in self._fail_kinds:
                self._fail -= 1
                raise DeviceError(f"{kind}: injected failure")

    def _run(self, kind: str, offset: int, mv: memoryview) -> None:
        for pos in range(0, len(mv), self._mdts):
            piece = mv[pos:pos + self._mdts]
            self._gate(kind)
            with self._mu:
                self.max_command_bytes = max(self.max_command_bytes, len(piece))
            if kind == "read":
                with self._data_mu:
                    self.backing.read(offset + pos, piece)
                continue
            tear: int | None = None
            die = False
            with self._mu:
                if self._crash_in is not None:
                    if self._crash_in == 0:
                        die, tear = True, self._crash_tear
                        self.dead = True
                        self._crash_in = None
                    else:
                        self._crash_in -= 1
                if not die and self._tear is not None:
                    tear, self._tear = self._tear, None
            if tear is not None:
                with self._data_mu:
                    self.backing.write(offset + pos, piece[:min(tear, len(piece))])
            if die:
                raise DeviceUnavailable("write: device died mid-command")
            if tear is not None:
                raise DeviceError("write: torn (injected)")
            with self._data_mu:
                self.backing.write(offset + pos, piece)
            if self.write_hook is not None:
                self.write_hook(offset + pos, bytes(piece))
