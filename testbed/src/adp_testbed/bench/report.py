"""Markdown + PNG report of the scenario benchmarks (restart, agents, sweep) from their results JSON.

    python -m adp_testbed.bench.report RESULTS.json [RESULTS.json ...] --out DIR

Plots need matplotlib (``pip install 'adp-kv-testbed[report]'``); without it the page holds the tables only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

COLORS = {"baseline": "#8c8c8c", "adp": "#1f77b4", "cpu-offload": "#ff7f0e"}
LABELS = {"baseline": "baseline (no connector)", "adp": "ADP connector",
          "cpu-offload": "vLLM OffloadingConnector (CPU tier)"}


def _plt() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        return None


def _avail(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in result["arms"].items() if v.get("available")}


def _fmt(x: Any, nd: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def _arms_lines(result: dict[str, Any]) -> list[str]:
    out = []
    for arm, a in result["arms"].items():
        state = f"ran ({a.get('wall_s', '-')} s; target: {a.get('target')})" if a.get("available") \
            else f"**unavailable**: {a.get('reason')}"
        out.append(f"- {LABELS.get(arm, arm)}: {state}")
    return out


# ---------------------------------------------------------------------------------------------------- restart


def _restart(result: dict[str, Any], out: Path, plt: Any) -> tuple[list[str], list[str]]:
    arms = _avail(result)
    lines = ["| arm | TTFT cold mean (s) | TTFT warm mean (s) | speed-up | cold confirmed | ext. hits cold | "
             "ext. hits warm (fraction) | outputs identical |", "|---|---|---|---|---|---|---|---|"]
    for arm, a in arms.items():
        s = a["summary"]
        lines.append(f"| {arm} | {_fmt(s['ttft_cold_mean_s'])} | {_fmt(s['ttft_warm_mean_s'])} | "
                     f"{_fmt(s['warm_speedup'], 2)}x | {s['cold_confirmed']} | {s['cold_hits']:.0f} | "
                     f"{s['warm_hits']:.0f} ({s['warm_hit_fraction']:.2f}) | {s['outputs_identical']} |")
    pngs = []
    if plt is not None and arms:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        width = 0.8 / max(len(arms), 1)
        for i, (arm, a) in enumerate(arms.items()):
            s = a["summary"]
            xs = [j + (i - (len(arms) - 1) / 2) * width for j in range(2)]
            vals = [s["ttft_cold_mean_s"] or 0, s["ttft_warm_mean_s"] or 0]
            bars = ax.bar(xs, vals, width, label=LABELS.get(arm, arm), color=COLORS.get(arm))
            ax.bar_label(bars, fmt="%.3f", fontsize=8)
        ax.set_xticks([0, 1], ["cold (first engine)", "warm (after restart)"])
        ax.set_ylabel("mean TTFT (s)")
        p = result["params"]
        ax.set_title(f"restart: {p['prompts']} prompts x {p['prompt_len']} tokens")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "restart_ttft.png", dpi=110)
        plt.close(fig)
        pngs.append("restart_ttft.png")
    return lines, pngs


# ---------------------------------------------------------------------------------------------------- agents


def _agents(result: dict[str, Any], out: Path, plt: Any) -> tuple[list[str], list[str]]:
    arms = _avail(result)
    floor = result["params"]["speed_floor_tps"]
    lines = [f"| arm | agents | mean tokens/s per agent | min agent tokens/s | requests below {floor:g} tok/s | "
             "TTFT p50 (s) | TTFT p95 (s) | ext. hit tokens | local hit tokens | failed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for arm, a in arms.items():
        for pt in a["points"]:
            lines.append(f"| {arm} | {pt['agents']} | {_fmt(pt['agent_tps_mean'], 1)} | {_fmt(pt['agent_tps_min'], 1)} "
                         f"| {pt['below_floor_share']:.0%} | {_fmt(pt['ttft_s']['p50'])} | {_fmt(pt['ttft_s']['p95'])} "
                         f"| {pt['counters']['external_prefix_cache_hits']:.0f} | "
                         f"{pt['counters']['prefix_cache_hits']:.0f} | {pt['failed']} |")
    pngs = []
    if plt is not None and arms:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
        for arm, a in arms.items():
            xs = [pt["agents"] for pt in a["points"]]
            a1.plot(xs, [pt["agent_tps_mean"] for pt in a["points"]], "o-", color=COLORS.get(arm),
                    label=LABELS.get(arm, arm))
            a1.fill_between(xs, [pt["agent_tps_min"] for pt in a["points"]],
                            [pt["agent_tps_max"] for pt in a["points"]], color=COLORS.get(arm), alpha=0.15)
            a2.plot(xs, [100 * pt["below_floor_share"] for pt in a["points"]], "o-", color=COLORS.get(arm),
                    label=LABELS.get(arm, arm))
        a1.set_xlabel("concurrent agents")
        a1.set_ylabel("tokens/s per agent (mean; band min-max)")
        a1.set_xscale("log", base=2)
        a2.set_xlabel("concurrent agents")
        a2.set_ylabel(f"% requests below {floor:g} tokens/s")
        a2.set_xscale("log", base=2)
        a2.set_ylim(-5, 105)
        a1.legend(fontsize=8)
        fig.suptitle("agents: per-agent speed with growing histories")
        fig.tight_layout()
        fig.savefig(out / "agents_tps.png", dpi=110)
        plt.close(fig)
        pngs.append("agents_tps.png")
    return lines, pngs


# ---------------------------------------------------------------------------------------------------- sweep


def _sweep(result: dict[str, Any], out: Path, plt: Any) -> tuple[list[str], list[str]]:
    arms = _avail(result)
    lines = ["| arm | users | requests | failed | TTFT p50 (s) | TTFT p95 (s) | output tokens/s | requests/s | "
             "ext. hit tokens |", "|---|---|---|---|---|---|---|---|---|"]
    for arm, a in arms.items():
        for pt in a["points"]:
            lines.append(f"| {arm} | {pt['users']} | {pt['requests']} | {pt['failed']} | "
                         f"{_fmt(pt['ttft_s']['p50'])} | {_fmt(pt['ttft_s']['p95'])} | {_fmt(pt['output_tps'], 1)} | "
                         f"{_fmt(pt['requests_per_s'], 2)} | "
                         f"{pt['counters']['external_prefix_cache_hits']:.0f} |")
    pngs = []
    if plt is not None and arms:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
        for arm, a in arms.items():
            xs = [pt["users"] for pt in a["points"]]
            c = COLORS.get(arm)
            a1.plot(xs, [pt["ttft_s"]["p95"] or 0 for pt in a["points"]], "o-", color=c,
                    label=f"{LABELS.get(arm, arm)} p95")
            a1.plot(xs, [pt["ttft_s"]["p50"] or 0 for pt in a["points"]], "s--", color=c, alpha=0.6,
                    label=f"{LABELS.get(arm, arm)} p50")
            a2.plot(xs, [pt["output_tps"] for pt in a["points"]], "o-", color=c, label=f"{arm} tokens/s")
            fails = [pt["failed"] for pt in a["points"]]
            if any(fails):
                a2.plot(xs, fails, "x:", color=c, label=f"{arm} failed requests")
        for ax in (a1, a2):
            ax.set_xlabel("concurrent users")
            ax.set_xscale("log")
            ax.legend(fontsize=7)
        a1.set_ylabel("TTFT (s)")
        a2.set_ylabel("output tokens/s (all users); failures")
        fig.suptitle("sweep: TTFT and throughput vs concurrent users")
        fig.tight_layout()
        fig.savefig(out / "sweep_ttft.png", dpi=110)
        plt.close(fig)
        pngs.append("sweep_ttft.png")
    return lines, pngs


_SECTIONS = {"restart": _restart, "agents": _agents, "sweep": _sweep}


def section(result: dict[str, Any], out: Path, plt: Any = None, image_prefix: str = "") -> list[str]:
    """The Markdown lines of one scenario's results; PNGs are written to ``out``."""
    sc = result["scenario"]
    table, pngs = _SECTIONS[sc](result, out, plt)
    e = result["engine"]
    head = [f"## {sc} ({result['preset']})", "",
            f"model `{Path(str(e['model'])).name}`, {e.get('vllm')}, max_model_len {e['max_model_len']}, "
            f"KV cache bytes {e.get('kv_cache_bytes')}; parameters `{json.dumps(result['params'])}`; "
            f"wall {result['wall_s']} s.", "", *_arms_lines(result), ""]
    if result.get("ratios"):
        head += ["Connector arm against the others, same run: " + "; ".join(
            ", ".join(f"{k} {v}" for k, v in r.items()) for r in result["ratios"]), ""]
    acc = result.get("acceptance")
    if sc == "restart":
        head += [f"Acceptance (connector arm): `{json.dumps(acc)}`" if acc else
                 "Acceptance: connector arm unavailable.", ""]
    imgs = [f"![{sc}]({image_prefix}{p})" for p in pngs]
    if plt is None:
        imgs = ["(plots skipped: matplotlib is not installed; `pip install 'adp-kv-testbed[report]'`)"]
    return head + table + [""] + imgs + [""]


def write_report(result: dict[str, Any], out: Path) -> Path:
    """Write ``report.md`` and the PNGs of one result into ``out``; returns the Markdown path."""
    out.mkdir(parents=True, exist_ok=True)
    md = out / "report.md"
    md.write_text("\n".join([f"# ADP KV scenario benchmark: {result['scenario']}", "", *section(result, out, _plt())]))
    return md


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m adp_testbed.bench.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="results.json files of restart / agents / sweep runs")
    ap.add_argument("--out", required=True, help="directory for report.md and the PNGs")
    ap.add_argument("--title", default="ADP KV scenario benchmarks")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    plt = _plt()
    lines = [f"# {a.title}", ""]
    for path in a.results:
        lines += section(json.loads(Path(path).read_text()), out, plt)
    (out / "report.md").write_text("\n".join(lines))
    print(out / "report.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
