"""scripts/restore_start_cost.py: the caller's time in starting restores and read-aheads beside the restore driver
(smoke: the calls it reports, with and without the driver, and its usage error; the figures belong to
docs/benchmarks.md, not to a test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the restore pipeline stages through torch tensors")
pytest.importorskip("adp_emulator.target", reason="the userspace target package is not installed")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "restore_start_cost.py"


@pytest.mark.parametrize("driver", [True, False], ids=["driver", "no-driver"])
def test_it_times_every_start_and_read_ahead(tmp_path: Path, driver: bool) -> None:
    out_json = tmp_path / "cost.json"
    cmd = [sys.executable, str(SCRIPT), "--pages", "40", "--requests", "3", "--rounds", "1", "--page-kib", "16",
           "--batch-pages", "8", "--slabs", "8", "--helpers", "1", "--step-ms", "5", "--json", str(out_json)]
    out = subprocess.run(cmd + ([] if driver else ["--no-driver"]), capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out_json.read_text())
    assert res["calls"]["start"]["n"] == 3 and res["calls"]["read_ahead"]["n"] == 3
    assert res["calls"]["poll"]["n"] >= 3 and res["driver_passes"] > 0
    assert res["gb"] == round(40 * 3 * 16 * 1024 / 1e9, 3) and res["wall_s"] > 0


def test_a_zero_count_is_a_usage_error() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--requests", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "must be >= 1" in out.stderr.strip().splitlines()[-1]
