"""Namespace backing store: one shared mmap (a memfd for RAM, the file for file backing).

The mapping is shared so that I/O worker processes (:mod:`.workers`) can map the same bytes from
the descriptor they are handed (:attr:`Namespace.fd`).
"""

from __future__ import annotations

import mmap
import os
import uuid

from .backing import NoRoom, shortfall

_ZERO_CHUNK = bytes(1 << 20)
_PAGE = mmap.PAGESIZE


class Namespace:
    """A namespace of ``capacity`` bytes addressed in ``lba_size`` blocks.

    ``view`` is a memoryview over the whole store: reads send slices of it, writes receive
    straight into slices of it (no intermediate copies). A new store that its backing cannot hold in full raises
    :class:`.backing.NoRoom` (:func:`.backing.shortfall`) unless ``overcommit``.
    """

    def __init__(self, nsid: int, capacity: int, lba_size: int, path: str | None = None,
                 nguid: bytes | None = None, fd: int | None = None, overcommit: bool = False) -> None:
        self.nsid = nsid
        self.capacity = capacity
        self.lba_size = lba_size
        self.lba_shift = lba_size.bit_length() - 1
        self.nsze = capacity >> self.lba_shift
        self.path = path
        self._durable = bool(path)
        if fd is None and not overcommit:
            why = shortfall(capacity, path)
            if why:
                raise NoRoom(f"{why}; lower the capacity, or accept that with --overcommit (adp.overcommit)")
        if fd is not None:  # a worker process maps its owner's store
            self._fd = os.dup(fd)
        elif path:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        else:
            self._fd = os.memfd_create(f"adp-ns{nsid}", os.MFD_CLOEXEC)
        if os.fstat(self._fd).st_size < capacity:
            os.ftruncate(self._fd, capacity)  # sparse extension
        self.mm = mmap.mmap(self._fd, capacity, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.view = memoryview(self.mm)
        self.nguid = nguid or uuid.uuid5(uuid.NAMESPACE_URL, f"adp-kv/{path or 'ram'}/{nsid}").bytes
        self.uuid = uuid.uuid5(uuid.NAMESPACE_URL, f"adp-kv/{path or 'ram'}/{nsid}/uuid").bytes

    @property
    def fd(self) -> int:
        """The descriptor of the backing store (for handing to worker processes)."""
        return self._fd

    def flush(self) -> None:
        """Make written data durable (msync + fsync for file backing; no-op for RAM)."""
        if self._durable and self._fd >= 0:
            self.mm.flush()
            os.fsync(self._fd)

    def zero(self, offset: int, length: int) -> None:
        """Zero (and where possible release) ``length`` bytes at ``offset``."""
        end = offset + length
        a = -(-offset // _PAGE) * _PAGE
        b = end // _PAGE * _PAGE
        madv = getattr(mmap, "MADV_REMOVE", None)
        if madv is not None and b - a >= _PAGE:
            try:
                self.mm.madvise(madv, a, b - a)  # punches a hole: reads give zeros
                self._memset0(offset, a)
                self._memset0(b, end)
                return
            except OSError:
                pass
        self._memset0(offset, end)

    def _memset0(self, start: int, end: int) -> None:
        v = self.view
        while start < end:
            n = min(end - start, len(_ZERO_CHUNK))
            v[start:start + n] = _ZERO_CHUNK[:n]
            start += n

    def close(self) -> None:
        """Flush and unmap; safe to call twice."""
        if self.mm.closed:
            return
        try:
            self.flush()
        finally:
            self.view.release()
            try:
                self.mm.close()
            except BufferError:  # a straggling slice still exported; the GC unmaps it later
                pass
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
