"""``testbed bench agents``: 1, 4, 8, 16 (``--agents``) concurrent agents, each with its own growing history.

Every agent starts from its own seeded history and runs ``turns`` turns: it sends its whole history, gets
``max_tokens`` greedy tokens, and appends them plus ``turn_tokens`` new tokens (a tool result / user turn), so each
request reuses the previous one's prefix. The device KV memory is limited so that the agents' histories do not all
fit and evict each other; the connector arm can restore an evicted history from the target. Per agent count:
tokens/s per agent (output tokens over the agent's request time, prefill included) and the share of requests slower
than the speed floor. One engine per arm serves all counts; each count uses fresh histories.
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

from .. import options as O
from . import common as C
from .traffic import Client, Progress, Result, summary, tokens


def add_arguments(p: argparse.ArgumentParser) -> None:
    C.add_common_arguments(p)
    p.add_argument("--agents", type=C.COUNTS, dest="agent_counts", help="comma-separated agent counts (1,4,8,16)")
    p.add_argument("--history-len", type=C.TOKENS, help="tokens of each agent's initial history")
    p.add_argument("--turn-tokens", type=C.SOME_TOKENS, help="new tokens appended per turn (besides the output)")
    p.add_argument("--turns", type=O.int_in(1, 1_000_000), help="requests per agent")
    p.add_argument("--max-tokens", type=C.TOKENS, help="tokens generated per request")
    p.add_argument("--speed-floor", type=O.non_negative_number, dest="speed_floor_tps",
                   help="tokens/s a request should reach")


def _agent(client: Client, history: list[int], key: str, prm: dict[str, Any], t0: float, bar: Progress) -> list[Result]:
    out = []
    for turn in range(prm["turns"]):
        r = client.complete(history, prm["max_tokens"], t0)
        out.append(r)
        bar.update()
        history = history + r.token_ids + tokens(f"{key}-turn-{turn}", prm["turn_tokens"])
    return out


def _point(client: Client, run: C.Run, arm: str, n: int, srv: Any) -> dict[str, Any]:
    prm = run.params
    hist = []
    for a in range(n):
        h = tokens(f"agent-{run.args.seed}-{n}-{a}", prm["history_len"])
        h[0] = 3 + (n * 64 + a) % 29000  # no shared first block between agents or between counts
        hist.append(h)
    bar = Progress(n * prm["turns"], f"{arm} {n} agent(s)")
    m0 = srv.metrics()
    t0 = time.perf_counter()
    per: list[list[Result]] = [[] for _ in range(n)]

    def go(i: int) -> None:
        per[i] = _agent(client, hist[i], f"agent-{run.args.seed}-{n}-{i}", prm, t0, bar)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    time.sleep(1.0)
    cnt = C.counter_phase(m0, srv.metrics())
    floor = prm["speed_floor_tps"]
    agent_tps = []
    for rs in per:
        busy = sum(r.latency_s or 0 for r in rs if r.ok)
        agent_tps.append(sum(r.output_tokens for r in rs if r.ok) / busy if busy else 0.0)
    reqs = [r for rs in per for r in rs]
    detail = [dict(r.to_json(), agent=i, turn=j) for i, rs in enumerate(per) for j, r in enumerate(rs)]
    return {
        "agents": n, "requests": len(reqs), "failed": sum(not r.ok for r in reqs), "wall_s": round(wall, 2),
        "agent_tps": [round(x, 2) for x in agent_tps], "agent_tps_mean": round(sum(agent_tps) / n, 2),
        "agent_tps_min": round(min(agent_tps), 2), "agent_tps_max": round(max(agent_tps), 2),
        "below_floor_share": round(sum(r.tokens_per_s < floor for r in reqs) / len(reqs), 4),
        "ttft_s": summary([r.ttft_s for r in reqs if r.ttft_s is not None]),
        "prompt_tokens_max": max(r.prompt_tokens for r in reqs),
        "counters": cnt, "saves": C.save_rates(cnt, wall),
        "requests_detail": detail, "turn_spans_s": turn_spans(detail),
    }


def turn_spans(detail: list[dict[str, Any]]) -> list[float]:
    """Per turn, the seconds from the end of the turn before it (the point's start, for the first) until the last
    answered request of the turn ended. Agents overlap turns, so this is each turn's share of the point's wall time.
    The first turn is a cold prefill in every arm; the later ones are what a cache changes."""
    ends: dict[int, float] = {}
    for r in detail:
        if r.get("ok") and r.get("latency_s") is not None:
            ends[r["turn"]] = max(ends.get(r["turn"], 0.0), r["started_s"] + r["latency_s"])
    spans, prev = [], 0.0
    for turn in sorted(ends):
        spans.append(round(ends[turn] - prev, 2))
        prev = ends[turn]
    return spans


def later_turns_s(pt: dict[str, Any]) -> float | None:
    """The mean span of a point's turns after the first (None with fewer than two turns); for results written before
    ``turn_spans_s`` existed, taken from ``requests_detail``."""
    spans = pt.get("turn_spans_s")
    if spans is None:
        spans = turn_spans(pt.get("requests_detail", []))
    return sum(spans[1:]) / (len(spans) - 1) if len(spans) > 1 else None


def _arm(run: C.Run, arm: str, kv: dict[str, Any] | None) -> dict[str, Any]:
    prm = run.params
    longest = prm["history_len"] + prm["turns"] * (prm["turn_tokens"] + prm["max_tokens"])
    if longest >= run.engine["max_model_len"]:
        raise ValueError(f"histories grow to {longest} tokens, over max_model_len {run.engine['max_model_len']}")
    with run.server(arm, kv, "engine") as srv:
        client = Client(srv.base_url, srv.spec.served_name, run.settings["request_timeout_s"])
        points = []
        for n in prm["agent_counts"]:
            points.append(_point(client, run, arm, n, srv))
            run.checkpoint(arm, points[-1])
        start_s = srv.start_seconds
    return {"engine_start_s": round(start_s, 1), "points": points}


def ratios(arms: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per agent count, the connector arm's mean tokens/s per agent over the other arms' in the same run (issue #7
    goals: >= 6x the baseline at 8 agents, <= 2% cost at 1 agent, >= 0.8x the CPU tier where it holds the working
    set); ``adp_failed`` counts its failed requests. ``later_turns_vs_<arm>``: the other arm's mean turn span after
    the first turn over the connector arm's (about what the ratio tends to with more turns, the cold first turn
    being the same in every arm). Empty unless the adp arm ran."""
    adp = arms.get("adp", {})
    if not adp.get("available"):
        return []
    others = {a: {pt["agents"]: pt for pt in arms[a]["points"]} for a in ("baseline", "cpu-offload")
              if arms.get(a, {}).get("available")}
    out = []
    for pt in adp["points"]:
        row: dict[str, Any] = {"agents": pt["agents"], "adp_failed": pt["failed"]}
        ours = later_turns_s(pt)
        for arm, pts in others.items():
            ref = pts.get(pt["agents"])
            if ref is None:
                continue
            if ref["agent_tps_mean"]:
                row[f"vs_{arm}"] = round(pt["agent_tps_mean"] / ref["agent_tps_mean"], 3)
            theirs = later_turns_s(ref)
            if ours and theirs:
                row[f"later_turns_vs_{arm}"] = round(theirs / ours, 3)
        out.append(row)
    return out


def main(args: argparse.Namespace) -> int:
    run = C.Run("agents", args, {k: getattr(args, k) for k in ("agent_counts", "history_len", "turn_tokens", "turns",
                                                                "max_tokens", "speed_floor_tps")})
    arms = run.run_arms(lambda arm, kv: _arm(run, arm, kv))
    result = run.finish(arms, {"ratios": ratios(arms)})
    rc = C.print_points(result, run, lambda pt: (
        f"{pt['agents']:3} agents  {pt['agent_tps_mean']:7.1f} tok/s per agent "
        f"(min {pt['agent_tps_min']:.1f})  below floor {pt['below_floor_share']:.0%}  "
        f"TTFT p95 {pt['ttft_s']['p95']}  ext hits {pt['counters']['external_prefix_cache_hits']:.0f}  "
        f"failed {pt['failed']}" + C.save_line(pt) + C.hook_line(pt)))
    for r in result["ratios"]:
        print(ratio_line(r))
    return rc


def ratio_line(row: dict[str, Any]) -> str:
    """One row of :func:`ratios` as printed after the points."""
    def some(prefix: str) -> str:
        return "  ".join(f"{k.removeprefix(prefix)} {v:.2f}x" for k, v in row.items() if k.startswith(prefix))

    later = some("later_turns_vs_")
    return (f"adp / other arms at {row['agents']:3} agents: {some('vs_')}"
            + (f"  (turns after the first: {later})" if later else ""))
