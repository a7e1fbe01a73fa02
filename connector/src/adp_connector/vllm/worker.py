"""The worker side of the connector: KV registration, and the engine's hooks onto the save and restore pipelines.

One instance per GPU worker (TP/PP rank). Pages cross through staging slabs (:class:`~adp_connector.pipeline.
StagingPool`, carved from the I/O helper's shared arena with ``io_process``); the pipelines themselves are vLLM-free
(:mod:`adp_connector.pipeline`). This module maps the scheduler's metadata onto them: this rank's keys (TP > 1),
failures reported as ``failed_recving`` (or, vLLM 0.26, block ids and a worker-metadata note).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import defaultdict

import torch

from ..pipeline import (
    Cause,
    Counters,
    LoadJob,
    PageAudit,
    PagedKV,
    RestorePipeline,
    SavePipeline,
    StagingPool,
    failure_counter,
)
from ..pipeline.save import DROP_COUNTER_PREFIX
from ..store.process import SharedArena
from .backend import StoreLink
from .card_stats import CardStatsWatch
from .compat import KVConnectorTransferResults, state_page_view
from .config import ADPConfig
from .layouts import GroupLayout
from .metadata import ADPMetadata, ADPWorkerMetadata, PageRef
from .naming import PageNamer

log = logging.getLogger("vllm.adp_kv.connector")


def restore_inflight(cfg: ADPConfig) -> int:
    """Restore batches in flight at once: ``restore_batches``, else four per store batch the I/O can run concurrently
    (each helper process runs ``io_threads`` batches; 96 of 64 MiB with a 16-core GPU host's defaults), so the I/O
    never idles while restores leave the other staging slabs to saves."""
    if cfg.restore_batches is not None:
        return cfg.restore_batches
    helpers = max(cfg.load_processes, cfg.save_processes) if cfg.io_process else 1
    return 4 * helpers * max(1, cfg.io_threads)


class WorkerSide:
    """KV tensors as pages, staging, and the two pipelines of one worker-role connector."""

    def __init__(self, cfg: ADPConfig, layouts: list[GroupLayout], namer: PageNamer, link: StoreLink,
                 counters: Counters, *, num_blocks: int, slab_bytes: int, arena: SharedArena | None,
                 audit: PageAudit | None, legacy: bool) -> None:
        self.cfg = cfg
        self.layouts = layouts
        self.namer = namer
        self.link = link
        self.counters = counters
        self.num_blocks = num_blocks
        self.slab_bytes = slab_bytes
        self.arena = arena
        self.audit = audit
        self.legacy = legacy
        self.tp_rank = namer.tp_rank
        self.kv: PagedKV | None = None
        self.pool: StagingPool | None = None  # created with the KV caches (pinned when they are on a GPU)
        self.restores: RestorePipeline | None = None
        self.saves: SavePipeline | None = None
        self.card_stats: CardStatsWatch | None = None  # the writers' eviction counters, read in a thread
        self.disabled = ""
        self._unstarted: list[LoadJob] = []  # restores failed before any pipeline existed (cache disabled)
        self._lock = threading.Lock()
        self._failed_load_reqs: list[str] = []  # failed restores, reported by build_worker_meta
        self._load_error_blocks: set[int] = set()  # vLLM 0.26: get_block_ids_with_load_errors
        self._lost: list[bytes] = []  # scheduler keys the card did not serve (reported by build_worker_meta)
        self._origins: dict[str, dict[bytes, bytes]] = {}  # restore in flight -> this rank's key -> scheduler's

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Map every group's layers to their per-block byte slices (validated against the layout)."""
        rows_by_group: dict[int, list[tuple[str, torch.Tensor, int]]] = {}
        drafts_by_group: dict[int, list[torch.Tensor]] = {}
        try:
            for g in self.layouts:
                rows: list[tuple[str, torch.Tensor, int]] = []
                drafts: list[torch.Tensor] = []
                for la in g.layers:
                    t = kv_caches.get(la.name)
                    if t is None:
                        raise ValueError(f"layer {la.name} of group {g.group_id} was not registered")
                    if isinstance(t, (list, tuple)):
                        if not self.legacy:
                            raise ValueError(f"layer {la.name}: per-state tensor lists are vLLM 0.26's, not this "
                                             "release's")
                        t = state_page_view(la.name, t)  # vLLM 0.26: one tensor per state -> the raw page view
                    if t.shape[0] != self.num_blocks:
                        raise ValueError(f"layer {la.name}: dim 0 is {t.shape[0]}, expected {self.num_blocks} "
                                         "blocks (kernel-block split or K/V-first layout)")
                    per_block = t[0].numel() * t.element_size()
                    if la.persisted and per_block < la.page_bytes:
                        raise ValueError(f"layer {la.name}: {per_block} B per block < layout {la.page_bytes} B")
                    if la.persisted:
                        rows.append((la.name, t, la.page_bytes))
                    else:
                        drafts.append(t)
                rows_by_group[g.group_id] = rows
                drafts_by_group[g.group_id] = drafts
        except ValueError as exc:
            self.disabled = str(exc)
            log.error("ADP KV: cache disabled: %s", exc)
            return
        self.kv = PagedKV(rows_by_group, drafts_by_group, restore_priority=self.cfg.restore_stream_priority,
                          page_copy=self.cfg.page_copy)
        self.kv.prepare()
        biggest = max((g.page_bytes for g in self.layouts if g.persists), default=0)
        if not biggest:
            return
        devs = [rows[0][1].device for rows in rows_by_group.values() if rows]
        slab = max(biggest, self.slab_bytes // biggest * biggest)
        arena = torch.frombuffer(self.arena.map, dtype=torch.int8) if self.arena is not None else None
        self.pool = StagingPool(slab, self.cfg.staging_mb << 20, pinned=bool(devs) and devs[0].type == "cuda",
                                arena=arena)
        page_bytes = {g.group_id: g.page_bytes for g in self.layouts if g.persists}
        # With the I/O helper a buffer outside the shared arena would cross its socket: no temporary buffers
        # (a save with no slab waits, save_spill_mb).
        spill = save_spill_bytes(self.cfg, devs[0] if devs else torch.device("cpu"))
        free = torch.cuda.mem_get_info(devs[0])[0] if devs and devs[0].type == "cuda" else None
        log.info("ADP KV: saves that find no staging wait in up to %.1f GiB of copies on the KV cache's device "
                 "(save_spill_mb)%s", spill / (1 << 30),
                 "" if free is None else f"; {free / (1 << 30):.1f} GiB of it free")
        self.saves = SavePipeline(self.kv, self.pool, self.counters,
                                  max_pending_bytes=self.cfg.max_pending_save_mb << 20,
                                  slab_required=self.arena is not None, audit=self.audit, max_spill_bytes=spill)
        self.restores = RestorePipeline(self.kv, self.pool, page_bytes, self.counters,
                                        timeout_s=self.cfg.load_timeout_s, audit=self.audit,
                                        discard_corrupt=self.cfg.save, ledger=self.saves.ledger,
                                        max_inflight=restore_inflight(self.cfg))
        ahead_mb = self.cfg.read_ahead_mb if self.cfg.read_ahead_mb is not None else self.cfg.staging_mb * 3 // 4
        self.restores.ahead_max_bytes = ahead_mb << 20
        restores = self.restores
        self.card_stats = CardStatsWatch(lambda: self.link.store, self.counters)
        self.card_stats.start()
        self.saves.yield_staging = lambda: restores.wants_staging  # a restore's wait costs a request's TTFT
        if devs and devs[0].type == "cuda":  # landed batches move as they land, not at the engine's next step
            apply_switch_interval(self.cfg.switch_interval_ms)
            self.restores.run_driver(lambda: self.link.store, on_start=lambda d=devs[0]: torch.cuda.set_device(d))

    # ------------------------------------------------------------------ restores

    def start_load_kv(self, meta: ADPMetadata) -> None:
        """Submit this step's restores; they complete in the store's threads (see :meth:`get_transfer_results`).
        Read-aheads the scheduler dropped go first, then the restores (a read-ahead of theirs becomes theirs), then
        this step's read-aheads."""
        store = self.link.store
        if self.restores is not None and not self.disabled:
            for rid in meta.read_ahead_drop:
                self.restores.drop_read_ahead(rid)
        for rid, planned in meta.loads.items():
            mine = [(gid, bid, self.namer.rank_key(gid, key, meta.block_hashes)) for gid, bid, key in planned]
            pages = [(gid, bid, key) for gid, bid, key in mine if key is not None]
            job = LoadJob(rid, pages, meta.zero.get(rid, []), time.monotonic(), blocks=meta.load_blocks.get(rid, []))
            self._origins[rid] = {mk: key for (_, _, key), (_, _, mk) in zip(planned, mine, strict=True)
                                  if mk is not None and mk != key}
            if len(pages) != len(planned):
                job.fail(Cause.TP_KEY_MISSING, "a page's block hash is missing for this TP rank")
            elif self.disabled:
                job.fail(Cause.CACHE_DISABLED, self.disabled)
            if self.restores is None:
                job.fail(Cause.CACHE_DISABLED, "no KV caches registered")
                self._unstarted.append(job)
                continue
            self.restores.start(job, store)
        if self.restores is not None and not self.disabled:
            for rid, wanted in meta.read_ahead.items():
                ahead = [(gid, self.namer.rank_key(gid, key, meta.block_hashes)) for gid, key in wanted]
                self.restores.read_ahead(rid, [(gid, k) for gid, k in ahead if k is not None], store)

    def get_transfer_results(self) -> KVConnectorTransferResults:
        """Copy landed restore chunks into the KV cache; report finished restores and failures (-> recompute).
        Saves waiting for staging move on too (every step calls this, with or without saves of its own)."""
        if self.saves is not None:
            self.saves.drain()
        out = KVConnectorTransferResults()
        finished, self._unstarted = self._unstarted, []
        if self.restores is not None:
            finished += self.restores.poll(self.link.store)
        for job in finished:
            out.finished_recving.add(job.req_id)
            origin = self._origins.pop(job.req_id, {})
            if not job.failed:
                continue
            if job.lost:
                with self._lock:
                    self._lost.extend(origin.get(k, k) for k in job.lost)
            out.failed_recving.add(job.req_id)
            with self._lock:  # named in the worker metadata beside the keys it lost (and, on 0.26, as the report)
                self._failed_load_reqs.append(job.req_id)
            if self.legacy:  # vLLM 0.26: block-level report (every block the restore was to fill)
                self._load_error_blocks.update(job.blocks)
            log.warning("ADP KV: restore of %s failed (%s); the request recomputes", job.req_id, job.failed)
            if self.restores is None:
                self.counters.add(**{"load_fallbacks": 1, "loads": 1, "load_s": time.monotonic() - job.t0,
                                     failure_counter(job.cause or Cause.CACHE_DISABLED): 1})
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM 0.26: blocks of failed restores since the last call (the scheduler recomputes from the first)."""
        out, self._load_error_blocks = self._load_error_blocks, set()
        return out

    # ------------------------------------------------------------------ saves

    def wait_for_save(self, meta: ADPMetadata) -> None:
        """Stage the pages this step filled (device -> host) and hand them to the store's writer (behind the saves
        that wait for staging)."""
        if not meta.saves or self.disabled or self.saves is None:
            return
        self.saves.new_step()
        store = self.link.store
        by_group: dict[int, list[PageRef]] = defaultdict(list)
        origin: dict[bytes, bytes] = {}  # this rank's key -> the scheduler's
        for gid, bid, key in meta.saves:
            g = self.layouts[gid]
            if g.tp_replicated and self.tp_rank != 0:
                continue  # identical on every rank: rank 0 writes it
            mine = self.namer.rank_key(gid, key, meta.block_hashes)
            if mine is not None:
                by_group[gid].append((gid, bid, mine))
                if mine != key:
                    origin[mine] = key
        if store is None:
            n = sum(len(v) for v in by_group.values())
            self.counters.add(**{"saves_dropped": n, "store_unavailable": 1, DROP_COUNTER_PREFIX + "no_store": n})
            return
        for gid, refs in by_group.items():
            self.saves.save(store, gid, refs, origin)

    def build_worker_meta(self) -> ADPWorkerMetadata | None:
        """Keys whose save failed since the last step (device full, target gone...): saved again later; keys the
        card no longer has: those restores missed, and (rank 0, whose keys are the scheduler's) the pages this
        worker's saves evicted, which the scheduler's index lists until its next refresh; and the keys a full card
        declined (the scheduler asks for them again when a request computes them next)."""
        keys = self.saves.take_failed_keys() if self.saves is not None else []
        declined = self.saves.take_declined_keys() if self.saves is not None else []
        store = self.link.store
        evicted = store.take_evicted() if store is not None and self.tp_rank == 0 else []
        with self._lock:
            reqs, self._failed_load_reqs = self._failed_load_reqs, []
            lost, self._lost = self._lost, []
        lost.extend(evicted)
        return ADPWorkerMetadata(keys, reqs, lost, declined) if keys or reqs or lost or declined else None

    def close(self) -> None:
        """Let in-flight saves finish (bounded); stop the restore driver."""
        if self.restores is not None:
            self.restores.stop_driver()
        if self.saves is not None:
            self.saves.close(30.0)
        if self.card_stats is not None:
            self.card_stats.close()


SAVE_SPILL_MAX_MB = 24576  # the derived save_spill_mb: at most this, and half of the GPU memory left free


def save_spill_bytes(cfg: ADPConfig, device: torch.device) -> int:
    """Bytes of page copies that saves waiting for staging may hold (``save_spill_mb``; derived when None: on a GPU
    min(24 GiB, half of its free memory once the KV cache is allocated), else the staging size in host memory).
    GPU run 16: 16 agents' first prefills (~42 GB in ~15 s) outran the writers and 8 GB of staging; 2.7% of the
    pages were dropped. GPU run 23: the sweep's warm-up burst (45 GB in 15 s) dropped 10.7% with 8 GiB and none
    with 24 GiB. Half, not all, of the free memory: vLLM sized its KV cache to leave that memory spare."""
    if cfg.save_spill_mb is not None:
        return cfg.save_spill_mb << 20
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return min(SAVE_SPILL_MAX_MB << 20, free // 2)
    return cfg.staging_mb << 20


def apply_switch_interval(ms: float) -> None:
    """Set this process's interpreter switch interval to ``ms`` (the ``switch_interval_ms`` option; 0: unchanged),
    logged with the value it replaces: it holds for every thread of the engine process, vLLM's included."""
    if ms <= 0:
        return
    before = sys.getswitchinterval()
    sys.setswitchinterval(ms / 1000.0)
    log.info("ADP KV: interpreter switch interval %.3g -> %.3g ms in this engine process (switch_interval_ms)",
             before * 1000.0, sys.getswitchinterval() * 1000.0)
