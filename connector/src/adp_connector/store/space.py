"""Space of the own segments: slots, extents, eviction, pins and slot-table writes (format.md §8, §10)."""

from __future__ import annotations

from .core import Loc, StoreCore
from .format import EMPTY_SLOT, SLOT_ENTRY_BYTES
from .results import PageStatus


class SpaceMixin(StoreCore):
    """Allocates, evicts and frees pages in the own segments (call with ``_lock`` held unless noted)."""

    def _release(self, loc: Loc) -> None:
        seg = self._segs.get(loc.segment)
        if seg is None:  # handed over or lost with the lease: its space is no longer ours to manage
            return
        seg.alloc.free(loc.lba, self.geometry.page_lbas(loc.length))
        seg.slot_free.append(loc.slot)

    def _fit(self, nl: int) -> Loc | None:
        """A slot and ``nl`` contiguous LBAs in some own segment, without evicting (first fit, claim order)."""
        last = self._segs.get(self._fill_hint)
        for seg in ([last] if last is not None else []) + list(self._segs.values()):
            if seg.alloc.free_lbas < nl or not seg.has_slot():
                continue
            at = seg.alloc.alloc(nl)
            if at is not None:
                self._fill_hint = seg.index
                return Loc(seg.index, seg.take_slot(), at, 0, 0)
        return None

    def _evictable(self, loc: Loc) -> bool:
        return not self._pins.get((loc.segment, loc.slot))

    def _allocate(self, nl: int, evicted: dict[int, list[int]], evict: bool = True, candidate: bytes | None = None
                  ) -> Loc | PageStatus:
        """A slot and ``nl`` contiguous LBAs (``Loc`` with length/seq unset), or why not: ``NO_SPACE``. With
        ``evict``, unpinned own pages are evicted in the order of the eviction policy (:mod:`.recency`; their slots
        listed in ``evicted`` by segment) until it fits. With the new page's key as ``candidate``, the first victim
        goes only if the frequency sketch admits the page over it (:mod:`.admission`; the sketch's halving period
        set to ten times the own pages, the card's size), or if it has outlived the reuse seen lately
        (:meth:`OwnPages.outlived`): else ``NOT_ADMITTED``, nothing evicted."""
        if nl > self.geometry.data_lbas:
            return PageStatus.NO_SPACE
        freq = self._freq if candidate is not None else None  # None once the first victim has been weighed
        while True:
            got = self._fit(nl)
            if got is not None:
                self._segs[got.segment].busy += 1
                return got
            if not evict:
                return PageStatus.NO_SPACE
            victim = self._own.victim(self._evictable)
            if victim is None:
                return PageStatus.NO_SPACE
            if freq is not None and candidate is not None:
                freq.period = max(10 * len(self._own), 1024)
                if self._own.outlived(victim):  # untouched past any reuse seen lately: goes whatever its count
                    self.stats.add(evictions_outlived=1)
                elif not freq.admits(candidate, victim):
                    return PageStatus.NOT_ADMITTED
                freq = None
            loc = self._own.pop(victim)
            self._clear_entry(loc)
            self._release(loc)
            evicted.setdefault(loc.segment, []).append(loc.slot)
            self._evicted_keys.append(victim)
            self.stats.add(evictions=1)

    def _clear_entry(self, loc: Loc) -> None:
        seg = self._segs.get(loc.segment)
        if seg is not None:
            seg.image[loc.slot * SLOT_ENTRY_BYTES:(loc.slot + 1) * SLOT_ENTRY_BYTES] = EMPTY_SLOT

    def _unpin(self, pin: tuple[int, int]) -> None:
        n = self._pins.get(pin, 0) - 1
        if n > 0:
            self._pins[pin] = n
            return
        self._pins.pop(pin, None)
        loc = self._doomed.pop(pin, None)
        if loc is not None:
            self._release(loc)

    def _drop_own(self, keys: list[bytes]) -> int:
        with self._lock:
            if self._partition is None:
                return 0
            locs = [loc for k in keys if (loc := self._own.pop(k, None)) is not None]
            for loc in locs:
                self._clear_entry(loc)
        if not locs:
            return 0
        by_seg: dict[int, list[int]] = {}
        for loc in locs:
            by_seg.setdefault(loc.segment, []).append(loc.slot)
        for s, slots in by_seg.items():
            self._write_slots(s, slots)
        with self._lock:
            for loc in locs:
                if self._pins.get((loc.segment, loc.slot)):
                    self._doomed[(loc.segment, loc.slot)] = loc
                else:
                    self._release(loc)
        return len(locs)

    def _write_slots(self, seg: int, slots: list[int], updates: dict[int, bytes] | None = None) -> set[int]:
        """Write the slot-table LBAs of segment ``seg`` holding ``slots``; returns the slots that failed."""
        return {slot for _seg, slot in self._write_slots_many({seg: (slots, updates)})}

    def _write_slots_many(self, groups: dict[int, tuple[list[int], dict[int, bytes] | None]]) -> set[tuple[int, int]]:
        """Write, for each own segment, the slot-table LBAs holding its ``slots`` from its in-memory image (its
        ``updates`` applied to the image first); returns the (segment, slot) pairs that failed (all of a segment's
        when it is no longer ours).

        Serialised per segment, so two writes of the same slot-table LBA are never in flight together, while the
        tables of different segments are written in parallel. Unchanged entries are rewritten byte-identical, so a
        torn LBA write can only damage the entries being changed (which their CRC then rejects).
        """
        g, lba = self.geometry, self._lba
        per = lba // SLOT_ENTRY_BYTES if lba >= SLOT_ENTRY_BYTES else 1
        failed: set[tuple[int, int]] = set()
        with self._lock:
            owned = {seg: self._segs.get(seg) for seg in groups}
        locked = []
        try:
            for seg in sorted(groups):  # one order: no deadlock between batches
                own = owned[seg]
                if own is not None:
                    own.write_lock.acquire()
                    locked.append(own)
            pending = []
            with self._lock:
                for seg, (slots, updates) in groups.items():
                    own = owned[seg]
                    if own is None or self._segs.get(seg) is not own:
                        failed.update((seg, s) for s in slots)
                        continue
                    for s, raw in (updates or {}).items():
                        own.image[s * SLOT_ENTRY_BYTES:(s + 1) * SLOT_ENTRY_BYTES] = raw
                    runs: list[list[int]] = []
                    for b in sorted({s // per for s in slots}):
                        if runs and runs[-1][-1] + 1 == b:
                            runs[-1].append(b)
                        else:
                            runs.append([b])
                    for r in runs:
                        pending.append((seg, r, bytes(own.image[r[0] * lba:(r[-1] + 1) * lba])))
            futs = [self._sub_write(g.segment_base(seg) + r[0] * lba, d) for seg, r, d in pending]
            bad_blocks: set[tuple[int, int]] = set()
            for (seg, r, _d), fs in zip(pending, futs, strict=True):
                if self._wait(fs) is not None:
                    bad_blocks.update((seg, b) for b in r)
        finally:
            for own in locked:
                own.write_lock.release()
        for seg, (slots, _u) in groups.items():
            failed.update((seg, s) for s in slots if (seg, s // per) in bad_blocks)
        return failed
