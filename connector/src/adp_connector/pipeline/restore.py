"""The restore pipeline: pages loaded from a store through staging slabs, checked, scattered into the KV cache.

A job (one request's restore) is split per group into slab-sized store batches. They run in parallel in the
store's threads (or helpers), at most ``max_inflight`` at a time and as many as there are free staging slabs; each
is copied into the KV cache as soon as it lands and its slab then takes the next batch (:meth:`RestorePipeline.poll`):
host memory stays bounded whatever the restore's size. Batches are handed out oldest job first: with several
restores in flight the first one finishes first (its request computes while the next restores) instead of all of
them finishing together, and restores never hold more slabs than the I/O can use, so saves still find staging.
Any page not restored fails the whole job (the caller recomputes).

The caller polls once per engine step. On a GPU a thread of the pipeline's own (:meth:`RestorePipeline.run_driver`)
also moves landed batches into the KV cache and hands their slabs the next batches as they land: polled only, a
slab waits for the engine's next step twice per cycle (landed -> copied -> free), so a long prefill step stalls every
restore in flight. While the driver runs it alone moves batches, so the copies of landed batches are never launched
from the engine's thread. Finishing a job (zero-fill, counters, the report) stays with the caller's poll. The
caller's :meth:`~RestorePipeline.start`, :meth:`~RestorePipeline.read_ahead` and
:meth:`~RestorePipeline.drop_read_ahead` only queue the call for the driver, in order: the engine's thread neither
waits for a driver's pass nor splits and submits a restore's batches itself (each submission is a system call, after
which the thread waits for the interpreter lock behind the connector's other threads; GPU run 30: ``start_load_kv``
took 7.2 s of an 83 s point at 16 agents, ~90 ms a restore).

A restore may also be read ahead (:meth:`RestorePipeline.read_ahead`): the pages of a request that waits for GPU
blocks are read into staging before its blocks exist, within ``ahead_max_bytes`` of slabs and only with slabs no
other restore waits for. When its restore starts, the landed batches are only copied into the KV cache: the read
left the request's critical path. Pages are named by their content key, so a page read ahead is the page a later
read would return; pages the restore does not need are skipped, pages it needs that were not read ahead are read
then.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from ..store.api import Store
from ..store.results import PageStatus
from .audit import PageAudit
from .counters import Counters
from .pages import PageSink
from .save import SaveLedger
from .staging import StagingPool

log = logging.getLogger("vllm.adp_kv.restore")
_now = time.monotonic  # the pipeline's clock (a test may set its own)
DRIVER_COPY_WAIT_S = 0.001  # the driver's wait while a host -> device copy holds a slab
DRIVER_IDLE_WAIT_S = 0.05  # its wait otherwise (a landed batch wakes it at once)

PageRef = tuple[int, int, bytes]  # (group id, block id, page key)


class Cause(str, Enum):
    """Why a restore failed (the ``cause`` label of ``vllm:adp_kv_load_failures``; docs/connector.md)."""

    EVICTED = "evicted"                        # committed by this worker, gone from its store's index since
    NEVER_COMMITTED = "never_committed"        # this worker's save of the page was dropped or failed
    NOT_INDEXED = "not_indexed"                # not in the loading store's index (another writer's page, evicted
    #                                            by it or not seen by this store's refresh yet)
    REPLACED = "replaced"                      # the index entry was stale: its writer reused the slot
    VERIFY_FAILED = "verify_failed"            # header or payload checksum mismatch
    IO_ERROR = "io_error"                      # device / transport error on the read
    HELPER_LOST = "helper_lost"                # the I/O helper process exited or its socket broke
    TARGET_UNREACHABLE = "target_unreachable"  # no store (target down, helper being restarted)
    TIMED_OUT = "timed_out"                    # a batch in flight did not land within load_timeout_s
    NO_STAGING = "no_staging"                  # waited load_timeout_s for a staging slab while no restore landed
    NOT_PLANNED = "not_planned"                # the scheduler found nothing restorable (a needed block unhashed/null)
    TP_KEY_MISSING = "tp_key_missing"          # TP > 1: a page's block hash did not reach this rank
    CACHE_DISABLED = "cache_disabled"          # KV registration failed: the worker serves without the cache
    SUBMIT_FAILED = "submit_failed"            # the store refused the batch


FAILURE_COUNTER_PREFIX = "load_failed_"  # counters named load_failed_<cause>, exported with a cause label
PHASE_COUNTER_PREFIX = "load_phase_s_"  # seconds of successful restores by phase, exported with a phase label
RESTORE_PHASES = {
    "queued": "from the restore's start until its first batch got a staging slab (behind older restores, or no slab)",
    "io": "from its first batch's slab until its last batch landed",
    "copy": "from its last batch landing until its last host -> device copy was seen done",
    "step_wait": "from then until the caller's poll (the engine's next step) finished it",
    "slab_wait": "within io: time a batch of it waited for a free staging slab (slabs held by saves or by copies)",
}


def failure_counter(cause: Cause) -> str:
    return FAILURE_COUNTER_PREFIX + cause.value


@dataclass
class LoadChunk:
    """Up to one staging slab of one group's pages: one store batch, copied into the KV cache when it lands."""

    gid: int
    idxs: list[int]  # indices into the job's pages
    buf: torch.Tensor | None = None  # staging slab (flat int8) while the chunk holds one
    handle: Any = None  # the store batch, once submitted
    applied: bool = False
    copied: Any = None  # GPU: event of the host -> device copy (the slab is busy and the pages not in place before)


@dataclass
class LoadJob:
    """One request's restore: ``pages`` into their blocks, ``zero`` (group, block) zero-filled on success."""

    req_id: str
    pages: list[PageRef]
    zero: list[tuple[int, int]]
    t0: float
    failed: str = ""  # '' or why it failed (the cause first; never just a status)
    cause: Cause | None = None
    blocks: list[int] = field(default_factory=list)  # vLLM 0.26: reported as load errors if the restore fails
    chunks: list[LoadChunk] = field(default_factory=list)
    lost: list[bytes] = field(default_factory=list)  # keys the store did not have (missing, stale or corrupt)
    progress_t: float = 0.0  # when a batch of this job last got a slab or landed (t0 before either)
    first_slab_t: float | None = None  # when its first batch got a staging slab
    landed_t: float | None = None  # when its latest batch landed
    placed_t: float | None = None  # when the latest of its host -> device copies was seen done
    ahead: bool = False  # a read-ahead: its pages' blocks are not known yet (block id -1: not to be placed)
    slab_wait_s: float = 0.0  # time after its first slab that a batch of it waited for one
    slab_wait_since: float | None = None  # when its current wait for a slab began (None: not waiting)

    def fail(self, cause: Cause, detail: str) -> None:
        """Mark the job failed (the first failure wins)."""
        if not self.failed:
            self.cause = cause
            self.failed = f"{cause.value}: {detail}"


def _in_place(job: LoadJob) -> bool:
    """Whether every batch of ``job`` landed and its copy into the KV cache ran (a batch's slab goes back only once
    its copy ran, so a batch without one asks its copy's event nothing: the driver asks this every pass)."""
    return all(ch.applied and (ch.buf is None or ch.copied is None or ch.copied.query()) for ch in job.chunks)


class RestorePipeline:
    """Jobs in flight; :meth:`poll` advances them and returns the finished ones (``job.failed`` '' on success)."""

    def __init__(self, sink: PageSink, pool: StagingPool, page_bytes: dict[int, int], counters: Counters, *,
                 timeout_s: float, audit: PageAudit | None = None,
                 discard_corrupt: bool = False, ledger: SaveLedger | None = None,
                 max_inflight: int | None = None) -> None:
        self.sink = sink
        self.pool = pool
        self.page_bytes = page_bytes
        self.counters = counters
        self.timeout_s = timeout_s
        self.audit = audit
        self.discard_corrupt = discard_corrupt  # drop pages failing verification (our own copies) from the store
        self.ledger = ledger  # this worker's recent save outcomes: tells an eviction from a save never committed
        self.max_inflight = max_inflight  # batches holding a slab at once (None: as many as there are slabs)
        self.jobs: list[LoadJob] = []
        self.landed_t = 0.0  # when any batch last landed: a restore queued behind others waits while they move
        self._lock = threading.RLock()  # the caller's start/poll and the driver thread
        self._wake = threading.Event()  # set when a batch lands
        self.wants_staging = False  # a batch waits for a free slab (its last feed found none)
        self._driver: threading.Thread | None = None
        # the driver's last pass left a restore in place or failed: a poll that finds the driver holding the pipeline
        # waits for that pass instead of leaving the restore to the engine's next step (read without the lock)
        self._finishable = False
        self._stopping = False
        # the caller's start / read_ahead / drop_read_ahead while the driver runs, applied by it in order
        self._inbox: deque[tuple[Callable[..., None], tuple[Any, ...]]] = deque()
        self.ahead_max_bytes = 0  # staging that read-aheads may hold (0: read_ahead is a no-op)
        self.ahead_ttl_s = max(timeout_s, 1.0)  # a read-ahead whose restore has not started by then is dropped
        self._ahead: dict[str, LoadJob] = {}  # request id -> its read-ahead (also in self.jobs)

    def start(self, job: LoadJob, store: Store | None) -> None:
        """Track ``job`` and submit its first batches (a job already ``failed`` just finishes at a coming poll); a
        read-ahead of its request becomes the job: what it read is only copied into place. With the driver running,
        the driver does it (:meth:`_call`)."""
        self._call(self._start, job, store)

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        """Apply one of the caller's calls: now, under the lock, without a driver; else queued for the driver's next
        pass, which it wakes (the caller returns at once)."""
        if self._driver is None:
            with self._lock:
                fn(*args)
            return
        self._inbox.append((fn, args))
        self._wake.set()

    def _take_inbox(self) -> None:
        """Apply the caller's queued calls, oldest first (under the lock)."""
        while self._inbox:
            fn, args = self._inbox.popleft()
            try:
                fn(*args)
            except Exception as exc:  # one bad call must not keep the ones after it from their restores
                log.exception("ADP KV: the restore driver failed to apply %s", getattr(fn, "__name__", fn))
                if fn == self._start:  # the restore fails (the request recomputes) rather than waiting forever
                    job = args[0]
                    job.fail(_exception_cause(exc), f"starting the restore: {type(exc).__name__}: {exc}")
                    if not any(j is job for j in self.jobs):
                        self.jobs.append(job)

    def _start(self, job: LoadJob, store: Store | None) -> None:
        ahead = self._ahead.pop(job.req_id, None)
        if ahead is not None:
            if job.failed or store is None or not job.pages:
                self._drop_ahead(ahead, "unused")
            else:
                self._attach(ahead, job, store)
                return
        self.jobs.append(job)
        if job.failed:
            return
        if store is None:
            job.fail(Cause.TARGET_UNREACHABLE, "no page store (target unreachable or I/O helper restarting)")
            return
        if not job.pages:
            job.fail(Cause.NOT_PLANNED, "nothing restorable was planned")
            return
        self._add_chunks(job, range(len(job.pages)))
        # every page of the restore at once, ahead of the saves that follow: its later chunks wait for slabs,
        # and on a full card those saves would evict exactly the oldest pages, the ones a restore reads
        store.note_reading([k for _, _, k in job.pages])
        self._feed(store)

    def _add_chunks(self, job: LoadJob, idxs: range) -> None:
        """Split pages ``idxs`` of ``job`` into slab-sized batches, per group."""
        by_group: dict[int, list[int]] = defaultdict(list)
        for i in idxs:
            by_group[job.pages[i][0]].append(i)
        for gid, mine in by_group.items():
            per = max(1, self.pool.slab_bytes // self.page_bytes[gid])
            job.chunks.extend(LoadChunk(gid, mine[s0:s0 + per]) for s0 in range(0, len(mine), per))

    def read_ahead(self, req_id: str, pages: list[tuple[int, bytes]], store: Store | None) -> None:
        """Read ``pages`` ((group, key)) of ``req_id``'s coming restore into staging now, within
        ``ahead_max_bytes`` (its restore, :meth:`start`, then copies them into place); dropped after ``ahead_ttl_s``
        or by :meth:`drop_read_ahead`. With the driver running, the driver does it (:meth:`_call`)."""
        if self.ahead_max_bytes <= 0 or store is None or not pages:
            return
        self._call(self._read_ahead, req_id, pages, store)

    def _read_ahead(self, req_id: str, pages: list[tuple[int, bytes]], store: Store) -> None:
        if req_id in self._ahead or any(j.req_id == req_id for j in self.jobs):
            return
        job = LoadJob(req_id, [(gid, -1, key) for gid, key in pages], [], _now(), ahead=True)
        self._add_chunks(job, range(len(job.pages)))
        self.jobs.append(job)
        self._ahead[req_id] = job
        self.counters.add(read_ahead_pages=len(pages))
        store.note_reading([k for _, k in pages])
        self._feed(store)

    def drop_read_ahead(self, req_id: str) -> None:
        """Forget ``req_id``'s read-ahead (its request finished or will not restore); its slabs go back."""
        self._call(self._drop_read_ahead, req_id)

    def _drop_read_ahead(self, req_id: str) -> None:
        ahead = self._ahead.pop(req_id, None)
        if ahead is not None:
            self._drop_ahead(ahead, "unused")

    def _drop_ahead(self, ahead: LoadJob, why: str) -> None:
        """Release a read-ahead no restore will use (``why``: the counter's suffix)."""
        self._ahead.pop(ahead.req_id, None)
        if ahead in self.jobs:
            self.jobs.remove(ahead)
        self.counters.add(**{f"read_ahead_{why}_pages": len(ahead.pages)})
        self.release(ahead)

    def _attach(self, ahead: LoadJob, job: LoadJob, store: Store) -> None:
        """Make ``job`` the owner of ``ahead``'s batches: the pages it needs get their blocks, batches holding none
        of them go back, and pages it needs that were not read ahead get batches of their own."""
        where = {(gid, key): i for i, (gid, _, key) in enumerate(ahead.pages)}
        pages = list(ahead.pages)  # block id -1: read ahead, not needed
        extra: list[PageRef] = []
        for gid, bid, key in job.pages:
            i = where.get((gid, key))
            if i is None or pages[i][1] >= 0:  # not read ahead, or a second block of the same page: read it
                extra.append((gid, bid, key))
            else:
                pages[i] = (gid, bid, key)
        keep, unused = [], []
        for ch in ahead.chunks:
            (keep if any(pages[i][1] >= 0 for i in ch.idxs) else unused).append(ch)
        ahead.chunks = unused
        self.release(ahead)  # slabs of batches holding no needed page
        job.pages = pages + extra
        job.chunks = keep
        self._add_chunks(job, range(len(pages), len(job.pages)))
        job.first_slab_t = ahead.first_slab_t  # waits before the restore started are not its own
        job.slab_wait_since = None if ahead.slab_wait_since is None else max(ahead.slab_wait_since, job.t0)
        used = len(job.pages) - len(extra) - sum(1 for p in pages if p[1] < 0)
        self.counters.add(read_ahead_used_pages=used, read_ahead_unused_pages=len(ahead.pages) - used)
        self.jobs[self.jobs.index(ahead)] = job  # its place in the queue: older than the restores started since
        if extra:
            store.note_reading([k for _, _, k in extra])
        self._feed(store)
        self._wake.set()  # batches that landed meanwhile are copied into place now

    def run_driver(self, store_of: Callable[[], Store | None],
                   on_start: Callable[[], None] | None = None) -> None:
        """Move landed batches into the KV cache in a thread of their own (``store_of``: the current store;
        ``on_start``: run first in that thread, e.g. to select the KV cache's GPU)."""
        if self._driver is not None:
            return
        self._stopping = False
        self.pool.on_give = self._slab_returned  # a slab a save gives back feeds a waiting restore at once
        self._driver = threading.Thread(target=self._drive, args=(store_of, on_start), name="adpkv-restore",
                                        daemon=True)
        self._driver.start()

    def stop_driver(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._driver is not None:
            self._driver.join(timeout)
            self._driver = None
        with self._lock:  # what the driver had not taken yet, so no restore is left unstarted
            self._take_inbox()

    def _drive(self, store_of: Callable[[], Store | None], on_start: Callable[[], None] | None) -> None:
        if on_start is not None:
            on_start()
        while not self._stopping:
            with self._lock:
                copying = any(ch.copied is not None and ch.buf is not None for job in self.jobs for ch in job.chunks)
            self._wake.wait(DRIVER_COPY_WAIT_S if copying else DRIVER_IDLE_WAIT_S)
            self._wake.clear()
            try:
                with self._lock:
                    self._take_inbox()
                    if self.jobs:
                        self._move(store_of(), _now())
                        self._finishable = any(not job.ahead and (job.failed or _in_place(job)) for job in self.jobs)
            except Exception:  # never leave restores without a mover: the caller's poll still runs
                log.exception("ADP KV: the restore driver failed a pass")

    def inflight(self) -> int:
        """Batches holding a staging slab (submitted and not yet copied out), less a read-ahead's landed ones: they
        wait for their restore, not for the I/O."""
        return sum(ch.buf is not None and not (job.ahead and ch.handle is not None and ch.handle.done())
                   for job in self.jobs for ch in job.chunks)

    def _feed(self, store: Store) -> None:
        """Submit waiting batches, oldest job first, while a slab is free and fewer than ``max_inflight`` are in
        flight (a temporary buffer only if no slab can ever be); a job never overtakes an older one. Read-aheads
        come after every restore, only with slabs none of them waits for, within ``ahead_max_bytes``."""
        room = None if self.max_inflight is None else self.max_inflight - self.inflight()
        self.wants_staging = False
        restores = [j for j in self.jobs if not j.ahead]
        if not self._feed_jobs(store, restores, room, None):
            return
        if self._ahead:
            room = None if self.max_inflight is None else self.max_inflight - self.inflight()
            held = sum(len(ch.idxs) * self.page_bytes[ch.gid] for j in self._ahead.values() for ch in j.chunks
                       if ch.buf is not None)
            self._feed_jobs(store, [j for j in self.jobs if j.ahead], room, self.ahead_max_bytes - held)

    def _feed_jobs(self, store: Store, jobs: list[LoadJob], room: int | None, budget: int | None) -> bool:
        """Give ``jobs``' waiting batches slabs in order (``budget``: bytes of slabs they may still take; None:
        restores, whose wait for a slab holds waiting saves back); False once one found no room."""
        for job in jobs:
            for ch in job.chunks:
                if job.failed:
                    break
                if ch.handle is not None:
                    continue
                if room is not None and room <= 0:
                    return False
                pb = self.page_bytes[ch.gid]
                n = len(ch.idxs)
                if budget is not None and n * pb > budget:
                    return False
                buf = self.pool.take(n * pb, temporary=self.pool.max_slabs == 0 and budget is None)
                now = _now()
                if buf is None:
                    if budget is None:
                        self.wants_staging = True  # saves waiting for staging hold back (SavePipeline.drain)
                    if job.first_slab_t is not None and job.slab_wait_since is None:
                        job.slab_wait_since = now
                    return False
                if budget is not None:
                    budget -= n * pb
                ch.buf = buf
                job.progress_t = now  # its batch got a slab: the wait for one ended
                if job.first_slab_t is None:
                    job.first_slab_t = now
                if job.slab_wait_since is not None:
                    job.slab_wait_s += now - job.slab_wait_since
                    job.slab_wait_since = None
                if room is not None:
                    room -= 1
                rows = buf[:n * pb].view(n, pb)
                try:
                    ch.handle = store.load_batch([job.pages[i][2] for i in ch.idxs],
                                                 [rows[j].numpy() for j in range(n)])
                except Exception as exc:
                    job.fail(_exception_cause(exc), f"submitting a batch: {type(exc).__name__}: {exc}")
                    continue
                if self._driver is not None:
                    ch.handle.add_done_callback(self._landed)
        return True

    def _landed(self, _handle: Any) -> None:
        self._wake.set()

    def _slab_returned(self) -> None:
        if self.wants_staging:
            self._wake.set()

    def poll(self, store: Store | None) -> list[LoadJob]:
        """Copy landed chunks into the KV cache and feed free slabs (unless the driver thread does), return (and
        release) the finished jobs. While the driver holds the pipeline (moving batches) the poll does not wait for
        it (GPU run 26: the engine thread waited 1.8 s of an 8-agent point here) unless the driver's last pass left a
        restore finished: then it waits for that pass, so the restore is not left to the engine's next step."""
        if not self._lock.acquire(blocking=self._driver is None):
            if not self._finishable:
                return []
            self._lock.acquire()  # one of the driver's passes, not an engine step: the restore is done
        try:
            now = _now()
            if self._driver is None:
                self._move(store, now)
            return self._finish(now)
        finally:
            self._lock.release()

    def _move(self, store: Store | None, now: float) -> None:
        """Copy landed chunks into the KV cache, give copied-out slabs back, feed the free ones (read-aheads keep
        theirs until their restore starts, or are dropped once ``ahead_ttl_s`` old or failed)."""
        for ahead in list(self._ahead.values()):
            if ahead.failed or now - ahead.t0 > self.ahead_ttl_s:
                self._drop_ahead(ahead, "expired")
        for job in self.jobs:
            if job.ahead:  # landed batches wait for the restore's blocks
                continue
            for ch in job.chunks:
                if job.failed:
                    break
                if not ch.applied and ch.handle is not None and ch.handle.done():
                    self._apply_chunk(job, ch, store)
                    ch.applied = True
                    job.progress_t = job.landed_t = self.landed_t = now
                if ch.applied and ch.buf is not None and (ch.copied is None or ch.copied.query()):
                    self.pool.give(ch.buf)  # in place: the slab takes the next batch
                    ch.buf = None
                    job.placed_t = now
            if not job.failed and store is None and any(ch.handle is None for ch in job.chunks):
                job.fail(Cause.TARGET_UNREACHABLE, "the page store went away during the restore")
        for job in self.jobs:  # a failed job's slabs go back before the free ones are handed out
            if job.failed and job.chunks:
                self.release(job)
        if store is not None:
            self._feed(store)

    def _finish(self, now: float) -> list[LoadJob]:
        """Finish the jobs whose pages are all in place (or that failed or timed out); return them."""
        done: list[LoadJob] = []
        keep: list[LoadJob] = []
        for job in self.jobs:
            if job.ahead:
                keep.append(job)
                continue
            if not job.failed and not _in_place(job):
                # Timeouts measure a lack of progress, not the length of the queue: a batch in flight must land
                # within timeout_s of the job's last progress (a batch of it given a slab or landed, else its
                # start), and a job waiting for slabs behind older restores waits while batches land somewhere.
                last = max(job.t0, job.progress_t)
                flying = any(ch.handle is not None and not ch.applied for ch in job.chunks)
                if now - (last if flying else max(last, self.landed_t)) < self.timeout_s:
                    keep.append(job)
                    continue
                waiting = sum(ch.handle is None for ch in job.chunks)
                if flying:
                    job.fail(Cause.TIMED_OUT, f"{sum(not ch.applied for ch in job.chunks)}/{len(job.chunks)} "
                             f"batch(es) not landed, none for {self.timeout_s} s ({now - job.t0:.1f} s since the "
                             f"restore started)")
                else:
                    ahead = sum(1 for j in self.jobs if j.t0 < job.t0 and not j.failed)
                    job.fail(Cause.NO_STAGING, f"{waiting}/{len(job.chunks)} batch(es) still waiting for a staging "
                             f"slab, no restore landed for {self.timeout_s} s, behind {ahead} older restore(s) "
                             f"(raise staging_mb or load_timeout_s)")
            if not job.failed:
                for gid, bid in job.zero:
                    self.sink.zero(gid, bid)
            self.release(job)
            if job.failed:
                self.counters.add(**{"load_fallbacks": 1, failure_counter(job.cause or Cause.IO_ERROR): 1})
            else:
                self.counters.add(loads_ok=1)
            took = _now() - job.t0
            self.counters.add(loads=1, load_s=took)
            if not job.failed:
                self.counters.observe(restore_seconds=took,
                                      restore_bytes=sum(self.page_bytes.get(gid, 0) for gid, _, _ in job.pages))
                phases = restore_phases(job, job.t0 + took)
                self.counters.add(**{PHASE_COUNTER_PREFIX + k: v for k, v in phases.items()})
            done.append(job)
        self.jobs = keep
        self._finishable = False  # what is left was not in place just now; the driver's next pass tells
        return done

    def release(self, job: LoadJob) -> None:
        """Return a finished job's slabs to the pool; a slab the store may still write into (a failed or timed-out
        restore) returns when that batch completes (a batch always completes: the device or the helper times out)."""
        pool = self.pool
        for ch in job.chunks:
            if ch.buf is None:
                continue
            if ch.copied is not None:  # a failed or timed-out job: its queued copies still read the slab
                ch.copied.synchronize()
            if ch.handle is None or ch.handle.done():
                pool.give(ch.buf)
            else:
                ch.handle.add_done_callback(lambda _h, buf=ch.buf: pool.give(buf))
            ch.buf = None
        job.chunks = []

    def _apply_chunk(self, job: LoadJob, ch: LoadChunk, store: Store | None) -> None:
        """Check one landed chunk and copy it into the KV cache (or fail the job, naming the cause)."""
        try:
            res = ch.handle.wait(0)
        except Exception as exc:
            job.fail(_exception_cause(exc), f"{type(exc).__name__}: {exc}")
            return
        rows = [j for j, i in enumerate(ch.idxs) if job.pages[i][1] >= 0]  # a read-ahead may hold pages not needed
        if len(rows) < len(ch.idxs):
            res = [res[j] for j in rows]
        bad_keys = [r.key for r in res if r.status is PageStatus.VERIFY_FAILED]
        if bad_keys:
            self.counters.add(verify_failures=len(bad_keys))
            if store is not None and self.discard_corrupt:
                try:  # drop them (our own partition's copies) so the recompute can write good ones
                    store.discard(bad_keys)
                except Exception as exc:
                    log.warning("ADP KV: discarding %d corrupt page(s) failed: %s", len(bad_keys), exc)
        bad = [r for r in res if r.status is not PageStatus.OK]
        job.lost.extend(bytes(r.key) for r in bad if r.status in (PageStatus.MISSING, PageStatus.VERIFY_FAILED))
        if bad:
            causes = [self.classify(r) for r in bad]
            first_cause, first_detail = causes[0]
            by_cause: dict[str, int] = defaultdict(int)
            for c, _ in causes:
                by_cause[c.value] += 1
            mix = "" if len(by_cause) == 1 else " [" + ", ".join(f"{c} {n}" for c, n in by_cause.items()) + "]"
            job.fail(first_cause, f"{len(bad)}/{len(res)} page(s) not restored{mix} (first: {bad[0].status.value}: "
                     f"{first_detail})")
            return
        pb = self.page_bytes[ch.gid]
        assert ch.buf is not None
        for j0, j1 in _runs(rows):  # each run of consecutive needed rows is one contiguous slice of the slab
            bids = [job.pages[ch.idxs[j]][1] for j in range(j0, j1)]
            # on one stream, in order: the last copy's event marks them all
            ch.copied = self.sink.scatter(ch.gid, bids, ch.buf[j0 * pb:j1 * pb].view(j1 - j0, pb))
        if self.audit is not None:
            if ch.copied is not None:
                ch.copied.synchronize()
            placed = [job.pages[ch.idxs[j]] for j in rows]
            self.audit.record("load", ch.gid, [k for _, _, k in placed],
                              self.sink.gather(ch.gid, [b for _, b, _ in placed]))
        self.counters.add(pages_loaded=len(res), bytes_loaded=sum(r.nbytes for r in res))

    def classify(self, r: Any) -> tuple[Cause, str]:
        """The cause of one page that was not restored, and a detail that is never empty."""
        detail = r.detail or ""
        if r.status is PageStatus.VERIFY_FAILED:
            return Cause.VERIFY_FAILED, detail or "checksum mismatch"
        if r.status is PageStatus.MISSING:
            if detail.startswith("stale index entry"):
                return Cause.REPLACED, detail
            seen = self.ledger.get(bytes(r.key)) if self.ledger is not None else None
            if seen is not None:
                outcome, age = seen
                if outcome == "committed":
                    return Cause.EVICTED, (f"committed by this worker {age:.1f} s ago, no longer in its store's "
                                           "index (evicted or discarded)" + (f"; {detail}" if detail else ""))
                return Cause.NEVER_COMMITTED, f"this worker's save of it {outcome} {age:.1f} s ago"
            return Cause.NOT_INDEXED, detail or ("not in the loading store's index (another writer's page, evicted "
                                                 "since the scheduler's lookup, or not refreshed yet)")
        if detail.startswith("store process"):
            return Cause.HELPER_LOST, detail
        return Cause.IO_ERROR, detail or f"status {r.status.value}"


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """Sorted row numbers as half-open runs of consecutive ones: [0, 1, 2, 5] -> [(0, 3), (5, 6)]."""
    out: list[tuple[int, int]] = []
    for r in rows:
        if out and out[-1][1] == r:
            out[-1] = (out[-1][0], r + 1)
        else:
            out.append((r, r + 1))
    return out


def restore_phases(job: LoadJob, end: float) -> dict[str, float]:
    """Seconds of a finished restore in each of :data:`RESTORE_PHASES` (all but ``slab_wait``, which is part of
    ``io``, add up to its time from ``job.t0`` to ``end``)."""
    def at(t: float | None, floor: float) -> float:
        return max(floor, min(floor if t is None else t, end))

    first = at(job.first_slab_t, job.t0) if job.first_slab_t is not None else end
    landed = at(job.landed_t, first)
    placed = at(job.placed_t, landed)
    return {"queued": first - job.t0, "io": landed - first, "copy": placed - landed, "step_wait": end - placed,
            "slab_wait": job.slab_wait_s}


def _exception_cause(exc: BaseException) -> Cause:
    """A batch that raised: a lost I/O helper, or the store refusing it."""
    return Cause.HELPER_LOST if type(exc).__name__ == "StoreProcessError" else Cause.SUBMIT_FAILED
