"""The scheduler side of the connector: lookups, restore planning at admission, save planning per step.

Runs in the engine-core process against a read-only view of the card (the store index, refreshed every
``refresh_interval_s``). Contract facts relied on (vLLM 0.32 ``v1/core/sched/scheduler.py``):

* ``get_num_new_matched_tokens -> (n, True)``: loads are asynchronous; under ``kv_load_failure_policy="recompute"``
  a failed load resets the request, which asks again: failed requests are remembered and get 0 the second time;
* ``build_connector_meta`` runs before ``_update_after_schedule``, so ``request.num_computed_tokens`` is the value
  before this step; ``scheduler_output.kv_connector_block_state`` gives block tables and the Mamba "align"
  boundary states committed by this step (vLLM 0.26: :class:`.compat.BlockTables`).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..pipeline.counters import Counters
from ..pipeline.policy import RestorePolicy
from .backend import StoreLink
from .compat import BlockTables, publishable_hashes
from .config import ADPConfig
from .layouts import PREFIX_KINDS, GroupKind, GroupLayout, best_hit
from .metadata import ADPMetadata, PageRef
from .naming import PageNamer

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.adp_kv.connector")

RECENT_SAVES = 65536  # keys remembered as "being saved" until the store index shows them
RECENT_SAVE_TTL_S = 10.0  # > a save's write + the scheduler index refresh (1 s): then failed saves are retried
LOST_KEYS = 1 << 18  # keys remembered as "not on the card" though the index may still list them
LOOKUP_REUSE_S = 0.25  # a waiting request asked again within this time gets its last lookup's answer
READ_AHEAD_REQUESTS = 2  # requests whose restore the workers read ahead at once (vLLM asks about its queue's head)
READ_AHEAD_KINDS = (GroupKind.FULL, GroupKind.MLA, GroupKind.WINDOW, GroupKind.STATE)  # pages known before blocks


@dataclass
class _Req:
    request: Any
    saved_blocks: dict[int, int] = field(default_factory=dict)  # group -> blocks handled (saved or skipped)


class SchedulerSide:
    """Per-request planning state of the scheduler-role connector."""

    def __init__(self, cfg: ADPConfig, layouts: list[GroupLayout], namer: PageNamer, link: StoreLink,
                 counters: Counters, *, legacy: bool) -> None:
        self.cfg = cfg
        self.layouts = layouts
        self.namer = namer
        self.link = link
        self.counters = counters
        self.legacy = legacy
        self.hash_block_size = namer.hash_block_size
        self._reqs: dict[str, _Req] = {}
        self._pending_hit: dict[str, int] = {}
        self._failed: set[str] = set()
        self._meta_loads: dict[str, list[PageRef]] = {}
        self._meta_zero: dict[str, list[tuple[int, int]]] = {}
        # key -> when its save was scheduled; skipped for RECENT_SAVE_TTL_S while the write may be in flight.
        # After that the (refreshed) store index decides: a save that failed is scheduled again.
        self._recent_saves: OrderedDict[bytes, float] = OrderedDict()
        self._planned: dict[str, list[bytes]] = {}  # rid -> keys of its restore in flight
        self._suspect: set[bytes] = set()  # keys of failed restores: rewrite them even if the index has them
        # Keys the workers found gone (evicted, missing at a restore): the index may list them until its next
        # refresh, so they are neither offered as hits nor skipped as stored until lost_ttl_s has passed.
        self._lost: OrderedDict[bytes, float] = OrderedDict()
        self.lost_ttl_s = max(RECENT_SAVE_TTL_S, 5 * cfg.refresh_interval_s)
        self.tables = BlockTables()  # vLLM 0.26 only
        self._meta_load_blocks: dict[str, list[int]] = {}
        self._meta_hashes: dict[bytes, bytes] = {}  # TP > 1: key -> block hash of the keys planned for this step
        self._key_cache: dict[str, dict[int, dict[int, bytes]]] = {}  # rid -> group -> block index -> key
        # rid -> (when, max_tokens, local hit, lost generation, presence by group) of its last lookup: vLLM asks
        # again every step a request waits (for blocks, or behind others), and each ask is a round trip to the
        # lookup helper
        self._last_lookup: dict[str, tuple[float, int, int, int, dict[int, list[bool]]]] = {}
        # rid -> tokens of its local prefix-cache hit at admission: those blocks were computed (and their saves
        # planned) by an earlier request, so neither the lookup nor the save planning walks them again
        self._local_hit: dict[str, int] = {}
        # a save failed or was not planned (no store) lately: admitted requests re-check their local blocks until then
        self._resave_until = 0.0
        self._lost_gen = 0  # bumped whenever the workers report keys gone: a reused answer may not hide them
        self.policy = (RestorePolicy(prior_bytes_per_s=cfg.restore_prior_gbps * 1e9)
                       if cfg.restore_policy == "auto" else None)
        # read-aheads: rid -> (request, local hit, hit) of a request offered a restore this step but not given blocks
        # (it waits for them), and rid -> when its read-ahead was sent (until its restore is planned or it ends)
        self._ahead_wanted: dict[str, tuple[Any, int, int]] = {}
        self._ahead_sent: dict[str, float] = {}
        self._ahead_drop: list[str] = []
        self.read_ahead = cfg.read_ahead_mb != 0 and cfg.load

    # ------------------------------------------------------------------ lookups and restores

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` restorable from the card (loaded asynchronously)."""
        rid = request.request_id
        self._local_hit[rid] = num_computed_tokens
        if not self.cfg.load or rid in self._failed or getattr(request, "skip_reading_prefix_cache", False):
            return 0, False
        store = self.link.store
        if store is None:
            self.counters.add(store_unavailable=1)
            return 0, False
        hashes = request.block_hashes
        # Leave >= 1 token to compute (and never restore a recurrent state at the very last token).
        hashed = len(hashes) * self.hash_block_size
        max_tokens = min(request.num_tokens - 1, hashed)
        if max_tokens <= num_computed_tokens:  # the local hit already covers all a restore could add: no lookup
            self._pending_hit.pop(rid, None)
            return 0, False
        now = time.monotonic()
        last = self._last_lookup.get(rid)
        if (last is not None and now - last[0] < LOOKUP_REUSE_S and last[1] == max_tokens
                and last[2] <= num_computed_tokens and last[3] == self._lost_gen):
            present = last[4]  # asked about the same blocks or more
            self.counters.add(lookups_reused=1)
        else:
            present = {}
            for g in self.layouts:
                if not g.persists:
                    continue
                nblk = max_tokens // g.block_size
                if g.stores_drafter and (nblk + 1) * g.block_size <= hashed:
                    nblk += 1  # the page after the hit decides whether its last block's drafter KV fits this request
                # blocks inside the local hit are on the GPU: a restore starts after them and never reads them
                local = min(num_computed_tokens // g.block_size, nblk)
                keys = self._lookup_keys(rid, g, hashes, local, nblk)
                found = store.contains(keys) if keys else []
                present[g.group_id] = [True] * local + [f and not self._is_lost(k)
                                                        for k, f in zip(keys, found, strict=True)]
            self._last_lookup[rid] = (now, max_tokens, num_computed_tokens, self._lost_gen, present)
            self.counters.add(lookups=1)
        hit = best_hit(self.layouts, present, max_tokens)
        self.counters.add(lookup_hit_tokens=max(hit - num_computed_tokens, 0))
        unit_blocks = self.cfg.min_hit_blocks * max((g.block_size for g in self.layouts), default=1)
        if hit <= num_computed_tokens or hit < unit_blocks:
            self._pending_hit.pop(rid, None)
            return 0, False
        if hit - num_computed_tokens < self.cfg.min_load_tokens:  # cheaper to compute than an extra engine step
            self.counters.add(async_loads_skipped=1)
            self._pending_hit.pop(rid, None)
            return 0, False
        if self.policy is not None:
            # the requests a recompute would delay: the others on the GPU (not those waiting for their restore)
            others = sum(1 for r in self._reqs if r != rid and r not in self._planned)
            choice = self.policy.choose(hit - num_computed_tokens, self._hit_bytes(num_computed_tokens, hit), others)
            if not choice.restore:
                self.counters.add(restores_declined=1)
                log.debug("ADP KV: %s recomputes its %d-token hit (engine delay: restore ~%.2f s%s, recompute ~%.2f s)",
                          rid, hit - num_computed_tokens, choice.restore_delay_s,
                          " at the prior throughput" if choice.prior else "", choice.recompute_delay_s)
                self._pending_hit.pop(rid, None)
                return 0, False
        self._pending_hit[rid] = hit
        if self.read_ahead:  # read ahead if vLLM finds it no blocks this step (update_state_after_alloc not called)
            self._ahead_wanted[rid] = (request, num_computed_tokens, hit)
        log.debug("ADP KV: %s external hit %d tokens (local %d)", rid, hit, num_computed_tokens)
        return hit - num_computed_tokens, True

    def _hit_bytes(self, start: int, hit: int) -> int:
        """Bytes of the pages a restore of tokens ``start..hit`` reads."""
        total = 0
        for g in self.layouts:
            if g.persists:
                need = g.needed_blocks(hit // g.block_size)  # a range: counted, not walked (asked every step)
                n = max(0, need.stop - max(need.start, start // g.block_size))
                if n and self.legacy and g.kind is GroupKind.STATE_ALL:
                    n = 1  # vLLM 0.26 allocates, and the restore reads, only the hit's last state block
                total += n * g.page_bytes
        return total

    def _lookup_keys(self, rid: str, g: GroupLayout, hashes: list, first: int, nblk: int) -> list[bytes]:
        """Keys of ``g``'s blocks ``first..nblk`` (fewer if their hashes are not known yet), each derived once per
        request: vLLM asks again every step a request waits, and a long prompt has thousands of blocks."""
        cache = self._key_cache.setdefault(rid, {}).setdefault(g.group_id, {})
        out: list[bytes] = []
        for j in range(first, nblk):
            key = cache.get(j)
            if key is None:
                derived = self.namer.key(g, hashes, j)
                if derived is None:
                    break
                key = cache[j] = bytes(derived)
            out.append(key)
        return out

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Plan the restore of the blocks the scheduler just allocated for an external hit."""
        rid = request.request_id
        st = self._reqs.setdefault(rid, _Req(request))
        st.request = request
        self._ahead_wanted.pop(rid, None)  # it has its blocks: its restore is planned below (or it has nothing)
        read_ahead = self._ahead_sent.pop(rid, None) is not None
        local = self._local_hit.pop(rid, 0)
        if local and time.monotonic() >= self._resave_until:
            # the local hit's blocks were computed by an earlier request, which planned their saves: walking
            # them again (thousands of keys for a long history) costs every turn of every session on the TTFT
            for g in self.layouts:
                if g.persists and g.kind is not GroupKind.STATE:
                    st.saved_blocks[g.group_id] = max(st.saved_blocks.get(g.group_id, 0), local // g.block_size)
        hit = self._pending_hit.pop(rid, None)
        if num_external_tokens <= 0 or hit is None:
            if read_ahead:  # no restore after all (its hit is computed): the workers drop what they read
                self._ahead_drop.append(rid)
            return
        start = hit - num_external_tokens
        block_ids = blocks.get_block_ids()
        pages: list[PageRef] = []
        zero: list[tuple[int, int]] = []
        fail_blocks: list[int] = []  # every block the restore fills (a failure must name at least one)
        why = ""  # the first reason the restore cannot be planned (empty: it can)
        looked_up = self._key_cache.get(rid, {})
        for g in self.layouts:
            # the lookup derived these keys (a long prompt: thousands); a key that goes with its block hash is named
            # again below, which records the hash for the workers
            known = {} if self.namer.sends_hashes(g) else looked_up.get(g.group_id, {})
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
                    # boundary must exist, else restoring would leave the layer without its KV. Mode "all" states
                    # before the boundary are null in vLLM 0.26 (its MambaManager keeps only the state the request
                    # resumes from: ``get_num_skipped_tokens`` is ``tokens - 1`` in every mode): never read, never
                    # hashed, nothing to restore there.
                    if g.kind is GroupKind.STATE_ALL and j < nblk - 1:
                        continue
                    if (g.kind in PREFIX_KINDS or g.kind is GroupKind.STATE) and not why:
                        why = f"group {g.group_id} ({g.kind.value}) has no block for its block {j}"
                    continue
                key = known.get(j)
                if key is None:
                    derived = self.namer.key(g, request.block_hashes, j, self._meta_hashes)
                    if derived is None:
                        why = why or f"group {g.group_id} block {j} has no key (its block hash is not known yet)"
                        continue
                    key = bytes(derived)
                pages.append((g.group_id, bid, key))
                if g.zero_filled_layers:
                    zero.append((g.group_id, bid))
        if why or not pages:
            # an empty restore reported as failed -> recompute
            log.warning("ADP KV: restore of %s not planned (%s); the request recomputes", rid,
                        why or "no page to restore")
            pages = []
        self._meta_loads[rid] = pages
        self._meta_zero[rid] = zero
        self._meta_load_blocks[rid] = fail_blocks
        self._planned[rid] = [k for _, _, k in pages]
        if self.policy is not None and pages:
            page_bytes = {g.group_id: g.page_bytes for g in self.layouts}
            self.policy.on_restore_planned(rid, sum(page_bytes[gid] for gid, _, _ in pages), time.monotonic())

    def _is_lost(self, key: bytes) -> bool:
        """True while the workers' report that ``key`` is not on the card is newer than the index can be."""
        if not self._lost:
            return False
        t = self._lost.get(key)
        if t is None:
            return False
        if time.monotonic() - t < self.lost_ttl_s:
            return True
        del self._lost[key]
        return False

    # ------------------------------------------------------------------ per step

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ADPMetadata:
        """This step's restores (planned at admission) and saves (blocks this step fills)."""
        ahead = self._plan_read_ahead() if self.read_ahead else {}
        meta = ADPMetadata(loads=self._meta_loads, zero=self._meta_zero,
                           load_blocks=self._meta_load_blocks if self.legacy else {}, block_hashes=self._meta_hashes,
                           read_ahead=ahead, read_ahead_drop=self._ahead_drop)
        self._meta_loads, self._meta_zero, self._meta_load_blocks, self._ahead_drop = {}, {}, {}, []
        if self.policy is not None:
            self._observe_step(scheduler_output)
        try:  # the saves planned below add their block hashes to meta.block_hashes (TP > 1)
            return self._plan_saves(scheduler_output, meta)
        finally:
            self._meta_hashes = {}

    def _plan_read_ahead(self) -> dict[str, list[tuple[int, bytes]]]:
        """Pages ((group, key)) of the requests offered a restore this step that got no blocks, for the workers to
        read ahead; each request once, at most READ_AHEAD_REQUESTS outstanding (a read-ahead whose restore does not
        start within load_timeout_s is dropped by the workers and forgotten here)."""
        now = time.monotonic()
        ttl = max(self.cfg.load_timeout_s, 1.0)
        for rid in [r for r, t in self._ahead_sent.items() if now - t > ttl]:
            del self._ahead_sent[rid]
        out: dict[str, list[tuple[int, bytes]]] = {}
        for rid, (request, start, hit) in self._ahead_wanted.items():
            if rid in self._ahead_sent or len(self._ahead_sent) >= READ_AHEAD_REQUESTS:
                continue
            pages: list[tuple[int, bytes]] = []
            for g in self.layouts:
                if not g.persists or g.kind not in READ_AHEAD_KINDS:
                    continue  # read when its restore starts
                first = start // g.block_size
                for j in g.needed_blocks(hit // g.block_size):
                    key = self.namer.key(g, request.block_hashes, j, self._meta_hashes) if j >= first else None
                    if key is not None:
                        pages.append((g.group_id, bytes(key)))
            if pages:
                out[rid] = pages
                self._ahead_sent[rid] = now
        self._ahead_wanted.clear()
        return out

    def _observe_step(self, scheduler_output: SchedulerOutput) -> None:
        """Feed the restore policy this step's scheduled tokens and the prompt tokens the GPU still has to prefill
        (admitted requests not waiting for a restore)."""
        assert self.policy is not None
        sched = scheduler_output.num_scheduled_tokens
        queued = 0
        for rid, st in self._reqs.items():
            if rid in self._planned:
                continue
            req = st.request
            left = getattr(req, "num_prompt_tokens", 0) - req.num_computed_tokens - sched.get(rid, 0)
            if left > 0:
                queued += left
        total = getattr(scheduler_output, "total_num_scheduled_tokens", None)
        self.policy.on_step(time.monotonic(), int(total if total is not None else sum(sched.values())), queued)

    def _plan_saves(self, scheduler_output: SchedulerOutput, meta: ADPMetadata) -> ADPMetadata:
        """Add the blocks this step fills (and the Mamba boundary states it offers) to ``meta.saves``."""
        if self.legacy:
            self.tables.update(scheduler_output)
            bs_state: Any = self.tables
        else:
            bs_state = getattr(scheduler_output, "kv_connector_block_state", None)
        store = self.link.store
        if self.cfg.save and store is None:  # blocks computed now go unsaved: later local hits walk them again
            self._resave_until = time.monotonic() + RECENT_SAVE_TTL_S
        if not self.cfg.save or store is None or bs_state is None:
            return meta
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens or {}
        offloads = getattr(bs_state, "boundary_state_offloads", None) or {}
        legacy_states = self.legacy and any(g.persists and g.kind is GroupKind.STATE for g in self.layouts)
        hashes_out = meta.block_hashes
        cand: list[PageRef] = []
        for rid, n_sched in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(rid)
            if st is None:
                continue
            req = st.request
            hashes = req.block_hashes
            computed = req.num_computed_tokens + n_sched - len(spec_tokens.get(rid, ()))
            done = min(computed, publishable_hashes(req) * self.hash_block_size)
            table = bs_state.get_block_ids(rid)
            if table is None:
                continue
            for g in self.layouts:
                if not g.persists or g.kind is GroupKind.STATE:
                    continue
                ids = table[g.group_id]
                upto = min(done // g.block_size, len(ids))
                for j in range(st.saved_blocks.get(g.group_id, 0), upto):
                    key = self.namer.key(g, hashes, j, hashes_out) if ids[j] != 0 else None
                    if key is not None:
                        cand.append((g.group_id, ids[j], bytes(key)))
                st.saved_blocks[g.group_id] = max(st.saved_blocks.get(g.group_id, 0), upto)
            boundaries = offloads.get(rid, ())
            if legacy_states:
                boundaries = self._legacy_boundary_states(table, req.num_computed_tokens, computed)
            for gid, bid, boundary in boundaries:
                g = self.layouts[gid]
                if not g.persists or g.kind is not GroupKind.STATE or boundary % g.block_size or bid == 0:
                    continue
                key = self.namer.key(g, hashes, boundary // g.block_size - 1, hashes_out)
                if key is not None:
                    cand.append((gid, bid, bytes(key)))
        if len({k for _, _, k in cand}) != len(cand):  # several requests filled the same block this step
            seen: set[bytes] = set()
            unique = [c for c in cand if not (c[2] in seen or seen.add(c[2]))]
            self.counters.add(saves_deduped=len(cand) - len(unique))
            cand = unique
        now = time.monotonic()
        recent = self._recent_saves
        cand = [c for c in cand
                if c[2] in self._suspect or now - recent.get(c[2], -RECENT_SAVE_TTL_S) >= RECENT_SAVE_TTL_S]
        if cand:
            known = store.contains([k for _, _, k in cand])
            meta.saves = [c for c, k in zip(cand, known, strict=True)
                          if not k or c[2] in self._suspect or self._is_lost(c[2])]
            self._suspect.difference_update(k for _, _, k in meta.saves)
            for _, _, k in meta.saves:
                recent[k] = now
                recent.move_to_end(k)
            while len(self._recent_saves) > RECENT_SAVES:
                self._recent_saves.popitem(last=False)
        return meta

    def _legacy_boundary_states(self, table: list[list[int]], computed_before: int,
                                done: int) -> list[tuple[int, int, int]]:
        """vLLM 0.26 (no ``boundary_state_offloads``): the Mamba "align" states this step commits, as
        ``(group, block id, boundary tokens)``.

        In 0.26's "align" mode the running state of a request lives in its last block
        (``MambaManager.allocate_new_blocks``, no speculative blocks: block ``cdiv(tokens, block) - 1`` of its
        table, earlier positions null), and the scheduler ends prefill chunks on block boundaries
        (``Scheduler._mamba_block_aligned_split``). A step that ends exactly on a boundary past the request's
        computed tokens therefore leaves the state at that boundary in block ``done / block - 1``; any other step
        commits no boundary state (a partial tail is never stored).
        """
        out: list[tuple[int, int, int]] = []
        for g in self.layouts:
            if not g.persists or g.kind is not GroupKind.STATE or done <= computed_before or done % g.block_size:
                continue
            ids = table[g.group_id] if g.group_id < len(table) else []
            j = done // g.block_size - 1
            if j < len(ids) and ids[j] != 0:
                out.append((g.group_id, ids[j], done))
        return out

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Remember failed restores so the recomputing request is not offered the same pages again;
        forget failed saves so a later request saves those pages again."""
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        failed_saves = getattr(wm, "failed_saves", ())
        for k in failed_saves:
            self._recent_saves.pop(k, None)
        if failed_saves:  # a request admitted with a local hit over those blocks saves them again
            self._resave_until = time.monotonic() + RECENT_SAVE_TTL_S
        for k in getattr(wm, "declined", ()):  # asked for again by the next request that computes it (counts for
            self._recent_saves.pop(k, None)  # its admission); no local hit is walked again for it
        lost = getattr(wm, "lost", ())
        if lost:
            self._lost_gen += 1
            now = time.monotonic()
            for k in lost:
                self._lost[k] = now
                self._lost.move_to_end(k)
                self._recent_saves.pop(k, None)  # save it again when a request computes it
            while len(self._lost) > LOST_KEYS:
                self._lost.popitem(last=False)
        reported = set(getattr(wm, "failed_loads", ()))
        failed = set(getattr(connector_output, "failed_recving", None) or ()) | reported
        if failed:
            self._failed.update(failed)
            lost_set = set(lost)
            for rid in failed:
                # The recompute rewrites the pages the card did not serve (the worker discarded the ones that failed
                # verification): those the workers named, or, without their report, every page of the restore.
                st = self._reqs.get(rid)
                if st is not None:
                    st.saved_blocks.clear()
                planned = self._planned.pop(rid, ())
                self._suspect.update(k for k in planned if k in lost_set or rid not in reported)
        for rid in getattr(connector_output, "finished_recving", None) or ():
            if rid not in (failed or ()):
                self._planned.pop(rid, None)
        if self.policy is not None:
            now = time.monotonic()
            for rid in (*failed, *(getattr(connector_output, "finished_recving", None) or ())):
                self.policy.on_restore_done(rid, now)

    def request_finished(self, rid: str) -> None:
        """Forget a finished request (its saves were staged when its blocks were computed)."""
        self._reqs.pop(rid, None)
        self._key_cache.pop(rid, None)
        self._last_lookup.pop(rid, None)
        self._local_hit.pop(rid, None)
        self.tables.drop(rid)
        self._planned.pop(rid, None)
        self._pending_hit.pop(rid, None)
        self._failed.discard(rid)
        self._ahead_wanted.pop(rid, None)
        if self._ahead_sent.pop(rid, None) is not None:  # finished (or aborted) before its restore started
            self._ahead_drop.append(rid)
        if self.policy is not None:
            self.policy.forget(rid)
