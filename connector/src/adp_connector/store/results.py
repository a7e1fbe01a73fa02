"""Per-page results, asynchronous batch handles and store statistics."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, fields
from enum import Enum


class PageStatus(str, Enum):
    """Outcome of one page of a batch."""

    OK = "ok"                        # saved and committed / loaded and verified
    EXISTS = "exists"                # save skipped without I/O: the key is already committed on the card
    MISSING = "missing"              # load: not in the index, or the index entry was stale
    VERIFY_FAILED = "verify_failed"  # load: header or checksum mismatch; the buffer content is undefined
    NO_SPACE = "no_space"            # save: nothing evictable makes room (or the page exceeds a segment)
    NOT_ADMITTED = "not_admitted"    # save: the card is full of pages asked for at least as often (admission.py)
    ERROR = "error"                  # device error, bad argument, no writer slot...


@dataclass(frozen=True)
class PageResult:
    """Result of one page; ``nbytes`` is the payload length moved."""

    key: bytes
    status: PageStatus
    nbytes: int = 0
    detail: str = ""

    @property
    def ok(self) -> bool:
        """True for a committed save or a verified load."""
        return self.status is PageStatus.OK

    @property
    def committed(self) -> bool:
        """Save: the key has a durable commit record on the card (saved now, or already there: ``exists``)."""
        return self.status in (PageStatus.OK, PageStatus.EXISTS)


class BatchHandle:
    """Completion handle of a ``save_batch``/``load_batch``: results in the order of the request."""

    def __init__(self, kind: str, n: int) -> None:
        self.kind = kind
        self.size = n
        self._future: Future[list[PageResult]] = Future()

    def done(self) -> bool:
        """True once every page has a result."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> list[PageResult]:
        """Block until done (TimeoutError after ``timeout`` seconds) and return the per-page results."""
        return self._future.result(timeout)

    @property
    def results(self) -> list[PageResult]:
        """Per-page results; raises InvalidStateError-like RuntimeError before completion."""
        if not self._future.done():
            raise RuntimeError("batch not finished")
        return self._future.result()

    def ok_count(self, timeout: float | None = None) -> int:
        """Number of pages with status OK (waits)."""
        return sum(r.ok for r in self.wait(timeout))

    def committed_keys(self, timeout: float | None = None) -> list[bytes]:
        """Save: the keys whose pages are committed on the card (waits); everything else is not stored."""
        return [r.key for r in self.wait(timeout) if r.committed]

    def add_done_callback(self, fn: Callable[[BatchHandle], None]) -> None:
        """Call ``fn(handle)`` on completion (immediately if already done)."""
        self._future.add_done_callback(lambda _f: fn(self))

    def _set(self, results: list[PageResult]) -> None:
        self._future.set_result(results)


@dataclass
class StoreStats:
    """Monotonic counters of one store instance (thread-safe through :meth:`add`)."""

    lookups: int = 0            # lookup()/contains() calls
    lookup_keys: int = 0        # keys asked
    lookup_hits: int = 0        # keys found (leading keys for lookup())
    hits: int = 0               # pages loaded and verified
    misses: int = 0             # pages asked to load but not returned (missing + verify_failed + error)
    pages_saved: int = 0
    bytes_saved: int = 0
    pages_loaded: int = 0
    bytes_loaded: int = 0
    save_exists: int = 0
    save_failed: int = 0        # error or no_space
    no_space: int = 0
    not_admitted: int = 0       # saves a full card declined: the next victim was asked for at least as often
    verify_failures: int = 0    # header/checksum mismatch on load
    stale_reads: int = 0        # another writer's page changed under a stale index entry (a miss)
    io_errors: int = 0          # failed device commands (reads, writes, flushes)
    evictions: int = 0
    evictions_outlived: int = 0  # of which victims untouched past the reuse horizon, evicted without weighing counts
    read_back_elsewhere: int = 0  # own pages another helper of the engine read back (note_read_back)
    reading_noted: int = 0  # own pages named as about to be read (note_reading): made most recent
    discards: int = 0
    lease_lost: int = 0
    segments_claimed: int = 0   # segments won by claims (free, released or of expired writers)
    segments_handed_over: int = 0  # own segments released to writers that asked for space
    refreshes: int = 0
    miss_refreshes: int = 0     # refreshes a load of unindexed keys triggered
    save_seconds: float = 0.0   # summed wall time of save batches
    load_seconds: float = 0.0   # summed wall time of load batches
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: float) -> None:
        """Atomically add to counters."""
        with self._lock:
            for k, v in deltas.items():
                setattr(self, k, getattr(self, k) + v)

    @property
    def save_gbps(self) -> float:
        """Saved payload GB/s (1e9 bytes) over the time spent in save batches."""
        return self.bytes_saved / self.save_seconds / 1e9 if self.save_seconds else 0.0

    @property
    def load_gbps(self) -> float:
        """Loaded payload GB/s over the time spent in load batches."""
        return self.bytes_loaded / self.load_seconds / 1e9 if self.load_seconds else 0.0

    def snapshot(self) -> dict[str, float]:
        """A consistent copy of every counter plus ``save_gbps``/``load_gbps``."""
        with self._lock:
            d: dict[str, float] = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        d["save_gbps"] = d["bytes_saved"] / d["save_seconds"] / 1e9 if d["save_seconds"] else 0.0
        d["load_gbps"] = d["bytes_loaded"] / d["load_seconds"] / 1e9 if d["load_seconds"] else 0.0
        return d
