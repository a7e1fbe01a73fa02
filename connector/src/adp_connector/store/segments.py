"""Segments: claim free or abandoned ones on demand, adopt their pages, hand cold ones over (format.md §9, §10).

No compare-and-swap exists on the device: a claim writes the segment records, waits ``claim_settle_s`` and reads
them back, exactly like a lease claim, and every record is written only by its owner or through that protocol.
"""

from __future__ import annotations

import logging
import threading
import time

from .alloc import ExtentAllocator
from .core import Loc, OwnSegment, StoreCore, warn_slow_claim
from .format import (
    EMPTY_SLOT,
    SEGMENT_FREE,
    SEGMENT_OWNED,
    SLOT_ENTRY_BYTES,
    LeaseRecord,
    SegmentRecord,
    pack_segment,
    unpack_lease,
    unpack_segment,
)

log = logging.getLogger("adp_connector.store.store")
_CLAIM_ATTEMPTS = 16  # an attempt slower than settle/2 is retried (a slow device, a tiny claim_settle_s)
_NO_CLAIM_BACKOFF_S = 1.0  # after a claim found nothing, saves evict instead of re-reading the tables for this long


class SegmentClaimError(Exception):
    """A segment claim failed on a device error (the pages that needed the space fail with ``error``)."""


class SegmentMixin(StoreCore):
    """Claims, adopts and hands over the segments a writer allocates its pages in."""

    # ---------------------------------------------------------------- tables

    def _read_lease_table(self) -> list[LeaseRecord | None]:
        g = self.geometry
        r = g.lease_record_bytes
        buf = self._read_region(g.lease_table_offset, g.writers * r)
        return [unpack_lease(buf[w * r:(w + 1) * r], self._seed) for w in range(g.writers)]

    def _read_segment_table(self) -> list[SegmentRecord | None]:
        g = self.geometry
        r = g.segment_record_bytes
        buf = self._read_region(g.segment_table_offset, g.segments * r)
        return [unpack_segment(buf[s * r:(s + 1) * r], self._seed) for s in range(g.segments)]

    def _write_segment_records(self, recs: list[SegmentRecord]) -> list[bool]:
        g = self.geometry
        futs = [self._sub_write(g.segment_record_offset(r.segment),
                                pack_segment(r, self._seed).ljust(g.segment_record_bytes, b"\0")) for r in recs]
        return [self._wait(f) is None for f in futs]

    @staticmethod
    def _live_writers(leases: list[LeaseRecord | None], now: int) -> set[int]:
        return {w for w, r in enumerate(leases) if r is not None and not r.expired(now)}

    # ---------------------------------------------------------------- claim

    def _claim_candidates(self, leases: list[LeaseRecord | None], segs: list[SegmentRecord | None],
                          now: int) -> list[int]:
        """Claimable segments, best first: ours on the device but not in memory (an unconfirmed earlier claim),
        never used or released ones, then those of writers whose lease expired, longest-claimed first."""
        me = self._partition
        live = self._live_writers(leases, now)
        mine, free, dead = [], [], []
        for s, r in enumerate(segs):
            if s in self._segs:
                continue
            if r is None or r.state != SEGMENT_OWNED:
                free.append(s)
            elif r.owner == me:
                mine.append(s)
            elif r.owner not in live:
                dead.append((r.claimed_ns, s))
        return mine + free + [s for _, s in sorted(dead)]

    def _claim_segments(self, n: int) -> int:
        """Claim up to ``n`` segments (write, settle, read back; as a lease claim) and adopt them; returns how
        many were won. Sets the ``wanted`` hint of the lease when nothing was claimable (handover, §9)."""
        cfg = self.config
        settle = cfg.claim_settle_s
        slow = 0.0  # the slowest attempt retried for taking longer than settle / 2
        for _attempt in range(_CLAIM_ATTEMPTS):
            w, lease = self._partition, self._lease
            if w is None or lease is None:
                return 0
            t0 = time.monotonic()
            try:
                leases, segs = self._read_lease_table(), self._read_segment_table()
            except Exception as exc:
                self.stats.add(io_errors=1)
                raise SegmentClaimError(f"segment claim failed: {type(exc).__name__}: {exc}") from exc
            now = time.time_ns()
            with self._lock:
                cands = self._claim_candidates(leases, segs, now)[:n]
            if not cands:
                live = self._live_writers(leases, now) | {w}
                fair = self.geometry.segments // len(live)
                wanted = max(0, min(n, fair - len(self._segs)))
                if wanted and not self._wanted:
                    self._wanted = wanted
                    self.heartbeat()  # publish the request now, not at the next renewal
                self._wanted = wanted
                return 0
            recs = [SegmentRecord(s, SEGMENT_OWNED, w, self._writer_id, lease.generation, now) for s in cands]
            written = self._write_segment_records(recs)
            if not any(written):
                raise SegmentClaimError("segment claim failed: the segment records could not be written")
            took = time.monotonic() - t0
            if took > settle / 2:
                slow = max(slow, took)
                continue  # too slow for the race argument: retry (our own records are preferred next time)
            time.sleep(settle)
            try:
                back = self._read_segment_table()
            except Exception as exc:
                self.stats.add(io_errors=1)
                raise SegmentClaimError(f"segment claim failed: {type(exc).__name__}: {exc}") from exc
            won = [r.segment for r, ok in zip(recs, written, strict=True) if ok and back[r.segment] == r]
            if self._partition != w:
                return 0
            if won:
                self._adopt(won)
                self._wanted = 0
                self.stats.add(segments_claimed=len(won))
                return len(won)
        if slow:
            warn_slow_claim("segment", _CLAIM_ATTEMPTS, slow, settle)
        return 0

    def _claim_more(self, lbas: int) -> int:
        """Claim segments for ``lbas`` more LBAs of pages (at least ``claim_segments`` of them; by default S/16, at
        least 2 and at most S/W) unless a recent
        attempt found none; returns how many were claimed. Runs on a save worker, never under ``_lock``.
        Raises SegmentClaimError on a device error."""
        g = self.geometry
        with self._claim_lock:
            if time.monotonic() < self._no_claim_until or self._partition is None:
                return 0
            step = self.config.claim_segments or max(1, min(max(2, g.segments // 16), g.segments // g.writers))
            n = max(step, -(-lbas // g.data_lbas))
            got = self._claim_segments(n)
            if not got:
                self._no_claim_until = time.monotonic() + _NO_CLAIM_BACKOFF_S
            return got

    def _maybe_claim_ahead(self) -> None:
        """After a save: when at most half of the own segments' space is free, claim more in the background,
        so that the next saves find room without waiting for a claim's settle time."""
        if self._closed or self._partition is None or time.monotonic() < self._no_claim_until:
            return
        with self._lock:
            have = len(self._segs) * self.geometry.data_lbas
            free = sum(seg.alloc.free_lbas for seg in self._segs.values())
            if have and free * 2 > have:
                return
            if self._claimer is not None and self._claimer.is_alive():
                return
            self._claimer = threading.Thread(target=self._claim_ahead, name="adpkv-store-claim", daemon=True)
            self._claimer.start()

    def _claim_ahead(self) -> None:
        try:
            self._claim_more(0)
        except Exception as exc:  # the next save that needs room claims (or fails) in the foreground
            log.debug("background segment claim failed: %s", exc)

    # ---------------------------------------------------------------- adopt

    def _adopt(self, segs: list[int]) -> None:
        """Make ``segs`` own segments: index their valid entries as own pages (the least recently used ones),
        tombstone their invalid or duplicate entries, and continue the sequence above theirs."""
        g = self.geometry
        for seg in segs:
            try:
                img = self._read_region(g.segment_base(seg), g.slot_table_bytes)
            except Exception:
                self.stats.add(io_errors=1)
                continue
            good, bad = self._valid_entries(seg, img)
            with self._lock:
                for k in [k for k, loc in good.items() if k in self._own and self._own[k].seq >= loc.seq]:
                    bad.append(good.pop(k).slot)
                for k in [k for k in good if k in self._own]:  # ours elsewhere but older: keep this copy
                    old = self._own.pop(k)
                    self._doomed_elsewhere(old)
                for s in bad:
                    img[s * SLOT_ENTRY_BYTES:(s + 1) * SLOT_ENTRY_BYTES] = EMPTY_SLOT
                start = g.data_start_lba(seg)
                alloc = ExtentAllocator(start, start + g.data_lbas,
                                        [(loc.lba, g.page_lbas(loc.length)) for loc in good.values()])
                used = {loc.slot for loc in good.values()}
                hwm = max(used) + 1 if used else 0
                self._segs[seg] = OwnSegment(seg, img, alloc, [s for s in range(hwm - 1, -1, -1) if s not in used],
                                             hwm, g.slots_per_segment)
                # adopted pages are older than anything used in this run: unprotected, at the cold end, by sequence
                self._own.add_oldest(sorted(good.items(), key=lambda kv: kv[1].seq))
                self._next_seq = max(self._next_seq, max((loc.seq for loc in good.values()), default=0) + 1)
                part = self._foreign_parts.pop(seg, None)
                if part:
                    for k, loc in part.items():
                        if self._foreign.get(k) is loc:
                            del self._foreign[k]
                self._table_digests.pop(seg, None)
            if bad:
                self._write_slots(seg, bad)

    def _doomed_elsewhere(self, loc: Loc) -> None:
        """An older own copy of a key adopted again from another segment: clear its entry (written back lazily by
        the next commit of its segment) and free its space."""
        self._clear_entry(loc)
        self._release(loc)

    # ---------------------------------------------------------------- hand over

    def _hand_over(self, leases: list[LeaseRecord | None]) -> int:
        """Release own segments, coldest first, while another live writer asks for segments and this one holds
        more than its fair share (segments / live writers). Their pages stay readable as foreign pages until the
        next owner reuses the space. Returns how many were released."""
        w = self._partition
        now = time.time_ns()
        live = self._live_writers(leases, now) | ({w} if w is not None else set())
        wanted = sum(r.wanted for i, r in enumerate(leases) if r is not None and i in live and i != w)
        if w is None or not wanted:
            return 0
        fair = self.geometry.segments // max(1, len(live))
        with self._lock:
            spare = min(len(self._segs) - fair, wanted)
            if spare <= 0:
                return 0
            heat: dict[int, int] = dict.fromkeys(self._segs, -1)
            for i, loc in enumerate(self._own.values()):
                heat[loc.segment] = i
            pinned = {seg for seg, _slot in self._pins}
            cold = [s for s, _ in sorted(heat.items(), key=lambda kv: kv[1])
                    if self._segs[s].busy == 0 and s not in pinned][:spare]
            for s in cold:
                del self._segs[s]
            moved = {s: {k: loc for k, loc in self._own.items() if loc.segment == s} for s in cold}
            for s, pages in moved.items():
                for k in pages:
                    del self._own[k]
                self._foreign_parts[s] = pages
                self._foreign.update(pages)
            lease = self._lease
        if not cold or lease is None:
            return 0
        recs = [SegmentRecord(s, SEGMENT_FREE, w, self._writer_id, lease.generation, now) for s in cold]
        self._write_segment_records(recs)
        self._flusher.flush(self.config.io_timeout_s)
        self.stats.add(segments_handed_over=len(cold))
        log.info("page store: handed %d segment(s) over to writers that asked for space", len(cold))
        return len(cold)
