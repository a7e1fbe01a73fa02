"""Everything that differs between vLLM releases, in one place: the version check, vLLM 0.26's legacy contract
(block tables from the scheduler output, failures as block ids, its model limits) and the optional >= 0.32 types.

docs/connector.md, "Supported vLLM versions": 0.32.x and 0.33.x natively, 0.26.x through the legacy path; any
other release is refused until it has been checked (its connector contract changes between minor releases).

vLLM 0.33.0, checked in its wheel's source (``pip download --no-deps vllm==0.33.0``):

* ``KVConnectorBase_V1.requires_kv_delivery`` defaults to ``is_kv_producer`` (True for ``kv_both``); the scheduler
  then recomputes a preempted request whose hand-off is pending (``drop_stale_output``): the connector returns
  False (a cache: a dropped save is a future miss);
* ``KVCacheSpec.is_draft`` tags a draft model's layers (``compare=False``: it never affects grouping; the planner
  derives ``KVCacheGroupSpec.is_eagle_group`` from it): :func:`draft_layers` reads it per layer;
* ``KVCacheConfig.hash_block_size`` carries the engine core's resolved hash granularity (0.26 / 0.32 do not have
  it: :func:`hash_block_size` resolves it the way their engine core does);
* KV-cache planning moved to ``vllm.v1.core.kv_cache_planning`` (``get_kv_cache_configs``, grouping, layouts);
  what the connector imports stayed in ``kv_cache_utils`` (``resolve_none_hash_seed``,
  ``resolve_kv_cache_block_sizes``) in 0.26, 0.32 and 0.33;
* ``Request.num_publishable_block_hashes`` is NOT in 0.33.0 (not in its ``v1/request.py``): it came later on
  vLLM's main, where block lists handed to connectors include the partial tail and draft KV is published only once
  materialized. :func:`publishable_hashes` caps saves by it where it exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import legacy_hybrid_hits, legacy_invalid_blocks
from .layouts import GroupKind, GroupLayout

try:  # vLLM >= 0.32: request-level failure reporting (0.26 has only block-level errors)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # vLLM 0.26: the legacy contract (see check_vllm_version)

    @dataclass
    class KVConnectorTransferResults:  # type: ignore[no-redef]
        """Stand-in for vLLM >= 0.32's result type (0.26 reports failures as block ids)."""

        finished_sending: set[str] = field(default_factory=set)
        finished_recving: set[str] = field(default_factory=set)
        failed_recving: set[str] = field(default_factory=set)

    HAS_FAILED_RECVING = False
else:
    HAS_FAILED_RECVING = True

MIN_VLLM = (0, 32)
NATIVE_VLLM = ((0, 32), (0, 33))  # the native contract, checked release by release (module docstring)
LEGACY_VLLM = ((0, 26),)  # also supported, through the legacy contract (docs/connector.md, "Supported vLLM versions")
SUPPORTED_TEXT = "0.26.x, 0.32.x and 0.33.x"

try:  # vLLM >= 0.32 labels external hits by tier
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    DISK_HIT_SOURCE = CacheHitSource.DISK
except Exception:  # pragma: no cover - older vLLM
    DISK_HIT_SOURCE = None

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput


def check_vllm_version(version: str, *, native_api: bool | None = None) -> bool:
    """Refuse vLLM releases whose connector contract is untested; True for the legacy (0.26) contract.

    ``native_api``: whether the installed vLLM has the >= 0.32 result type (default: what was imported)."""
    native = HAS_FAILED_RECVING if native_api is None else native_api
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        return not native  # a development build: go by the API it has
    if (major, minor) in LEGACY_VLLM:
        return True
    if (major, minor) not in NATIVE_VLLM or not native:
        newer = (major, minor) > max(NATIVE_VLLM)
        raise RuntimeError(
            f"ADPConnector supports vLLM {SUPPORTED_TEXT} (found {version}): "
            + ("a newer release's connector contract has not been checked yet (base.py, the scheduler, KV-cache "
               "planning change between minor releases)" if newer else
               "the releases in between are untested (their connector contract differs: load-failure reporting, "
               "block state, Mamba registration)")
            + ". See docs/connector.md, \"Supported vLLM versions\".")
    return False


def hash_block_size(kv_cache_config: Any, vllm_config: Any) -> int:
    """Tokens per ``Request.block_hashes`` entry: vLLM 0.33 records it in the config; 0.26 / 0.32 resolve it in the
    engine core (``kv_cache_utils.resolve_kv_cache_block_sizes``: the GCD of the groups' block sizes with several
    groups), which is reproduced here; ``cache_config.block_size`` only where neither exists."""
    v = getattr(kv_cache_config, "hash_block_size", None)
    if v:
        return int(v)
    dcp = int(getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) or 1)
    if len(kv_cache_config.kv_cache_groups) <= 1:
        return int(vllm_config.cache_config.block_size) * dcp
    try:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    except ImportError:  # pragma: no cover - every supported release has it
        return int(vllm_config.cache_config.block_size)
    return int(resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1])


def draft_layers(kv_cache_config: Any) -> set[str]:
    """Layers vLLM >= 0.33 tags as a draft model's (``KVCacheSpec.is_draft``), where the per-layer specs are known
    (``UniformTypeKVCacheSpecs``); a plain group's spec is merged from its first layer, so its tag says nothing
    about the others (the layer names cover those: layouts.drafter_layer_names; ``is_eagle_group`` only says a
    group holds some drafter layer, with MTP the target's own group, so it is not read)."""
    out: set[str] = set()
    for g in kv_cache_config.kv_cache_groups:
        per_layer = getattr(g.kv_cache_spec, "kv_cache_specs", None)
        if isinstance(per_layer, dict):
            out.update(n for n, sp in per_layer.items() if getattr(sp, "is_draft", False))
    return out


def publishable_hashes(request: Any) -> int:
    """How many of ``request.block_hashes`` may be stored by hash: all, unless this vLLM publishes fewer
    (``num_publishable_block_hashes``, after 0.33.0: a block whose draft KV is not materialized yet)."""
    n = len(request.block_hashes)
    cap = getattr(request, "num_publishable_block_hashes", None)
    return n if cap is None else max(0, min(n, int(cap)))


def check_legacy_layouts(version: str, layouts: list[GroupLayout], *, hash_block_size: int | None = None,
                         speculative: bool = False) -> None:
    """vLLM 0.26 limits, each handled by a checked shim or refused with the reason.

    * Several KV-cache groups: 0.26's ``Scheduler._update_requests_with_invalid_blocks`` reads one group per
      request, so a failed restore would crash the engine: :mod:`.legacy_invalid_blocks` fixes that in the
      engine-core process; such models are refused if it cannot.
    * Mamba/GDN hybrids: with any connector 0.26 takes the local hit as the maximum over groups (0.26
      ``scheduler.py``, the ``find_longest_cache_hit_per_group`` branch), which would resume from an uncomputed
      state: :mod:`.legacy_hybrid_hits` makes it the hit every group has; refused if it cannot.
    * Mamba states: 0.26 has no ``boundary_state_offloads``; the scheduler side reads them from the block table
      ("align": :meth:`.scheduler.SchedulerSide._legacy_boundary_states`; "all": every full block), which holds
      only without speculative blocks and ("align") with hashes at the Mamba block (no copy-on-write partial
      hits): else refused.
    Per-tensor state registration is undone by :func:`state_page_view` (worker side).
    """
    kinds = {g.kind for g in layouts}
    reason = ""
    hybrid = bool(kinds & {GroupKind.STATE, GroupKind.STATE_ALL}) or any(g.spec_name.startswith("Mamba")
                                                                         for g in layouts)
    align = [g for g in layouts if g.kind is GroupKind.STATE and g.persists]
    if len(layouts) > 1 and not legacy_invalid_blocks.install():
        reason = (f"{len(layouts)} KV-cache groups ({', '.join(g.kind.value for g in layouts)}): 0.26 reports a "
                  "failed restore per block, and its scheduler here does not have the load-error method this "
                  "connector extends for several groups (a multi-group failure would crash the engine)")
    elif hybrid and not legacy_hybrid_hits.install():
        reason = ("a Mamba/GDN hybrid: 0.26 computes the local prefix hit of such a model as the maximum over its "
                  "KV-cache groups whenever a connector is attached, and its HybridKVCacheCoordinator here does not "
                  "have the lookups this connector reconciles that with (it would resume from an uncomputed state)")
    elif hybrid and speculative:
        reason = ("a Mamba/GDN hybrid with speculative decoding: 0.26 reports no boundary states to a connector, "
                  "and with speculative blocks which block holds which state depends on the tokens accepted")
    elif align and hash_block_size is not None and any(hash_block_size != g.block_size for g in align):
        reason = (f"a Mamba/GDN hybrid in mamba cache mode 'align' hashed every {hash_block_size} tokens, finer "
                  f"than its Mamba block ({align[0].block_size}): 0.26 reports no boundary states to a connector, "
                  "and its partial-block hits move states between blocks")
    if reason:
        raise RuntimeError(f"ADPConnector on vLLM {version} cannot serve this model safely: {reason}. "
                           f"Use vLLM >= {MIN_VLLM[0]}.{MIN_VLLM[1]} for it (docs/connector.md).")


def state_page_view(name: str, tensors: list[Any] | tuple[Any, ...]) -> Any:
    """vLLM 0.26 registers a Mamba layer as one tensor per state (``GPUModelRunner._reshape_kv_cache_tensors``:
    ``torch.as_strided`` views of one raw buffer, state i at the byte offset of the states before it, every state's
    block stride the padded page): the page-major ``int8 [num_blocks, state bytes]`` view of that buffer (block
    stride the page), like the raw page view vLLM >= 0.32 registers. Raises ``ValueError`` unless the states are
    exactly that layout."""
    import torch

    if not tensors:
        raise ValueError(f"layer {name}: no state tensors registered")
    first = tensors[0]
    size = first.element_size()
    stride = first.stride(0) * size
    base = first.storage_offset() * size
    n = first.shape[0]
    offset = 0
    for i, t in enumerate(tensors):
        es = t.element_size()
        inner = t[0].numel() * es
        if (t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or t.shape[0] != n
                or t.stride(0) * es != stride or t.storage_offset() * es - base != offset
                or (t.dim() > 1 and not t[0].is_contiguous())):
            raise ValueError(f"layer {name}: state {i} is not at byte {offset} of a {stride}-byte page of one "
                             "buffer (vLLM 0.26's per-state layout changed)")
        offset += inner
    if offset > stride:
        raise ValueError(f"layer {name}: states of {offset} B exceed their {stride}-byte page")
    raw = torch.empty(0, dtype=torch.int8, device=first.device)
    return raw.set_(first.untyped_storage(), base, (n, offset), (stride, 1))  # the states' bytes of each page


class BlockTables:
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


def tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:
        return 0


def pp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_pp_group

        return int(get_pp_group().rank_in_group)
    except Exception:
        return 0
