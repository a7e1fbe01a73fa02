"""Writer leases: claim a writer slot without compare-and-swap, heartbeat it, notice losing it (format.md §9)."""

from __future__ import annotations

import logging
import random
import time

from .core import StoreCore, warn_slow_claim
from .format import (
    LEASE_HELD,
    LeaseRecord,
    pack_lease,
    unpack_lease,
)

log = logging.getLogger("adp_connector.store.store")


class LeaseMixin(StoreCore):
    """Claims and renews the writer lease of one writer slot."""

    def heartbeat(self) -> bool:
        """Renew this writer's lease (publishing how many segments it asks for) and hand segments over to writers
        that ask, when this one holds more than its fair share; False (and read-only from then on) if lost."""
        with self._lease_lock:
            p, lease = self._partition, self._lease
            if p is None or lease is None:
                return False
            started = time.monotonic()
            if started - self._lease_ok > self.config.lease_ttl_s:
                self._lose_lease("lease expired before renewal")
                return False
            try:
                table = self._read_lease_table()
            except Exception:
                self.stats.add(io_errors=1)
                return True  # retried by the next heartbeat; lost for real only after the TTL
            cur = table[p]
            if cur is None or (cur.writer_id, cur.instance, cur.generation) != (
                    lease.writer_id, lease.instance, lease.generation):
                self._lose_lease("lease taken over by another writer")
                return False
            new = LeaseRecord(p, LEASE_HELD, lease.writer_id, lease.instance, lease.generation, time.time_ns(),
                              lease.ttl_ns, lease.label, self._wanted)
            try:
                self._write_lease(new)
            except Exception:
                self.stats.add(io_errors=1)
                return True
            self._lease, self._lease_ok = new, started
        try:
            self._hand_over(table)
        except Exception as exc:
            self.stats.add(io_errors=1)
            log.warning("page store: segment handover failed: %s", exc)
        return True

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
        self._dev.write(self.geometry.lease_offset(rec.writer_slot), raw, self.config.io_timeout_s)

    def _candidates(self, recs: list[LeaseRecord | None], now: int, skip: set[int]) -> list[int]:
        """Writer slots in claim order: our own id's, the preferred one, never used, released, expired."""
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
        """Claim a writer slot: write the lease, wait ``claim_settle_s``, read it back; back off if overwritten.

        The write must land within ``settle/2`` of reading the table (else the attempt is repeated), so a
        competitor that read the record as free before our write can only write before our read-back.
        """
        cfg = self.config
        settle = cfg.claim_settle_s
        skip: set[int] = set()
        slow = 0.0  # the slowest attempt retried for taking longer than settle / 2
        attempts = 4 * self.geometry.partitions + 8
        for _attempt in range(attempts):
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
            took = time.monotonic() - t0
            if took > settle / 2:
                slow = max(slow, took)
                continue  # too slow for the race argument: retry (our own record is preferred next time)
            time.sleep(settle)
            back = self._read_lease(p)
            if back is not None and (back.writer_id, back.instance, back.generation) == (
                    rec.writer_id, rec.instance, rec.generation):
                self._lease, self._lease_ok = rec, t0
                return p
            skip.add(p)
            time.sleep(random.uniform(0, settle))
        if slow:
            warn_slow_claim("writer slot", attempts, slow, settle)
        return None

    def _lose_lease(self, why: str) -> None:
        log.warning("page store: %s; continuing read-only", why)
        with self._lock:
            p = self._partition
            if p is None:
                return
            self._partition = None
            self._lease = None
            for loc_key, loc in self._own.items():
                self._foreign_parts.setdefault(loc.segment, {})[loc_key] = loc
            self._foreign.update(self._own)
            self._own.clear()
            self._segs.clear()
        self.stats.add(lease_lost=1)

    def _ensure_lease(self) -> None:
        if self._partition is not None and time.monotonic() - self._lease_ok > self.config.lease_ttl_s / 3:
            self.heartbeat()

