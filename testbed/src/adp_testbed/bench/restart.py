"""``testbed bench restart``: N independent prompts cold, engine restarted (device KV cache wiped), same prompts warm.

Per arm: a fresh ``vllm serve`` runs the prompts one at a time (cold; confirmed cold by the prefix-cache counters:
no local or external hit, every prompt token queried), then the same prompts again in the same engine (a local
prefix-cache hit: the reference with the compute shapes of a restored run); the server is stopped (its whole process
group) and a new one runs the prompts again (warm). The baseline arm recomputes; the connector arm restores from the
target. Reports TTFT cold vs warm and the counters.

The verdict cannot flip on numerics: a random bf16 model may change a greedy token between a full prefill and any
run whose prefix was cached, locally or restored. So the warm (restored) outputs are compared with the local-hit
reference, which has the compute shapes of a restored run, and every restored page is compared byte for byte with
the page that was saved (the connector's audit log: digests of the KV blocks as saved, and as found in the KV cache
after the restore). Identity with the cold full prefill is reported as information only. ``--corrupt-card`` is the
negative control: it flips payload bytes of every stored page between the phases, so the verdict must fail.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

from .. import options as O
from ..card_faults import corrupt_payloads
from . import common as C
from .traffic import Client, Progress, Result, independent_prompts, summary

SETTLE_S = 1.5  # after a phase: let counters reach /metrics and the connector's saves land


def add_arguments(p: argparse.ArgumentParser) -> None:
    C.add_common_arguments(p)
    p.add_argument("--prompts", type=O.int_in(1, 1_000_000), help="independent prompts")
    p.add_argument("--prompt-len", type=C.TOKENS, help="tokens per prompt")
    p.add_argument("--max-tokens", type=C.TOKENS, help="greedy tokens generated per prompt")
    p.add_argument("--corrupt-card", action="store_true",
                   help="negative control: between the cold and warm phases flip payload bytes of every page stored "
                        "on the local emulator (never a card at --target); the acceptance must then fail")


def _pass(client: Client, prompts: list[list[int]], max_tokens: int, label: str) -> list[Result]:
    bar = Progress(len(prompts), label)
    out = []
    for p in prompts:
        out.append(client.complete(p, max_tokens))
        bar.update()
    return out


def _is_adp(kv: dict[str, Any] | None) -> bool:
    return kv is not None and kv.get("kv_connector") == "ADPConnector"


def _with_audit(kv: dict[str, Any] | None, audit_dir: Path) -> dict[str, Any] | None:
    """The ADP connector's config with its page audit log in ``audit_dir`` (other arms unchanged)."""
    if not _is_adp(kv):
        return kv
    kv = copy.deepcopy(kv)
    kv["kv_connector_extra_config"]["audit_path"] = str(audit_dir)
    # this scenario measures what a restore costs and checks what it delivers, so every hit is restored unless
    # --connector-opt restore_policy=... says otherwise (auto may recompute a hit the card serves slower)
    kv["kv_connector_extra_config"].setdefault("restore_policy", "always")
    return kv


def _audit_records(audit_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for f in sorted(audit_dir.glob("pages-*.jsonl"))
            for line in f.read_text().splitlines() if line]


def _connector_totals(audit_dir: Path) -> dict[str, float]:
    """The connector's running totals of one engine (scheduler + workers), written beside its audit log."""
    tot: dict[str, float] = {}
    for f in audit_dir.glob("stats-*.json"):
        for k, v in json.loads(f.read_text()).items():
            tot[k] = tot.get(k, 0) + v
    return tot


def page_comparison(cold_audit: Path, warm_audit: Path) -> dict[str, int]:
    """Every page restored in the warm phase against the digest of the page the cold phase saved under its key."""
    saved = {r["key"]: r["sha256"] for r in _audit_records(cold_audit) if r["op"] == "save"}
    loads = [r for r in _audit_records(warm_audit) if r["op"] == "load"]
    totals = _connector_totals(warm_audit)
    return {"pages_saved": len(saved), "pages_compared": len(loads),
            "pages_mismatched": sum(saved.get(r["key"]) != r["sha256"] for r in loads),
            "load_fallbacks": int(totals.get("load_fallbacks", 0)),
            "verify_failures": int(totals.get("verify_failures", 0))}


def _phase(run: C.Run, arm: str, kv: dict[str, Any] | None, phase: str, prompts: list[list[int]]) -> dict[str, Any]:
    max_tokens = run.params["max_tokens"]
    kv = _with_audit(kv, run.out / "audit" / f"{arm}-{phase}")
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
    corrupted = None
    if run.args.corrupt_card and run.card is not None:
        c = run.card
        corrupted = corrupt_payloads(c.backing, c.traddr, c.trsvcid, c.subnqn)
        print(f"[restart] negative control: payload bytes of {corrupted} stored page(s) flipped on the card",
              file=sys.stderr)
    warm = _phase(run, arm, kv, "warm", prompts)
    cold_ids = [r["token_ids"] for r in cold["requests"]]
    warm_ids = [r["token_ids"] for r in warm["requests"]]
    ok = all(r["ok"] for r in cold["requests"] + warm["requests"])
    pages: dict[str, Any] = {}
    if _is_adp(kv):  # compare the restored pages
        pages = page_comparison(run.out / "audit" / f"{arm}-cold", run.out / "audit" / f"{arm}-warm")
        pages["corrupted_pages"] = corrupted
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
        # the verdict's comparison: the local-hit reference has the compute shapes of a restored run
        "outputs_identical": ok and cold["reference_token_ids"] == warm_ids,
        "outputs_identical_to_full_prefill": ok and cold_ids == warm_ids,  # information only: may flip on numerics
        "failed": cold["failed"] + warm["failed"],
        **pages,
    }
    return {"summary": summ, "phases": {"cold": cold, "warm": warm}}


def acceptance(s: dict[str, Any]) -> dict[str, bool]:
    """The connector arm's verdict: cold really cold, warm restored, and what was restored is what was saved."""
    acc = {"cold_hits_zero": bool(s["cold_hits"] == 0 and s["cold_confirmed"]),
           "warm_hits_positive": s["warm_hits"] > 0,
           "outputs_identical": bool(s["outputs_identical"]),  # to the local-hit reference
           "restored_pages_compared": s["pages_compared"] > 0,
           "restored_pages_identical": s["pages_mismatched"] == 0,
           "no_load_fallbacks": s["load_fallbacks"] == 0}
    acc["ok"] = all(acc.values())
    return acc


def main(args: argparse.Namespace) -> int:
    if args.corrupt_card and args.target:
        raise O.UsageError("testbed bench restart: --corrupt-card writes into the local emulator's pages; it is "
                           "refused with --target (a card at an address is never corrupted)")
    run = C.Run("restart", args, {"prompts": args.prompts, "prompt_len": args.prompt_len,
                                  "max_tokens": args.max_tokens})
    arms = run.run_arms(lambda arm, kv: _arm(run, arm, kv))
    acc = acceptance(arms["adp"]["summary"]) if arms["adp"].get("available") else None
    result = run.finish(arms, {"acceptance": acc, "negative_control": bool(args.corrupt_card)})
    for arm, a in result["arms"].items():
        if not a.get("available"):
            print(f"{arm:8} unavailable: {a['reason'][:200]}")
            continue
        s = a["summary"]
        print(f"{arm:8} TTFT cold {s['ttft_cold_mean_s']:.3f} s  warm {s['ttft_warm_mean_s']:.3f} s  "
              f"({s['warm_speedup']}x)  ext hits cold {s['cold_hits']:.0f} warm {s['warm_hits']:.0f}  "
              f"cold confirmed {s['cold_confirmed']}  outputs identical to the local-hit reference "
              f"{s['outputs_identical']} (to the full prefill {s['outputs_identical_to_full_prefill']}, information)")
        if "pages_compared" in s:
            print(f"{'':8} restored pages compared {s['pages_compared']}  mismatched {s['pages_mismatched']}  "
                  f"load fallbacks {s['load_fallbacks']}  verify failures {s['verify_failures']}")
    if acc is not None:
        print(f"acceptance: {acc}")
        if args.corrupt_card:
            print("negative control (--corrupt-card): this verdict is expected to fail")
        return 0 if acc["ok"] else 1
    print("acceptance: connector arm unavailable", file=sys.stderr)
    return 1 if "adp" in run.arms else 0
