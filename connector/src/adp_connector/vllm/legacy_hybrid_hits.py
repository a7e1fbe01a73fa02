"""vLLM 0.26: the local prefix hit of a Mamba/GDN hybrid, when a connector is attached, is the hit every group has.

vLLM 0.26's ``Scheduler.schedule`` (``v1/core/sched/scheduler.py``, the branch guarded by ``self.connector is not
None and self.has_mamba_layers`` and a ``HybridKVCacheCoordinator``) asks
``HybridKVCacheCoordinator.find_longest_cache_hit_per_group`` and takes ``max(per_group_hits)`` as the local hit,
with each group's own blocks. That path was written for a connector that always transfers the Mamba state (NIXL);
for a cache it is wrong: when the attention blocks of a prefix are cached locally but its recurrent state is not
(evicted, or never at that boundary), the request would resume from a state that was never computed. It is the
only caller of that method in 0.26 (checked: ``grep -rn find_longest_cache_hit_per_group vllm/``).

:func:`install` replaces the method, in the engine-core process, by the reconciled lookup vLLM uses without a
connector (``HybridKVCacheCoordinator.find_longest_cache_hit``: the longest hit every group can serve, each group's
blocks cut to it), reported as the hit of every group; the maximum is then that hit. vLLM >= 0.32 reconciles the
groups itself (``supports_divergent_local_hybrid_hits`` False) and has no such method to patch.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

log = logging.getLogger(__name__)

_PATCHED = "_adp_reconciled_hit"
_PER_GROUP_PARAMS = ["self", "block_hashes", "max_cache_hit_length"]
_RECONCILED_PARAMS = ["self", "block_hashes", "max_cache_hit_length"]


def reconciled_per_group(blocks: tuple[list[Any], ...], hit: int) -> tuple[tuple[list[Any], ...], tuple[int, ...]]:
    """(blocks per group, hit per group) for a hit every group agrees on: ``hit`` for each group."""
    return tuple(blocks), tuple(hit for _ in blocks)


def _reconciled(orig: Any) -> Any:
    @functools.wraps(orig)
    def find_longest_cache_hit_per_group(self: Any, block_hashes: list[Any],
                                         max_cache_hit_length: int) -> tuple[tuple[list[Any], ...], tuple[int, ...]]:
        blocks, hit, _uncached = self.find_longest_cache_hit(block_hashes, max_cache_hit_length)
        return reconciled_per_group(blocks, hit)

    setattr(find_longest_cache_hit_per_group, _PATCHED, True)
    return find_longest_cache_hit_per_group


def install(coordinator_cls: Any | None = None) -> bool:
    """Make 0.26's per-group local hit the reconciled one; True if in place (now or before).

    False if the coordinator does not have the two 0.26 methods with the parameters this expects (the caller then
    refuses Mamba/GDN hybrids).
    """
    if coordinator_cls is None:
        try:
            from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator as coordinator_cls
        except ImportError:
            return False
    per_group = getattr(coordinator_cls, "find_longest_cache_hit_per_group", None)
    reconciled = getattr(coordinator_cls, "find_longest_cache_hit", None)
    if per_group is None or reconciled is None:
        return False
    if getattr(per_group, _PATCHED, False):
        return True
    try:
        got = (list(inspect.signature(per_group).parameters), list(inspect.signature(reconciled).parameters))
    except (TypeError, ValueError):
        return False
    if got != (_PER_GROUP_PARAMS, _RECONCILED_PARAMS):
        log.warning("ADP KV: HybridKVCacheCoordinator lookups have parameters %s, not %s: not patched", got,
                    (_PER_GROUP_PARAMS, _RECONCILED_PARAMS))
        return False
    coordinator_cls.find_longest_cache_hit_per_group = _reconciled(per_group)
    return True
