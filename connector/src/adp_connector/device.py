"""The block-device contract between the page store and whatever moves the bytes.

The page store (``adp_connector.store``) only ever talks to a :class:`BlockDevice`. The NVMe/TCP host
client (``adp_connector.nvmeof.host``) implements it for the emulator and for a real ADP card alike;
unit tests of the store may use an in-memory implementation.

Rules every implementation follows:

* ``offset`` and ``len(buf)`` are byte quantities and must be multiples of :attr:`lba_size`;
  anything else raises :class:`ValueError` before any I/O is issued.
* Transfers of any size are accepted: splitting at the device's maximum data transfer size (MDTS)
  or the transport's limits happens below this interface.
* ``submit_*`` return a :class:`concurrent.futures.Future` that resolves to ``None`` or raises
  :class:`DeviceError` (or a subclass). The caller must keep ``buf`` alive and untouched until the
  future is done.
* All methods are thread-safe.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol, runtime_checkable

Buffer = bytes | bytearray | memoryview


class DeviceError(Exception):
    """An I/O request failed (NVMe status, timeout, lost connection...)."""


class DeviceUnavailable(DeviceError):
    """The device cannot be reached right now (connection lost and not yet re-established)."""


@runtime_checkable
class BlockDevice(Protocol):
    """A byte-addressed view of one namespace, in whole logical blocks."""

    @property
    def lba_size(self) -> int:
        """Logical block size in bytes (512 or 4096)."""
        ...

    @property
    def capacity_bytes(self) -> int:
        """Namespace size in bytes (a multiple of ``lba_size``)."""
        ...

    @property
    def max_transfer_bytes(self) -> int:
        """Largest single command the device takes; informational (larger requests are split)."""
        ...

    def submit_read(self, offset: int, buf: memoryview) -> Future[None]:
        """Start reading ``len(buf)`` bytes at ``offset`` into ``buf``."""
        ...

    def submit_write(self, offset: int, data: Buffer) -> Future[None]:
        """Start writing ``data`` at ``offset``."""
        ...

    def read_into(self, offset: int, buf: memoryview, timeout: float | None = None) -> None:
        """Blocking read; raises :class:`DeviceError`."""
        ...

    def write(self, offset: int, data: Buffer, timeout: float | None = None) -> None:
        """Blocking write; raises :class:`DeviceError`."""
        ...

    def flush(self, timeout: float | None = None) -> None:
        """Make every completed write durable (NVMe Flush)."""
        ...

    def deallocate(self, offset: int, length: int, timeout: float | None = None) -> None:
        """Tell the device a range is unused (Dataset Management, deallocate). Reads then return zeros."""
        ...

    def close(self) -> None:
        """Release connections; further I/O raises :class:`DeviceUnavailable`."""
        ...


class ScatterList:
    """Buffers one transfer lands in, in order (a host-side scatter list).

    A device that offers ``submit_readv(offset, bufs)`` (optional: the NVMe/TCP client does) reads
    ``sum(len(b))`` contiguous bytes into several buffers with as few commands as one buffer of that
    size would take; the page store uses it to read a page's header and payload in one command.
    Slicing (``[start:stop]``, step 1) gives the scatter list of that byte range.
    """

    __slots__ = ("nbytes", "views")

    def __init__(self, views: list[memoryview]) -> None:
        self.views = [v for v in views if len(v)]
        self.nbytes = sum(len(v) for v in self.views)

    def __len__(self) -> int:
        return self.nbytes

    def __getitem__(self, s: slice) -> ScatterList:
        start, stop, step = s.indices(self.nbytes)
        if step != 1:
            raise ValueError("a scatter list slices contiguously")
        out: list[memoryview] = []
        pos = 0
        for v in self.views:
            end = pos + len(v)
            if end > start and pos < stop:
                out.append(v[max(start - pos, 0):min(stop, end) - pos])
            pos = end
            if pos >= stop:
                break
        return ScatterList(out)


def check_aligned(offset: int, length: int, lba_size: int, capacity: int) -> None:
    """Raise ValueError unless [offset, offset+length) is LBA-aligned and inside the namespace."""
    if offset < 0 or length < 0:
        raise ValueError(f"negative offset/length: offset={offset} length={length}")
    if offset % lba_size or length % lba_size:
        raise ValueError(f"offset {offset} and length {length} must be multiples of the LBA size {lba_size}")
    if offset + length > capacity:
        raise ValueError(f"range [{offset}, {offset + length}) exceeds the namespace capacity {capacity}")
