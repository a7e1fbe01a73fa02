"""The page store: content-keyed KV pages on a :class:`~adp_connector.device.BlockDevice` (format in docs/format.md).

Threading: public methods are thread-safe. ``save_batch``/``load_batch`` run on a small worker pool and return a
:class:`BatchHandle` at once; the caller keeps every buffer alive and unmodified until the handle is done.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future

from ..device import BlockDevice, Buffer
from .admission import FrequencySketch
from .batches import BatchPool
from .core import Loc, OwnSegment, StoreConfig, StoreCore
from .flush import FlushGroup
from .format import (
    LEASE_FREE,
    META_ALIGN,
    REFORMAT_HINT,
    SEGMENT_OWNED,
    ForeignDataError,
    FormatError,
    FormatVersionError,
    Geometry,
    LeaseRecord,
    align_up,
    compute_geometry,
    holds_data,
    pack_superblock,
    unpack_superblock,
)
from .index import IndexMixin
from .leases import LeaseMixin
from .pipeline import PipelineMixin
from .recency import OwnPages
from .results import BatchHandle, PageResult, StoreStats
from .segments import SegmentMixin
from .space import SpaceMixin

log = logging.getLogger(__name__)
EVICTED_KEYS_KEPT = 1 << 16  # evicted own keys kept for take_evicted (a full deque drops the oldest)
_REFRESH_DUTY = 0.02  # background index refreshes take at most this share of the time (see _background)



def _read(device: BlockDevice, offset: int, length: int, timeout: float) -> bytes:
    buf = bytearray(length)
    device.read_into(offset, memoryview(buf), timeout)
    return bytes(buf)


class PageStore(LeaseMixin, SegmentMixin, IndexMixin, SpaceMixin, PipelineMixin, StoreCore):
    """A store of variable-size pages keyed by 32-byte content keys on one block-device namespace.

    The parts: :mod:`.leases` (writer lease), :mod:`.segments` (claiming, adopting and handing over segments),
    :mod:`.index` (own and foreign index, refresh), :mod:`.space` (slots, extents, eviction in the own segments;
    :mod:`.recency` orders them, :mod:`.admission` decides whether a new page may evict one) and :mod:`.pipeline`
    (save and load batches).
    """

    def __init__(self, device: BlockDevice, config: StoreConfig | None = None) -> None:
        """Open the store on ``device`` (formatting it if empty and ``config.create``); claim a writer slot."""
        self.config = cfg = config or StoreConfig()
        self._dev = device
        lba = device.lba_size
        sb = bytearray(align_up(META_ALIGN, lba))
        device.read_into(0, memoryview(sb), cfg.io_timeout_s)
        try:
            geo = unpack_superblock(sb)
        except FormatVersionError:
            if not cfg.reformat:
                raise
            log.warning("page store: reformatting a store of another format version (reformat=True)")
            geo = self._format_for(device, cfg)
        except FormatError:
            if not cfg.create:
                raise
            if not cfg.reformat and holds_data(lambda off, n: _read(device, off, n, cfg.io_timeout_s),
                                               device.capacity_bytes):
                raise ForeignDataError("the namespace holds data but no page store; refusing to format it: "
                                       + REFORMAT_HINT.replace("to erase it and format version 2",
                                                               "to erase it and format a page store")) from None
            geo = self._format_for(device, cfg)
        if geo.lba_size != lba or geo.capacity_bytes > device.capacity_bytes:
            raise FormatError("store geometry does not match the device (LBA size or capacity)")
        self.geometry = geo
        self._seed = geo.crc_seed
        self._lba = lba
        step = cfg.max_io_bytes // lba * lba
        self._step = step if step > 0 else 1 << 62
        # header + payload (+ tail) of a page in one scatter read where the device offers it (fewer commands)
        self._readv: Callable[[int, list[Buffer]], Future[None]] | None = getattr(device, "submit_readv", None)
        self.stats = StoreStats()
        self._flusher = FlushGroup(device.flush)  # concurrent batches share flushes (group commit)
        self._lock = threading.RLock()
        self._claim_lock = threading.Lock()
        self._no_claim_until = 0.0
        self._wanted = 0
        self._refresh_lock = threading.Lock()
        self._lease_lock = threading.Lock()
        self._own = OwnPages(cfg.eviction, cfg.protected_share)
        self._freq = FrequencySketch() if cfg.writer and cfg.admission == "frequency" else None
        self._evicted_keys: deque[bytes] = deque(maxlen=EVICTED_KEYS_KEPT)  # own pages evicted, until taken
        self._foreign: dict[bytes, Loc] = {}
        self._foreign_parts: dict[int, dict[bytes, Loc]] = {}
        self._table_digests: dict[int, bytes] = {}  # segment -> digest of its slot table at the last refresh
        self.index_changed = threading.Event()  # set when a refresh or a stale read changed the others' pages
        self._inflight: dict[bytes, threading.Event] = {}
        self._pins: dict[tuple[int, int], int] = {}
        self._doomed: dict[tuple[int, int], Loc] = {}
        self._partition: int | None = None
        self._segs: dict[int, OwnSegment] = {}
        self._fill_hint = -1
        self._claimer: threading.Thread | None = None
        self._next_seq = 1
        self._lease: LeaseRecord | None = None
        self._lease_ok = 0.0
        self._writer_id = bytes(cfg.writer_id) if cfg.writer_id is not None else os.urandom(16)
        if len(self._writer_id) != 16:
            raise ValueError("writer_id must be 16 bytes")
        self._instance = os.urandom(16)
        self._closed = False
        self._pool = BatchPool(cfg.io_threads, name="adpkv-store")
        if cfg.writer:
            p = self._claim()
            if p is None:
                log.warning("page store: no writer slot available; opened read-only")
            else:
                self._partition = p
                self._recover()
        self.refresh()
        self._stop = threading.Event()
        self.refresh_gap_s = cfg.refresh_interval_s  # the background refresh's current gap (stretched when slow)
        self._miss_refresh_lock = threading.Lock()
        self._miss_refresh_at = -1e9
        self._bg: threading.Thread | None = None
        hb = self._hb_interval()
        if hb > 0 or cfg.refresh_interval_s > 0:
            self._bg = threading.Thread(target=self._background, name="adpkv-store-bg", daemon=True)
            self._bg.start()

    # ------------------------------------------------------------------ format

    @staticmethod
    def format(device: BlockDevice, *, partitions: int = 16, slots_per_partition: int | None = None,
               avg_page_bytes: int = 256 << 10, segment_bytes: int | None = None) -> Geometry:
        """Write a fresh, empty store onto ``device`` (destroys any previous one) and return its geometry.

        ``partitions`` is the number of writer slots (the most concurrent writers), ``slots_per_partition`` the
        slots per segment.
        """
        lba = device.lba_size
        geo = compute_geometry(device.capacity_bytes, lba, partitions, slots_per_partition, avg_page_bytes,
                               os.urandom(16), time.time_ns(), segment_bytes)
        unit = align_up(META_ALIGN, lba)
        device.write(0, bytes(unit))  # invalidate any old superblock first
        regions = [(geo.lease_table_offset, geo.segments_offset - geo.lease_table_offset)]
        regions += [(geo.segment_base(s), geo.slot_table_bytes) for s in range(geo.segments)]
        for off, n in regions:
            # Hygiene only: records of an older format never validate (their CRCs are seeded with its UUID).
            with contextlib.suppress(Exception):
                device.deallocate(off, n)
        device.flush()
        device.write(0, pack_superblock(geo).ljust(unit, b"\0"))
        device.flush()
        return geo

    @classmethod
    def _format_for(cls, device: BlockDevice, cfg: StoreConfig) -> Geometry:
        return cls.format(device, partitions=cfg.partitions, slots_per_partition=cfg.slots_per_partition,
                          avg_page_bytes=cfg.avg_page_bytes, segment_bytes=cfg.segment_bytes)

    def _recover(self) -> None:
        """Adopt the segments recorded as this writer slot's (a restart or a takeover gets its pages back), or
        claim a first batch of segments so that the first saves need not."""
        p = self._partition
        try:
            segs = self._read_segment_table()
        except Exception:
            self.stats.add(io_errors=1)
            segs = []
        mine = [s for s, r in enumerate(segs) if r is not None and r.state == SEGMENT_OWNED and r.owner == p]
        if mine:
            self._adopt(mine)
        else:
            try:
                self._claim_more(0)
            except Exception as exc:  # the first save claims again
                log.warning("page store: no segment claimed at open: %s", exc)

    # ------------------------------------------------------------------ public API

    @property
    def partition(self) -> int | None:
        """The writer partition this instance owns (None: read-only)."""
        return self._partition

    @property
    def writer_id(self) -> bytes:
        """The 16-byte writer id stored in this instance's lease."""
        return self._writer_id

    def save_batch(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> BatchHandle:
        """Start saving ``buffers[i]`` under ``keys[i]``; the buffers must stay unchanged until done."""
        return self._start("save", self._run_save, keys, buffers)

    def load_batch(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> BatchHandle:
        """Start loading ``keys[i]`` into the writable ``buffers[i]`` (at least the page length)."""
        return self._start("load", self._run_load, keys, buffers)

    def save(self, key: bytes, data: Buffer, timeout: float | None = None) -> PageResult:
        """Blocking single-page save."""
        return self.save_batch([key], [data]).wait(timeout)[0]

    def load(self, key: bytes, buf: Buffer, timeout: float | None = None) -> PageResult:
        """Blocking single-page load."""
        return self.load_batch([key], [buf]).wait(timeout)[0]

    def note_read_back(self, keys: Sequence[bytes]) -> int:
        """Own pages among ``keys`` (one load batch, in its order) that another process read back (a reader helper
        of the same engine): ranked for eviction as if this store had served the load. Returns how many were own."""
        with self._lock:
            own = [k for k in keys if k in self._own]
            self._count_asked(own)
            self._own.read_back(reversed(own))  # the head of the batch ends most recent
        self.stats.add(read_back_elsewhere=len(own))
        return len(own)

    def take_evicted(self) -> list[bytes]:
        """Own pages evicted since the last call (at most ``EVICTED_KEYS_KEPT``, the newest): a reader's index may
        list them until its next refresh, so their owner reports them to whoever offers hits from one."""
        with self._lock:
            keys = list(self._evicted_keys)
            self._evicted_keys.clear()
        return keys

    def note_reading(self, keys: Sequence[bytes]) -> int:
        """Own pages among ``keys`` (a restore, in its order) that are about to be read, here or by another helper:
        made the most recent of their class (the head last), so that saves landing before and during their reads
        evict other pages. Returns how many were own."""
        with self._lock:
            own = [k for k in keys if k in self._own]
            self._own.touch(reversed(own))
        self.stats.add(reading_noted=len(own))
        return len(own)

    def discard(self, keys: Iterable[bytes]) -> int:
        """Delete own pages (commits a tombstone); returns how many were removed. Others' pages are ignored."""
        n = self._drop_own(list(keys))
        self.stats.add(discards=n)
        return n

    def flush(self) -> None:
        """Make everything committed so far durable."""
        self._flusher.flush(self.config.io_timeout_s)

    def info(self) -> dict[str, int | None]:
        """Occupancy: own/foreign pages, own segments and their free LBAs and slots, the card's data LBAs."""
        with self._lock:
            segs = list(self._segs.values())
            return {"partition": self._partition, "own_pages": len(self._own), "foreign_pages": len(self._foreign),
                    "segments": len(segs), "card_segments": self.geometry.segments,
                    "free_lbas": sum(s.alloc.free_lbas for s in segs),
                    "own_data_lbas": len(segs) * self.geometry.data_lbas,
                    "data_lbas": self.geometry.total_data_lbas,
                    "used_lbas": sum(self.geometry.page_lbas(loc.length) for loc in self._own.values()),
                    "free_slots": sum(len(s.slot_free) + s.slots - s.slot_hwm for s in segs)}

    def close(self, release: bool = True) -> None:
        """Finish running batches, flush, and (``release``) mark the lease free; the device stays open."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._bg is not None:
            self._bg.join()
        self._pool.shutdown(wait=True)
        if self._claimer is not None:
            self._claimer.join()
        with contextlib.suppress(Exception):
            self.flush()
        p, lease = self._partition, self._lease
        if release and p is not None and lease is not None:
            with contextlib.suppress(Exception):
                cur = self._read_lease(p)
                if cur is not None and (cur.writer_id, cur.instance) == (lease.writer_id, lease.instance):
                    self._write_lease(LeaseRecord(p, LEASE_FREE, lease.writer_id, lease.instance,
                                                  lease.generation, time.time_ns(), lease.ttl_ns, lease.label))
                    self._dev.flush(self.config.io_timeout_s)

    def abandon(self) -> None:
        """Stop without flushing or releasing the lease (tests: simulate a writer that died)."""
        self._closed = True
        self._stop.set()
        self._pool.shutdown(wait=True)
        if self._claimer is not None:
            self._claimer.join()

    def __enter__(self) -> PageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _background(self) -> None:
        cfg = self.config
        hb = self._hb_interval()
        rf = cfg.refresh_interval_s
        tick = min(x for x in (hb, rf) if x > 0) / 2
        last_hb = last_rf = time.monotonic()
        rf_gap = rf
        while not self._stop.wait(tick):
            now = time.monotonic()
            try:
                if hb > 0 and self._partition is not None and now - last_hb >= hb:
                    last_hb = now
                    self.heartbeat()
                if rf > 0 and now - last_rf >= rf_gap:
                    last_rf = now
                    cpu = time.thread_time()
                    self.refresh()
                    # Re-parsing large changing tables holds the interpreter lock that the caller (an inference
                    # engine) needs: keep this thread's CPU time (not the I/O wait) in refreshes to <= _REFRESH_DUTY
                    # of the time, whatever the interval asked.
                    self.refresh_gap_s = rf_gap = max(rf, (time.thread_time() - cpu) / _REFRESH_DUTY)
            except Exception:  # never let the background thread die
                log.exception("page store background task failed")

