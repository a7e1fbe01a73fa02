"""``testbed bench sweep``: 1..300 concurrent users (``--users``); p50/p95 TTFT, throughput and failures per point.

Users share a pool of ``contexts`` long documents (seeded); each request is one document (picked by a seeded RNG)
plus a unique ``suffix_len``-token question. With ``warmup`` every document is sent once first, so the pool exists
in some cache; the device KV memory holds only part of it, so the connector arm restores evicted documents from the
target while the baseline recomputes them. Each user sends ``requests_per_user`` requests one after another (closed
loop). One engine per arm serves all points.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from .. import options as O
from . import common as C
from . import serve as SV
from .traffic import Client, Progress, Result, run_concurrent, summary, tokens


def add_arguments(p: argparse.ArgumentParser) -> None:
    C.add_common_arguments(p)
    p.add_argument("--users", type=C.COUNTS, help="comma-separated concurrent user counts (1,8,32,...,300)")
    p.add_argument("--requests-per-user", type=O.int_in(1, 1_000_000))
    p.add_argument("--contexts", type=O.int_in(1, 1_000_000), help="shared documents in the pool")
    p.add_argument("--context-len", type=C.TOKENS, help="tokens per document")
    p.add_argument("--suffix-len", type=C.SOME_TOKENS, help="unique tokens per request after the document")
    p.add_argument("--max-tokens", type=C.TOKENS, help="tokens generated per request")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", default=None,
                   help="do not send every document once before the points")


def contexts(run: C.Run) -> list[list[int]]:
    prm = run.params
    out = []
    for i in range(prm["contexts"]):
        c = tokens(f"context-{run.args.seed}-{i}", prm["context_len"])
        c[0] = 3 + i
        out.append(c)
    return out


def _user(client: Client, docs: list[list[int]], run: C.Run, users: int, u: int, t0: float,
          bar: Progress) -> list[Result]:
    prm = run.params
    rng = random.Random(f"pick-{run.args.seed}-{users}-{u}")
    out = []
    for r in range(prm["requests_per_user"]):
        prompt = docs[rng.randrange(len(docs))] + tokens(f"q-{run.args.seed}-{users}-{u}-{r}", prm["suffix_len"])
        out.append(client.complete(prompt, prm["max_tokens"], t0))
        bar.update()
    return out


# save outcomes: a phase has settled when none of them moves (an idle engine reports its connector's counters only
# with a step, so the probes below drive one)
SETTLE_COUNTERS = ("adp_kv_pages_saved", "adp_kv_saves_dropped", "adp_kv_save_errors", "adp_kv_saves_not_admitted")
SETTLE_PROBE_TOKENS = 8  # under one block: a probe fills no block, so it saves nothing itself
SETTLE_QUIET_S = 3.0  # no outcome for this long: twice a save batch's mean time under load (run 21 warm-up: ~1.5 s)
SETTLE_TIMEOUT_S = 180.0


def settle(client: Client, srv: Any, seed: int, interval_s: float = 0.5, timeout_s: float = SETTLE_TIMEOUT_S,
           quiet_s: float = SETTLE_QUIET_S) -> dict[str, Any]:
    """Wait until the saves of the phase before have landed (or dropped); returns ``{"s": seconds waited,
    "settled": whether it went quiet before ``timeout_s``, "landed": each save outcome counted meanwhile}``.

    Each point starts from a quiet card, so it measures its own traffic: the warm-up's 64 documents ask the card for
    ~49 GB of saves, which ran on into the first point (GPU run 17: the 1-user point wrote 3,096 of them). A probe
    request of a few tokens every ``interval_s`` gives the engine a step; settled is ``quiet_s`` with no save outcome
    counted. What landed meanwhile belongs to the phase before (its counters were read before it had landed).
    """
    def outcomes() -> tuple[float, ...]:
        cnt = SV.counters(srv.metrics())
        return tuple(cnt.get(k, 0.0) for k in SETTLE_COUNTERS)

    t0 = time.perf_counter()
    first = last = outcomes()
    quiet_since = t0
    settled = False
    i = 0
    while True:
        client.complete(tokens(f"settle-{seed}-{i}", SETTLE_PROBE_TOKENS), 1)
        i += 1
        now = outcomes()
        t = time.perf_counter()
        if now != last:
            quiet_since = t
        last = now
        if t - quiet_since >= quiet_s:
            settled = True
            break
        if t - t0 >= timeout_s:
            break
        time.sleep(interval_s)
    landed = {k: b - a for k, a, b in zip(SETTLE_COUNTERS, first, last, strict=True)}
    return {"s": round(time.perf_counter() - t0, 2), "settled": settled, "landed": landed}


def _point(client: Client, docs: list[list[int]], run: C.Run, arm: str, users: int, srv: Any) -> dict[str, Any]:
    before = settle(client, srv, run.args.seed)
    bar = Progress(users * run.params["requests_per_user"], f"{arm} {users} user(s)")
    m0 = srv.metrics()
    t0 = time.perf_counter()
    per = run_concurrent([lambda u=u: _user(client, docs, run, users, u, t0, bar) for u in range(users)], users)
    wall = time.perf_counter() - t0
    time.sleep(1.0)
    cnt = C.counter_phase(m0, srv.metrics())
    reqs = [r for rs in per for r in rs]
    ok = [r for r in reqs if r.ok]
    errors = sorted({r.error for r in reqs if r.error})[:5]
    return {
        "users": users, "requests": len(reqs), "failed": len(reqs) - len(ok), "errors": errors,
        "settle_s": before["s"], "settled": before["settled"], "landed_while_settling": before["landed"],
        "wall_s": round(wall, 2),
        "ttft_s": summary([r.ttft_s for r in ok if r.ttft_s is not None]),
        "latency_s": summary([r.latency_s for r in ok if r.latency_s is not None]),
        "output_tps": round(sum(r.output_tokens for r in ok) / wall, 2),
        "requests_per_s": round(len(ok) / wall, 3), "counters": cnt, "saves": C.save_rates(cnt, wall),
    }


def _arm(run: C.Run, arm: str, kv: dict[str, Any] | None) -> dict[str, Any]:
    docs = contexts(run)
    with run.server(arm, kv, "engine") as srv:
        client = Client(srv.base_url, srv.spec.served_name, run.settings["request_timeout_s"])
        warm: dict[str, Any] | None = None
        if run.params["warmup"]:
            bar = Progress(len(docs), f"{arm} warm-up")
            m0 = srv.metrics()
            t0 = time.perf_counter()
            res = []
            for d in docs:
                res.append(client.complete(d, 1))
                bar.update()
            wall = time.perf_counter() - t0
            time.sleep(1.0)
            cnt = C.counter_phase(m0, srv.metrics())
            warm = {"failed": sum(not r.ok for r in res), "wall_s": round(wall, 2), "counters": cnt,
                    "saves": C.save_rates(cnt, wall)}
        points = []
        for n in run.params["users"]:
            points.append(_point(client, docs, run, arm, n, srv))
            run.checkpoint(arm, points[-1])
        start_s = srv.start_seconds
    return {"engine_start_s": round(start_s, 1), "warmup": warm, "points": points}


def ratios(arms: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per user count, the connector arm's p95 TTFT over the baseline's in the same run and both arms' failed
    requests (issue #7 goal: lower p95 at every point, 0 failed with the connector). Empty unless both ran."""
    adp, base = arms.get("adp", {}), arms.get("baseline", {})
    if not (adp.get("available") and base.get("available")):
        return []
    ref = {pt["users"]: pt for pt in base["points"]}
    out = []
    for pt in adp["points"]:
        b = ref.get(pt["users"])
        if b is None:
            continue
        p95, b95 = pt["ttft_s"]["p95"], b["ttft_s"]["p95"]
        out.append({"users": pt["users"], "p95_ttft_vs_baseline": round(p95 / b95, 3) if p95 and b95 else None,
                    "adp_failed": pt["failed"], "baseline_failed": b["failed"]})
    return out


def main(args: argparse.Namespace) -> int:
    run = C.Run("sweep", args, {k: getattr(args, k) for k in ("users", "requests_per_user", "contexts", "context_len",
                                                               "suffix_len", "max_tokens", "warmup")})
    arms = run.run_arms(lambda arm, kv: _arm(run, arm, kv))
    result = run.finish(arms, {"ratios": ratios(arms)})
    rc = C.print_points(result, run, lambda pt: (
        f"{pt['users']:4} users  TTFT p50 {pt['ttft_s']['p50']} p95 {pt['ttft_s']['p95']}  "
        f"{pt['output_tps']:8.1f} tok/s  failed {pt['failed']}/{pt['requests']}  "
        f"ext hits {pt['counters']['external_prefix_cache_hits']:.0f}" + C.save_line(pt) + C.hook_line(pt)))
    for r in result["ratios"]:
        print(f"adp / baseline at {r['users']:4} users: p95 TTFT {r['p95_ttft_vs_baseline']}x  "
              f"failed {r['adp_failed']} vs {r['baseline_failed']}")
    return rc
