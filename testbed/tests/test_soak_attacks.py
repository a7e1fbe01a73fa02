"""The bounded attack modes of scripts/soak and scripts/fuzz-target (issue 18 acceptance): connections held open
during the storm and descriptor exhaustion; short runs (about 10 s each)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_soak_with_held_connections_and_descriptor_exhaustion(tmp_path: Path) -> None:
    """40 silent connections against RLIMIT_NOFILE 48 exhaust the target's descriptors (accept errors counted),
    the storm runs, and the clients still make progress with no wrong byte."""
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "soak"), "--seconds", "10", "--threads", "2", "--procs", "1",
         "--fault-interval", "0.8", "--no-restart", "--seed", "3", "--hold-open", "40", "--nofile", "48",
         "--storm-rate", "50", "--handshake-timeout", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["wrong_bytes"] == 0 and res["wrong_reads"] == 0 and res["lost_clients"] == 0
    assert res["reads"] > 100 and res["bytes_verified"] > 0
    assert res["nofile"] == 48 and res["held_open"]["max_held"] == 40 and res["storm"]["connects"] > 0
    # the attack took effect: the target ran out of descriptors and closed silent connections at its deadline
    assert res["listener_totals"]["accept_errors"] > 0, res["listener_totals"]
    assert res["listener_totals"]["handshake_timeouts"] > 0 and res["held_open"]["closed_by_target"] > 0
    assert "held_open=" in proc.stdout and "listener=" in proc.stdout


def test_soak_attack_options_are_bounded(tmp_path: Path) -> None:
    for bad in (["--hold-open", "100000"], ["--nofile", "8"], ["--storm-rate", "1e9"], ["--seconds", "0"]):
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak"), *bad], capture_output=True,
                              text=True, timeout=60, cwd=tmp_path)
        assert proc.returncode == 2 and "--hold-open 0-4096" in proc.stderr, (bad, proc.stderr)


def test_fuzz_target_with_held_connections(tmp_path: Path) -> None:
    out = tmp_path / "fuzz.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "fuzz-target"), "--engine", "random",
                        "--inputs", "60", "--check-every", "30", "--hold-open", "8", "--storm-rate", "20",
                        "--json", str(out), "--crash-dir", str(tmp_path / "crashes")], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    st = json.loads(out.read_text())
    assert st["inputs"] == 60 and st["crashes"] == st["hangs"] == st["bad_output"] == 0 and st["checks"] >= 2
    att = json.loads(Path(str(out) + ".attacks.json").read_text())
    assert att["hold_open"] == 8 and att["held"]["max_held"] == 8 and att["storm"]["connects"] > 0
    assert "fuzz-target: attacks" in r.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "fuzz-target"), "--hold-open", "-1"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--hold-open" in bad.stderr
