"""A ~10 s run of scripts/soak: several clients, random faults (incl. a target restart), every byte checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_soak_short(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "soak"), "--seconds", "10", "--threads", "2", "--procs", "1",
         "--fault-interval", "0.6", "--seed", "7", "--json", str(out)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["wrong_bytes"] == 0 and res["wrong_reads"] == 0
    assert res["reads"] > 100 and res["bytes_verified"] > 0
    assert res["faults_total"] >= 3
    assert "soak: duration=" in proc.stdout
