"""``scripts/fuzz-target``: the exit status tells the truth and the summary is always written, in both engines.

Each test runs the real script against a real target. The failing runs use ``--deadline 0.000001``: no connection
is even set up and closed within a microsecond, so every input hangs (the failure the atheris engine used to report as
success). atheris runs need the package (requirements-dev.txt installs it on Linux x86_64); without it they skip,
except under CI=true where they fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fuzz-target"


def _atheris() -> None:
    try:
        import atheris  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("atheris is not installed (pip install -r requirements-dev.txt)")
        pytest.skip("atheris is not installed (pip install -r requirements-dev.txt)")


def fuzz(tmp_path: Path, *opts: str, env: dict[str, str] | None = None,
         timeout: float = 180) -> tuple[int, str, dict | None]:
    """Run the script; (exit status, its output, the JSON it wrote or None)."""
    out = tmp_path / "fuzz.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--json", str(out), "--crash-dir", str(tmp_path / "crashes"),
                        *opts], cwd=tmp_path, capture_output=True, text=True, timeout=timeout, env=env)
    return r.returncode, r.stdout + r.stderr, json.loads(out.read_text()) if out.exists() else None


def _summary(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.startswith("fuzz-target: ")]
    assert len(lines) == 1, text[-3000:]
    return lines[0]


@pytest.mark.parametrize("engine", ["random", "atheris"])
def test_hangs_fail_the_run(engine: str, tmp_path: Path) -> None:
    if engine == "atheris":
        _atheris()
    rc, text, st = fuzz(tmp_path, "--engine", engine, "--inputs", "30", "--check-every", "15", "--deadline", "0.000001")
    assert st is not None and st["final"], text[-3000:]
    assert st["hangs"] > 0 and st["inputs"] == 30 and st["ok"] is False
    assert rc == 1, text[-3000:]
    assert "FAIL" in _summary(text) and f"hangs={st['hangs']}" in _summary(text)
    assert list((tmp_path / "crashes").glob("hangs-*.bin"))


@pytest.mark.parametrize("engine", ["random", "atheris"])
def test_clean_run_passes(engine: str, tmp_path: Path) -> None:
    if engine == "atheris":
        _atheris()
    rc, text, st = fuzz(tmp_path, "--engine", engine, "--inputs", "40", "--check-every", "20")
    assert st is not None and st["final"] and st["ok"], text[-3000:]
    assert st["inputs"] == 40 and st["stopped_by"] == "inputs" and st["checks"] >= 2
    assert rc == 0 and "OK" in _summary(text)


@pytest.mark.parametrize("engine", ["random", "atheris"])
def test_seconds_running_out_still_writes_the_summary(engine: str, tmp_path: Path) -> None:
    if engine == "atheris":
        _atheris()
    rc, text, st = fuzz(tmp_path, "--engine", engine, "--inputs", "1000000000", "--seconds", "2",
                        "--check-every", "50", timeout=120)
    assert st is not None and st["final"] and st["stopped_by"] == "seconds", text[-3000:]
    assert 0 < st["inputs"] < 1_000_000_000 and st["checks"] >= 1
    assert rc == 0 and f"inputs={st['inputs']}" in _summary(text)


def test_atheris_missing_is_a_usage_error_naming_the_install(tmp_path: Path) -> None:
    """--engine atheris without atheris: exit 2 and how to install it (auto falls back to random)."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "atheris.py").write_text("raise ImportError('atheris hidden by this test')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shadow), os.environ.get("PYTHONPATH", "")]))
    rc, text, st = fuzz(tmp_path, "--engine", "atheris", "--inputs", "5", env=env)
    assert rc == 2 and st is None
    assert "atheris is not installed" in text and "requirements-dev.txt" in text
    rc, text, st = fuzz(tmp_path, "--engine", "auto", "--inputs", "5", env=env)
    assert rc == 0 and st is not None and st["engine"] == "random"


@pytest.mark.parametrize("opt", [["--deadline", "0"], ["--seconds", "-1"], ["--check-every", "0"]])
def test_bad_options_are_usage_errors(opt: list[str], tmp_path: Path) -> None:
    rc, text, st = fuzz(tmp_path, *opt)
    assert rc == 2 and "Traceback" not in text and st is None
