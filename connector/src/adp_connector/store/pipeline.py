"""The save and load pipelines: batches of page writes/reads, commit records and verification (format.md §5, §8)."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

from ..device import Buffer, ScatterList
from .core import LandedDigest, Loc, PageOp, StoreCore, failed_future
from .format import (
    EMPTY_SLOT,
    RECORD_BYTES,
    SLOT_ENTRY_BYTES,
    PageHeader,
    SlotEntry,
    align_up,
    pack_header,
    pack_slot,
    page_checksum,
    unpack_header,
)
from .keys import KEY_BYTES
from .results import BatchHandle, PageResult, PageStatus
from .segments import SegmentClaimError

log = logging.getLogger("adp_connector.store.store")


class PipelineMixin(StoreCore):
    """Runs save and load batches on the worker pool."""

    def _split(self, submit: Callable[[int, Any], Future[None]], off: int,
               buf: memoryview | ScatterList) -> list[Future[None]]:
        """``submit`` each ``max_io_bytes`` piece of ``buf`` (a memoryview or a ScatterList) at its offset."""
        out: list[Future[None]] = []
        for i in range(0, len(buf), self._step):
            try:
                out.append(submit(off + i, buf[i:i + self._step]))
            except Exception as exc:
                out.append(failed_future(exc))
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

        self._pool.submit(run, urgent=kind == "load")
        return h


    def _run_save(self, h: BatchHandle, keys: list[bytes], buffers: list[Buffer]) -> None:
        t0 = time.perf_counter()
        g, lba = self.geometry, self._lba
        results: list[PageResult | None] = [None] * len(keys)
        ops: list[PageOp] = []
        evicted: dict[int, list[int]] = {}
        self._ensure_lease()
        short: list[tuple[int, bytes, memoryview]] = []  # pages that did not fit without evicting
        finished = threading.Event()  # set once this batch's pages are committed or failed
        waits: list[tuple[int, bytes, int, threading.Event]] = []  # keys another batch (or this one) is saving
        stored: list[tuple[int, bytes]] = []  # (index, key) of the own pages found already stored
        with self._lock:
            p = self._partition
            self._count_asked([k for k in keys if len(k) == KEY_BYTES])  # every save asked is a request for its page
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
                    stored.append((i, k))
                    results[i] = PageResult(k, PageStatus.EXISTS, len(mv))
                elif self.config.dedupe and k in self._foreign:
                    results[i] = PageResult(k, PageStatus.EXISTS, len(mv))
                elif (other := self._inflight.get(k)) is not None:
                    waits.append((i, k, len(mv), other))
                elif p is None:
                    results[i] = PageResult(k, PageStatus.ERROR, 0, "read-only: no writer slot")
                elif isinstance(got := self._allocate(g.page_lbas(len(mv)), evicted, evict=False), Loc):
                    ops.append(self._planned(i, k, mv, got, finished))
                else:
                    short.append((i, k, mv))
                    self._inflight[k] = finished
            self._own.touch(k for _i, k in reversed(stored))  # before this batch evicts anything
        if short:
            # Free or abandoned segments first (the whole card fills before anything is evicted), then own pages
            # in eviction order (recency.py).
            claim_err = None
            try:
                self._claim_more(sum(g.page_lbas(len(mv)) for _, _, mv in short))
            except SegmentClaimError as exc:
                claim_err = str(exc)
            with self._lock:
                for i, k, mv in short:
                    self._inflight.pop(k, None)
                    if self._partition != p:
                        results[i] = PageResult(k, PageStatus.ERROR, 0, "lease lost")
                    elif claim_err is not None:  # a device error: do not evict cached pages for a failing save
                        results[i] = PageResult(k, PageStatus.ERROR, 0, claim_err)
                    elif isinstance(got := self._allocate(g.page_lbas(len(mv)), evicted, candidate=k), Loc):
                        ops.append(self._planned(i, k, mv, got, finished))
                    else:
                        results[i] = PageResult(k, got, 0)  # no_space, or not_admitted by a full card
        ops.sort(key=lambda op: op.idx)  # commit order is the batch order
        with self._lock:
            for op in ops:
                op.loc.seq = self._next_seq
                self._next_seq += 1
        committed: list[PageOp] = []
        try:
            if evicted and p is not None:
                self._write_slots_many({s: (sl, None) for s, sl in evicted.items()})  # tombstones land first
            window: deque[PageOp] = deque()
            inflight = 0
            for op in ops:
                self._submit_page_write(op)
                window.append(op)
                inflight += op.loc.length + lba
                while inflight > self.config.window_bytes and len(window) > 1:
                    oldest = window.popleft()
                    oldest.err = self._wait(oldest.futs)
                    inflight -= oldest.loc.length + lba
            for op in window:
                op.err = self._wait(op.futs)
            good = [op for op in ops if op.err is None]
            if good:
                try:
                    self._flusher.flush(self.config.io_timeout_s)  # data durable before any commit record
                except Exception as exc:
                    self.stats.add(io_errors=1)
                    for op in good:
                        op.err = f"flush: {exc}"
                    good = []
            if good and p is not None:
                committed = self._commit(good)
        finally:
            ok = {id(op) for op in committed}
            with self._lock:
                for op in ops:
                    if self._inflight.get(op.key) is finished:
                        del self._inflight[op.key]
                    seg = self._segs.get(op.loc.segment)
                    if seg is not None:
                        seg.busy -= 1
                    if id(op) not in ok:
                        self._release(op.loc)
                self._order_tail_first(stored + [(op.idx, op.key) for op in committed])
            finished.set()
        for i, k, n, ev in waits:
            # Reported as stored only once the other batch committed it: a failed save is never "exists".
            landed = ev.wait(self.config.io_timeout_s)
            with self._lock:
                stored = k in self._own or k in self._foreign
            results[i] = (PageResult(k, PageStatus.EXISTS, n) if stored else
                          PageResult(k, PageStatus.ERROR, 0, "a concurrent save of this key failed" if landed
                                     else "a concurrent save of this key timed out"))
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
                       not_admitted=sum(r.status is PageStatus.NOT_ADMITTED for r in final),
                       save_seconds=time.perf_counter() - t0)
        h._set(final)
        if ops or short:
            self._maybe_claim_ahead()

    def _order_tail_first(self, touched: list[tuple[int, bytes]]) -> None:
        """Make a batch's stored pages (``(index, key)``, under ``_lock``) the most recent, its head (lowest
        index) last: a prefix is used from its first page, so a chain loses its tail before its head."""
        self._own.touch(k for _i, k in sorted(touched, reverse=True))

    def _submit_page_write(self, op: PageOp) -> None:
        lba, loc, mv = self._lba, op.loc, op.mv
        n = loc.length
        cks = page_checksum(op.key, loc.seq, n, mv)
        gen = self._lease.generation if self._lease is not None else 0
        hdr = pack_header(PageHeader(op.key, loc.seq, n, loc.lba, loc.segment, cks, gen, time.time_ns()),
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

    def _planned(self, i: int, k: bytes, mv: memoryview, at: Loc, done: threading.Event) -> PageOp:
        """A page write into the allocated ``at`` (under ``_lock``); its sequence number is set later."""
        op = PageOp(i, k, mv, Loc(at.segment, at.slot, at.lba, len(mv), 0), own=True)
        self._inflight[k] = done
        return op

    def _commit(self, good: list[PageOp]) -> list[PageOp]:
        """Write the commit records (slot entries) of pages whose data is durable; returns those committed."""
        groups: dict[int, tuple[list[int], dict[int, bytes]]] = {}
        for op in good:
            slots, updates = groups.setdefault(op.loc.segment, ([], {}))
            slots.append(op.loc.slot)
            updates[op.loc.slot] = pack_slot(SlotEntry(op.key, op.loc.seq, op.loc.lba, op.loc.length), self._seed)
        failed = self._write_slots_many(groups)
        committed = [op for op in good if (op.loc.segment, op.loc.slot) not in failed]
        for op in good:
            if (op.loc.segment, op.loc.slot) in failed:
                op.err = "commit record write failed" if op.loc.segment in self._segs else "lease lost"
        if self.config.flush_commits and committed:
            try:
                self._flusher.flush(self.config.io_timeout_s)
            except Exception:
                self.stats.add(io_errors=1)  # written but maybe not durable yet: still a valid page
        with self._lock:
            for seg, slot in failed:
                own = self._segs.get(seg)
                if own is not None:
                    own.image[slot * SLOT_ENTRY_BYTES:(slot + 1) * SLOT_ENTRY_BYTES] = EMPTY_SLOT
            kept = []
            for op in committed:
                if op.loc.segment not in self._segs:
                    op.err = "lease lost"
                    continue
                self._own[op.key] = op.loc
                kept.append(op)
        return kept

    def _run_load(self, h: BatchHandle, keys: list[bytes], buffers: list[Buffer]) -> None:
        t0 = time.perf_counter()
        self._refresh_for(keys)
        results: list[PageResult | None] = [None] * len(keys)
        ops: list[PageOp] = []
        hits: list[bytes] = []  # own pages read back, in batch order
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
                    hits.append(k)
                    pin = (loc.segment, loc.slot)
                    self._pins[pin] = self._pins.get(pin, 0) + 1
                ops.append(PageOp(i, k, mv, loc, own=own))
            self._count_asked(hits)
            self._own.read_back(reversed(hits))  # the head of the batch ends most recent
        corrupt_own: list[bytes] = []
        stale: list[PageOp] = []
        try:
            window: deque[PageOp] = deque()
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
                        self._unpin((op.loc.segment, op.loc.slot))
                for op in stale:
                    d = self._foreign_parts.get(op.loc.segment)
                    if self._foreign.get(op.key) is op.loc:
                        del self._foreign[op.key]
                        self.index_changed.set()
                    if d is not None and d.get(op.key) is op.loc:
                        del d[op.key]
        if corrupt_own:
            self._drop_own(corrupt_own)
        final = [r if r is not None else PageResult(keys[i], PageStatus.ERROR) for i, r in enumerate(results)]
        hits = [r for r in final if r.ok]
        self.stats.add(hits=len(hits), misses=len(final) - len(hits), pages_loaded=len(hits),
                       bytes_loaded=sum(r.nbytes for r in hits), load_seconds=time.perf_counter() - t0)
        h._set(final)


    def _submit_page_read(self, op: PageOp) -> None:
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
        else:
            op.futs = self._sub_read(off, memoryview(op.staging)) + self._sub_read(off + lba, op.mv[:body])
            if op.tail is not None:
                op.futs += self._sub_read(off + lba + body, memoryview(op.tail))
        if self.config.verify:
            op.digest = LandedDigest(op.futs, lambda: self._payload_checksum(op))

    def _payload_checksum(self, op: PageOp) -> bytes:
        """The stored-format checksum of a non-inline page read into ``op.mv`` (body) and ``op.tail``."""
        n, lba = op.loc.length, self._lba
        body = n // lba * lba
        tail = memoryview(op.tail)[:n - body] if op.tail is not None else b""
        return page_checksum(op.key, op.loc.seq, n, op.mv[:body], tail)

    def _finish_read(self, op: PageOp, corrupt_own: list[bytes], stale: list[PageOp]) -> PageResult:
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
            else:  # taken as the last command landed (in cache), or here
                cks = op.digest.result() if op.digest is not None else self._payload_checksum(op)
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
