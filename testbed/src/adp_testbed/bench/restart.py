"""``testbed bench restart``: N independent prompts cold, engine restarted (device KV cache wiped), same prompts warm.

Per arm: a fresh ``vllm serve`` runs the prompts one at a time (cold; confirmed cold by the prefix-cache counters:
no local or external hit, every prompt token queried), then the same prompts again in the same engine (a local
prefix-cache hit: the reference with the compute shapes of a restored run); the server is stopped (its whole process
group) and a new one runs the prompts again (warm). The baseline arm recomputes; the connector arm restores from the
target. Reports TTFT cold vs warm, the counters, and whether the greedy outputs are identical.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from . import common as C
from .traffic import Client, Progress, Result, independent_prompts, summary

SETTLE_S = 1.5  # after a phase: let counters reach /metrics and the connector's saves land


def add_arguments(p: argparse.ArgumentParser) -> None:
    C.add_common_arguments(p)
    p.add_argument("--prompts", type=int, help="independent prompts")
    p.add_argument("--prompt-len", type=int, help="tokens per prompt")
    p.add_argument("--max-tokens", type=int, help="greedy tokens generated per prompt")


def _pass(client: Client, prompts: list[list[int]], max_tokens: int, label: str) -> list[Result]:
    bar = Progress(len(prompts), label)
    out = []
    for p in prompts:
        out.append(client.complete(p, max_tokens))
        bar.update()
    return out


def _phase(run: C.Run, arm: str, kv: dict[str, Any] | None, phase: str, prompts: list[list[int]]) -> dict[str, Any]:
    max_tokens = run.params["max_tokens"]
    total = sum(len(p) for p in prompts)
    with run.server(arm, kv, phase) as srv:
        client = Client(srv.base_url, srv.spec.served_name, run.settings["request_timeout_s"])
        m0 = srv.metrics()
        res = _pass(client, prompts, max_tokens, f"{arm} {phase}")
        time.sleep(SETTLE_S)
        m1 = srv.metrics()
        ref: list[Result] = []
        if phase == "cold":
            ref = _pass(client, prompts, max_tokens, f"{arm} cold, local-hit reference")
            time.sleep(SETTLE_S)
        start_s = srv.start_seconds
    cnt = C.counter_phase(m0, m1)
    hits = cnt["prefix_cache_hits"] + cnt["external_prefix_cache_hits"]
    out: dict[str, Any] = {
        "engine_start_s": round(start_s, 1),
        "prompt_tokens": total,
        "ttft_s": summary([r.ttft_s for r in res if r.ttft_s is not None]),
        "failed": sum(not r.ok for r in res),
        "counters": cnt,
        "requests": [r.to_json(with_ids=True) for r in res],
    }
    if phase == "cold":
        queried = cnt["external_prefix_cache_queries"] if kv is not None else cnt["prefix_cache_queries"]
        out["cold_confirmed"] = bool(hits == 0 and queried == total)
        out["reference_ttft_s"] = summary([r.ttft_s for r in ref if r.ttft_s is not None])
        out["reference_token_ids"] = [r.token_ids for r in ref]
    return out


def _arm(run: C.Run, arm: str, kv: dict[str, Any] | None) -> dict[str, Any]:
    prm = run.params
    prompts = independent_prompts(prm["prompts"], prm["prompt_len"], run.args.seed)
    cold = _phase(run, arm, kv, "cold", prompts)
    warm = _phase(run, arm, kv, "warm", prompts)
    cold_ids = [r["token_ids"] for r in cold["requests"]]
    warm_ids = [r["token_ids"] for r in warm["requests"]]
    ok = all(r["ok"] for r in cold["requests"] + warm["requests"])
    c, w = cold["ttft_s"]["mean"], warm["ttft_s"]["mean"]
    summ = {
        "ttft_cold_mean_s": c, "ttft_warm_mean_s": w,
        "ttft_cold_p50_s": cold["ttft_s"]["p50"], "ttft_warm_p50_s": warm["ttft_s"]["p50"],
        "warm_speedup": round(c / w, 2) if c and w else None,
        "cold_confirmed": cold["cold_confirmed"],
        "cold_hits": cold["counters"]["external_prefix_cache_hits"],
        "cold_queries": cold["counters"]["external_prefix_cache_queries"],
        "warm_hits": warm["counters"]["external_prefix_cache_hits"],
        "warm_queries": warm["counters"]["external_prefix_cache_queries"],
        "warm_hit_fraction": round(warm["counters"]["external_prefix_cache_hits"] / warm["prompt_tokens"], 4),
        "outputs_identical": ok and cold_ids == warm_ids,
        "outputs_identical_to_local_hit": ok and cold["reference_token_ids"] == warm_ids,
        "failed": cold["failed"] + warm["failed"],
    }
    return {"summary": summ, "phases": {"cold": cold, "warm": warm}}


def main(args: argparse.Namespace) -> int:
    run = C.Run("restart", args, {"prompts": args.prompts, "prompt_len": args.prompt_len,
                                  "max_tokens": args.max_tokens})
    arms = run.run_arms(lambda arm, kv: _arm(run, arm, kv))
    acc = None
    if arms["adp"].get("available"):
        s = arms["adp"]["summary"]
        acc = {"cold_hits_zero": s["cold_hits"] == 0 and s["cold_confirmed"], "warm_hits_positive": s["warm_hits"] > 0,
               "outputs_identical": s["outputs_identical"]}
        acc["ok"] = all(acc.values())
    result = run.finish(arms, {"acceptance": acc})
    for arm, a in result["arms"].items():
        if not a.get("available"):
            print(f"{arm:8} unavailable: {a['reason'][:200]}")
            continue
        s = a["summary"]
        print(f"{arm:8} TTFT cold {s['ttft_cold_mean_s']:.3f} s  warm {s['ttft_warm_mean_s']:.3f} s  "
              f"({s['warm_speedup']}x)  ext hits cold {s['cold_hits']:.0f} warm {s['warm_hits']:.0f}  "
              f"cold confirmed {s['cold_confirmed']}  outputs identical {s['outputs_identical']}")
    if acc is not None:
        print(f"acceptance: {acc}")
        return 0 if acc["ok"] else 1
    print("acceptance: connector arm unavailable", file=sys.stderr)
    return 1 if "adp" in run.arms else 0
