"""Plot TTFT per prompt length from restart_ttft.py results: the baseline and every warm arm of each run.

    python scripts/gpu/plot_restart.py OUT.png LABEL=DIR/restart.json [LABEL=DIR/restart.json ...]

Each file's baseline is drawn once (dashed); its warm arms (restored after an engine restart) as solid lines.
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main(argv: list[str]) -> None:
    out, runs = argv[0], argv[1:]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for spec in runs:
        label, _, path = spec.partition("=")
        with open(path) as f:
            arms = json.load(f)["arms"]
        for name, arm in arms.items():
            rows = arm.get("rows")
            if not rows or not (name == "baseline" or name.startswith("adp-warm")):
                continue
            xs = [r["tokens"] / 1000 for r in rows]
            ys = [r["ttft_s"] for r in rows]
            style = "--" if name == "baseline" else "-"
            ax.plot(xs, ys, style, marker="o", label=f"{label}: {name}")
    ax.set_xlabel("prompt (k tokens)")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("Restart experiment, Llama-3.1-8B shape, H200, vLLM 0.26")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1:])
