"""scripts/store_call_latency.py: a helper's synchronous call timed alone and beside a bytecode thread (smoke: the
rows it reports, and its usage error; the figures themselves belong to docs/benchmarks.md, not to a test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("adp_emulator.target", reason="the userspace target package is not installed")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "store_call_latency.py"


def test_it_reports_each_key_count_alone_and_beside_a_thread() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--keys", "1,8", "--calls", "5", "--switch-intervals", "0.001",
                          "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout)
    assert [(r["beside"], r["switch_interval_s"]) for r in rows][1:] == [("a bytecode thread", 0.001)]
    assert rows[0]["beside"] == "nothing"
    for r in rows:
        assert sorted(r["calls"]) == ["1", "8"]
        assert all(0 < c["median_ms"] <= c["p90_ms"] for c in r["calls"].values())


def test_a_zero_call_count_is_a_usage_error() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--calls", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--calls" in out.stderr.strip().splitlines()[-1]
