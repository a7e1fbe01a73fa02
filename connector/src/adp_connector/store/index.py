"""The in-memory index: own and foreign entries, slot-table parsing, rebuild and refresh (format.md §7)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import xxhash

from .core import SCAN_CHUNK, Loc, StoreCore
from .format import (
    unpack_slots,
)

log = logging.getLogger("adp_connector.store.store")
_REFRESH_GROUP = 64  # slot tables read in parallel by a refresh


class IndexMixin(StoreCore):
    """Lookups over the own and foreign index and its rebuild from the slot tables."""

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
        """Every indexed key (own segments and, as of the last refresh, the others)."""
        with self._lock:
            return list(self._own) + [k for k in self._foreign if k not in self._own]


    def payload_extents(self) -> list[tuple[bytes, int, int]]:
        """(key, namespace byte offset, length) of every indexed page's payload, which follows the page's header
        block (docs/format.md §5): what a media-corruption control needs to hit payload bytes only."""
        lba = self._dev.lba_size
        with self._lock:
            locs = {**self._foreign, **self._own}
            return [(k, (loc.lba + 1) * lba, loc.length) for k, loc in locs.items()]

    def refresh(self) -> None:
        """Re-read the slot tables of every segment not ours so other writers' pages become visible (or vanish)."""
        with self._refresh_lock:  # one at a time: the digest cache must match the installed index
            self._refresh()

    def _refresh(self) -> None:
        g = self.geometry
        with self._lock:
            mine = set(self._segs)
        todo = [x for x in range(g.segments) if x not in mine]
        new: dict[int, dict[bytes, Loc]] = {}
        changed = False
        digests = self._table_digests
        for i in range(0, len(todo), _REFRESH_GROUP):
            group = todo[i:i + _REFRESH_GROUP]
            for seg, img in zip(group, self._read_tables(group), strict=True):
                if img is None:
                    self.stats.add(io_errors=1)
                    new[seg] = self._foreign_parts.get(seg, {})
                    continue
                # Parsing a large table is the expensive part (and holds the GIL): skip an unchanged one.
                d = xxhash.xxh3_128_digest(img)
                if digests.get(seg) == d and seg in self._foreign_parts:
                    new[seg] = self._foreign_parts[seg]
                    continue
                digests[seg] = d
                changed = True
                new[seg] = self._valid_entries(seg, img)[0]
        if not changed and set(new) == set(self._foreign_parts):
            self.stats.add(refreshes=1)
            return
        with self._lock:
            self._foreign_parts = {x: d for x, d in new.items() if x not in self._segs}
            merged: dict[bytes, Loc] = {}
            for d in self._foreign_parts.values():
                merged.update(d)
            self._foreign = merged
        self.index_changed.set()
        self.stats.add(refreshes=1)

    def _read_tables(self, segs: list[int]) -> list[bytearray | None]:
        """The slot tables of ``segs``, read in parallel (None where a read failed)."""
        g = self.geometry
        n = g.slot_table_bytes
        imgs = [bytearray(n) for _ in segs]
        futs = []
        for seg, img in zip(segs, imgs, strict=True):
            mv, off = memoryview(img), g.segment_base(seg)
            futs.append([self._dev.submit_read(off + i, mv[i:i + SCAN_CHUNK]) for i in range(0, n, SCAN_CHUNK)])
        out: list[bytearray | None] = []
        for img, fs in zip(imgs, futs, strict=True):
            try:
                for f in fs:
                    f.result(self.config.io_timeout_s)
                out.append(img)
            except Exception:
                out.append(None)
        return out

    def _read_region(self, off: int, n: int) -> bytearray:
        buf = bytearray(n)
        mv = memoryview(buf)
        futs = [self._dev.submit_read(off + i, mv[i:i + SCAN_CHUNK]) for i in range(0, n, SCAN_CHUNK)]
        for f in futs:
            f.result(self.config.io_timeout_s)
        return buf

    def _valid_entries(self, p: int, img: bytearray) -> tuple[dict[bytes, Loc], list[int]]:
        """Usable entries of segment ``p``'s slot table (one per key, no overlapping extents) and the slots to
        clear."""
        g = self.geometry
        start = g.data_start_lba(p)
        end = start + g.data_lbas
        best: dict[bytes, Loc] = {}
        bad: list[int] = []
        for slot, e in unpack_slots(img, self._seed):
            if e.lba < start or e.lba + g.page_lbas(e.length) > end:
                bad.append(slot)
                continue
            loc = Loc(p, slot, e.lba, e.length, e.seq)
            old = best.get(e.key)
            if old is None or old.seq < e.seq:
                if old is not None:
                    bad.append(old.slot)
                best[e.key] = loc
            else:
                bad.append(slot)
        accepted: list[tuple[bytes, Loc]] = []
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

