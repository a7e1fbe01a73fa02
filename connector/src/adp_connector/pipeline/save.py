"""The save pipeline: pages gathered from the KV cache into staging slabs, handed to a store's writer.

Saves are staged in the step that computed the blocks, so the engine may free and reuse a block right after: on a
GPU the gather is queued on the compute stream (before any later step's kernels) and the device -> host copy on a
side stream, and a submitter thread starts the store batch when the copy has landed. Staged bytes in flight are
capped (``max_pending_bytes``). Beyond it, or with no free slab where one is required, a save waits: its pages are
copied (gathered) on the KV cache's device at once, so the engine may still reuse the blocks, and they are staged
from that copy, oldest first, when room comes back (:meth:`SavePipeline.drain`, called every engine step). Those
copies are bounded too (``max_spill_bytes``); only a save that finds no room there either is dropped (counted).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..store.api import Store
from ..store.results import PageStatus
from .audit import PageAudit
from .counters import Counters
from .pages import PagedKV
from .staging import StagingPool

log = logging.getLogger("vllm.adp_kv.save")

PageRef = tuple[int, int, bytes]  # (group id, block id, page key)
# GPU memory of earlier steps' gathered save pages waiting for their device -> host copy. The current step's copies
# are never waited for: they start only once its forward has run, so a wait for them held the engine thread until
# the GPU finished the step and vLLM's asynchronous scheduling lost its overlap (GPU run 26: 9.1 s of the engine
# thread's 36.7 s at 8 agents in wait_for_save, on that wait). A step's own gathers are bounded by what it computed.
D2H_INFLIGHT_BYTES = 1 << 30
# A step's pages of one group are gathered on the GPU at once, up to this much, then copied out slab by slab.
# Gathering slab by slab launched 2-3 kernels per layer per 64 MiB: thousands per long prefill step, which filled
# CUDA's launch queue, so the engine thread blocked in wait_for_save until the step's forward had drained
# (GPU run 8: 78 s of the engine thread's samples on that line in a 341 s agents arm).
GATHER_MAX_BYTES = 512 << 20
DROP_COUNTER_PREFIX = "save_dropped_"  # pages of saves not attempted, by cause (exported with a cause label)
DROP_CAUSES = {
    "pending_cap": "max_pending_save_mb of saves already in flight, and save_spill_mb of saves waiting",
    "no_staging": "no free staging slab (staging_mb, shared with restores), and save_spill_mb of saves waiting",
    "no_store": "no page store (target unreachable or I/O helper restarting)",
    "closed": "the connector closed while the save waited for staging",
}


@dataclass(slots=True)
class _Waiting:
    """A save waiting for staging: its pages copied on the KV cache's device (``pages``, complete at ``ready``)."""

    store: Store
    gid: int
    refs: list[PageRef]
    pb: int
    origin: dict[bytes, bytes]
    pages: torch.Tensor
    ready: Any

    @property
    def nbytes(self) -> int:
        return len(self.refs) * self.pb


class SaveLedger:
    """The latest save outcome of recent keys ("committed", "dropped ...", "failed ..."), bounded, thread-safe:
    lets a restore that finds a page missing tell an eviction from a save that never committed."""

    def __init__(self, max_keys: int = 1 << 18) -> None:
        self.max_keys = max_keys
        self._lock = threading.Lock()
        self._seen: OrderedDict[bytes, tuple[str, float]] = OrderedDict()

    def record(self, keys: list[bytes], outcome: str) -> None:
        now = time.monotonic()
        with self._lock:
            for k in keys:
                self._seen[k] = (outcome, now)
                self._seen.move_to_end(k)
            while len(self._seen) > self.max_keys:
                self._seen.popitem(last=False)

    def get(self, key: bytes) -> tuple[str, float] | None:
        """(outcome, seconds ago) of ``key``'s latest save here, or None if not seen (or forgotten)."""
        with self._lock:
            got = self._seen.get(key)
        return None if got is None else (got[0], time.monotonic() - got[1])


class SavePipeline:
    """Stage and submit saves; ``failed_keys`` collects the keys whose save failed (by their origin key)."""

    def __init__(self, kv: PagedKV, pool: StagingPool, counters: Counters, *, max_pending_bytes: int,
                 slab_required: bool, audit: PageAudit | None = None, step_gather: bool | None = None,
                 max_spill_bytes: int = 0, yield_staging: Callable[[], bool] | None = None) -> None:
        self.kv = kv
        self.pool = pool
        self.counters = counters
        self.max_pending_bytes = max_pending_bytes
        self.max_spill_bytes = max_spill_bytes  # device copies of saves waiting for staging (0: drop at once)
        self.spill_bytes = 0
        self._waiting: deque[_Waiting] = deque()  # oldest first (under _wait_lock)
        self._wait_cause = "no_staging"  # why the oldest waiting save could not be staged
        self._wait_lock = threading.Lock()  # the engine thread drains; close() may drain from another
        self.yield_staging = yield_staging  # True while restores wait for a slab: waiting saves let them go first
        self.slab_required = slab_required  # an I/O helper reads only the shared arena: no temporary buffers
        self.step_gather = step_gather  # gather a step's pages at once (None: on a GPU, where launches cost)
        self.audit = audit
        self.pending_bytes = 0  # staged save bytes not yet written (or failed)
        self.handles: set[Any] = set()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()  # staged slabs -> the submitter thread
        self._submitter: threading.Thread | None = None
        self._d2h_stream: Any = None
        self._d2h_inflight: deque[tuple[Any, int, int]] = deque()  # (copy event, bytes, step) of copies queued
        self._step = 0  # the engine step whose saves are being staged (:meth:`new_step`)
        self._lock = threading.Lock()
        self._failed_keys: list[bytes] = []
        self._declined_keys: list[bytes] = []  # pages a full card did not admit (by the scheduler's key)
        self._origin: dict[bytes, bytes] = {}  # this rank's key -> the scheduler's, while saving
        self.ledger = SaveLedger()

    def new_step(self) -> None:
        """The engine's next step begins saving: copies queued so far belong to earlier steps."""
        self._step += 1

    def save(self, store: Store, gid: int, refs: list[PageRef], origin: dict[bytes, bytes]) -> None:
        """Save ``refs`` (one group) in slab-sized batches; ``origin`` maps keys to the name failures report."""
        pb = self.kv.page_bytes(gid)
        per = max(1, self.pool.slab_bytes // pb)
        together = self.kv.device(gid).type == "cuda" if self.step_gather is None else self.step_gather
        span = max(per, GATHER_MAX_BYTES // pb // per * per) if together else per
        for g0 in range(0, len(refs), span):
            part = refs[g0:g0 + span]
            gathered = None
            if together and len(part) > per:  # several slabs: one gather, each slab copies its rows out
                self._bound_d2h()
                try:
                    gathered = self.kv.gather_on_device(gid, [b for _, b, _ in part])
                except Exception as exc:  # each chunk gathers (and reports) on its own then
                    log.warning("ADP KV: gathering %d save pages failed: %s", len(part), exc)
            for s0 in range(0, len(part), per):
                self._save_chunk(store, gid, part[s0:s0 + per], pb, origin,
                                 None if gathered is None else gathered[s0:s0 + per])

    def take_declined_keys(self) -> list[bytes]:
        """Keys (the scheduler's) of pages a full card declined since the last call."""
        with self._lock:
            keys, self._declined_keys = self._declined_keys, []
        return keys

    def take_failed_keys(self) -> list[bytes]:
        with self._lock:
            keys, self._failed_keys = self._failed_keys, []
        return keys

    def _save_chunk(self, store: Store, gid: int, refs: list[PageRef], pb: int, origin: dict[bytes, bytes],
                    gathered: torch.Tensor | None = None) -> None:
        """Stage up to one slab of pages and queue them for the store (the slab returns to the pool when written);
        with no room, the save waits behind the others (or is dropped when their copies are at their bound)."""
        if self._waiting:
            self.drain()  # room may have come back since the last step
        cause = self._wait_cause if self._waiting else self._try_stage(store, gid, refs, pb, origin, gathered)
        if cause is not None:
            self._wait_or_drop(store, gid, refs, pb, origin, gathered, cause)

    def _try_stage(self, store: Store, gid: int, refs: list[PageRef], pb: int, origin: dict[bytes, bytes],
                   gathered: torch.Tensor | None, ready: Any = None) -> str | None:
        """Stage ``refs`` and queue them for the store; the drop cause if there is no room now (nothing taken)."""
        nbytes = len(refs) * pb
        with self._lock:  # a save larger than the cap goes alone, so that a waiting one always gets its turn
            room = self.pending_bytes + nbytes <= self.max_pending_bytes or (
                self.pending_bytes == 0 and self.max_pending_bytes > 0)
            if room:
                self.pending_bytes += nbytes
        if not room:
            self._wait_cause = "pending_cap"
            return self._wait_cause
        buf = self.pool.take(nbytes, temporary=not self.slab_required or self.pool.max_slabs == 0)
        if buf is None:
            with self._lock:
                self.pending_bytes -= nbytes
            self._wait_cause = "no_staging"
            return self._wait_cause
        stage = buf[:nbytes].view(len(refs), pb)
        try:
            copied = self._stage(gid, [b for _, b, _ in refs], stage, gathered, ready)
        except Exception as exc:
            log.warning("ADP KV: staging a save failed: %s", exc)
            self._failed(refs, buf, nbytes, origin)
            return None
        mine = {k: origin[k] for _, _, k in refs if k in origin}
        if self._submitter is None:
            self._submitter = threading.Thread(target=self._submit_loop, name="adpkv-save-submit", daemon=True)
            self._submitter.start()
        self._queue.put((copied, store, gid, refs, stage, buf, nbytes, mine))
        return None

    def _wait_or_drop(self, store: Store, gid: int, refs: list[PageRef], pb: int, origin: dict[bytes, bytes],
                      gathered: torch.Tensor | None, cause: str) -> None:
        """Copy the pages on their device and queue the save for :meth:`drain`, within ``max_spill_bytes``."""
        nbytes = len(refs) * pb
        if self.spill_bytes + nbytes > self.max_spill_bytes:
            self._dropped(refs, origin, cause)
            return
        try:
            pages = gathered if gathered is not None else self.kv.gather_on_device(gid, [b for _, b, _ in refs])
        except Exception as exc:
            log.warning("ADP KV: copying %d save pages to wait for staging failed: %s", len(refs), exc)
            self._dropped(refs, origin, cause)
            return
        ready = None
        if pages.device.type == "cuda":  # the copy is queued on the compute stream: staging waits for this event
            ready = torch.cuda.Event()
            ready.record()
        with self._wait_lock:
            self._waiting.append(_Waiting(store, gid, refs, pb, origin, pages, ready))
            self.spill_bytes += nbytes
        self.counters.add(saves_waited=len(refs))

    def drain(self) -> int:
        """Stage waiting saves, oldest first, while there is room and no restore waits for a slab (engine thread,
        every step); pages staged."""
        staged = 0
        if self.yield_staging is not None and self.yield_staging():
            return staged
        with self._wait_lock:
            while self._waiting:
                w = self._waiting[0]
                if self._try_stage(w.store, w.gid, w.refs, w.pb, w.origin, w.pages, w.ready) is not None:
                    break
                self._waiting.popleft()
                self.spill_bytes -= w.nbytes
                staged += len(w.refs)
        return staged

    @property
    def waiting_pages(self) -> int:
        """Pages of saves waiting for staging."""
        with self._wait_lock:
            return sum(len(w.refs) for w in self._waiting)

    def _bound_d2h(self) -> None:
        """Wait while more than D2H_INFLIGHT_BYTES of earlier steps' gathered pages wait for their device -> host
        copy (saves outrunning PCIe); this step's copies are not waited for."""
        while True:
            with self._lock:
                while self._d2h_inflight and self._d2h_inflight[0][0].query():
                    self._d2h_inflight.popleft()
                earlier = sum(n for _, n, step in self._d2h_inflight if step < self._step)
                if earlier <= D2H_INFLIGHT_BYTES:
                    break
                oldest = self._d2h_inflight[0][0]  # queued in step order: an earlier step's
            oldest.synchronize()

    def _stage(self, gid: int, block_ids: list[int], out: torch.Tensor, gathered: torch.Tensor | None = None,
               ready: Any = None) -> Any:
        """Copy the pages into ``out``; on a GPU asynchronously (returns the CUDA event that marks the copy done).
        ``gathered``: the pages already gathered on the GPU (rows in ``block_ids`` order), complete once ``ready``
        (an event; None: once the work queued on the current stream so far has run)."""
        dev = self.kv.device(gid)
        if dev.type != "cuda":
            if gathered is None:
                self.kv.gather(gid, block_ids, out=out)
            else:
                out.copy_(gathered)
            return None
        if self._d2h_stream is None:
            self._d2h_stream = torch.cuda.Stream(device=dev)
        if gathered is None:
            self._bound_d2h()
            gathered = self.kv.gather_on_device(gid, block_ids)  # queued on the compute stream, after the forward
        compute_done = ready
        if compute_done is None:
            compute_done = torch.cuda.Event()
            compute_done.record()
        side = self._d2h_stream
        with torch.cuda.stream(side):
            side.wait_event(compute_done)
            out.copy_(gathered, non_blocking=True)
            gathered.record_stream(side)  # the allocator keeps it until the copy has run
            copied = torch.cuda.Event(blocking=True)  # the submitter thread sleeps on it instead of spinning
            copied.record(side)
        with self._lock:
            self._d2h_inflight.append((copied, out.numel(), self._step))
        return copied

    def _submit_loop(self) -> None:
        """Submitter thread: wait for each staged slab's copy, then start its store batch."""
        while True:
            item = self._queue.get()
            if item is None:
                return
            ready, store, gid, refs, stage, buf, nbytes, origin = item
            try:
                if ready is not None:
                    ready.synchronize()
                keys = [k for _, _, k in refs]
                if self.audit is not None:
                    self.audit.record("save", gid, keys, stage)
                t0 = time.monotonic()
                h = store.save_batch(keys, [stage[i].numpy() for i in range(len(refs))])
            except Exception as exc:
                log.warning("ADP KV: save failed: %s", exc)
                self._failed(refs, buf, nbytes, origin)
                continue
            with self._lock:
                self.handles.add(h)
                self._origin.update(origin)
            h.add_done_callback(lambda hh, buf=buf, nbytes=nbytes, t0=t0: self._done(hh, buf, nbytes, t0))

    def _dropped(self, refs: list[PageRef], origin: dict[bytes, bytes], cause: str) -> None:
        """A save not attempted: counted by cause, and reported like a failed one (a later request may save it)."""
        self.counters.add(**{"saves_dropped": len(refs), DROP_COUNTER_PREFIX + cause: len(refs)})
        keys = [k for _, _, k in refs]
        self.ledger.record(keys, f"was dropped ({DROP_CAUSES[cause]})")
        with self._lock:
            self._failed_keys.extend(origin.get(k, k) for k in keys)

    def _failed(self, refs: list[PageRef], buf: torch.Tensor, nbytes: int, origin: dict[bytes, bytes]) -> None:
        self.counters.add(save_errors=len(refs))
        keys = [k for _, _, k in refs]
        self.ledger.record(keys, "failed before reaching the store")
        with self._lock:
            self.pending_bytes -= nbytes
            self._failed_keys.extend(origin.get(k, k) for k in keys)
        self.pool.give(buf)

    def _done(self, h: Any, buf: torch.Tensor, nbytes: int, t0: float) -> None:
        try:
            res = h.wait(0)
        except Exception:
            res = []
        ok = [r for r in res if r.status is PageStatus.OK]
        declined = [r for r in res if r.status is PageStatus.NOT_ADMITTED]
        bad = [r for r in res if r.status not in (PageStatus.OK, PageStatus.EXISTS, PageStatus.NOT_ADMITTED)]
        self.ledger.record([bytes(r.key) for r in ok], "committed")
        self.ledger.record([bytes(r.key) for r in declined], "was not admitted (the card is full of pages asked for "
                           "at least as often)")
        for r in bad:
            self.ledger.record([bytes(r.key)], f"failed ({r.status.value}{': ' + r.detail if r.detail else ''})")
        took, nbytes_ok = time.monotonic() - t0, sum(r.nbytes for r in ok)
        self.counters.add(saves=1, pages_saved=len(ok), bytes_saved=nbytes_ok, save_s=took, save_errors=len(bad),
                          saves_not_admitted=len(declined))
        if ok:
            self.counters.observe(save_seconds=took, save_bytes=nbytes_ok)
        with self._lock:
            # reported by the scheduler's (rank 0) key, which is what it schedules saves by. Declined pages are not
            # failures: no request re-walks its local blocks for them (GPU run 20: ~30 GB of such copies declined
            # again); the scheduler only forgets it asked, so the next request that computes one asks again, which
            # counts for its admission (remembered for 10 s, about one round of 8 agents, a declined page could be
            # recomputed in the next round without being asked for again: a likely reason, not a measured one, why
            # GPU run 26 still declined pages after the first round)
            self._failed_keys.extend(self._origin.get(bytes(r.key), bytes(r.key)) for r in bad)
            self._declined_keys.extend(self._origin.get(bytes(r.key), bytes(r.key)) for r in declined)
            for r in res:
                self._origin.pop(bytes(r.key), None)
            self.pending_bytes -= nbytes
            self.handles.discard(h)
        self.pool.give(buf)

    def close(self, timeout: float = 30.0) -> None:
        """Let waiting, staged and in-flight saves finish (bounded by ``timeout``); what still waits is dropped."""
        deadline = time.monotonic() + timeout
        self.yield_staging = None  # restores have stopped: nothing to let go first
        while self.drain() or self._waiting:  # each slab written frees room for the next waiting save
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        with self._wait_lock:
            left, self._waiting, self.spill_bytes = list(self._waiting), deque(), 0
        for w in left:
            self._dropped(w.refs, w.origin, "closed")
        if self._submitter is not None:  # staged slabs still queued reach the store first
            self._queue.put(None)
            self._submitter.join(timeout)
        while True:
            with self._lock:
                pending = list(self.handles)
            if not pending or time.monotonic() > deadline:
                break
            for h in pending:
                try:
                    h.wait(max(0.0, deadline - time.monotonic()))
                except Exception:
                    pass
