"""Presets of the vLLM scenario benchmarks: ``cpu-smoke`` (a tiny random-weight Llama, minutes on 2 cores) and
``gpu`` (the issue's sizes: 40-50k-token agent histories, 1..300 users; give ``--model``).

Each preset has ``engine`` settings shared by every scenario (a scenario may override them under its own
``engine`` key) and one dict per scenario. Sizes are tokens unless named ``*_bytes``.
"""

from __future__ import annotations

from typing import Any

MiB = 1 << 20
GiB = 1 << 30

PRESETS: dict[str, dict[str, Any]] = {
    "cpu-smoke": {
        "engine": {"model": "tiny:dense", "max_model_len": 8192, "kv_cache_bytes": 256 * MiB, "enforce_eager": True,
                   "load_format": "auto"},
        "target_capacity_bytes": 2 * GiB,
        "request_timeout_s": 600.0,
        "restart": {"prompts": 4, "prompt_len": 4000, "max_tokens": 16},
        # dense tiny model: 2 KiB of KV per token, so 16 MiB holds 8192 tokens: 2 agents fit, 4 evict each other
        "agents": {"agent_counts": [1, 2, 4], "history_len": 3000, "turn_tokens": 256, "max_tokens": 32, "turns": 3,
                   "speed_floor_tps": 20.0, "engine": {"kv_cache_bytes": 16 * MiB, "max_model_len": 6144}},
        # 8 shared 1500-token contexts (12k tokens) against 8192 tokens of KV memory
        "sweep": {"users": [1, 4, 16], "requests_per_user": 2, "contexts": 8, "context_len": 1500, "suffix_len": 64,
                  "max_tokens": 16, "warmup": True, "engine": {"kv_cache_bytes": 16 * MiB, "max_model_len": 4096}},
    },
    "gpu": {
        "engine": {"model": None, "max_model_len": 65536, "kv_cache_bytes": None, "gpu_memory_utilization": 0.9,
                   "enforce_eager": False, "load_format": "auto"},
        "target_capacity_bytes": 512 * GiB,
        "offload_cpu_bytes": 64 * GiB,  # the cpu-offload arm's RAM tier (the H200 host has 128 GiB)
        "request_timeout_s": 1800.0,
        "restart": {"prompts": 16, "prompt_len": 32000, "max_tokens": 64},
        # an 8B Llama has 128 KiB of KV per token: 24 GiB hold ~190k tokens, i.e. 4 agents of 45k; 8 and 16 evict
        "agents": {"agent_counts": [1, 4, 8, 16], "history_len": 40000, "turn_tokens": 1500, "max_tokens": 128,
                   "turns": 6, "speed_floor_tps": 20.0, "engine": {"kv_cache_bytes": 24 * GiB}},
        "sweep": {"users": [1, 8, 32, 64, 128, 200, 300], "requests_per_user": 4, "contexts": 64, "context_len": 8000,
                  "suffix_len": 256, "max_tokens": 128, "warmup": True, "engine": {"kv_cache_bytes": 24 * GiB}},
    },
}


def scenario_preset(preset: str, scenario: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(engine settings, scenario parameters, run settings) of ``scenario`` in ``preset`` (copies)."""
    p = PRESETS[preset]
    params = dict(p[scenario])
    engine = dict(p["engine"])
    engine.update(params.pop("engine", {}))
    run = {"target_capacity_bytes": p["target_capacity_bytes"], "request_timeout_s": p["request_timeout_s"],
           "offload_cpu_bytes": p.get("offload_cpu_bytes", p["target_capacity_bytes"])}
    return engine, params, run
