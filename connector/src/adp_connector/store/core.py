"""Shared state and records of the page store's parts: options, index locations, in-flight page operations."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..device import BlockDevice, Buffer, ScatterList
from .alloc import ExtentAllocator
from .batches import BatchPool
from .flush import FlushGroup
from .format import (
    Geometry,
    LeaseRecord,
)
from .results import PageStatus, StoreStats

if TYPE_CHECKING:
    from .admission import FrequencySketch
    from .recency import OwnPages

log = logging.getLogger("adp_connector.store.store")  # the name the other store parts log under

SCAN_CHUNK = 4 << 20  # bytes per read when scanning slot tables
EVICTION_POLICIES = ("slru", "lru")  # StoreConfig.eviction (recency.py)
ADMISSION_POLICIES = ("frequency", "always")  # StoreConfig.admission (admission.py)


def check_eviction(policy: str, protected_share: float) -> None:
    """Raise ``ValueError`` (one line) for an unknown eviction policy or a protected share outside 0..1."""
    if policy not in EVICTION_POLICIES:
        raise ValueError(f"StoreConfig.eviction must be one of {', '.join(EVICTION_POLICIES)}, got {policy!r}")
    if not 0.0 <= protected_share <= 1.0:
        raise ValueError(f"StoreConfig.protected_share must be within 0..1, got {protected_share!r}")


def check_admission(policy: str) -> None:
    """Raise ``ValueError`` (one line) for an unknown admission policy."""
    if policy not in ADMISSION_POLICIES:
        raise ValueError(f"StoreConfig.admission must be one of {', '.join(ADMISSION_POLICIES)}, got {policy!r}")


@dataclass
class StoreConfig:
    """Options of one :class:`PageStore` instance (format options apply only when it formats the device)."""

    writer: bool = True                    # claim a writer slot (False: read-only)
    writer_id: bytes | None = None         # stable 16-byte id: a restarted writer gets its slot and segments back
    writer_label: str = ""                 # free text stored in the lease (host, pid, rank) for humans
    preferred_partition: int | None = None  # preferred writer slot, e.g. the TP rank
    lease_ttl_s: float = 30.0              # a lease not renewed for this long may be taken over
    heartbeat_interval_s: float | None = None  # None: ttl/4; 0: renewed only by saves (lapses when idle > ttl)
    claim_settle_s: float = 0.25           # claim: write, wait this long, read back (>> one write latency)
    refresh_interval_s: float = 0.0        # >0: re-index the segments of other writers periodically
    miss_refresh_gap_s: float = 0.25       # a load of unindexed keys refreshes first, at most this often (<0: never)
    verify: bool = True                    # verify the payload checksum on every load
    dedupe: bool = True                    # skip saving keys another writer already stores
    flush_commits: bool = True             # flush after the commit records (durable on return)
    inline_bytes: int = 256 << 10          # pages up to this size move as one staged command (header+payload)
    max_io_bytes: int = 0                  # split commands at this size (0: leave splitting to the device)
    window_bytes: int = 64 << 20           # bytes in flight per batch
    io_threads: int = 2                    # concurrent batches
    io_timeout_s: float = 60.0
    create: bool = True                    # format the device when it holds no store
    reformat: bool = False                 # format over foreign data or a store of another format version
    claim_segments: int = 0                # segments claimed at a time (0: S/16, at least 2, at most S/writers)
    partitions: int = 16                   # format: writer slots (leases), the most concurrent writers
    slots_per_partition: int | None = None  # format: slots per segment; default segment bytes / (avg_page + lba)
    avg_page_bytes: int = 256 << 10        # format: sizing hint for the slot tables and the segment size
    segment_bytes: int | None = None       # format: segment size (default: >= 16 pages, <= 1024 segments)
    eviction: str = "slru"                 # slru: pages read back are evicted last; lru: least recently used first
    protected_share: float = 0.8           # slru: at most this share of the own pages is protected
    admission: str = "frequency"           # a full card: frequency: a new page displaces the next victim only if
    #                                        asked for more often (admission.py); always: every new page evicts

    def __post_init__(self) -> None:
        check_eviction(self.eviction, self.protected_share)
        check_admission(self.admission)


@dataclass(slots=True)
class Loc:
    """Where one indexed page lives: its segment, slot, first LBA, payload length and sequence."""

    segment: int
    slot: int
    lba: int
    length: int
    seq: int


@dataclass(slots=True)
class PageOp:
    """One page of a running batch: its buffer, location, command futures and staging blocks."""

    idx: int
    key: bytes
    mv: memoryview
    loc: Loc
    futs: list[Future[None]] = field(default_factory=list)
    staging: bytearray | None = None
    tail: bytearray | None = None
    err: str | None = None
    own: bool = False
    inline: bool = False
    digest: LandedDigest | None = None  # a load's payload checksum, taken as its last command lands


class LandedDigest:
    """A page's payload checksum computed by whichever comes first: the thread that completes the page's last
    read command (the bytes just landed, still in cache: measured 0.033-0.036 against 0.048-0.053 CPU seconds
    per GiB when taken after the batch's window moved on), or the batch's finish step (which then computes it
    itself, or waits for a computation under way). ``compute`` is the store format's checksum over the landed
    buffers."""

    __slots__ = ("_compute", "_event", "_lock", "_remaining", "_state", "value")

    _PENDING, _HASHING, _DONE, _CLAIMED = range(4)

    def __init__(self, futures: list[Future[None]], compute: Callable[[], bytes]) -> None:
        self._compute = compute
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._state = self._PENDING
        self._remaining = len(futures)
        self.value: bytes | None = None
        for f in futures:
            f.add_done_callback(self._landed)

    def _landed(self, fut: Future[None]) -> None:
        with self._lock:
            self._remaining -= 1
            if fut.cancelled() or fut.exception() is not None:
                self._state = self._CLAIMED  # a failed page is not hashed here (the finish step reports the error)
            if self._remaining or self._state != self._PENDING:
                return
            self._state = self._HASHING
        try:
            self.value = self._compute()
        finally:
            self._state = self._DONE
            self._event.set()

    def result(self) -> bytes:
        """The checksum (computed here if no landing thread has started it; call once the commands are done)."""
        with self._lock:
            mine = self._state in (self._PENDING, self._CLAIMED)
            self._state = self._CLAIMED if mine else self._state
        if mine:
            self.value = self._compute()
            return self.value
        self._event.wait()
        if self.value is None:  # the landing thread's computation raised: do it here, where errors are reported
            self.value = self._compute()
        return self.value


@dataclass(eq=False)
class OwnSegment:
    """A segment this writer owns: its slot-table image, free slots and free extents."""

    index: int
    image: bytearray
    alloc: ExtentAllocator
    slot_free: list[int]
    slot_hwm: int
    slots: int
    busy: int = 0  # pages being saved into it: never handed over while > 0
    write_lock: threading.Lock = field(default_factory=threading.Lock)  # one slot-table write at a time

    def has_slot(self) -> bool:
        """True while a slot is free."""
        return bool(self.slot_free) or self.slot_hwm < self.slots

    def take_slot(self) -> int:
        """A free slot (the caller checked :meth:`has_slot`)."""
        if self.slot_free:
            return self.slot_free.pop()
        self.slot_hwm += 1
        return self.slot_hwm - 1


def failed_future(exc: BaseException) -> Future[None]:
    """A future that already holds ``exc`` (a command that could not even be submitted)."""
    f: Future[None] = Future()
    f.set_exception(exc)
    return f


def warn_slow_claim(what: str, attempts: int, slow: float, settle: float) -> None:
    """A writer-slot or segment claim gave up with attempts retried for taking longer than ``settle / 2``: say so
    (the saves then fail read-only or ``no_space`` without naming why)."""
    log.warning(
        "page store: no %s claimed in %d attempts, some slower than half of claim_settle_s (up to %.3f s against "
        "%.3f s): the device may answer too slowly for the claim protocol (docs/format.md §9; "
        "StoreConfig.claim_settle_s, the same on every writer of a card)", what, attempts, slow, settle)


class StoreCore:
    """State shared by the parts of :class:`~adp_connector.store.PageStore` (each part is a mixin over it)."""

    config: StoreConfig
    geometry: Geometry
    stats: StoreStats
    _dev: BlockDevice
    _flusher: FlushGroup
    _seed: int
    _lba: int
    _step: int
    _readv: Callable[[int, list[Buffer]], Future[None]] | None
    _lock: threading.RLock
    _claim_lock: threading.Lock
    _no_claim_until: float
    _wanted: int
    _refresh_lock: threading.Lock
    _lease_lock: threading.Lock
    _miss_refresh_lock: threading.Lock
    _miss_refresh_at: float
    _own: OwnPages  # own pages in eviction order
    _freq: FrequencySketch | None  # request counts for admission into a full card (None: admit every page)
    _foreign: dict[bytes, Loc]
    index_changed: threading.Event
    _foreign_parts: dict[int, dict[bytes, Loc]]
    _table_digests: dict[int, bytes]
    _inflight: dict[bytes, threading.Event]  # key -> set when the batch saving it has finished
    _pins: dict[tuple[int, int], int]
    _evicted_keys: deque[bytes]
    _doomed: dict[tuple[int, int], Loc]
    _partition: int | None
    _segs: dict[int, OwnSegment]
    _claimer: threading.Thread | None  # a background claim (claim ahead of need)
    _fill_hint: int  # the segment the last allocation succeeded in (tried first)
    _next_seq: int
    _lease: LeaseRecord | None
    _lease_ok: float
    _writer_id: bytes
    _instance: bytes
    _closed: bool
    _pool: BatchPool

    def _count_asked(self, keys: list[bytes]) -> None:
        """Pages asked for (each save asked, each own page read back): counted for admission, and on the own pages'
        clock (their age, :meth:`OwnPages.outlived`, which only admission weighs). Call with ``_lock`` held."""
        if self._freq is None:
            return
        self._freq.record(keys)
        self._own.asked(keys)

    def _refresh(self) -> None:
        raise NotImplementedError

    def refresh(self) -> None:
        raise NotImplementedError

    def heartbeat(self) -> bool:
        raise NotImplementedError

    def _valid_entries(self, p: int, img: bytearray) -> tuple[dict[bytes, Loc], list[int]]:
        raise NotImplementedError

    def _write_slots(self, seg: int, slots: list[int], updates: dict[int, bytes] | None = None) -> set[int]:
        raise NotImplementedError

    def _write_slots_many(self, groups: dict[int, tuple[list[int], dict[int, bytes] | None]]
                          ) -> set[tuple[int, int]]:
        raise NotImplementedError

    def _sub_write(self, off: int, data: Buffer) -> list[Future[None]]:
        raise NotImplementedError

    def _sub_read(self, off: int, mv: memoryview) -> list[Future[None]]:
        raise NotImplementedError

    def _sub_readv(self, off: int, sl: ScatterList) -> list[Future[None]]:
        raise NotImplementedError

    def _wait(self, futs: list[Future[None]]) -> str | None:
        raise NotImplementedError

    def _release(self, loc: Loc) -> None:
        raise NotImplementedError

    def _unpin(self, pin: tuple[int, int]) -> None:
        raise NotImplementedError

    def _drop_own(self, keys: list[bytes]) -> int:
        raise NotImplementedError

    def _allocate(self, nl: int, evicted: dict[int, list[int]], evict: bool = True, candidate: bytes | None = None
                  ) -> Loc | PageStatus:
        raise NotImplementedError

    def _clear_entry(self, loc: Loc) -> None:
        raise NotImplementedError

    def _hand_over(self, leases: list[LeaseRecord | None]) -> int:
        raise NotImplementedError

    def _read_lease_table(self) -> list[LeaseRecord | None]:
        raise NotImplementedError

    def _adopt(self, segs: list[int]) -> None:
        raise NotImplementedError

    def _claim_more(self, lbas: int) -> int:
        raise NotImplementedError

    def _read_region(self, off: int, n: int) -> bytearray:
        raise NotImplementedError

    def _maybe_claim_ahead(self) -> None:
        raise NotImplementedError

    def _ensure_lease(self) -> None:
        raise NotImplementedError

    def _refresh_for(self, keys: list[bytes]) -> None:
        raise NotImplementedError

