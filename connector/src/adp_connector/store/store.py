"""The page store: content-keyed KV pages on a :class:`~adp_connector.device.BlockDevice` (format in docs/format.md).

Threading: public methods are thread-safe. ``save_batch``/``load_batch`` run on a small worker pool and return a
:class:`BatchHandle` at once; the caller keeps every buffer alive and unmodified until the handle is done.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import struct
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

import xxhash

from ..device import BlockDevice, Buffer, ScatterList
from .alloc import ExtentAllocator
from .format import (
    EMPTY_SLOT,
    LEASE_FREE,
    LEASE_HELD,
    META_ALIGN,
    RECORD_BYTES,
    SLOT_ENTRY_BYTES,
    FormatError,
    Geometry,
    LeaseRecord,
    PageHeader,
    SlotEntry,
    align_up,
    compute_geometry,
    pack_header,
    pack_lease,
    pack_slot,
    pack_superblock,
    page_checksum,
    unpack_header,
    unpack_lease,
    unpack_slots,
    unpack_superblock,
)
from .keys import KEY_BYTES
from .results import BatchHandle, PageResult, PageStatus, StoreStats

log = logging.getLogger(__name__)
_SCAN_CHUNK = 4 << 20
_REFRESH_DUTY = 0.02  # background index refreshes take at most this share of the time (see _background)


@dataclass
class StoreConfig:
    """Options of one :class:`PageStore` instance (format options apply only when it formats the device)."""

    writer: bool = True                    # claim a writer partition (False: read-only)
    writer_id: bytes | None = None         # stable 16-byte id: a restarted writer gets its partition back
    writer_label: str = ""                 # free text stored in the lease (host, pid, rank) for humans
    preferred_partition: int | None = None  # e.g. the TP rank
    lease_ttl_s: float = 30.0              # a lease not renewed for this long may be taken over
    heartbeat_interval_s: float | None = None  # None: ttl/4; 0: renewed only by saves (lapses when idle > ttl)
    claim_settle_s: float = 0.25           # claim: write, wait this long, read back (>> one write latency)
    refresh_interval_s: float = 0.0        # >0: re-index other writers' partitions periodically
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
    partitions: int = 16                   # format: writer partitions
    slots_per_partition: int | None = None  # format: default data_bytes / (avg_page_bytes + lba)
    avg_page_bytes: int = 256 << 10        # format: sizing hint for the slot tables


@dataclass(slots=True)
class _Loc:
    partition: int
    slot: int
    lba: int
    length: int
    seq: int


@dataclass(slots=True)
class _Op:
    idx: int
    key: bytes
    mv: memoryview
    loc: _Loc
    futs: list[Future[None]] = field(default_factory=list)
    staging: bytearray | None = None
    tail: bytearray | None = None
    err: str | None = None
    own: bool = False
    inline: bool = False


def _failed(exc: BaseException) -> Future[None]:
    f: Future[None] = Future()
    f.set_exception(exc)
    return f


class PageStore:
    """A store of variable-size pages keyed by 32-byte content keys on one block-device namespace."""

    def __init__(self, device: BlockDevice, config: StoreConfig | None = None) -> None:
        """Open the store on ``device`` (formatting it if empty and ``config.create``); claim a partition."""
        self.config = cfg = config or StoreConfig()
        self._dev = device
        lba = device.lba_size
        sb = bytearray(align_up(META_ALIGN, lba))
        device.read_into(0, memoryview(sb), cfg.io_timeout_s)
        try:
            geo = unpack_superblock(sb)
        except FormatError:
            if not cfg.create:
                raise
            geo = self.format(device, partitions=cfg.partitions, slots_per_partition=cfg.slots_per_partition,
                              avg_page_bytes=cfg.avg_page_bytes)
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
        self._lock = threading.RLock()
        self._commit_lock = threading.Lock()
        self._refresh_lock = threading.Lock()
        self._lease_lock = threading.Lock()
        self._own: OrderedDict[bytes, _Loc] = OrderedDict()
        self._foreign: dict[bytes, _Loc] = {}
        self._foreign_parts: dict[int, dict[bytes, _Loc]] = {}
        self._table_digests: dict[int, bytes] = {}  # partition -> digest of its slot table at the last refresh
        self._inflight: set[bytes] = set()
        self._pins: dict[int, int] = {}
        self._doomed: dict[int, _Loc] = {}
        self._partition: int | None = None
        self._slot_image = bytearray()
        self._slot_free: list[int] = []
        self._slot_hwm = 0
        self._alloc = ExtentAllocator(0, 0)
        self._next_seq = 1
        self._lease: LeaseRecord | None = None
        self._lease_ok = 0.0
        self._writer_id = bytes(cfg.writer_id) if cfg.writer_id is not None else os.urandom(16)
        if len(self._writer_id) != 16:
            raise ValueError("writer_id must be 16 bytes")
        self._instance = os.urandom(16)
        self._closed = False
        self._pool = ThreadPoolExecutor(max(1, cfg.io_threads), thread_name_prefix="adpkv-store")
        if cfg.writer:
            p = self._claim()
            if p is None:
                log.warning("page store: no writer partition available; opened read-only")
            else:
                self._recover(p)
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
               avg_page_bytes: int = 256 << 10) -> Geometry:
        """Write a fresh, empty store onto ``device`` (destroys any previous one) and return its geometry."""
        lba = device.lba_size
        geo = compute_geometry(device.capacity_bytes, lba, partitions, slots_per_partition, avg_page_bytes,
                               os.urandom(16), time.time_ns())
        unit = align_up(META_ALIGN, lba)
        device.write(0, bytes(unit))  # invalidate any old superblock first
        regions = [(geo.lease_table_offset, geo.partitions_offset - geo.lease_table_offset)]
        regions += [(geo.partition_base(p), geo.slot_table_bytes) for p in range(partitions)]
        for off, n in regions:
            # Hygiene only: records of an older format never validate (their CRCs are seeded with its UUID).
            with contextlib.suppress(Exception):
                device.deallocate(off, n)
        device.flush()
        device.write(0, pack_superblock(geo).ljust(unit, b"\0"))
        device.flush()
        return geo

    # ------------------------------------------------------------------ public API

    @property
    def partition(self) -> int | None:
        """The writer partition this instance owns (None: read-only)."""
        return self._partition

    @property
    def writer_id(self) -> bytes:
        """The 16-byte writer id stored in this instance's lease."""
        return self._writer_id

    def lookup(self, keys: Iterable[bytes]) -> int:
        """Number of leading ``keys`` present in the index (in memory, no I/O)."""
        n = asked = 0
        with self._lock:
            for k in keys:
                asked += 1
                if k in self._own or k in self._foreign:
                    n += 1
                else:
                    break
        self.stats.add(lookups=1, lookup_keys=asked, lookup_hits=n)
        return n

    def contains(self, keys: Iterable[bytes]) -> list[bool]:
        """Presence of every key (for sliding-window and Mamba lookups that are not prefix scans)."""
        with self._lock:
            out = [k in self._own or k in self._foreign for k in keys]
        self.stats.add(lookups=1, lookup_keys=len(out), lookup_hits=sum(out))
        return out

    def page_length(self, key: bytes) -> int | None:
        """Stored payload length of ``key`` (None if absent)."""
        with self._lock:
            loc = self._own.get(key) or self._foreign.get(key)
            return None if loc is None else loc.length

    def indexed_keys(self) -> list[bytes]:
        """Every indexed key (own partition and, as of the last refresh, the others)."""
        with self._lock:
            return list(self._own) + [k for k in self._foreign if k not in self._own]

    def payload_extents(self) -> list[tuple[bytes, int, int]]:
        """(key, namespace byte offset, length) of every indexed page's payload, which follows the page's header
        block (docs/format.md §5): what a media-corruption control needs to hit payload bytes only."""
        lba = self._dev.lba_size
        with self._lock:
            locs = {**self._foreign, **self._own}
            return [(k, (loc.lba + 1) * lba, loc.length) for k, loc in locs.items()]

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

    def discard(self, keys: Iterable[bytes]) -> int:
        """Delete own pages (commits a tombstone); returns how many were removed. Others' pages are ignored."""
        n = self._drop_own(list(keys))
        self.stats.add(discards=n)
        return n

    def refresh(self) -> None:
        """Re-read the slot tables of every other partition so their pages become visible (or vanish)."""
        with self._refresh_lock:  # one at a time: the digest cache must match the installed index
            self._refresh()

    def _refresh(self) -> None:
        g = self.geometry
        new: dict[int, dict[bytes, _Loc]] = {}
        changed = False
        digests = self._table_digests
        for p in range(g.partitions):
            if p == self._partition:
                continue
            try:
                img = self._read_region(g.partition_base(p), g.slot_table_bytes)
            except Exception:
                self.stats.add(io_errors=1)
                new[p] = self._foreign_parts.get(p, {})
                continue
            # Parsing a large table is the expensive part (and holds the GIL): skip it when the table is unchanged.
            d = xxhash.xxh3_128_digest(img)
            if digests.get(p) == d and p in self._foreign_parts:
                new[p] = self._foreign_parts[p]
                continue
            digests[p] = d
            changed = True
            new[p] = {k: loc for k, loc in self._valid_entries(p, img)[0].items()}
        if not changed and set(new) == set(self._foreign_parts):
            self.stats.add(refreshes=1)
            return
        with self._lock:
            mine = self._partition
            self._foreign_parts = {p: d for p, d in new.items() if p != mine}
            merged: dict[bytes, _Loc] = {}
            for d in self._foreign_parts.values():
                merged.update(d)
            self._foreign = merged
        self.stats.add(refreshes=1)

    def heartbeat(self) -> bool:
        """Renew this writer's lease; False (and read-only from then on) if it was lost."""
        with self._lease_lock:
            p, lease = self._partition, self._lease
            if p is None or lease is None:
                return False
            started = time.monotonic()
            if started - self._lease_ok > self.config.lease_ttl_s:
                self._lose_lease("lease expired before renewal")
                return False
            try:
                cur = self._read_lease(p)
            except Exception:
                self.stats.add(io_errors=1)
                return True  # retried by the next heartbeat; lost for real only after the TTL
            if cur is None or (cur.writer_id, cur.instance, cur.generation) != (
                    lease.writer_id, lease.instance, lease.generation):
                self._lose_lease("lease taken over by another writer")
                return False
            new = LeaseRecord(p, LEASE_HELD, lease.writer_id, lease.instance, lease.generation, time.time_ns(),
                              lease.ttl_ns, lease.label)
            try:
                self._write_lease(new)
            except Exception:
                self.stats.add(io_errors=1)
                return True
            self._lease, self._lease_ok = new, started
            return True

    def flush(self) -> None:
        """Make everything committed so far durable."""
        self._dev.flush(self.config.io_timeout_s)

    def info(self) -> dict[str, int | None]:
        """Occupancy figures: own/foreign pages, free LBAs of the own partition."""
        with self._lock:
            return {"partition": self._partition, "own_pages": len(self._own), "foreign_pages": len(self._foreign),
                    "free_lbas": self._alloc.free_lbas if self._partition is not None else 0,
                    "data_lbas": self.geometry.data_lbas,
                    "free_slots": len(self._slot_free) + self.geometry.slots_per_partition - self._slot_hwm
                    if self._partition is not None else 0}

    def close(self, release: bool = True) -> None:
        """Finish running batches, flush, and (``release``) mark the lease free; the device stays open."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._bg is not None:
            self._bg.join()
        self._pool.shutdown(wait=True)
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

    def __enter__(self) -> PageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ leases

    def _hb_interval(self) -> float:
        cfg = self.config
        if not cfg.writer:
            return 0.0
        return cfg.lease_ttl_s / 4 if cfg.heartbeat_interval_s is None else cfg.heartbeat_interval_s

    def _read_lease(self, p: int) -> LeaseRecord | None:
        buf = bytearray(self._lba)
        self._dev.read_into(self.geometry.lease_offset(p), memoryview(buf), self.config.io_timeout_s)
        return unpack_lease(buf, self._seed)

    def _read_leases(self) -> list[LeaseRecord | None]:
        g = self.geometry
        buf = bytearray(g.partitions * g.lease_record_bytes)
        self._dev.read_into(g.lease_table_offset, memoryview(buf), self.config.io_timeout_s)
        r = g.lease_record_bytes
        return [unpack_lease(buf[p * r:(p + 1) * r], self._seed) for p in range(g.partitions)]

    def _write_lease(self, rec: LeaseRecord) -> None:
        raw = pack_lease(rec, self._seed).ljust(self.geometry.lease_record_bytes, b"\0")
        self._dev.write(self.geometry.lease_offset(rec.partition), raw, self.config.io_timeout_s)

    def _candidates(self, recs: list[LeaseRecord | None], now: int, skip: set[int]) -> list[int]:
        """Partitions in claim order: our own id's, the preferred one, never used, released, expired."""
        mine, pref, fresh, released, expired = [], [], [], [], []
        for p, r in enumerate(recs):
            if p in skip:
                continue
            if r is not None and r.writer_id == self._writer_id:
                mine.append(p)
            elif r is not None and not r.expired(now):
                continue
            elif p == self.config.preferred_partition:
                pref.append(p)
            elif r is None:
                fresh.append(p)
            elif r.state != LEASE_HELD:
                released.append(p)
            else:
                expired.append((r.heartbeat_ns, p))
        return mine + pref + fresh + released + [p for _, p in sorted(expired)]

    def _claim(self) -> int | None:
        """Claim a partition: write the lease, wait ``claim_settle_s``, read it back; back off if overwritten.

        The write must land within ``settle/2`` of reading the table (else the attempt is repeated), so a
        competitor that read the record as free before our write can only write before our read-back.
        """
        cfg = self.config
        settle = cfg.claim_settle_s
        skip: set[int] = set()
        for _attempt in range(4 * self.geometry.partitions + 8):
            t0 = time.monotonic()
            recs = self._read_leases()
            cands = self._candidates(recs, time.time_ns(), skip)
            if not cands:
                if not skip:
                    return None
                skip.clear()
                time.sleep(random.uniform(settle, 2 * settle))
                continue
            p = cands[0]
            old = recs[p]
            rec = LeaseRecord(p, LEASE_HELD, self._writer_id, self._instance,
                              (old.generation if old else 0) + 1, time.time_ns(), int(cfg.lease_ttl_s * 1e9),
                              cfg.writer_label)
            self._write_lease(rec)
            if time.monotonic() - t0 > settle / 2:
                continue  # too slow for the race argument: retry (our own record is preferred next time)
            time.sleep(settle)
            back = self._read_lease(p)
            if back is not None and (back.writer_id, back.instance, back.generation) == (
                    rec.writer_id, rec.instance, rec.generation):
                self._lease, self._lease_ok = rec, t0
                return p
            skip.add(p)
            time.sleep(random.uniform(0, settle))
        return None

    def _lose_lease(self, why: str) -> None:
        log.warning("page store: %s; continuing read-only", why)
        with self._lock:
            p = self._partition
            if p is None:
                return
            self._partition = None
            self._lease = None
            d = dict(self._own)
            self._own.clear()
            self._foreign_parts[p] = d
            self._foreign.update(d)
        self.stats.add(lease_lost=1)

    def _ensure_lease(self) -> None:
        if self._partition is not None and time.monotonic() - self._lease_ok > self.config.lease_ttl_s / 3:
            self.heartbeat()

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

    # ------------------------------------------------------------------ index rebuild

    def _read_region(self, off: int, n: int) -> bytearray:
        buf = bytearray(n)
        mv = memoryview(buf)
        futs = [self._dev.submit_read(off + i, mv[i:i + _SCAN_CHUNK]) for i in range(0, n, _SCAN_CHUNK)]
        for f in futs:
            f.result(self.config.io_timeout_s)
        return buf

    def _valid_entries(self, p: int, img: bytearray) -> tuple[dict[bytes, _Loc], list[int]]:
        """Usable entries of one slot table (one per key, no overlapping extents) and the slots to clear."""
        g = self.geometry
        start = g.data_start_lba(p)
        end = start + g.data_lbas
        best: dict[bytes, _Loc] = {}
        bad: list[int] = []
        for slot, e in unpack_slots(img, self._seed):
            if e.lba < start or e.lba + g.page_lbas(e.length) > end:
                bad.append(slot)
                continue
            loc = _Loc(p, slot, e.lba, e.length, e.seq)
            old = best.get(e.key)
            if old is None or old.seq < e.seq:
                if old is not None:
                    bad.append(old.slot)
                best[e.key] = loc
            else:
                bad.append(slot)
        accepted: list[tuple[bytes, _Loc]] = []
        for k, loc in sorted(best.items(), key=lambda kv: kv[1].lba):
            if accepted:
                _, prev = accepted[-1]
                if prev.lba + g.page_lbas(prev.length) > loc.lba:
                    if prev.seq > loc.seq:
                        bad.append(loc.slot)
                        continue
                    bad.append(prev.slot)
                    accepted.pop()
            accepted.append((k, loc))
        return dict(accepted), bad

    def _recover(self, p: int) -> None:
        """Rebuild the own partition's allocator, LRU order (by sequence) and free slots from its slot table."""
        g = self.geometry
        img = self._read_region(g.partition_base(p), g.slot_table_bytes)
        good, bad = self._valid_entries(p, img)
        for s in bad:
            img[s * SLOT_ENTRY_BYTES:(s + 1) * SLOT_ENTRY_BYTES] = EMPTY_SLOT
        start = g.data_start_lba(p)
        with self._lock:
            self._partition = p
            self._slot_image = img
            self._alloc = ExtentAllocator(start, start + g.data_lbas,
                                          [(loc.lba, g.page_lbas(loc.length)) for loc in good.values()])
            self._own = OrderedDict(sorted(good.items(), key=lambda kv: kv[1].seq))
            used = {loc.slot for loc in good.values()}
            self._slot_hwm = max(used) + 1 if used else 0
            self._slot_free = [s for s in range(self._slot_hwm - 1, -1, -1) if s not in used]
            self._next_seq = max((loc.seq for loc in good.values()), default=0) + 1
        if bad:
            self._write_slots(p, bad)

    # ------------------------------------------------------------------ space management (under self._lock)

    def _take_slot(self) -> int:
        if self._slot_free:
            return self._slot_free.pop()
        self._slot_hwm += 1
        return self._slot_hwm - 1

    def _has_slot(self) -> bool:
        return bool(self._slot_free) or self._slot_hwm < self.geometry.slots_per_partition

    def _release(self, loc: _Loc) -> None:
        self._alloc.free(loc.lba, self.geometry.page_lbas(loc.length))
        self._slot_free.append(loc.slot)

    def _allocate(self, nl: int, evicted: list[int]) -> tuple[int, int] | None:
        """A slot and ``nl`` contiguous LBAs, evicting least-recently-used unpinned own pages as needed."""
        if nl > self.geometry.data_lbas:
            return None
        while True:
            if self._has_slot():
                lba = self._alloc.alloc(nl)
                if lba is not None:
                    return self._take_slot(), lba
            victim = next((k for k, loc in self._own.items() if not self._pins.get(loc.slot)), None)
            if victim is None:
                return None
            loc = self._own.pop(victim)
            self._slot_image[loc.slot * SLOT_ENTRY_BYTES:(loc.slot + 1) * SLOT_ENTRY_BYTES] = EMPTY_SLOT
            self._release(loc)
            evicted.append(loc.slot)
            self.stats.add(evictions=1)

    def _unpin(self, slot: int) -> None:
        n = self._pins.get(slot, 0) - 1
        if n > 0:
            self._pins[slot] = n
            return
        self._pins.pop(slot, None)
        loc = self._doomed.pop(slot, None)
        if loc is not None and loc.partition == self._partition:
            self._release(loc)

    def _drop_own(self, keys: list[bytes]) -> int:
        with self._lock:
            p = self._partition
            if p is None:
                return 0
            locs = [loc for k in keys if (loc := self._own.pop(k, None)) is not None]
            for loc in locs:
                self._slot_image[loc.slot * SLOT_ENTRY_BYTES:(loc.slot + 1) * SLOT_ENTRY_BYTES] = EMPTY_SLOT
        if not locs:
            return 0
        self._write_slots(p, [loc.slot for loc in locs])
        with self._lock:
            if self._partition == p:
                for loc in locs:
                    if self._pins.get(loc.slot):
                        self._doomed[loc.slot] = loc
                    else:
                        self._release(loc)
        return len(locs)

    def _write_slots(self, p: int, slots: list[int], updates: dict[int, bytes] | None = None) -> set[int]:
        """Write the slot-table LBAs holding ``slots`` from the in-memory image; returns the slots that failed.

        ``updates`` are applied to the image first. Serialised by the commit lock, so two writes of the same
        slot-table LBA are never in flight together; unchanged entries are rewritten byte-identical, so a torn
        LBA write can only damage the entries being changed (which their CRC then rejects).
        """
        g, lba = self.geometry, self._lba
        per = lba // SLOT_ENTRY_BYTES if lba >= SLOT_ENTRY_BYTES else 1
        with self._commit_lock:
            with self._lock:
                if self._partition != p:
                    return set(slots)
                for s, raw in (updates or {}).items():
                    self._slot_image[s * SLOT_ENTRY_BYTES:(s + 1) * SLOT_ENTRY_BYTES] = raw
                blocks = sorted({s // per for s in slots})
                runs: list[list[int]] = []
                for b in blocks:
                    if runs and runs[-1][-1] + 1 == b:
                        runs[-1].append(b)
                    else:
                        runs.append([b])
                datas = [bytes(self._slot_image[r[0] * lba:(r[-1] + 1) * lba]) for r in runs]
            base = g.partition_base(p)
            futs = [self._sub_write(base + r[0] * lba, d) for r, d in zip(runs, datas, strict=True)]
            failed_blocks: set[int] = set()
            for r, fs in zip(runs, futs, strict=True):
                if self._wait(fs) is not None:
                    failed_blocks.update(r)
        return {s for s in slots if s // per in failed_blocks}

    # ------------------------------------------------------------------ I/O helpers

    def _split(self, submit: Callable[[int, Any], Future[None]], off: int,
               buf: memoryview | ScatterList) -> list[Future[None]]:
        """``submit`` each ``max_io_bytes`` piece of ``buf`` (a memoryview or a ScatterList) at its offset."""
        out: list[Future[None]] = []
        for i in range(0, len(buf), self._step):
            try:
                out.append(submit(off + i, buf[i:i + self._step]))
            except Exception as exc:
                out.append(_failed(exc))
        return out

    def _sub_write(self, off: int, data: Buffer) -> list[Future[None]]:
        return self._split(self._dev.submit_write, off, memoryview(data))

    def _sub_read(self, off: int, mv: memoryview) -> list[Future[None]]:
        return self._split(self._dev.submit_read, off, mv)

    def _sub_readv(self, off: int, sl: ScatterList) -> list[Future[None]]:
        readv = self._readv
        assert readv is not None
        return self._split(lambda o, part: readv(o, list(part.views)), off, sl)

    def _wait(self, futs: list[Future[None]]) -> str | None:
        """Wait for commands; returns an error description (and counts io_errors) or None."""
        _done, pending = wait_futures(futs, timeout=self.config.io_timeout_s)
        err: str | None = None
        nerr = len(pending)
        if pending:
            err = "device timeout"
        for f in futs:
            if f in pending:
                continue
            exc = f.exception()
            if exc is not None:
                nerr += 1
                err = err or f"{type(exc).__name__}: {exc}"
        if nerr:
            self.stats.add(io_errors=nerr)
        return err

    def _start(self, kind: str, fn: Callable[[BatchHandle, list[bytes], list[Buffer]], None],
               keys: Sequence[bytes], buffers: Sequence[Buffer]) -> BatchHandle:
        if len(keys) != len(buffers):
            raise ValueError("keys and buffers differ in length")
        if self._closed:
            raise RuntimeError("page store is closed")
        h = BatchHandle(kind, len(keys))
        ks, bs = [bytes(k) for k in keys], list(buffers)

        def run() -> None:
            try:
                fn(h, ks, bs)
            except Exception as exc:  # a bug must not leave the caller waiting forever
                log.exception("page store %s batch failed", kind)
                if not h.done():
                    h._set([PageResult(k, PageStatus.ERROR, 0, repr(exc)) for k in ks])

        self._pool.submit(run)
        return h

    # ------------------------------------------------------------------ save

    def _run_save(self, h: BatchHandle, keys: list[bytes], buffers: list[Buffer]) -> None:
        t0 = time.perf_counter()
        g, lba = self.geometry, self._lba
        results: list[PageResult | None] = [None] * len(keys)
        ops: list[_Op] = []
        evicted: list[int] = []
        self._ensure_lease()
        with self._lock:
            p = self._partition
            for i, (k, b) in enumerate(zip(keys, buffers, strict=True)):
                if len(k) != KEY_BYTES:
                    results[i] = PageResult(k, PageStatus.ERROR, 0, "key must be 32 bytes")
                    continue
                try:
                    mv = memoryview(b).cast("B")
                except (TypeError, ValueError) as exc:
                    results[i] = PageResult(k, PageStatus.ERROR, 0, f"buffer: {exc}")
                    continue
                if k in self._own:
                    self._own.move_to_end(k)
                    results[i] = PageResult(k, PageStatus.EXISTS, len(mv))
                elif k in self._inflight or (self.config.dedupe and k in self._foreign):
                    results[i] = PageResult(k, PageStatus.EXISTS, len(mv))
                elif p is None:
                    results[i] = PageResult(k, PageStatus.ERROR, 0, "read-only: no writer partition")
                elif (got := self._allocate(g.page_lbas(len(mv)), evicted)) is None:
                    results[i] = PageResult(k, PageStatus.NO_SPACE, 0)
                else:
                    slot, at = got
                    ops.append(_Op(i, k, mv, _Loc(p, slot, at, len(mv), self._next_seq), own=True))
                    self._next_seq += 1
                    self._inflight.add(k)
        committed: list[_Op] = []
        try:
            if evicted and p is not None:
                self._write_slots(p, evicted)  # tombstones land before their extents are overwritten
            window: deque[_Op] = deque()
            inflight = 0
            for op in ops:
                self._submit_page_write(op)
                window.append(op)
                inflight += op.loc.length + lba
                while inflight > self.config.window_bytes and len(window) > 1:
                    done = window.popleft()
                    done.err = self._wait(done.futs)
                    inflight -= done.loc.length + lba
            for op in window:
                op.err = self._wait(op.futs)
            good = [op for op in ops if op.err is None]
            if good:
                try:
                    self._dev.flush(self.config.io_timeout_s)  # data durable before any commit record
                except Exception as exc:
                    self.stats.add(io_errors=1)
                    for op in good:
                        op.err = f"flush: {exc}"
                    good = []
            if good and p is not None:
                committed = self._commit(p, good)
        finally:
            ok = {id(op) for op in committed}
            with self._lock:
                for op in ops:
                    self._inflight.discard(op.key)
                    if id(op) in ok:
                        continue
                    if self._partition == p:
                        self._release(op.loc)
        nbytes = 0
        for op in ops:
            if id(op) in ok:
                results[op.idx] = PageResult(op.key, PageStatus.OK, op.loc.length)
                nbytes += op.loc.length
            else:
                results[op.idx] = PageResult(op.key, PageStatus.ERROR, 0, op.err or "not committed")
        final = [r if r is not None else PageResult(keys[i], PageStatus.ERROR) for i, r in enumerate(results)]
        failed = sum(r.status in (PageStatus.ERROR, PageStatus.NO_SPACE) for r in final)
        self.stats.add(pages_saved=len(ok), bytes_saved=nbytes, save_failed=failed,
                       save_exists=sum(r.status is PageStatus.EXISTS for r in final),
                       no_space=sum(r.status is PageStatus.NO_SPACE for r in final),
                       save_seconds=time.perf_counter() - t0)
        h._set(final)

    def _submit_page_write(self, op: _Op) -> None:
        lba, loc, mv = self._lba, op.loc, op.mv
        n = loc.length
        cks = page_checksum(op.key, loc.seq, n, mv)
        gen = self._lease.generation if self._lease is not None else 0
        hdr = pack_header(PageHeader(op.key, loc.seq, n, loc.lba, loc.partition, cks, gen, time.time_ns()),
                          self._seed)
        off = loc.lba * lba
        body = n // lba * lba
        if n <= self.config.inline_bytes or body == 0:
            op.inline = True
            st = bytearray(lba + align_up(n, lba))
            st[:RECORD_BYTES] = hdr
            st[lba:lba + n] = mv
            op.staging = st
            op.futs = self._sub_write(off, st)
            return
        hb = bytearray(lba)
        hb[:RECORD_BYTES] = hdr
        op.staging = hb
        op.futs = self._sub_write(off, hb) + self._sub_write(off + lba, mv[:body])
        if n > body:
            tb = bytearray(lba)
            tb[:n - body] = mv[body:]
            op.tail = tb
            op.futs += self._sub_write(off + lba + body, tb)

    def _commit(self, p: int, good: list[_Op]) -> list[_Op]:
        """Write the commit records (slot entries) of pages whose data is durable; returns those committed."""
        updates = {op.loc.slot: pack_slot(SlotEntry(op.key, op.loc.seq, op.loc.lba, op.loc.length), self._seed)
                   for op in good}
        failed = self._write_slots(p, list(updates), updates)
        committed = [op for op in good if op.loc.slot not in failed]
        for op in good:
            if op.loc.slot in failed:
                op.err = "commit record write failed" if self._partition == p else "lease lost"
        if self.config.flush_commits and committed:
            try:
                self._dev.flush(self.config.io_timeout_s)
            except Exception:
                self.stats.add(io_errors=1)  # written but maybe not durable yet: still a valid page
        with self._lock:
            if self._partition != p:
                for op in committed:
                    op.err = "lease lost"
                return []
            for s in failed:
                self._slot_image[s * SLOT_ENTRY_BYTES:(s + 1) * SLOT_ENTRY_BYTES] = EMPTY_SLOT
            for op in committed:
                self._own[op.key] = op.loc
        return committed

    # ------------------------------------------------------------------ load

    def _run_load(self, h: BatchHandle, keys: list[bytes], buffers: list[Buffer]) -> None:
        t0 = time.perf_counter()
        self._refresh_for(keys)
        results: list[PageResult | None] = [None] * len(keys)
        ops: list[_Op] = []
        with self._lock:
            for i, (k, b) in enumerate(zip(keys, buffers, strict=True)):
                try:
                    mv = memoryview(b).cast("B")
                except (TypeError, ValueError) as exc:
                    results[i] = PageResult(k, PageStatus.ERROR, 0, f"buffer: {exc}")
                    continue
                if mv.readonly:
                    results[i] = PageResult(k, PageStatus.ERROR, 0, "buffer is read-only")
                    continue
                own = True
                loc = self._own.get(k)
                if loc is None:
                    own, loc = False, self._foreign.get(k)
                if loc is None:
                    results[i] = PageResult(k, PageStatus.MISSING)
                    continue
                if len(mv) < loc.length:
                    results[i] = PageResult(k, PageStatus.ERROR, 0, f"buffer smaller than page ({loc.length})")
                    continue
                if own:
                    self._own.move_to_end(k)
                    self._pins[loc.slot] = self._pins.get(loc.slot, 0) + 1
                ops.append(_Op(i, k, mv, loc, own=own))
        corrupt_own: list[bytes] = []
        stale: list[_Op] = []
        try:
            window: deque[_Op] = deque()
            inflight = 0
            for op in ops:
                self._submit_page_read(op)
                window.append(op)
                inflight += op.loc.length
                while inflight > self.config.window_bytes and len(window) > 1:
                    done = window.popleft()
                    inflight -= done.loc.length
                    results[done.idx] = self._finish_read(done, corrupt_own, stale)
            for op in window:
                results[op.idx] = self._finish_read(op, corrupt_own, stale)
        finally:
            with self._lock:
                for op in ops:
                    if op.own:
                        self._unpin(op.loc.slot)
                for op in stale:
                    d = self._foreign_parts.get(op.loc.partition)
                    if self._foreign.get(op.key) is op.loc:
                        del self._foreign[op.key]
                    if d is not None and d.get(op.key) is op.loc:
                        del d[op.key]
        if corrupt_own:
            self._drop_own(corrupt_own)
        final = [r if r is not None else PageResult(keys[i], PageStatus.ERROR) for i, r in enumerate(results)]
        hits = [r for r in final if r.ok]
        self.stats.add(hits=len(hits), misses=len(final) - len(hits), pages_loaded=len(hits),
                       bytes_loaded=sum(r.nbytes for r in hits), load_seconds=time.perf_counter() - t0)
        h._set(final)

    def _refresh_for(self, keys: list[bytes]) -> None:
        """A load asks for keys this store has not indexed: another writer may have saved them since the last
        refresh (the caller learned of them through its own, newer index). Refresh once, at most every
        ``miss_refresh_gap_s``, so that such a load finds them instead of failing as MISSING."""
        gap = self.config.miss_refresh_gap_s
        if gap < 0:
            return
        with self._lock:
            if all(k in self._own or k in self._foreign for k in keys):
                return
        with self._miss_refresh_lock:  # concurrent batches wait for one refresh instead of each doing one
            if time.monotonic() - self._miss_refresh_at < gap:
                return
            try:
                self.refresh()
                self.stats.add(miss_refreshes=1)
            except Exception as exc:
                log.debug("refresh on a load miss failed: %s", exc)
            self._miss_refresh_at = time.monotonic()

    def _submit_page_read(self, op: _Op) -> None:
        lba, loc = self._lba, op.loc
        n = loc.length
        off = loc.lba * lba
        body = n // lba * lba
        if n <= self.config.inline_bytes or body == 0:
            op.inline = True
            op.staging = bytearray(lba + align_up(n, lba))
            op.futs = self._sub_read(off, memoryview(op.staging))
            return
        op.staging = bytearray(lba)
        if n > body:
            op.tail = bytearray(lba)
        if self._readv is not None:
            views = [memoryview(op.staging), op.mv[:body]]
            if op.tail is not None:
                views.append(memoryview(op.tail))
            op.futs = self._sub_readv(off, ScatterList(views))
            return
        op.futs = self._sub_read(off, memoryview(op.staging)) + self._sub_read(off + lba, op.mv[:body])
        if op.tail is not None:
            op.futs += self._sub_read(off + lba + body, memoryview(op.tail))

    def _finish_read(self, op: _Op, corrupt_own: list[bytes], stale: list[_Op]) -> PageResult:
        err = self._wait(op.futs)
        k, loc, lba = op.key, op.loc, self._lba
        if err is not None:
            return PageResult(k, PageStatus.ERROR, 0, err)
        assert op.staging is not None
        hdr = unpack_header(op.staging, self._seed)
        if hdr is None or (hdr.key, hdr.seq, hdr.length, hdr.lba) != (k, loc.seq, loc.length, loc.lba):
            if op.own:
                corrupt_own.append(k)
                self.stats.add(verify_failures=1)
                return PageResult(k, PageStatus.VERIFY_FAILED, 0, "page header mismatch")
            stale.append(op)
            self.stats.add(stale_reads=1)
            return PageResult(k, PageStatus.MISSING, 0, "stale index entry (page replaced by its writer)")
        n = loc.length
        body = n // lba * lba
        inline = op.inline
        if self.config.verify:
            if inline:
                cks = page_checksum(k, loc.seq, n, memoryview(op.staging)[lba:lba + n])
            else:
                x = xxhash.xxh3_128()
                x.update(k)
                x.update(struct.pack("<QQ", loc.seq, n))
                x.update(op.mv[:body])
                if op.tail is not None:
                    x.update(memoryview(op.tail)[:n - body])
                cks = x.digest()
            if cks != hdr.checksum:
                self.stats.add(verify_failures=1)
                if op.own:
                    corrupt_own.append(k)
                else:
                    stale.append(op)
                return PageResult(k, PageStatus.VERIFY_FAILED, 0, "payload checksum mismatch")
        if inline:
            op.mv[:n] = memoryview(op.staging)[lba:lba + n]
        elif op.tail is not None:
            op.mv[body:n] = memoryview(op.tail)[:n - body]
        return PageResult(k, PageStatus.OK, n)
