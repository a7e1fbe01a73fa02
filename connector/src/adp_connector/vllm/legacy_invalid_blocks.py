"""vLLM 0.26: block-level load errors for models with several KV-cache groups (SWA hybrids, DSA, ...).

vLLM 0.26 reports a failed connector load only as block ids (``get_block_ids_with_load_errors``), and its
``Scheduler._update_requests_with_invalid_blocks`` reads one group per request (``(req_block_ids,) =
kv_cache_manager.get_block_ids(...)``; "TODO: add support for hybrid memory allocator"): on a model with several
groups, any reported block raises ``ValueError`` in the engine core instead of recomputing (0.32 reports failures
per request and has no such limit).

:func:`install` wraps that method, in the engine-core process, when the model has several groups: a request's
computed tokens are cut at the first failed block of any group, rounded down to a token boundary every group's
block size divides, so the scheduler recomputes from there. The connector reports every block a failed restore
was to fill, so the cut lands where the restore began: cutting inside it would be wrong for a sliding-window group,
whose window before the cut was never restored. Loads are asynchronous, so failed blocks are never shared with
another request. Single-group models keep vLLM's own code.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)

_PATCHED = "_adp_multi_group"
_PARAMS = ["self", "requests", "invalid_block_ids", "num_scheduled_tokens", "evict_blocks"]


def cut_at_first_failed_block(per_group: Iterable[list[int]], block_sizes: list[int], computed: int,
                              invalid: set[int]) -> int | None:
    """Tokens still valid when ``invalid`` blocks failed (None: none of this request's blocks did).

    ``per_group[g]`` is the request's block ids in group g (block size ``block_sizes[g]``); only the blocks
    holding the first ``computed`` tokens count. Block 0 (vLLM's null block: SWA positions outside the window)
    is never loaded, so never failed.
    """
    first_bad: int | None = None
    for ids, bs in zip(per_group, block_sizes, strict=True):
        for idx, bid in enumerate(ids[:-(-computed // bs)]):
            if bid != 0 and bid in invalid:
                first_bad = idx * bs if first_bad is None else min(first_bad, idx * bs)
                break
    if first_bad is None:
        return None
    unit = math.lcm(*block_sizes)
    return first_bad // unit * unit


def _multi_group(orig: Any) -> Any:
    @functools.wraps(orig)
    def update(self: Any, requests: Iterable[Any], invalid_block_ids: set[int], num_scheduled_tokens: dict[str, int],
               evict_blocks: bool = True) -> tuple[set[str], int, set[int]]:
        groups = self.kv_cache_config.kv_cache_groups
        if len(groups) < 2:
            return orig(self, requests, invalid_block_ids, num_scheduled_tokens, evict_blocks)
        sizes = [int(g.kv_cache_spec.block_size) for g in groups]
        affected: set[str] = set()
        total = 0
        evict: set[int] = set()
        for request in requests:
            rid = request.request_id
            per_group = self.kv_cache_manager.get_block_ids(rid)
            computed = request.num_computed_tokens - num_scheduled_tokens.get(rid, 0)
            cut = cut_at_first_failed_block(per_group, sizes, computed, invalid_block_ids)
            if cut is None:
                continue
            request.num_computed_tokens = cut
            total += computed - cut
            if evict_blocks:
                for ids, bs in zip(per_group, sizes, strict=True):
                    evict.update(b for b in ids[cut // bs:] if b != 0)
            affected.add(rid)
        return affected, total, evict

    setattr(update, _PATCHED, True)
    return update


def install(scheduler_cls: Any | None = None) -> bool:
    """Make 0.26's scheduler handle load errors of multi-group models; True if in place (now or before).

    False if the scheduler does not have the 0.26 method this expects (the caller then refuses such models).
    """
    if scheduler_cls is None:
        try:
            from vllm.v1.core.sched.scheduler import Scheduler as scheduler_cls
        except ImportError:
            return False
    orig = getattr(scheduler_cls, "_update_requests_with_invalid_blocks", None)
    if orig is None:
        return False
    if getattr(orig, _PATCHED, False):
        return True
    try:
        params = list(inspect.signature(orig).parameters)
    except (TypeError, ValueError):
        return False
    if params != _PARAMS:
        log.warning("ADP KV: Scheduler._update_requests_with_invalid_blocks has parameters %s, not %s: "
                    "not patched", params, _PARAMS)
        return False
    scheduler_cls._update_requests_with_invalid_blocks = _multi_group(orig)
    return True
