"""scripts/gpu/bg.sh: the background runner the H200 runs use across device calls (start, wait, stop)."""

from __future__ import annotations

import subprocess
from pathlib import Path

BG = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "bg.sh"


def _bg(tmp_path: Path, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(BG), *args], env={"BG_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=timeout)


def test_wait_returns_the_end_and_its_log(tmp_path: Path) -> None:
    assert _bg(tmp_path, "start", "job", "bash", "-c", "echo hello-from-job").returncode == 0
    r = _bg(tmp_path, "wait", "job", "20")
    assert r.returncode == 0, r.stderr
    assert "hello-from-job" in r.stdout and "ended with status 0" in r.stdout


def test_wait_on_a_running_job_says_so(tmp_path: Path) -> None:
    _bg(tmp_path, "start", "slow", "sleep", "30")
    try:
        r = _bg(tmp_path, "wait", "slow", "1")
        assert r.returncode == 3 and "still running" in r.stdout
    finally:
        _bg(tmp_path, "stop", "slow")


def test_wait_on_a_fresh_machine_fails_at_once(tmp_path: Path) -> None:
    """A machine given back while idle comes back bare: waiting out the limit there only spent device time."""
    r = _bg(tmp_path, "wait", "never-started", "600", timeout=10)
    assert r.returncode == 4
    assert "no job never-started on this machine" in r.stderr
    # the negative control: the same name once started is found
    _bg(tmp_path, "start", "never-started", "true")
    assert _bg(tmp_path, "wait", "never-started", "20").returncode == 0
