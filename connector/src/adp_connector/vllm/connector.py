"""``ADPConnector``: vLLM v1 KV connector (HMA-capable) keeping KV pages on an ADP card through the page store.

The front class vLLM loads (``kv_connector_module_path="adp_connector.vllm.connector"``). As vLLM's own connectors
do, it only delegates: to :class:`.scheduler.SchedulerSide` in the scheduler role (lookups, restore and save
planning) and to :class:`.worker.WorkerSide` in the worker role (KV registration, the vLLM-free save and restore
pipelines of :mod:`adp_connector.pipeline`). What to store per cache group comes from :mod:`.layouts`, page keys
from :mod:`.naming`, the card connection from :mod:`.backend`, everything vLLM-version specific from :mod:`.compat`.

Contract facts relied on (vLLM 0.32, ``distributed/kv_transfer/kv_connector/v1/base.py``): the factory requires the
3-argument constructor and ``SupportsHMA`` keeps the hybrid manager on; a failed load is reported in both
``failed_recving`` and ``finished_recving``; saves are staged in ``wait_for_save`` of the step that computed the
block. vLLM 0.26 goes through the legacy path (:mod:`.compat`, :mod:`.legacy_invalid_blocks`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm import __version__ as _VLLM_VERSION
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from ..pipeline import Counters, LoadChunk, LoadJob, PageAudit, write_totals
from ..store.process import SharedArena
from .backend import StoreLink
from .compat import (
    DISK_HIT_SOURCE,
    KVConnectorTransferResults,
    check_legacy_layouts,
    check_vllm_version,
    draft_layers,
    hash_block_size,
)
from .compat import HAS_FAILED_RECVING as _HAS_FAILED_RECVING
from .compat import pp_rank as _pp_rank
from .compat import tp_rank as _tp_rank
from .config import ADPConfig, parse_config
from .hook_timing import HOOK_REPORT_INTERVAL_S, HookClock, timed
from .layouts import GroupLayout, describe_groups, drafter_layer_names
from .metadata import ADPMetadata, ADPWorkerMetadata, PageRef
from .naming import PageNamer
from .scheduler import SchedulerSide
from .worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.adp_kv.connector")  # under "vllm": shown by vLLM's log handler

_SLAB_BYTES = 64 << 20  # staging slab: one store batch of pages (loads and saves are split at this size)
# kept importable from here (older callers and tests)
_check_vllm_version = check_vllm_version
_check_legacy_layouts = check_legacy_layouts
_LoadChunk, _LoadJob = LoadChunk, LoadJob
_clock = time.monotonic  # the clock of the hook-time reports (a module name, so a test can move it)
__all__ = ["_HAS_FAILED_RECVING", "ADPConnector", "ADPMetadata", "ADPWorkerMetadata", "PageRef"]


def make_recompute_effective(ktc: Any) -> None:
    """Make a failed restore recompute, whatever ``kv_load_failure_policy`` says (vLLM's default is "fail": the
    request would end with an empty output). Called by the scheduler-role connector: vLLM 0.26 and 0.32 create it
    (``v1/core/sched/scheduler.py``, ``KVConnectorFactory.create_connector``) before the scheduler reads the policy
    from the same ``kv_transfer_config``, so setting it here is what the scheduler then applies."""
    policy = getattr(ktc, "kv_load_failure_policy", "recompute")
    if policy == "recompute":
        return
    try:
        ktc.kv_load_failure_policy = "recompute"
    except Exception as exc:  # a frozen config: the override cannot take effect
        raise RuntimeError(f"ADPConnector: kv_load_failure_policy={policy!r} would fail requests whose restore "
                           f"fails and cannot be overridden ({exc}); set \"kv_load_failure_policy\": \"recompute\" "
                           "in --kv-transfer-config") from None
    log.warning("ADP KV: kv_load_failure_policy=%r overridden to \"recompute\": a restore that fails (bad card, "
                "checksum mismatch, timeout) recomputes the prefix instead of failing the request", policy)


class ADPConnector(KVConnectorBase_V1, SupportsHMA):
    """KV connector persisting prefix-cache pages on an ADP card (or the emulator) over NVMe/TCP."""

    if DISK_HIT_SOURCE is not None:
        _cache_hit_source = DISK_HIT_SOURCE

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        self._legacy = check_vllm_version(_VLLM_VERSION)
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.cfg: ADPConfig = parse_config(ktc.kv_connector_extra_config)
        self._is_worker = role == KVConnectorRole.WORKER
        if not self._is_worker:
            make_recompute_effective(ktc)
        pc = vllm_config.parallel_config
        self.tp_rank = _tp_rank() if self._is_worker else 0
        self.tp_size = pc.tensor_parallel_size
        self.pp_rank = _pp_rank() if self._is_worker else 0
        self.pp_size = pc.pipeline_parallel_size
        spec_cfg = getattr(vllm_config, "speculative_config", None)
        all_layers = [n for g in kv_cache_config.kv_cache_groups for n in g.layer_names]
        n_target = getattr(vllm_config.model_config.hf_text_config, "num_hidden_layers", None)
        self.layouts: list[GroupLayout] = describe_groups(
            kv_cache_config,
            drafter_layer_names(all_layers, n_target, spec_cfg is not None) | draft_layers(kv_cache_config),
            store_drafters=self.cfg.store_drafter_kv)
        self.hash_block_size = hash_block_size(kv_cache_config, vllm_config)
        if self._legacy:
            check_legacy_layouts(_VLLM_VERSION, self.layouts, hash_block_size=self.hash_block_size,
                                 speculative=spec_cfg is not None)
        self.namer = PageNamer(vllm_config, self.cfg, self.layouts, hash_block_size=self.hash_block_size,
                               tp_rank=self.tp_rank, tp_size=self.tp_size, pp_rank=self.pp_rank,
                               pp_size=self.pp_size, legacy=self._legacy)
        self.counters = Counters()
        self.hook_clock = HookClock()  # the time inside each hook (hook_timing.py)
        role_name = "worker" if self._is_worker else "scheduler"
        self.audit = PageAudit(self.cfg.audit_path, role_name) if self.cfg.audit_path else None
        self.role_name = role_name
        # The writer identity is per engine launch (vLLM's engine_id is a fresh UUID each start): two replicas
        # of one model on one card must never share a writer partition. A restarted engine claims a free or
        # expired partition; the old one's pages stay readable by everyone meanwhile.
        engine_id = getattr(ktc, "engine_id", None) or ""
        ident = (f"{self.namer.model_id}|{self.cfg.namespace_extra}|tp{self.tp_rank}/{self.tp_size}|pp{self.pp_rank}"
                 f"|{engine_id}")
        # Worker: page I/O in a helper process that shares the staging memory (the arena), off this process's GIL.
        arena = (SharedArena(max(self.cfg.staging_mb << 20, _SLAB_BYTES))
                 if self._is_worker and self.cfg.io_process else None)
        self.link = StoreLink(self.cfg, writer=self._is_worker and self.cfg.save, identity=ident,
                              partition=self.tp_rank if self._is_worker else None,
                              label=f"{role_name}-tp{self.tp_rank}-{os.getpid()}", arena=arena,
                              page_bytes=min((g.page_bytes for g in self.layouts if g.persists), default=None))
        self.scheduler_side = SchedulerSide(self.cfg, self.layouts, self.namer, self.link, self.counters,
                                            legacy=self._legacy)
        self.worker_side = WorkerSide(self.cfg, self.layouts, self.namer, self.link, self.counters,
                                      num_blocks=kv_cache_config.num_blocks, slab_bytes=_SLAB_BYTES, arena=arena,
                                      audit=self.audit, legacy=self._legacy)
        self._reported_up: bool | None = None  # the link state last reported in the stats
        self._hooks_reported_at = 0.0  # when hook time alone was last reported (not every step: HOOK_REPORT_INTERVAL_S)
        self.link.wait_startup()  # an unreachable target is reported (WARNING, with its address) by the link
        log.info("ADP KV connector (%s): %d group(s): %s", role.name, len(self.layouts),
                 "; ".join(f"g{g.group_id}={g.kind.value}/{g.block_size}/{g.page_bytes}B" for g in self.layouts))

    # ------------------------------------------------------------------ scheduler side

    @timed("get_num_new_matched_tokens")
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` restorable from the card (loaded asynchronously)."""
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """Groups a restore fills (others, e.g. drafter groups, are zeroed by the engine)."""
        return tuple(g.group_id for g in self.layouts if g.persists)

    @timed("update_state_after_alloc")
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Plan the restore of the blocks the scheduler just allocated for an external hit."""
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    @timed("build_connector_meta")
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's restores (planned at admission) and saves (blocks this step fills)."""
        return self.scheduler_side.build_connector_meta(scheduler_output)

    @timed("update_connector_output")
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Failed restores and failed saves reported by the workers."""
        self.scheduler_side.update_connector_output(connector_output)

    @timed("request_finished")
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Saves are staged when blocks are computed, so blocks are free to go at once."""
        self.scheduler_side.request_finished(request.request_id)
        return False, None

    @timed("request_finished")
    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """HMA variant of :meth:`request_finished`."""
        self.scheduler_side.request_finished(request.request_id)
        return False, None

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache: a dropped save is only a future miss."""
        return False

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Map every group's layers to their per-block byte slices (validated against the layout)."""
        self.worker_side.register_kv_caches(kv_caches)

    @timed("start_load_kv")
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Submit this step's restores; they complete in the store's threads (see :meth:`get_transfer_results`)."""
        meta = self._get_connector_metadata()
        if isinstance(meta, ADPMetadata):
            self.worker_side.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block-granular restores complete before the request is scheduled: nothing to wait for."""
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Saves are block-granular (see :meth:`wait_for_save`)."""
        return

    @timed("wait_for_save")
    def wait_for_save(self) -> None:
        """Stage the pages this step filled (device -> host) and hand them to the store's writer."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if isinstance(meta, ADPMetadata):
            self.worker_side.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished saves, finished restores) — see :meth:`get_transfer_results` for failures."""
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    @timed("get_transfer_results")
    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished restores and failures (-> recompute)."""
        return self.worker_side.get_transfer_results()

    @timed("get_block_ids_with_load_errors")
    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM 0.26: blocks of failed restores since the last call (the scheduler recomputes from the first)."""
        return self.worker_side.get_block_ids_with_load_errors()

    @timed("build_connector_worker_meta")
    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """Keys whose save failed since the last step (device full, target gone...): saved again later."""
        return self.worker_side.build_worker_meta()

    # ------------------------------------------------------------------ stats, lifecycle

    def get_kv_connector_stats(self) -> Any:
        """This interval's counters and samples (``ADPConnectorStats``); None when nothing happened. The store
        link's state rides along when it changed and at every step while it is down (the "connected" gauge)."""
        up = self.link.store is not None
        if up != self._reported_up or not up:
            self.counters.add(store_links=1, store_links_up=int(up))
            self._reported_up = up
        if not self.counters.any():  # hook time alone rides along at most every HOOK_REPORT_INTERVAL_S
            now = _clock()
            if not self.hook_clock.any() or now - self._hooks_reported_at < HOOK_REPORT_INTERVAL_S:
                return None
            self._hooks_reported_at = now
        self.counters.add(**self.hook_clock.drain())
        data = self.counters.drain()
        self._write_totals()
        from .stats import ADPConnectorStats

        return ADPConnectorStats(data=data)

    def _write_totals(self) -> None:
        """The counters' running totals into ``audit_path`` and ``stats_path`` (each when set)."""
        if self.audit is None and not self.cfg.stats_path:
            return
        totals = self.counters.snapshot_totals()
        if self.audit is not None:
            self.audit.write_totals(totals)
        if self.cfg.stats_path:
            write_totals(self.cfg.stats_path, self.role_name, totals)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        from .stats import ADPConnectorStats

        return ADPConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        from .stats import ADPPromMetrics

        return ADPPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """No layerwise work inside CUDA graphs. vLLM asks this while it builds its config (GPU hosts with CUDA
        graphs), before any engine process starts: a bad option fails there, before weights load."""
        parse_config(extra_config)
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """No layout demand: pages are gathered per layer (the CPU backend supports only LBHNC)."""
        return None

    def reset_cache(self) -> bool | None:
        """The card is shared and persistent: an engine's prefix-cache reset leaves it alone."""
        return True

    def shutdown(self) -> None:
        """Let in-flight saves finish (bounded), then close the store and the connection."""
        self.worker_side.close()
        self.counters.drain()
        self._write_totals()
        self.link.close()
