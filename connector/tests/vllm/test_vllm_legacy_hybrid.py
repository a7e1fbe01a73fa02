"""vLLM 0.26 and Mamba/GDN hybrids (issue 16 item 3): the three gaps of 0.26 and what the connector does about them.

* the local hit as the maximum over groups -> :mod:`adp_connector.vllm.legacy_hybrid_hits` (checked patch);
* state registered per tensor -> :func:`adp_connector.vllm.compat.state_page_view`;
* no ``boundary_state_offloads``, Nemotron-H in mode "all" -> ``SchedulerSide._legacy_boundary_states`` ("align")
  and the ``STATE_ALL`` group kind ("all").

The shims are tested on stand-ins (no engine); where the installed vLLM is 0.26, also against its own classes.
"""

from __future__ import annotations

import inspect
import math
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from adp_connector.vllm import compat, legacy_hybrid_hits  # noqa: E402
from adp_connector.vllm.config import ADPConfig  # noqa: E402
from adp_connector.vllm.layouts import (  # noqa: E402
    GroupKind,
    GroupLayout,
    LayerLayout,
    LayerRole,
    best_hit,
    describe_group,
)
from adp_connector.vllm.scheduler import SchedulerSide  # noqa: E402

# ---------------------------------------------------------------------------- gap 1: the local hit


class _Coordinator:
    """Stand-in with 0.26's two lookups: group 0 (attention) hits 3 blocks, group 1 (Mamba) 1 block."""

    def find_longest_cache_hit_per_group(self, block_hashes: list[Any], max_cache_hit_length: int) -> Any:
        return (["a0", "a1", "a2"], ["null", "m1"]), (48, 32)  # what 0.26 computes: each group on its own

    def find_longest_cache_hit(self, block_hashes: list[Any], max_cache_hit_length: int) -> Any:
        return (["a0", "a1"], ["null", "m1"]), 32, 0  # reconciled: the hit both groups have


def test_the_per_group_local_hit_becomes_the_hit_every_group_has() -> None:
    cls = type("Coord", (_Coordinator,), {})
    before = cls().find_longest_cache_hit_per_group([], 100)
    assert max(before[1]) == 48  # control: 0.26's scheduler would resume the Mamba group at 48 (state at 32)
    assert legacy_hybrid_hits.install(cls) is True
    blocks, hits = cls().find_longest_cache_hit_per_group([], 100)
    assert max(hits) == 32 and hits == (32, 32) and blocks == (["a0", "a1"], ["null", "m1"])
    assert legacy_hybrid_hits.install(cls) is True  # idempotent
    assert getattr(cls.find_longest_cache_hit_per_group, "_adp_reconciled_hit", False)


def test_the_hit_patch_refuses_what_it_does_not_know() -> None:
    class Renamed(_Coordinator):
        def find_longest_cache_hit_per_group(self, hashes: list[Any], limit: int) -> Any:  # type: ignore[override]
            return super().find_longest_cache_hit_per_group(hashes, limit)

    assert legacy_hybrid_hits.install(Renamed) is False
    assert not getattr(Renamed.find_longest_cache_hit_per_group, "_adp_reconciled_hit", False)
    assert legacy_hybrid_hits.install(type("NoLookup", (), {})) is False


def test_the_hit_patch_matches_the_installed_vllm_026(monkeypatch: pytest.MonkeyPatch) -> None:
    vllm = pytest.importorskip("vllm")
    if not vllm.__version__.startswith("0.26."):
        pytest.skip(f"vLLM {vllm.__version__}: the patch is installed on 0.26 only (the legacy path)")
    cls = pytest.importorskip("vllm.v1.core.kv_cache_coordinator").HybridKVCacheCoordinator
    sched = inspect.getsource(pytest.importorskip("vllm.v1.core.sched.scheduler"))
    assert "num_new_local_computed_tokens = max(per_group_hits)" in sched  # the 0.26 branch this patch is for
    monkeypatch.setattr(cls, "find_longest_cache_hit_per_group", cls.find_longest_cache_hit_per_group)
    assert legacy_hybrid_hits.install() is True
    assert getattr(cls.find_longest_cache_hit_per_group, "_adp_reconciled_hit", False)


# ---------------------------------------------------------------------------- gap 2: per-state registration


def _per_state_views(num_blocks: int, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype],
                     page: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """What vLLM 0.26's ``_reshape_kv_cache_tensors`` registers for a Mamba layer (its algorithm: as_strided views
    of one raw buffer, each state at the offset of the ones before it, every block stride the padded page)."""
    raw = torch.arange(num_blocks * page, dtype=torch.int64).remainder(251).to(torch.int8)
    views, off = [], 0
    for shape, dt in zip(shapes, dtypes, strict=True):
        es = torch.empty((), dtype=dt).element_size()
        stride = torch.empty((num_blocks, *shape)).stride()
        views.append(torch.as_strided(raw.view(dt), (num_blocks, *shape), (page // es, *stride[1:]), off // es))
        off += stride[0] * es
    return raw, views


def test_per_state_tensors_become_the_page_view() -> None:
    shapes, dtypes, page = [(3, 8), (2, 4, 4)], [torch.bfloat16, torch.float32], 512
    raw, views = _per_state_views(6, shapes, dtypes, page)
    real = sum(math.prod(s) * torch.empty((), dtype=d).element_size() for s, d in zip(shapes, dtypes, strict=True))
    v = compat.state_page_view("model.layers.0.mixer", views)
    assert v.dtype == torch.int8 and tuple(v.shape) == (6, real) and v.stride() == (page, 1)
    assert torch.equal(v, raw.view(6, page)[:, :real])  # every state byte, none of the padding
    v[4].fill_(7)  # the view writes the engine's states (a restore)
    assert torch.all(views[0][4].view(torch.int8) == 7) and torch.all(views[1][4].view(torch.int8) == 7)
    assert torch.equal(raw.view(6, page)[3], raw.view(6, page)[3]) and not torch.all(raw.view(6, page)[4, real:] == 7)


def test_per_state_tensors_in_another_layout_are_refused() -> None:
    _, views = _per_state_views(6, [(3, 8), (2, 4, 4)], [torch.bfloat16, torch.float32], 512)
    with pytest.raises(ValueError, match="state 1 is not at byte 48"):
        shifted = torch.as_strided(views[1], views[1].shape, views[1].stride(), views[1].storage_offset() + 1)
        compat.state_page_view("l", [views[0], shifted])  # a state at another place than 0.26 puts it
    with pytest.raises(ValueError, match="state 1"):
        compat.state_page_view("l", [views[0], views[1][:, :, :2]])  # a state not contiguous within its block
    with pytest.raises(ValueError, match="state 1"):
        compat.state_page_view("l", [views[0], torch.zeros(6, 2, 4, 4)])  # another buffer
    with pytest.raises(ValueError, match="no state tensors"):
        compat.state_page_view("l", [])


def test_the_026_mamba_page_is_the_states_without_padding() -> None:
    spec = type("MambaSpec", (), {"shapes": ((3, 8), (2, 4, 4)), "dtypes": (torch.bfloat16, torch.float32),
                                  "page_size_bytes": 512, "block_size": 16, "mamba_cache_mode": "align"})()
    g = describe_group(1, SimpleNamespace(kv_cache_spec=spec, layer_names=["model.layers.0.mixer"]))
    assert g.kind is GroupKind.STATE and g.page_bytes == 3 * 8 * 2 + 2 * 4 * 4 * 4


# ---------------------------------------------------------------------------- gap 3: cache modes, boundary states


def _mamba(mode: str) -> GroupLayout:
    spec = type("MambaSpec", (), {"shapes": ((4,),), "dtypes": (torch.float32,), "page_size_bytes": 16,
                                  "block_size": 16, "mamba_cache_mode": mode})()
    return describe_group(1, SimpleNamespace(kv_cache_spec=spec, layer_names=["model.layers.0.mixer"]))


def test_mamba_modes_map_to_what_a_hit_needs() -> None:
    align, every, none = _mamba("align"), _mamba("all"), _mamba("none")
    assert (align.kind, align.window_blocks, list(align.needed_blocks(3))) == (GroupKind.STATE, 1, [2])
    # "all": every block's state, and a hit restores all of them (vLLM hashes the allocated blocks after a load)
    assert (every.kind, list(every.needed_blocks(3))) == (GroupKind.STATE_ALL, [0, 1, 2])
    assert none.kind is GroupKind.UNSUPPORTED
    attn = GroupLayout(0, GroupKind.FULL, "FullAttentionSpec", 16, (LayerLayout("a", LayerRole.KV, 64),))
    assert best_hit([attn, every], {0: [True] * 4, 1: [True, False, True, True]}, 63) == 16  # a gap stops it
    assert best_hit([attn, every], {0: [True] * 4, 1: [True] * 4}, 63) == 48
    assert best_hit([attn, align], {0: [True] * 4, 1: [False, False, True, False]}, 63) == 48


def _legacy_side(layouts: list[GroupLayout]) -> SchedulerSide:
    side = SchedulerSide.__new__(SchedulerSide)
    side.layouts, side.legacy = layouts, True
    return side


def test_026_align_boundary_states_are_read_from_the_block_table() -> None:
    attn = GroupLayout(0, GroupKind.FULL, "FullAttentionSpec", 16, (LayerLayout("a", LayerRole.KV, 64),))
    side = _legacy_side([attn, _mamba("align")])
    table = [[11, 12, 13, 14], [0, 0, 23, 0]]
    assert side._legacy_boundary_states(table, 0, 48) == [(1, 23, 48)]  # a chunk ended on a boundary: its state
    assert side._legacy_boundary_states(table, 0, 50) == []  # mid-block: a partial tail, never stored
    assert side._legacy_boundary_states(table, 48, 48) == []  # nothing computed this step
    assert side._legacy_boundary_states(table, 16, 32) == []  # the position is null: no state there
    assert _legacy_side([attn, _mamba("all")])._legacy_boundary_states(table, 0, 48) == []  # "all": saved as blocks


def _groups(*kinds: GroupKind) -> list[GroupLayout]:
    return [GroupLayout(i, k, "MambaSpec" if k in (GroupKind.STATE, GroupKind.STATE_ALL) else "FullAttentionSpec",
                        16, (LayerLayout(f"l{i}", LayerRole.KV, 64),)) for i, k in enumerate(kinds)]


def test_026_serves_hybrids_with_its_shims_and_refuses_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat.legacy_invalid_blocks, "install", lambda: True)
    monkeypatch.setattr(compat.legacy_hybrid_hits, "install", lambda: True)
    compat.check_legacy_layouts("0.26.0", _groups(GroupKind.FULL, GroupKind.STATE), hash_block_size=16)
    compat.check_legacy_layouts("0.26.0", _groups(GroupKind.FULL, GroupKind.STATE_ALL), hash_block_size=8)
    compat.check_legacy_layouts("0.26.0", _groups(GroupKind.FULL, GroupKind.FULL), speculative=True)  # not hybrid
    for kind in (GroupKind.STATE, GroupKind.STATE_ALL):
        with pytest.raises(RuntimeError, match=r"cannot serve this model safely: .*with speculative decoding"):
            compat.check_legacy_layouts("0.26.0", _groups(GroupKind.FULL, kind), speculative=True)
    with pytest.raises(RuntimeError, match=r"cannot serve this model safely: .*hashed every 8 tokens"):
        compat.check_legacy_layouts("0.26.0", _groups(GroupKind.FULL, GroupKind.STATE), hash_block_size=8)
    monkeypatch.setattr(compat.legacy_hybrid_hits, "install", lambda: False)
    with pytest.raises(RuntimeError, match=r"cannot serve this model safely: a Mamba/GDN hybrid: .*maximum"):
        compat.check_legacy_layouts("0.26.0", _groups(GroupKind.FULL, GroupKind.STATE), hash_block_size=16)


def _legacy_saves(mamba: GroupLayout, mamba_table: list[int], n_sched: int) -> list[tuple[int, int, bytes]]:
    """The saves the scheduler side plans on 0.26 (block tables from the scheduler output) for one new request
    that computes ``n_sched`` of its 64 tokens this step."""
    from adp_connector.pipeline.counters import Counters

    attn = GroupLayout(0, GroupKind.FULL, "FullAttentionSpec", 16, (LayerLayout("a", LayerRole.KV, 64),))
    cfg = ADPConfig()  # the defaults: saves and loads on, one block is a hit
    namer = SimpleNamespace(hash_block_size=16, sends_hashes=lambda g: False,
                            key=lambda g, hashes, j, out=None: f"{g.group_id}:{hashes[j]}".encode()
                            if j < len(hashes) else None)
    link = SimpleNamespace(store=SimpleNamespace(contains=lambda keys: [False] * len(keys)))
    side = SchedulerSide(cfg, [attn, mamba], namer, link, Counters(), legacy=True)  # type: ignore[arg-type]
    req = SimpleNamespace(request_id="r", block_hashes=["h0", "h1", "h2", "h3"], num_tokens=64, num_computed_tokens=0)
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ()), 0)  # type: ignore[arg-type]
    so = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="r", block_ids=([11, 12, 13, 14], mamba_table))],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set()),
        num_scheduled_tokens={"r": n_sched}, scheduled_spec_decode_tokens={})
    return sorted(side.build_connector_meta(so).saves)  # type: ignore[arg-type]


def test_026_saves_every_state_in_mode_all_and_the_boundary_state_in_align() -> None:
    attn_saves = [(0, 11, b"0:h0"), (0, 12, b"0:h1"), (0, 13, b"0:h2")]
    assert _legacy_saves(_mamba("all"), [21, 22, 23, 24], 48) == [
        *attn_saves, (1, 21, b"1:h0"), (1, 22, b"1:h1"), (1, 23, b"1:h2")]  # "all": every full block's state
    assert _legacy_saves(_mamba("align"), [0, 0, 23, 0], 48) == [*attn_saves, (1, 23, b"1:h2")]
    assert _legacy_saves(_mamba("align"), [0, 0, 0, 24], 50) == attn_saves  # control: mid-block, no state
    assert _legacy_saves(_mamba("none"), [21, 22, 23, 24], 48) == attn_saves  # mode none: no state is stored


def _planned_restore(mamba: GroupLayout, mamba_ids: list[int]) -> list[tuple[int, int, bytes]]:
    """The pages a 48-token external hit (of a 64-token request, nothing local) restores."""
    from adp_connector.pipeline.counters import Counters

    attn = GroupLayout(0, GroupKind.FULL, "FullAttentionSpec", 16, (LayerLayout("a", LayerRole.KV, 64),))
    cfg = ADPConfig()  # the defaults: saves and loads on, one block is a hit
    namer = SimpleNamespace(hash_block_size=16, sends_hashes=lambda g: False,
                            key=lambda g, hashes, j, out=None: f"{g.group_id}:{hashes[j]}".encode())
    link = SimpleNamespace(store=SimpleNamespace(contains=lambda keys: [True] * len(keys)))
    side = SchedulerSide(cfg, [attn, mamba], namer, link, Counters(), legacy=True)  # type: ignore[arg-type]
    req = SimpleNamespace(request_id="r", block_hashes=["h0", "h1", "h2", "h3"], num_tokens=64, num_computed_tokens=0,
                          skip_reading_prefix_cache=False)
    assert side.get_num_new_matched_tokens(req, 0) == (48, True)  # type: ignore[arg-type]
    blocks = SimpleNamespace(get_block_ids=lambda: ([11, 12, 13], mamba_ids))
    side.update_state_after_alloc(req, blocks, 48)  # type: ignore[arg-type]
    return sorted(side._meta_loads["r"])


def test_the_policy_counts_the_bytes_a_mode_all_restore_reads() -> None:
    """restore_policy weighs a hit by the bytes its restore reads: on vLLM 0.26 one state of a mode-"all" group (the
    one 0.26 allocates), on later vLLM every state of the hit (the control)."""
    attn = GroupLayout(0, GroupKind.FULL, "FullAttentionSpec", 16, (LayerLayout("a", LayerRole.KV, 64),))
    every = _mamba("all")
    side = _legacy_side([attn, every])
    assert side._hit_bytes(0, 48) == 3 * attn.page_bytes + every.page_bytes
    side.legacy = False
    assert side._hit_bytes(0, 48) == 3 * (attn.page_bytes + every.page_bytes)


def test_a_hit_restores_every_state_in_mode_all_and_the_last_in_align() -> None:
    attn = [(0, 11, b"0:h0"), (0, 12, b"0:h1"), (0, 13, b"0:h2")]
    assert _planned_restore(_mamba("all"), [21, 22, 23]) == [*attn, (1, 21, b"1:h0"), (1, 22, b"1:h1"),
                                                             (1, 23, b"1:h2")]
    assert _planned_restore(_mamba("align"), [0, 0, 23]) == [*attn, (1, 23, b"1:h2")]
    assert _planned_restore(_mamba("all"), [21, 0, 23]) == [*attn, (1, 21, b"1:h0"), (1, 23, b"1:h2")]
    assert _planned_restore(_mamba("all"), [21, 22, 0]) == []  # control: no block for the boundary state
    assert _planned_restore(_mamba("align"), [0, 22, 0]) == []  # nor in align


def _mamba_all_table_026(block: int, hit: int) -> list[int]:
    """The Mamba block ids vLLM 0.26's own ``MambaManager`` (mode "all") gives a new request with an external hit of
    ``hit`` tokens and nothing local: what ``KVCacheCoordinator`` calls at admission, in its order."""
    vllm = pytest.importorskip("vllm")
    if not vllm.__version__.startswith("0.26."):
        pytest.skip(f"vLLM {vllm.__version__}: 0.26's allocation is what this reproduces")
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager
    from vllm.v1.kv_cache_interface import MambaSpec

    spec = MambaSpec(block_size=block, shapes=((4,),), dtypes=(torch.float32,), mamba_cache_mode="all")
    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=block)
    mgr = MambaManager(spec, pool, enable_caching=True, kv_cache_group_id=1, scheduler_block_size=block)
    mgr.add_local_computed_blocks("r", [], 0, hit)
    mgr.allocate_external_computed_blocks("r", 0, hit)
    return [b.block_id for b in mgr.req_to_blocks["r"]]


def test_a_mode_all_hit_restores_the_one_state_vllm_026_allocates() -> None:
    """The H200 run of Nemotron-H on vLLM 0.26 (mode "all", block 384, 1200-token prompts, a 1152-token hit): 0.26
    allocates only the boundary state's block, the two before it are null. Both restores fell back there
    ("nothing restorable was planned") before the connector skipped those null states."""
    ids = _mamba_all_table_026(384, 1152)
    assert len(ids) == 3 and ids[:2] == [0, 0] and ids[2] != 0  # what 0.26 itself allocates
    # the same 3-block hit at the stand-ins' block size (16 tokens: 48 of 64), on the table 0.26 builds
    pages = _planned_restore(_mamba("all"), ids)
    assert pages == [(0, 11, b"0:h0"), (0, 12, b"0:h1"), (0, 13, b"0:h2"), (1, ids[2], b"1:h2")]


def test_restore_policy_counts_the_other_requests_on_the_gpu() -> None:
    """restore_policy auto, through the scheduler side: a restore a little slower than its recompute is declined
    while the request is alone (the control), and taken once two other requests run on the GPU, whom the
    recompute would delay too (GPU run 9, 8 agents)."""
    from adp_connector.pipeline.counters import Counters
    from adp_connector.pipeline.policy import MIN_SAMPLES

    attn = GroupLayout(0, GroupKind.FULL, "FullAttentionSpec", 16, (LayerLayout("a", LayerRole.KV, 64),))
    namer = SimpleNamespace(hash_block_size=16, sends_hashes=lambda g: False,
                            key=lambda g, hashes, j, out=None: f"{g.group_id}:{hashes[j]}".encode())
    link = SimpleNamespace(store=SimpleNamespace(contains=lambda keys: [True] * len(keys)))
    side = SchedulerSide(ADPConfig(), [attn], namer, link, Counters(), legacy=True)  # type: ignore[arg-type]
    assert side.policy is not None  # auto is the default
    for i in range(MIN_SAMPLES + 1):  # 1000 prompt tokens/s: a 48-token recompute takes 0.048 s
        side.policy.on_step(float(i), 1000, 0)
    for i in range(MIN_SAMPLES):  # 1920 B/s from the card: the hit's 192 bytes take 0.1 s
        side.policy.on_restore_planned(f"m{i}", 192, 10.0 + i)
        side.policy.on_restore_done(f"m{i}", 10.1 + i)

    def ask(rid: str) -> tuple[int, bool]:
        req = SimpleNamespace(request_id=rid, block_hashes=["h0", "h1", "h2", "h3"], num_tokens=64,
                              num_computed_tokens=0, skip_reading_prefix_cache=False)
        return side.get_num_new_matched_tokens(req, 0)  # type: ignore[arg-type]

    assert ask("alone") == (0, False) and side.counters["restores_declined"] == 1
    for rid in ("o1", "o2"):  # two requests running on the GPU (admitted, nothing to restore)
        other = SimpleNamespace(request_id=rid, block_hashes=[], num_tokens=64, num_computed_tokens=0,
                                num_prompt_tokens=64, skip_reading_prefix_cache=False)
        side.update_state_after_alloc(other, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4],)), 0)  # type: ignore[arg-type]
    assert ask("busy") == (48, True)
