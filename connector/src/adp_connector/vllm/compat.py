"""Everything that differs between vLLM releases, in one place: the version check, vLLM 0.26's legacy contract
(block tables from the scheduler output, failures as block ids, its model limits) and the optional >= 0.32 types.

docs/connector.md, "Supported vLLM versions": >= 0.32 natively, 0.26.x through the legacy path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from . import legacy_invalid_blocks
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
LEGACY_VLLM = ((0, 26),)  # also supported, through the legacy contract (docs/connector.md, "Supported vLLM versions")

try:  # vLLM >= 0.32 labels external hits by tier
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    DISK_HIT_SOURCE = CacheHitSource.DISK
except Exception:  # pragma: no cover - older vLLM
    DISK_HIT_SOURCE = None

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput


def check_vllm_version(version: str) -> bool:
    """Refuse vLLM releases whose connector contract is untested; True for the legacy (0.26) contract."""
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        return not HAS_FAILED_RECVING  # a development build: go by the API it has
    if (major, minor) in LEGACY_VLLM:
        return True
    if (major, minor) < MIN_VLLM or not HAS_FAILED_RECVING:
        raise RuntimeError(
            f"ADPConnector supports vLLM 0.26.x and >= {MIN_VLLM[0]}.{MIN_VLLM[1]} (found {version}): the "
            "releases in between are untested (their connector contract differs: load-failure reporting, block "
            "state, Mamba registration). See docs/connector.md, \"Supported vLLM versions\".")
    return False


def check_legacy_layouts(version: str, layouts: list[GroupLayout]) -> None:
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
