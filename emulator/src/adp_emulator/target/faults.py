"""Fault injection hooks. Thread-safe; the I/O hot path reads only ``armed``."""

from __future__ import annotations

import threading
from collections.abc import Callable

from adp_wire.status import Status


class Faults:
    """Faults a test can switch on while the target runs (all off by default).

    * :meth:`drop_connections` - close every TCP connection now (associations are torn down).
    * :meth:`set_delay` - sleep this long before executing each I/O command.
    * :meth:`fail_next_io` - complete the next ``count`` I/O commands with ``status`` (no effect on data).
    * :meth:`corrupt` - XOR bytes of the stored data (simulated media corruption).
    * :meth:`corrupt_next_reads` - flip a byte in the wire copy of the next ``count`` read payloads
      (the data digest is computed on the good data, so a digest-checking host sees a mismatch).
    * :meth:`set_device_full` - fail Write / Write Zeroes with Capacity Exceeded.
    """

    def __init__(self, dropper: Callable[[], int], corrupter: Callable[[int, int, int, int], None]) -> None:
        self._lock = threading.Lock()
        #: Told of every change of the per-command state (``wait``: the change came from a caller, who
        #: must not return before every I/O worker process has it); see :meth:`snapshot`.
        self.listener: Callable[[bool], None] | None = None
        self._dropper = dropper
        self._corrupter = corrupter
        self.delay_s = 0.0
        self.device_full = False
        self._fail_count = 0
        self._fail_status = Status.named("INTERNAL_ERROR")
        self._corrupt_reads = 0
        self.armed = False  # any per-command fault active

    def _rearm(self) -> None:
        self.armed = bool(self.delay_s or self.device_full or self._fail_count or self._corrupt_reads)

    def _changed(self, wait: bool = True) -> None:
        if self.listener is not None:
            self.listener(wait)

    def snapshot(self) -> dict[str, object]:
        """The state an I/O worker process mirrors; it asks :meth:`take_failure` /
        :meth:`take_read_corruption` here whenever ``armed`` is set."""
        with self._lock:
            return {"armed": self.armed, "delay_s": self.delay_s, "device_full": self.device_full}

    def drop_connections(self) -> int:
        """Close every connection (admin, I/O, discovery); returns how many were closed."""
        return self._dropper()

    def set_delay(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("delay must be >= 0")
        with self._lock:
            self.delay_s = float(seconds)
            self._rearm()
        self._changed()

    def fail_next_io(self, count: int, status: Status | str = "INTERNAL_ERROR") -> None:
        """Complete the next ``count`` I/O commands with ``status`` (a Status or a status name)."""
        if count < 0:
            raise ValueError("count must be >= 0")
        st = Status.named(status) if isinstance(status, str) else status
        with self._lock:
            self._fail_count = count
            self._fail_status = st
            self._rearm()
        self._changed()

    def corrupt(self, offset: int, length: int = 1, xor: int = 0xFF, nsid: int = 1) -> None:
        """XOR ``length`` stored bytes at byte ``offset`` of namespace ``nsid`` with ``xor``."""
        self._corrupter(nsid, offset, length, xor)

    def corrupt_next_reads(self, count: int = 1) -> None:
        with self._lock:
            self._corrupt_reads = count
            self._rearm()
        self._changed()

    def set_device_full(self, full: bool = True) -> None:
        with self._lock:
            self.device_full = bool(full)
            self._rearm()
        self._changed()

    def clear(self) -> None:
        """Switch every fault off."""
        with self._lock:
            self.delay_s = 0.0
            self.device_full = False
            self._fail_count = 0
            self._corrupt_reads = 0
            self._rearm()
        self._changed()

    # Used by the target.
    def take_failure(self) -> int:
        """STATUS word to fail the current I/O command with, or 0."""
        with self._lock:
            if not self._fail_count:
                return 0
            self._fail_count -= 1
            self._rearm()
            word, last = self._fail_status.word, not self._fail_count
        if last:
            self._changed(wait=False)
        return word

    def take_read_corruption(self) -> bool:
        with self._lock:
            if not self._corrupt_reads:
                return False
            self._corrupt_reads -= 1
            self._rearm()
            last = not self._corrupt_reads
        if last:
            self._changed(wait=False)
        return True
