"""``ADPConnector``: vLLM v1 KV connector (HMA-capable) keeping KV pages on an ADP card through the page store.

Thin adapter: what to store per cache group comes from :mod:`.layouts`; I/O goes through
:class:`~adp_connector.store.PageStore`. Contract facts relied on (vLLM 0.32, ``distributed/kv_transfer/
kv_connector/v1/base.py`` and ``v1/core/sched/scheduler.py``):

* the factory requires the 3-argument constructor and ``SupportsHMA`` keeps the hybrid manager on;
* loads are asynchronous (``get_num_new_matched_tokens -> (n, True)``); a failed load is reported in both
  ``failed_recving`` and ``finished_recving`` and, under ``kv_load_failure_policy="recompute"``, the scheduler
  resets the request, which asks us again: failed requests are remembered and get 0 the second time;
* ``build_connector_meta`` runs before ``_update_after_schedule``, so ``request.num_computed_tokens`` is the value
  before this step; ``scheduler_output.kv_connector_block_state`` gives block tables and the Mamba "align"
  boundary states committed by this step;
* saves are staged in ``wait_for_save`` of the step that computed the block, so the engine may free and reuse the
  block right after: on a GPU the gather is queued on the compute stream (before any later step's kernels) and the
  device -> host copy on a side stream, and a submitter thread starts the store batch when the copy has landed;
  the NVMe writes run in the I/O helper process (``io_process``) or the store's threads.

vLLM 0.26 goes through a legacy path of the same class (``_check_vllm_version``): block tables from the scheduler
output (``_BlockTables``), failed restores reported as block ids (several KV-cache groups through
:mod:`.legacy_invalid_blocks`), no Mamba/GDN hybrids (docs/connector.md).

Keys: ``KeyNamespace(...).key_for_block_hash(request.block_hashes[k])`` where ``k`` indexes the hash at the
block's end boundary; the namespace carries the model id, KV dtype, the group descriptor from :mod:`.layouts`,
the block size, TP/PP ranks (not for TP-replicated MLA), and vLLM's hash algorithm and NONE_HASH seed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections import OrderedDict, defaultdict, deque
from dataclasses import dataclass, field
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

from ..store import KeyNamespace, PageKey, PageStatus
from ..store.process import SharedArena
from . import legacy_invalid_blocks
from .backend import StoreLink
from .config import ADPConfig, parse_config
from .layouts import GroupKind, GroupLayout, best_hit, describe_groups, drafter_layer_names
from .staging import StagingPool

try:  # vLLM >= 0.32: request-level failure reporting (0.26 has only block-level errors)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # vLLM 0.26: the legacy contract (see _check_vllm_version)

    @dataclass
    class KVConnectorTransferResults:  # type: ignore[no-redef]
        """Stand-in for vLLM >= 0.32's result type (0.26 reports failures as block ids)."""

        finished_sending: set[str] = field(default_factory=set)
        finished_recving: set[str] = field(default_factory=set)
        failed_recving: set[str] = field(default_factory=set)

    _HAS_FAILED_RECVING = False
else:
    _HAS_FAILED_RECVING = True

MIN_VLLM = (0, 32)
LEGACY_VLLM = ((0, 26),)  # also supported, through the legacy contract (docs/connector.md, "Supported vLLM versions")

try:  # vLLM >= 0.32 labels external hits by tier
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    _DISK = CacheHitSource.DISK
except Exception:  # pragma: no cover - older vLLM
    _DISK = None

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.adp_kv.connector")  # under "vllm": shown by vLLM's log handler

PageRef = tuple[int, int, bytes]  # (group id, block id, page key)
_RECENT_SAVES = 65536  # keys remembered as "being saved" until the store index shows them
_SLAB_BYTES = 64 << 20  # staging slab: one store batch of pages (loads and saves are split at this size)
_D2H_INFLIGHT_BYTES = 1 << 30  # GPU memory of gathered save pages waiting for their device -> host copy
_RECENT_SAVE_TTL_S = 10.0  # > a save's write + the scheduler index refresh (1 s): then failed saves are retried


@dataclass
class ADPMetadata(KVConnectorMetadata):
    """Scheduler -> worker: this step's restores and saves (picklable)."""

    loads: dict[str, list[PageRef]] = field(default_factory=dict)
    zero: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # drafter (group, block) to zero-fill
    saves: list[PageRef] = field(default_factory=list)
    # vLLM 0.26: block ids a failed restore reports (get_block_ids_with_load_errors), from the first restored one
    load_blocks: dict[str, list[int]] = field(default_factory=dict)
    # TP > 1: the block hash behind each key of this step (keys are rank 0's; a worker of another rank derives its
    # own key for groups that differ per rank)
    block_hashes: dict[bytes, bytes] = field(default_factory=dict)


class ADPWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, per step: keys whose save failed (saved again later) and requests whose restore
    failed (vLLM 0.26 has no ``failed_recving``: the scheduler side learns of them here)."""

    def __init__(self, failed_saves: list[bytes], failed_loads: list[str] | None = None) -> None:
        self.failed_saves = failed_saves
        self.failed_loads = failed_loads or []

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        return ADPWorkerMetadata(self.failed_saves + list(getattr(other, "failed_saves", ())),
                                 self.failed_loads + list(getattr(other, "failed_loads", ())))


@dataclass
class _Req:
    request: Any
    saved_blocks: dict[int, int] = field(default_factory=dict)  # group -> blocks handled (saved or skipped)


@dataclass
class _LoadChunk:
    """Up to one staging slab of one group's pages: one store batch, copied into the KV cache when it lands."""

    gid: int
    idxs: list[int]  # indices into the job's pages
    buf: torch.Tensor | None = None  # staging slab (flat int8) while the chunk holds one
    handle: Any = None  # the store batch, once submitted
    applied: bool = False
    copied: Any = None  # GPU: event of the host -> device copy (the slab is busy and the pages not in place before)


@dataclass
class _LoadJob:
    req_id: str
    pages: list[PageRef]
    zero: list[tuple[int, int]]
    t0: float
    failed: str = ""
    blocks: list[int] = field(default_factory=list)  # vLLM 0.26: reported as load errors if the restore fails
    chunks: list[_LoadChunk] = field(default_factory=list)


class _BlockTables:
    """Per-request block ids tracked from ``SchedulerOutput`` (vLLM 0.26 has no ``kv_connector_block_state``)."""

    def __init__(self) -> None:
        self._ids: dict[str, list[list[int]]] = {}

    def update(self, so: SchedulerOutput) -> None:
        for nr in so.scheduled_new_reqs:
            self._ids[nr.req_id] = [list(g) for g in nr.block_ids]
        cr = so.scheduled_cached_reqs
        resumed = set(getattr(cr, "resumed_req_ids", ()) or ())
        for rid, new in zip(cr.req_ids, cr.new_block_ids, strict=False):
            if new is None:
                continue
            if rid in resumed or rid not in self._ids:
                self._ids[rid] = [list(g) for g in new]
            else:
                for table, add in zip(self._ids[rid], new, strict=False):
                    table.extend(add)

    def get_block_ids(self, rid: str) -> list[list[int]] | None:
        return self._ids.get(rid)

    def drop(self, rid: str) -> None:
        self._ids.pop(rid, None)


class ADPConnector(KVConnectorBase_V1, SupportsHMA):
    """KV connector persisting prefix-cache pages on an ADP card (or the emulator) over NVMe/TCP."""

    if _DISK is not None:
        _cache_hit_source = _DISK

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        self._legacy = _check_vllm_version(_VLLM_VERSION)
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.cfg: ADPConfig = parse_config(ktc.kv_connector_extra_config)
        if getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning("ADP KV: kv_load_failure_policy=%r turns a bad restore into a failed request; "
                        "use \"recompute\"", ktc.kv_load_failure_policy)
        pc = vllm_config.parallel_config
        self.tp_rank = _tp_rank() if role == KVConnectorRole.WORKER else 0
        self.tp_size = pc.tensor_parallel_size
        self.pp_rank = _pp_rank() if role == KVConnectorRole.WORKER else 0
        self.pp_size = pc.pipeline_parallel_size
        mc = vllm_config.model_config
        spec_cfg = getattr(vllm_config, "speculative_config", None)
        all_layers = [n for g in kv_cache_config.kv_cache_groups for n in g.layer_names]
        n_target = getattr(mc.hf_text_config, "num_hidden_layers", None)
        self.layouts: list[GroupLayout] = describe_groups(
            kv_cache_config, drafter_layer_names(all_layers, n_target, spec_cfg is not None),
            store_drafters=self.cfg.store_drafter_kv)
        if self._legacy:
            _check_legacy_layouts(_VLLM_VERSION, self.layouts)
        self.hash_block_size = int(getattr(kv_cache_config, "hash_block_size", None)
                                   or vllm_config.cache_config.block_size)
        self._namespaces = self._build_namespaces(vllm_config)
        self._stats: dict[str, float] = defaultdict(float)
        self._stats_lock = threading.Lock()
        # The writer identity is per engine launch (vLLM's engine_id is a fresh UUID each start): two replicas
        # of one model on one card must never share a writer partition. A restarted engine claims a free or
        # expired partition; the old one's pages stay readable by everyone meanwhile.
        engine_id = getattr(vllm_config.kv_transfer_config, "engine_id", None) or ""
        ident = (f"{self._model_id}|{self.cfg.namespace_extra}|tp{self.tp_rank}/{self.tp_size}|pp{self.pp_rank}"
                 f"|{engine_id}")
        self._is_worker = role == KVConnectorRole.WORKER
        # Worker: page I/O in a helper process that shares the staging memory (the arena), off this process's GIL.
        self._arena = (SharedArena(max(self.cfg.staging_mb << 20, _SLAB_BYTES))
                       if self._is_worker and self.cfg.io_process else None)
        self.link = StoreLink(self.cfg, writer=self._is_worker and self.cfg.save, identity=ident,
                              partition=self.tp_rank if self._is_worker else None,
                              label=f"{'worker' if self._is_worker else 'scheduler'}-tp{self.tp_rank}-{os.getpid()}",
                              arena=self._arena)
        # scheduler side
        self._reqs: dict[str, _Req] = {}
        self._pending_hit: dict[str, int] = {}
        self._failed: set[str] = set()
        self._meta_loads: dict[str, list[PageRef]] = {}
        self._meta_zero: dict[str, list[tuple[int, int]]] = {}
        # key -> when its save was scheduled; skipped for _RECENT_SAVE_TTL_S while the write may be in flight.
        # After that the (refreshed) store index decides: a save that failed is scheduled again.
        self._recent_saves: OrderedDict[bytes, float] = OrderedDict()
        self._planned: dict[str, list[bytes]] = {}  # rid -> keys of its restore in flight
        self._suspect: set[bytes] = set()  # keys of failed restores: rewrite them even if the index has them
        self._tables = _BlockTables()  # vLLM 0.26 only
        self._meta_load_blocks: dict[str, list[int]] = {}
        self._meta_hashes: dict[bytes, bytes] = {}  # TP > 1: key -> block hash of the keys planned for this step
        # worker side
        self._kv: dict[int, list[tuple[str, torch.Tensor, int]]] = {}  # group -> [(layer, tensor, bytes/block)]
        self._draft_kv: dict[int, list[torch.Tensor]] = {}
        self._jobs: list[_LoadJob] = []
        self._pool: StagingPool | None = None  # created with the KV caches (pinned when they are on a GPU)
        self._pending_save_bytes = 0  # staged save bytes not yet written (or failed)
        self._save_handles: set[Any] = set()
        self._save_queue: queue.SimpleQueue[Any] = queue.SimpleQueue()  # staged slabs -> the submitter thread
        self._submitter: threading.Thread | None = None
        self._d2h_stream: Any = None  # GPU: the side stream of save copies
        self._h2d_stream: Any = None  # GPU: the side stream of restore copies
        self._d2h_inflight: deque[tuple[Any, int]] = deque()  # (copy event, bytes) of save copies queued
        self._d2h_inflight_bytes = 0
        self._save_lock = threading.Lock()
        self._failed_save_keys: list[bytes] = []  # reported to the scheduler by build_connector_worker_meta
        self._failed_load_reqs: list[str] = []  # idem (vLLM 0.26)
        self._save_origin: dict[bytes, bytes] = {}  # TP rank > 0: this rank's key -> the scheduler's, while saving
        self._load_error_blocks: set[int] = set()  # vLLM 0.26: get_block_ids_with_load_errors
        self._audit_lock = threading.Lock()
        self._disabled = ""
        if self.link.wait_ready(self.cfg.connect_timeout_s) is None:
            log.warning("ADP KV: no page store yet (%s); serving without the cache until it comes up",
                        self.link.last_error or "connecting")
        log.info("ADP KV connector (%s): %d group(s): %s", role.name, len(self.layouts),
                 "; ".join(f"g{g.group_id}={g.kind.value}/{g.block_size}/{g.page_bytes}B" for g in self.layouts))

    # ------------------------------------------------------------------ identity

    def _build_namespaces(self, vllm_config: VllmConfig) -> dict[int, KeyNamespace]:
        mc = vllm_config.model_config
        self._model_id = self.cfg.model_id or f"{mc.model}@{getattr(mc, 'revision', None) or ''}"
        cc = vllm_config.cache_config
        algo = str(getattr(cc, "prefix_caching_hash_algo", "sha256"))
        try:
            from vllm.utils.hashing import get_hash_fn_by_name
            from vllm.v1.core.kv_cache_utils import resolve_none_hash_seed

            seed = resolve_none_hash_seed(get_hash_fn_by_name(algo))
        except Exception:
            seed = os.environ.get("PYTHONHASHSEED", "")
        if algo.startswith("xxhash") and os.environ.get("PYTHONHASHSEED") is None:
            log.warning("ADP KV: prefix_caching_hash_algo=%s without PYTHONHASHSEED: block hashes change at every "
                        "restart, so pages written now will never be found again. Set PYTHONHASHSEED or use "
                        "sha256_cbor.", algo)
        kv_dtype = str(getattr(cc, "cache_dtype", "auto"))
        if kv_dtype == "auto":
            kv_dtype = str(mc.dtype)
        out = {}
        for g in self.layouts:
            rep = g.tp_replicated
            out[g.group_id] = KeyNamespace(
                model=self._model_id, dtype=kv_dtype, layout=g.descriptor, block_size=g.block_size,
                tp_rank=0 if rep else self.tp_rank, tp_size=1 if rep else self.tp_size,
                pp_rank=self.pp_rank, pp_size=self.pp_size, group_id=0,
                extra=(("hash_algo", algo), ("none_hash_seed", str(seed)), ("user", self.cfg.namespace_extra),
                       ("hash_block_size", self.hash_block_size))
                + ((("vllm_kv_abi", "0.26"),) if self._legacy else ()))
        return out

    def _key(self, group: GroupLayout, block_hashes: list, block_idx: int, plan: bool = False) -> PageKey | None:
        """Key of ``group``'s block ``block_idx`` (None when its end-boundary hash is not known yet).

        ``plan``: the key goes to the workers; with TP > 1 its block hash travels along (see :meth:`_rank_key`).
        """
        k = (block_idx + 1) * group.block_size // self.hash_block_size - 1
        if k >= len(block_hashes):
            return None
        h = bytes(block_hashes[k])
        key = self._namespaces[group.group_id].key_for_block_hash(h)
        if plan and self.tp_size > 1 and not group.tp_replicated:
            self._meta_hashes[bytes(key)] = h
        return key

    def _rank_key(self, gid: int, key: bytes, meta: ADPMetadata) -> bytes | None:
        """This worker's key for a page the scheduler named by rank 0's key (the same key when the group is
        identical on every rank, or at TP 1). None if the block hash did not come along."""
        g = self.layouts[gid]
        if self.tp_size == 1 or self.tp_rank == 0 or g.tp_replicated:
            return key
        h = meta.block_hashes.get(key)
        return None if h is None else bytes(self._namespaces[gid].key_for_block_hash(h))

    def _stat(self, **deltas: float) -> None:
        with self._stats_lock:
            for k, v in deltas.items():
                self._stats[k] += v

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` restorable from the card (loaded asynchronously)."""
        rid = request.request_id
        if not self.cfg.load or rid in self._failed or getattr(request, "skip_reading_prefix_cache", False):
            return 0, False
        store = self.link.store
        if store is None:
            self._stat(store_unavailable=1)
            return 0, False
        hashes = request.block_hashes
        # Leave >= 1 token to compute (and never restore a recurrent state at the very last token).
        hashed = len(hashes) * self.hash_block_size
        max_tokens = min(request.num_tokens - 1, hashed)
        present: dict[int, list[bool]] = {}
        for g in self.layouts:
            if not g.persists:
                continue
            nblk = max_tokens // g.block_size
            if g.stores_drafter and (nblk + 1) * g.block_size <= hashed:
                nblk += 1  # the page after the hit decides whether its last block's drafter KV fits this request
            keys = [self._key(g, hashes, j) for j in range(nblk)]
            present[g.group_id] = store.contains([k for k in keys if k is not None]) if keys else []
        hit = best_hit(self.layouts, present, max_tokens)
        self._stat(lookups=1, lookup_hit_tokens=max(hit - num_computed_tokens, 0))
        unit_blocks = self.cfg.min_hit_blocks * max((g.block_size for g in self.layouts), default=1)
        if hit <= num_computed_tokens or hit < unit_blocks:
            self._pending_hit.pop(rid, None)
            return 0, False
        self._pending_hit[rid] = hit
        log.debug("ADP KV: %s external hit %d tokens (local %d)", rid, hit, num_computed_tokens)
        return hit - num_computed_tokens, True

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """Groups a restore fills (others, e.g. drafter groups, are zeroed by the engine)."""
        return tuple(g.group_id for g in self.layouts if g.persists)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Plan the restore of the blocks the scheduler just allocated for an external hit."""
        rid = request.request_id
        st = self._reqs.setdefault(rid, _Req(request))
        st.request = request
        hit = self._pending_hit.pop(rid, None)
        if num_external_tokens <= 0 or hit is None:
            return
        start = hit - num_external_tokens
        block_ids = blocks.get_block_ids()
        pages: list[PageRef] = []
        zero: list[tuple[int, int]] = []
        fail_blocks: list[int] = []  # every block the restore fills (a failure must name at least one)
        ok = True
        for g in self.layouts:
            ids = block_ids[g.group_id] if g.group_id < len(block_ids) else []
            nblk = hit // g.block_size
            st.saved_blocks[g.group_id] = max(st.saved_blocks.get(g.group_id, 0), nblk)
            if not g.persists:
                continue
            first = start // g.block_size
            fail_blocks.extend(b for b in ids[first:nblk] if b != 0)
            for j in g.needed_blocks(nblk):
                if j < first:
                    continue
                bid = ids[j] if j < len(ids) else 0
                if bid == 0:
                    # Null block: outside the window (fine for SWA); a prefix block or the recurrent state at the
                    # boundary must exist, else restoring would leave the layer without its KV.
                    if g.kind in (GroupKind.FULL, GroupKind.MLA, GroupKind.STATE):
                        ok = False
                    continue
                key = self._key(g, request.block_hashes, j, plan=True)
                if key is None:
                    ok = False
                    continue
                pages.append((g.group_id, bid, bytes(key)))
                if g.zero_filled_layers:
                    zero.append((g.group_id, bid))
        if not ok or not pages:
            pages = []  # an empty restore reported as failed -> recompute
        self._meta_loads[rid] = pages
        self._meta_zero[rid] = zero
        self._meta_load_blocks[rid] = fail_blocks
        self._planned[rid] = [k for _, _, k in pages]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's restores (planned at admission) and saves (blocks this step fills)."""
        meta = ADPMetadata(loads=self._meta_loads, zero=self._meta_zero,
                           load_blocks=self._meta_load_blocks if self._legacy else {}, block_hashes=self._meta_hashes)
        self._meta_loads, self._meta_zero, self._meta_load_blocks = {}, {}, {}
        try:  # the saves planned below add their block hashes to meta.block_hashes (TP > 1)
            return self._plan_saves(scheduler_output, meta)
        finally:
            self._meta_hashes = {}

    def _plan_saves(self, scheduler_output: SchedulerOutput, meta: ADPMetadata) -> ADPMetadata:
        """Add the blocks this step fills (and the Mamba boundary states it offers) to ``meta.saves``."""
        if self._legacy:
            self._tables.update(scheduler_output)
            bs_state: Any = self._tables
        else:
            bs_state = getattr(scheduler_output, "kv_connector_block_state", None)
        store = self.link.store
        if not self.cfg.save or store is None or bs_state is None:
            return meta
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens or {}
        offloads = getattr(bs_state, "boundary_state_offloads", None) or {}
        cand: list[PageRef] = []
        for rid, n_sched in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(rid)
            if st is None:
                continue
            req = st.request
            hashes = req.block_hashes
            done = req.num_computed_tokens + n_sched - len(spec_tokens.get(rid, ()))
            done = min(done, len(hashes) * self.hash_block_size)
            table = bs_state.get_block_ids(rid)
            if table is None:
                continue
            for g in self.layouts:
                if not g.persists or g.kind is GroupKind.STATE:
                    continue
                ids = table[g.group_id]
                upto = min(done // g.block_size, len(ids))
                for j in range(st.saved_blocks.get(g.group_id, 0), upto):
                    key = self._key(g, hashes, j, plan=True) if ids[j] != 0 else None
                    if key is not None:
                        cand.append((g.group_id, ids[j], bytes(key)))
                st.saved_blocks[g.group_id] = max(st.saved_blocks.get(g.group_id, 0), upto)
            for gid, bid, boundary in offloads.get(rid, ()):
                g = self.layouts[gid]
                if not g.persists or g.kind is not GroupKind.STATE or boundary % g.block_size or bid == 0:
                    continue
                key = self._key(g, hashes, boundary // g.block_size - 1, plan=True)
                if key is not None:
                    cand.append((gid, bid, bytes(key)))
        now = time.monotonic()
        recent = self._recent_saves
        cand = [c for c in cand
                if c[2] in self._suspect or now - recent.get(c[2], -_RECENT_SAVE_TTL_S) >= _RECENT_SAVE_TTL_S]
        if cand:
            known = store.contains([k for _, _, k in cand])
            meta.saves = [c for c, k in zip(cand, known, strict=True) if not k or c[2] in self._suspect]
            self._suspect.difference_update(k for _, _, k in meta.saves)
            for _, _, k in meta.saves:
                recent[k] = now
                recent.move_to_end(k)
            while len(self._recent_saves) > _RECENT_SAVES:
                self._recent_saves.popitem(last=False)
        return meta

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """Keys whose save failed since the last step (device full, target gone...): saved again later."""
        with self._save_lock:
            keys, self._failed_save_keys = self._failed_save_keys, []
            reqs, self._failed_load_reqs = self._failed_load_reqs, []
        return ADPWorkerMetadata(keys, reqs) if keys or reqs else None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Remember failed restores so the recomputing request is not offered the same pages again;
        forget failed saves so a later request saves those pages again."""
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        for k in getattr(wm, "failed_saves", ()):
            self._recent_saves.pop(k, None)
        failed = set(getattr(connector_output, "failed_recving", None) or ()) | set(getattr(wm, "failed_loads", ()))
        if failed:
            self._failed.update(failed)
            for rid in failed:
                # The recompute rewrites the pages (the worker discarded the ones that failed verification).
                st = self._reqs.get(rid)
                if st is not None:
                    st.saved_blocks.clear()
                self._suspect.update(self._planned.pop(rid, ()))
        for rid in getattr(connector_output, "finished_recving", None) or ():
            if rid not in (failed or ()):
                self._planned.pop(rid, None)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Saves are staged when blocks are computed, so blocks are free to go at once."""
        self._forget(request.request_id)
        return False, None

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """HMA variant of :meth:`request_finished`."""
        self._forget(request.request_id)
        return False, None

    def _forget(self, rid: str) -> None:
        self._reqs.pop(rid, None)
        self._tables.drop(rid)
        self._planned.pop(rid, None)
        self._pending_hit.pop(rid, None)
        self._failed.discard(rid)

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache: a dropped save is only a future miss."""
        return False

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Map every group's layers to their per-block byte slices (validated against the layout)."""
        num_blocks = self._kv_cache_config.num_blocks
        try:
            for g in self.layouts:
                rows: list[tuple[str, torch.Tensor, int]] = []
                drafts: list[torch.Tensor] = []
                for la in g.layers:
                    t = kv_caches.get(la.name)
                    if t is None:
                        raise ValueError(f"layer {la.name} of group {g.group_id} was not registered")
                    if isinstance(t, (list, tuple)):
                        raise ValueError(f"layer {la.name}: per-state tensor lists (vLLM < 0.32) are not supported")
                    if t.shape[0] != num_blocks:
                        raise ValueError(f"layer {la.name}: dim 0 is {t.shape[0]}, expected {num_blocks} blocks "
                                         "(kernel-block split or K/V-first layout)")
                    per_block = t[0].numel() * t.element_size()
                    if la.persisted and per_block < la.page_bytes:
                        raise ValueError(f"layer {la.name}: {per_block} B per block < layout {la.page_bytes} B")
                    if la.persisted:
                        rows.append((la.name, t, la.page_bytes))
                    else:
                        drafts.append(t)
                self._kv[g.group_id] = rows
                self._draft_kv[g.group_id] = drafts
            biggest = max((g.page_bytes for g in self.layouts if g.persists), default=0)
            devs = [rows[0][1].device for rows in self._kv.values() if rows]
            if biggest:
                slab = max(biggest, _SLAB_BYTES // biggest * biggest)
                arena = torch.frombuffer(self._arena.map, dtype=torch.int8) if self._arena is not None else None
                self._pool = StagingPool(slab, self.cfg.staging_mb << 20,
                                         pinned=bool(devs) and devs[0].type == "cuda", arena=arena)
        except ValueError as exc:
            self._disabled = str(exc)
            log.error("ADP KV: cache disabled: %s", exc)

    def _gather(self, gid: int, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Pages of ``block_ids`` in group ``gid`` as one host int8 tensor ``[n, page_bytes]`` (into ``out``),
        synchronously. On a GPU the page rows are assembled on the device and cross PCIe in one copy."""
        rows = self._kv[gid]
        dev = rows[0][1].device
        if out is None:
            page = sum(b for _, _, b in rows)
            out = torch.empty((len(block_ids), page), dtype=torch.int8, pin_memory=dev.type == "cuda")
        if dev.type == "cpu":
            self._gather_on_device(gid, block_ids, out)
        else:
            out.copy_(self._gather_on_device(gid, block_ids))
        return out

    def _gather_on_device(self, gid: int, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Pages as ``[n, page_bytes]`` int8 on the KV cache's device, queued on the current stream."""
        rows = self._kv[gid]
        page = sum(b for _, _, b in rows)
        dev = rows[0][1].device
        n = len(block_ids)
        ids = self._index_tensor(block_ids, dev)
        dst = out if out is not None else torch.empty((n, page), dtype=torch.int8, device=dev)
        off = 0
        for _, t, nb in rows:
            dst[:, off:off + nb].copy_(t.index_select(0, ids).reshape(n, -1).view(torch.int8)[:, :nb])
            off += nb
        return dst

    @staticmethod
    def _index_tensor(block_ids: list[int], dev: torch.device) -> torch.Tensor:
        """Block ids on ``dev``; on a GPU through pinned memory, so the host does not wait for the stream."""
        ids = torch.tensor(block_ids, dtype=torch.long)
        if dev.type == "cpu":
            return ids
        return ids.pin_memory().to(dev, non_blocking=True)

    def _scatter(self, gid: int, block_ids: list[int], pages: torch.Tensor) -> Any:
        """Write host pages ``[n, page_bytes]`` into the group's layers at ``block_ids``.

        On a GPU: one host -> device copy and the scatter, queued on a side stream (the compute stream keeps
        running other requests' steps); returns the CUDA event marking them done (None on a CPU: done on return).
        """
        dev = self._kv[gid][0][1].device
        if dev.type == "cpu":
            self._scatter_rows(gid, self._index_tensor(block_ids, dev), pages)
            return None
        if self._h2d_stream is None:
            self._h2d_stream = torch.cuda.Stream(device=dev)
        with torch.cuda.stream(self._h2d_stream):
            self._scatter_rows(gid, self._index_tensor(block_ids, dev), pages.to(dev, non_blocking=True))
            done = torch.cuda.Event()
            done.record()
        return done

    def _scatter_rows(self, gid: int, ids: torch.Tensor, src: torch.Tensor) -> None:
        off = 0
        n = src.shape[0]
        for _, t, nb in self._kv[gid]:
            per_block = t[0].numel() * t.element_size()
            if nb == per_block:  # page bytes are the block in logical order (_gather); index_copy_ takes any strides
                t.index_copy_(0, ids, src[:, off:off + nb].contiguous().view(t.dtype).reshape(n, *t.shape[1:]))
            else:  # a padded page: only the real bytes are stored
                cur = t.index_select(0, ids).contiguous()
                flat = cur.reshape(n, -1).view(torch.int8)
                flat[:, :nb].copy_(src[:, off:off + nb])
                t.index_copy_(0, ids, cur)
            off += nb

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Submit this step's restores; they complete in the store's threads (see :meth:`get_transfer_results`)."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, ADPMetadata):
            return
        store = self.link.store
        for rid, planned in meta.loads.items():
            mine = [(gid, bid, self._rank_key(gid, key, meta)) for gid, bid, key in planned]
            pages = [(gid, bid, key) for gid, bid, key in mine if key is not None]
            job = _LoadJob(rid, pages, meta.zero.get(rid, []), time.monotonic(), blocks=meta.load_blocks.get(rid, []))
            self._jobs.append(job)
            if len(pages) != len(planned):
                job.failed = "a page's block hash is missing for this TP rank"
                continue
            if self._disabled or store is None or not pages:
                job.failed = self._disabled or ("target unreachable" if store is None else "nothing restorable")
                continue
            # Split per group into slab-sized store batches. They run in parallel in the store's threads, as many as
            # there are free staging slabs; each is copied into the KV cache as soon as it lands and its slab then
            # takes the next batch (get_transfer_results): host memory stays bounded whatever the restore's size.
            assert self._pool is not None
            by_group: dict[int, list[int]] = defaultdict(list)
            for i, (gid, _, _) in enumerate(pages):
                by_group[gid].append(i)
            for gid, idxs in by_group.items():
                per = max(1, self._pool.slab_bytes // self.layouts[gid].page_bytes)
                job.chunks.extend(_LoadChunk(gid, idxs[s0:s0 + per]) for s0 in range(0, len(idxs), per))
            self._feed(job, store)

    def _feed(self, job: _LoadJob, store: Any) -> None:
        """Submit the job's next chunks while staging slabs are free (a temporary buffer only if none can ever be)."""
        assert self._pool is not None
        for ch in job.chunks:
            if job.failed:
                return
            if ch.handle is not None:
                continue
            pb = self.layouts[ch.gid].page_bytes
            n = len(ch.idxs)
            buf = self._pool.take(n * pb, temporary=self._pool.max_slabs == 0)
            if buf is None:
                return
            ch.buf = buf
            rows = buf[:n * pb].view(n, pb)
            try:
                ch.handle = store.load_batch([job.pages[i][2] for i in ch.idxs], [rows[j].numpy() for j in range(n)])
            except Exception as exc:
                job.failed = f"{type(exc).__name__}: {exc}"

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block-granular restores complete before the request is scheduled: nothing to wait for."""
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Saves are block-granular (see :meth:`wait_for_save`)."""
        return

    def wait_for_save(self) -> None:
        """Stage the pages this step filled (device -> host) and hand them to the store's writer threads."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if not isinstance(meta, ADPMetadata) or not meta.saves or self._disabled:
            return
        store = self.link.store
        by_group: dict[int, list[PageRef]] = defaultdict(list)
        origin: dict[bytes, bytes] = {}  # this rank's key -> the scheduler's
        for gid, bid, key in meta.saves:
            g = self.layouts[gid]
            if g.tp_replicated and self.tp_rank != 0:
                continue  # identical on every rank: rank 0 writes it
            mine = self._rank_key(gid, key, meta)
            if mine is not None:
                by_group[gid].append((gid, bid, mine))
                if mine != key:
                    origin[mine] = key
        if store is None:
            self._stat(saves_dropped=sum(len(v) for v in by_group.values()), store_unavailable=1)
            return
        assert self._pool is not None
        for gid, refs_all in by_group.items():
            pb = self.layouts[gid].page_bytes
            per = max(1, self._pool.slab_bytes // pb)
            for s0 in range(0, len(refs_all), per):
                self._save_chunk(store, gid, refs_all[s0:s0 + per], pb, origin)

    def _save_chunk(self, store: Any, gid: int, refs: list[PageRef], pb: int, origin: dict[bytes, bytes]) -> None:
        """Stage up to one slab of pages and queue them for the store (the slab returns to the pool when written).

        On a GPU the gather is queued on the compute stream and the device -> host copy on a side stream: this
        returns at once, and the submitter thread hands the slab to the store when the copy's event has fired.
        """
        assert self._pool is not None
        nbytes = len(refs) * pb
        with self._save_lock:
            if self._pending_save_bytes + nbytes > (self.cfg.max_pending_save_mb << 20):
                self._stat(saves_dropped=len(refs))
                return
            self._pending_save_bytes += nbytes
        # With the I/O helper a buffer outside the shared arena would cross its socket: drop the save instead.
        buf = self._pool.take(nbytes, temporary=self._arena is None or self._pool.max_slabs == 0)
        if buf is None:
            self._stat(saves_dropped=len(refs))
            with self._save_lock:
                self._pending_save_bytes -= nbytes
            return
        stage = buf[:nbytes].view(len(refs), pb)
        try:
            ready = self._stage_save(gid, [b for _, b, _ in refs], stage)
        except Exception as exc:
            log.warning("ADP KV: staging a save failed: %s", exc)
            self._save_failed(refs, buf, nbytes)
            return
        mine = {k: origin[k] for _, _, k in refs if k in origin}
        if self._submitter is None:
            self._submitter = threading.Thread(target=self._submit_saves, name="adpkv-save-submit", daemon=True)
            self._submitter.start()
        self._save_queue.put((ready, store, gid, refs, stage, buf, nbytes, mine))

    def _stage_save(self, gid: int, block_ids: list[int], out: torch.Tensor) -> Any:
        """Copy the pages into ``out``; on a GPU asynchronously (returns the CUDA event that marks the copy done)."""
        dev = self._kv[gid][0][1].device
        if dev.type != "cuda":
            self._gather(gid, block_ids, out=out)
            return None
        while True:  # bound the GPU memory of gathers waiting for their copy (saves outrunning PCIe)
            with self._save_lock:
                while self._d2h_inflight and self._d2h_inflight[0][0].query():
                    self._d2h_inflight_bytes -= self._d2h_inflight.popleft()[1]
                if not self._d2h_inflight or self._d2h_inflight_bytes <= _D2H_INFLIGHT_BYTES:
                    break
                oldest = self._d2h_inflight[0][0]
            oldest.synchronize()
        if self._d2h_stream is None:
            self._d2h_stream = torch.cuda.Stream(device=dev)
        gathered = self._gather_on_device(gid, block_ids)  # queued on the compute stream, after this step's forward
        compute_done = torch.cuda.Event()
        compute_done.record()
        side = self._d2h_stream
        with torch.cuda.stream(side):
            side.wait_event(compute_done)
            out.copy_(gathered, non_blocking=True)
            gathered.record_stream(side)  # the allocator keeps it until the copy has run
            copied = torch.cuda.Event()
            copied.record(side)
        with self._save_lock:
            self._d2h_inflight.append((copied, out.numel()))
            self._d2h_inflight_bytes += out.numel()
        return copied

    def _submit_saves(self) -> None:
        """Submitter thread: wait for each staged slab's copy, then start its store batch."""
        while True:
            item = self._save_queue.get()
            if item is None:
                return
            ready, store, gid, refs, stage, buf, nbytes, origin = item
            try:
                if ready is not None:
                    ready.synchronize()
                keys = [k for _, _, k in refs]
                self._audit("save", gid, keys, stage)
                t0 = time.monotonic()
                h = store.save_batch(keys, [stage[i].numpy() for i in range(len(refs))])
            except Exception as exc:
                log.warning("ADP KV: save failed: %s", exc)
                self._save_failed(refs, buf, nbytes)
                continue
            with self._save_lock:
                self._save_handles.add(h)
                self._save_origin.update(origin)
            h.add_done_callback(lambda hh, buf=buf, nbytes=nbytes, t0=t0: self._save_done(hh, buf, nbytes, t0))

    def _save_failed(self, refs: list[PageRef], buf: torch.Tensor, nbytes: int) -> None:
        self._stat(save_errors=len(refs))
        with self._save_lock:
            self._pending_save_bytes -= nbytes
        if self._pool is not None:
            self._pool.give(buf)

    def _save_done(self, h: Any, buf: torch.Tensor, nbytes: int, t0: float) -> None:
        try:
            res = h.wait(0)
        except Exception:
            res = []
        ok = [r for r in res if r.status is PageStatus.OK]
        bad = [r for r in res if r.status not in (PageStatus.OK, PageStatus.EXISTS)]
        self._stat(saves=1, pages_saved=len(ok), bytes_saved=sum(r.nbytes for r in ok),
                   save_s=time.monotonic() - t0, save_errors=len(bad))
        with self._save_lock:
            # reported by the scheduler's (rank 0) key, which is what it schedules saves by
            self._failed_save_keys.extend(self._save_origin.get(bytes(r.key), bytes(r.key)) for r in bad)
            for r in res:
                self._save_origin.pop(bytes(r.key), None)
            self._pending_save_bytes -= nbytes
            self._save_handles.discard(h)
        if self._pool is not None:
            self._pool.give(buf)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished saves, finished restores) — see :meth:`get_transfer_results` for failures."""
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Copy landed restore chunks into the KV cache; report finished restores and failures (-> recompute)."""
        out = KVConnectorTransferResults()
        keep: list[_LoadJob] = []
        now = time.monotonic()
        for job in self._jobs:
            for ch in job.chunks:
                if job.failed:
                    break
                if not ch.applied and ch.handle is not None and ch.handle.done():
                    job.failed = self._apply_chunk(job, ch)
                    ch.applied = True
                if ch.applied and ch.buf is not None and (ch.copied is None or ch.copied.query()):
                    self._pool.give(ch.buf)  # in place: the slab takes the next batch
                    ch.buf = None
            if not job.failed and any(ch.handle is None for ch in job.chunks):
                store = self.link.store
                if store is None:
                    job.failed = "target unreachable"
                else:
                    self._feed(job, store)
            in_place = all(ch.applied and (ch.copied is None or ch.copied.query()) for ch in job.chunks)
            if not job.failed and not in_place:
                if now - job.t0 < self.cfg.load_timeout_s:
                    keep.append(job)
                    continue
                job.failed = f"timed out after {self.cfg.load_timeout_s} s"
            if not job.failed:
                for gid, bid in job.zero:
                    for t in self._draft_kv.get(gid, ()):
                        t[bid].zero_()
            self._release(job)
            out.finished_recving.add(job.req_id)
            if job.failed:
                out.failed_recving.add(job.req_id)
                if self._legacy:  # vLLM 0.26: block-level report (every block the restore was to fill)
                    self._load_error_blocks.update(job.blocks)
                    with self._save_lock:
                        self._failed_load_reqs.append(job.req_id)
                log.warning("ADP KV: restore of %s failed (%s); the request recomputes", job.req_id, job.failed)
                self._stat(load_fallbacks=1)
            else:
                self._stat(loads_ok=1)
            self._stat(loads=1, load_s=time.monotonic() - job.t0)
        self._jobs = keep
        return out

    def _release(self, job: _LoadJob) -> None:
        """Return a finished job's slabs to the pool; a slab the store may still write into (a failed or timed-out
        restore) returns when that batch completes (a batch always completes: the device or the helper times out)."""
        pool = self._pool
        for ch in job.chunks:
            if pool is None or ch.buf is None:
                continue
            if ch.copied is not None:  # a failed or timed-out job: its queued copies still read the slab
                ch.copied.synchronize()
            if ch.handle is None or ch.handle.done():
                pool.give(ch.buf)
            else:
                ch.handle.add_done_callback(lambda _h, buf=ch.buf: pool.give(buf))
            ch.buf = None
        job.chunks = []

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM 0.26: blocks of failed restores since the last call (the scheduler recomputes from the first)."""
        out, self._load_error_blocks = self._load_error_blocks, set()
        return out

    def _apply_chunk(self, job: _LoadJob, ch: _LoadChunk) -> str:
        """Check one landed chunk and copy it into the KV cache; return an error text ('' on success)."""
        try:
            res = ch.handle.wait(0)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        bad_keys = [r.key for r in res if r.status is PageStatus.VERIFY_FAILED]
        if bad_keys:
            self._stat(verify_failures=len(bad_keys))
            store = self.link.store
            if store is not None and self.cfg.save:
                try:  # drop them (our own partition's copies) so the recompute can write good ones
                    store.discard(bad_keys)
                except Exception as exc:
                    log.warning("ADP KV: discarding %d corrupt page(s) failed: %s", len(bad_keys), exc)
        bad = [r for r in res if r.status is not PageStatus.OK]
        if bad:
            return f"{len(bad)}/{len(res)} page(s) not restored ({bad[0].status.value}: {bad[0].detail})"
        pb = self.layouts[ch.gid].page_bytes
        bids = [job.pages[i][1] for i in ch.idxs]
        assert ch.buf is not None
        ch.copied = self._scatter(ch.gid, bids, ch.buf[:len(bids) * pb].view(len(bids), pb))
        if self.cfg.audit_path:
            if ch.copied is not None:
                ch.copied.synchronize()
            self._audit("load", ch.gid, [job.pages[i][2] for i in ch.idxs], self._gather(ch.gid, bids))
        self._stat(pages_loaded=len(res), bytes_loaded=sum(r.nbytes for r in res))
        return ""

    def _audit(self, op: str, gid: int, keys: list[bytes], pages: torch.Tensor) -> None:
        """Acceptance harness: record the digest of each saved / restored page (``audit_path`` only)."""
        if not self.cfg.audit_path:
            return
        lines = []
        for i, k in enumerate(keys):
            digest = hashlib.sha256(pages[i].contiguous().numpy().tobytes()).hexdigest()
            lines.append(json.dumps({"op": op, "group": gid, "key": k.hex(), "sha256": digest,
                                     "bytes": int(pages.shape[1])}))
        with self._audit_lock:
            os.makedirs(self.cfg.audit_path, exist_ok=True)
            with open(os.path.join(self.cfg.audit_path, f"pages-{os.getpid()}.jsonl"), "a") as f:
                f.write("\n".join(lines) + "\n")

    def _write_audit_stats(self) -> None:
        if not self.cfg.audit_path:
            return
        with self._stats_lock:
            snap = dict(self._totals) if hasattr(self, "_totals") else {}
        os.makedirs(self.cfg.audit_path, exist_ok=True)
        role = "worker" if self._is_worker else "scheduler"
        path = os.path.join(self.cfg.audit_path, f"stats-{role}-{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:  # replaced whole: a reader never sees a half-written file
            json.dump(snap, f)
        os.replace(path + ".tmp", path)

    # ------------------------------------------------------------------ stats, lifecycle

    def get_kv_connector_stats(self) -> Any:
        """This interval's counters (``ADPConnectorStats``); None when nothing happened."""
        with self._stats_lock:
            if not any(self._stats.values()):
                return None
        data = self._drain_stats()
        self._write_audit_stats()
        from .stats import ADPConnectorStats

        return ADPConnectorStats(data=data)

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
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """No layout demand: pages are gathered per layer (the CPU backend supports only LBHNC)."""
        return None

    def reset_cache(self) -> bool | None:
        """The card is shared and persistent: an engine's prefix-cache reset leaves it alone."""
        return True

    def shutdown(self) -> None:
        """Let in-flight saves finish (bounded), then close the store and the connection."""
        deadline = time.monotonic() + 30.0
        if self._submitter is not None:  # staged slabs still queued reach the store first
            self._save_queue.put(None)
            self._submitter.join(30.0)
        while True:
            with self._save_lock:
                pending = list(self._save_handles)
            if not pending or time.monotonic() > deadline:
                break
            for h in pending:
                try:
                    h.wait(max(0.0, deadline - time.monotonic()))
                except Exception:
                    pass
        self._drain_stats()
        self._write_audit_stats()
        self.link.close()

    def _drain_stats(self) -> dict[str, float]:
        """Move this interval's counters into the running totals; returns the interval's counters."""
        with self._stats_lock:
            data = dict(self._stats)
            self._stats.clear()
            tot = getattr(self, "_totals", None)
            if tot is None:
                tot = self._totals = defaultdict(float)
            for k, v in data.items():
                tot[k] += v
        return data


def _check_vllm_version(version: str) -> bool:
    """Refuse vLLM releases whose connector contract is untested; True for the legacy (0.26) contract.

    docs/connector.md, "Supported vLLM versions": >= 0.32 natively, 0.26.x through the legacy path.
    """
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        return not _HAS_FAILED_RECVING  # a development build: go by the API it has
    if (major, minor) in LEGACY_VLLM:
        return True
    if (major, minor) < MIN_VLLM or not _HAS_FAILED_RECVING:
        raise RuntimeError(
            f"ADPConnector supports vLLM 0.26.x and >= {MIN_VLLM[0]}.{MIN_VLLM[1]} (found {version}): the "
            "releases in between are untested (their connector contract differs: load-failure reporting, block "
            "state, Mamba registration). See docs/connector.md, \"Supported vLLM versions\".")
    return False


def _check_legacy_layouts(version: str, layouts: list[GroupLayout]) -> None:
    """vLLM 0.26 limits: no recurrent state; several KV-cache groups only with its load-error path patched.

    With any connector on a Mamba hybrid 0.26 takes the local hit as the maximum over groups (0.26
    ``scheduler.py``, the ``find_longest_cache_hit_per_group`` branch), which is wrong unless the connector restores
    the state. 0.26's ``Scheduler._update_requests_with_invalid_blocks`` reads one group per request, so a failed
    restore on a model with several groups would crash the engine: :mod:`.legacy_invalid_blocks` fixes that in
    the engine-core process, and such models are refused if it cannot.
    """
    kinds = {g.kind for g in layouts}
    reason = ""
    if GroupKind.STATE in kinds or any(g.spec_name.startswith("Mamba") for g in layouts):
        reason = ("a Mamba/GDN hybrid: 0.26 computes the local prefix hit of such a model as the maximum over its "
                  "KV-cache groups whenever a connector is attached, which would read an uncomputed state")
    elif len(layouts) > 1 and not legacy_invalid_blocks.install():
        reason = (f"{len(layouts)} KV-cache groups ({', '.join(g.kind.value for g in layouts)}): 0.26 reports a "
                  "failed restore per block, and its scheduler here does not have the load-error method this "
                  "connector extends for several groups (a multi-group failure would crash the engine)")
    if reason:
        raise RuntimeError(f"ADPConnector on vLLM {version} cannot serve this model safely: {reason}. "
                           f"Use vLLM >= {MIN_VLLM[0]}.{MIN_VLLM[1]} for it (docs/connector.md).")


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:
        return 0


def _pp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_pp_group

        return int(get_pp_group().rank_in_group)
    except Exception:
        return 0
