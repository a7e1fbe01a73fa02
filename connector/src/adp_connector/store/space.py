"""Space of the own partition: slots, extents, LRU eviction, pins and slot-table writes (format.md §8, §10)."""

from __future__ import annotations

import logging

from .core import Loc, StoreCore
from .format import (
    EMPTY_SLOT,
    SLOT_ENTRY_BYTES,
)

log = logging.getLogger("adp_connector.store.store")


class SpaceMixin(StoreCore):
    """Allocates, evicts and frees pages of the own partition (call with ``_lock`` held unless noted)."""

    def _take_slot(self) -> int:
        if self._slot_free:
            return self._slot_free.pop()
        self._slot_hwm += 1
        return self._slot_hwm - 1

    def _has_slot(self) -> bool:
        return bool(self._slot_free) or self._slot_hwm < self.geometry.slots_per_partition

    def _release(self, loc: Loc) -> None:
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
