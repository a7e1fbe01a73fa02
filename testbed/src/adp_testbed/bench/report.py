"""Markdown + PNG report of the scenario benchmarks (restart, agents, sweep) from their results JSON.

    python -m adp_testbed.bench.report RESULTS.json [RESULTS.json ...] --out DIR

Plots need matplotlib (``pip install 'adp-kv-testbed[report]'``); without it the page holds the tables only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .serve import hook_ms_per_request, restore_phase_ms

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


def caption(result: dict[str, Any]) -> str:
    """The line printed on every figure: hardware, model, vLLM, date (what the numbers were measured on)."""
    env = result.get("environment") or {}
    hw = []
    if env.get("gpu"):
        hw.append(f"GPU {env['gpu']}")
    cpu = env.get("cpu_model") or env.get("machine") or "CPU unknown"
    hw.append(f"CPU {cpu}" + (f" ({env['cpu_cores']} cores)" if env.get("cpu_cores") else ""))
    if not env.get("gpu"):
        hw.append("no GPU")
    e = result.get("engine") or {}
    model = Path(str(e.get("model", "?"))).name
    date = env.get("date") or _date_from_run_id(result.get("run_id")) or "date unknown"
    return f"{'; '.join(hw)} | model {model} | {e.get('vllm') or 'vLLM ?'} | {date}"


def _date_from_run_id(run_id: Any) -> str | None:
    parts = str(run_id or "").split("-")  # bench-<scenario>-YYYYmmdd-HHMMSS-<hex>
    for i, part in enumerate(parts[:-1]):
        if len(part) == 8 and part.isdigit() and len(parts[i + 1]) == 6 and parts[i + 1].isdigit():
            d, t = part, parts[i + 1]
            return f"{d[:4]}-{d[4:6]}-{d[6:]} {t[:2]}:{t[2:4]}"
    return None


def _finish_figure(fig: Any, result: dict[str, Any], title: str) -> None:
    fig.suptitle(title)
    fig.text(0.005, 0.005, caption(result), fontsize=6.5, color="#444444", ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.04, 1, 1))


def _count_axis(ax: Any, counts: list[int], label: str) -> None:
    """An x axis of agent / user counts: log scale, a tick at each measured count, integer labels only."""
    from matplotlib.ticker import FixedLocator, NullLocator

    ticks = sorted({int(c) for c in counts})
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([str(t) for t in ticks])
    ax.set_xlabel(label)


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
        fig = restart_figure(result, plt)
        fig.savefig(out / "restart_ttft.png", dpi=110)
        plt.close(fig)
        pngs.append("restart_ttft.png")
    return lines, pngs


def restart_figure(result: dict[str, Any], plt: Any) -> Any:
    arms = _avail(result)
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    width = 0.8 / max(len(arms), 1)
    for i, (arm, a) in enumerate(arms.items()):
        s = a["summary"]
        xs = [j + (i - (len(arms) - 1) / 2) * width for j in range(2)]
        vals = [s["ttft_cold_mean_s"] or 0, s["ttft_warm_mean_s"] or 0]
        bars = ax.bar(xs, vals, width, label=LABELS.get(arm, arm), color=COLORS.get(arm))
        ax.bar_label(bars, fmt="%.3f", fontsize=8)
    ax.set_xticks([0, 1], ["cold (first engine)", "warm (after restart)"])
    ax.set_ylabel("mean TTFT (s)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    p = result["params"]
    _finish_figure(fig, result, f"restart: {p['prompts']} prompts x {p['prompt_len']} tokens, TTFT per arm")
    return fig


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
    spans = [(arm, pt["agents"], pt["turn_spans_s"]) for arm, a in arms.items() for pt in a["points"]
             if len(pt.get("turn_spans_s", [])) > 1]
    if spans:
        lines += ["", "Each turn's share of the point's wall time: from the end of the turn before it until its last "
                  "request ended. The first turn is a cold prefill in every arm.", "",
                  "| arm | agents | first turn (s) | each later turn (s) | later turns' mean (s) |",
                  "|---|---|---|---|---|"]
        lines += [f"| {arm} | {n} | {_fmt(s[0], 1)} | {' / '.join(_fmt(x, 1) for x in s[1:])} | "
                  f"{_fmt(sum(s[1:]) / (len(s) - 1), 1)} |" for arm, n, s in spans]
    pngs = []
    if plt is not None and arms:
        fig = agents_figure(result, plt)
        fig.savefig(out / "agents_tps.png", dpi=110)
        plt.close(fig)
        pngs.append("agents_tps.png")
    return lines, pngs


def agents_figure(result: dict[str, Any], plt: Any) -> Any:
    arms = _avail(result)
    floor = result["params"]["speed_floor_tps"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9.6, 4.0))
    counts: list[int] = []
    for arm, a in arms.items():
        xs = [pt["agents"] for pt in a["points"]]
        counts += xs
        a1.plot(xs, [pt["agent_tps_mean"] for pt in a["points"]], "o-", color=COLORS.get(arm),
                label=LABELS.get(arm, arm))
        a1.fill_between(xs, [pt["agent_tps_min"] for pt in a["points"]],
                        [pt["agent_tps_max"] for pt in a["points"]], color=COLORS.get(arm), alpha=0.15)
        a2.plot(xs, [100 * pt["below_floor_share"] for pt in a["points"]], "o-", color=COLORS.get(arm),
                label=LABELS.get(arm, arm))
    for ax in (a1, a2):
        _count_axis(ax, counts, "concurrent agents")
        ax.legend(fontsize=7)
    a1.set_ylabel("tokens/s per agent (mean; band min-max)")
    a1.set_ylim(bottom=0)
    a2.set_ylabel(f"% requests below {floor:g} tokens/s")
    a2.set_ylim(0, 105)
    _finish_figure(fig, result, "agents: per-agent speed with growing histories")
    return fig


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
        fig = sweep_figure(result, plt)
        fig.savefig(out / "sweep_ttft.png", dpi=110)
        plt.close(fig)
        pngs.append("sweep_ttft.png")
    return lines, pngs


def sweep_figure(result: dict[str, Any], plt: Any) -> Any:
    """Left: p95 (solid) and p50 (dashed) TTFT; right: output tokens/s (solid) and failed requests (x, dotted,
    right-hand axis) — one legend entry per arm, the line styles explained by grey keys."""
    from matplotlib.lines import Line2D

    arms = _avail(result)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9.6, 4.0))
    fail_ax = None
    counts: list[int] = []
    for arm, a in arms.items():
        xs = [pt["users"] for pt in a["points"]]
        counts += xs
        c = COLORS.get(arm)
        a1.plot(xs, [pt["ttft_s"]["p95"] or 0 for pt in a["points"]], "o-", color=c, label=LABELS.get(arm, arm))
        a1.plot(xs, [pt["ttft_s"]["p50"] or 0 for pt in a["points"]], "s--", color=c, alpha=0.6)
        a2.plot(xs, [pt["output_tps"] for pt in a["points"]], "o-", color=c, label=LABELS.get(arm, arm))
        fails = [pt["failed"] for pt in a["points"]]
        if any(fails):
            fail_ax = fail_ax or a2.twinx()
            fail_ax.plot(xs, fails, "x:", color=c)
    grey = "#555555"
    keys1 = [Line2D([], [], color=grey, ls="-", marker="o", label="p95"),
             Line2D([], [], color=grey, ls="--", marker="s", label="p50")]
    h1, _ = a1.get_legend_handles_labels()
    a1.legend(handles=h1 + keys1, fontsize=7)
    h2, _ = a2.get_legend_handles_labels()
    keys2 = [Line2D([], [], color=grey, ls=":", marker="x", label="failed requests (right axis)")] if fail_ax else []
    a2.legend(handles=h2 + keys2, fontsize=7)
    for ax in (a1, a2):
        _count_axis(ax, counts, "concurrent users")
        ax.set_ylim(bottom=0)
    if fail_ax is not None:
        fail_ax.set_ylim(bottom=0)
        fail_ax.set_ylabel("failed requests")
        fail_ax.yaxis.get_major_locator().set_params(integer=True)
    a1.set_ylabel("TTFT (s)")
    a2.set_ylabel("output tokens/s (all users)")
    _finish_figure(fig, result, "sweep: TTFT and throughput vs concurrent users")
    return fig


_SECTIONS = {"restart": _restart, "agents": _agents, "sweep": _sweep}

# ---------------------------------------------------------------------------------------------------- behind

CONNECTOR = "adp"


def _pct(ours: float, theirs: float) -> str:
    return f"{(ours - theirs) / theirs:+.0%}" if theirs else "n/a"


def _why(c: dict[str, float], failed: int = 0, other_failed: int = 0) -> str:
    """Why the connector arm is slower at one point, from its counters (one sentence)."""
    c = c or {}
    fb, vf = c.get("adp_kv_load_fallbacks", 0), c.get("adp_kv_verify_failures", 0)
    ext, local = c.get("external_prefix_cache_hits", 0), c.get("prefix_cache_hits", 0)
    loads, saved = c.get("adp_kv_loads_ok", 0), c.get("adp_kv_pages_saved", 0)
    errs = c.get("adp_kv_save_errors", 0) + c.get("adp_kv_saves_dropped", 0)
    parts = []
    if fb or vf:
        parts.append(f"{fb:.0f} restore(s) fell back to recompute ({vf:.0f} verify failure(s)), so those requests "
                     f"waited for the card and then prefilled anyway")
    elif not ext:
        parts.append(f"the connector restored nothing here (0 external hit tokens; vLLM's own prefix cache hit "
                     f"{local:.0f} tokens), so the arm only paid for saving ({saved:.0f} pages saved)")
    else:
        text = f"it restored {ext:.0f} tokens from the card in {loads:.0f} load(s) beside {local:.0f} local hit tokens"
        phases = restore_phase_ms(c)
        if phases:
            text += " (a restore took " + ", ".join(f"{p} {v:.0f}" for p, v in phases.items()) + " ms)"
        parts.append(text)
    hooks = hook_ms_per_request(c)
    if hooks and not (fb or vf):
        parts.append("inside vLLM's hooks it spent " + ", ".join(f"{h} {v:.1f}" for h, v in list(hooks.items())[:3])
                     + " ms per request")
    if errs:
        parts.append(f"{errs:.0f} save(s) failed or were dropped")
    if failed > other_failed:
        parts.append(f"{failed} request(s) failed against {other_failed}")
    return "; ".join(parts) + "."


def behind_notes(result: dict[str, Any]) -> list[str]:
    """One sentence per point where the connector arm is behind another arm of the same run, from the numbers.
    Empty when the connector arm did not run or no other arm did."""
    arms = _avail(result)
    if CONNECTOR not in arms or len(arms) < 2:
        return []
    ours, sc, notes = arms[CONNECTOR], result["scenario"], []
    for name, other in arms.items():
        if name == CONNECTOR:
            continue
        them = LABELS.get(name, name)
        if sc == "restart":
            a, b = ours["summary"], other["summary"]
            w, wo = a.get("ttft_warm_mean_s"), b.get("ttft_warm_mean_s")
            if w is not None and wo is not None and w > wo:
                c = (ours.get("phases", {}).get("warm") or {}).get("counters") or {
                    "external_prefix_cache_hits": a.get("warm_hits", 0)}
                notes.append(f"Warm phase: the connector arm's mean TTFT is {w:.3f} s against {wo:.3f} s for {them} "
                             f"({_pct(w, wo)}); {a.get('warm_hits', 0):.0f} of {a.get('warm_queries', 0):.0f} "
                             f"queried tokens were external hits; " + _why(c, a.get("failed", 0), b.get("failed", 0)))
            continue
        key = "agents" if sc == "agents" else "users"
        theirs = {pt[key]: pt for pt in other.get("points", [])}
        for pt in ours.get("points", []):
            o = theirs.get(pt[key])
            if o is None:
                continue
            if sc == "agents":
                v, vo = pt["agent_tps_mean"], o["agent_tps_mean"]
                if v is None or vo is None or v >= vo:
                    continue
                what = f"{v:.1f} tokens/s per agent against {vo:.1f} for {them} ({_pct(v, vo)})"
            else:
                p95, p95o = pt["ttft_s"].get("p95"), o["ttft_s"].get("p95")
                slow = p95 is not None and p95o is not None and p95 > p95o
                fewer = pt["output_tps"] < o["output_tps"]
                if not (slow or fewer):
                    continue
                bits = []
                if slow:
                    bits.append(f"TTFT p95 {p95:.3f} s against {p95o:.3f} s ({_pct(p95, p95o)})")
                if fewer:
                    bits.append(f"{pt['output_tps']:.1f} output tokens/s against {o['output_tps']:.1f} "
                                f"({_pct(pt['output_tps'], o['output_tps'])})")
                what = " and ".join(bits) + f" for {them}"
            notes.append(f"At {pt[key]} {key}: the connector arm is behind, {what}; "
                         + _why(pt.get("counters", {}), pt.get("failed", 0), o.get("failed", 0)))
    return notes


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
    notes = behind_notes(result)
    if notes:
        table = [*table, "", "Where the connector arm is behind (from this run's numbers):", "",
                 *[f"- {n}" for n in notes]]
    elif CONNECTOR in _avail(result) and len(_avail(result)) > 1:
        table = [*table, "", "The connector arm is not behind another arm at any measured point."]
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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m adp_testbed.bench.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="results.json files of restart / agents / sweep runs")
    ap.add_argument("--out", required=True, help="directory for report.md and the PNGs")
    ap.add_argument("--title", default="ADP KV scenario benchmarks")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
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
