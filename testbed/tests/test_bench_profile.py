"""``testbed bench --profile``: py-spy samples an arm's server process tree and the stacks land beside the logs."""

from __future__ import annotations

import gzip
import subprocess
import sys
import time
from pathlib import Path

import pytest

from adp_testbed import options as O
from adp_testbed.bench import serve as SV
from adp_testbed.bench.common import Run, add_common_arguments


def _args(tmp_path: Path, *extra: str):
    import argparse

    p = argparse.ArgumentParser()
    add_common_arguments(p)
    return p.parse_args(["--model", "m", "--out", str(tmp_path), "--vllm-python", sys.executable, *extra])


def test_profile_of_an_unknown_arm_is_refused(tmp_path: Path) -> None:
    with pytest.raises(O.UsageError, match="--profile: unknown arm"):
        Run("sweep", _args(tmp_path, "--profile", "adp,nonsense"), {})


def test_profile_without_py_spy_is_refused_before_any_arm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SV, "py_spy", lambda: None)
    with pytest.raises(O.UsageError, match="needs py-spy"):
        Run("sweep", _args(tmp_path, "--profile", "adp"), {})


def test_only_the_named_arm_is_profiled(tmp_path: Path) -> None:
    if SV.py_spy() is None:
        pytest.skip("py-spy not on PATH (requirements-dev.txt installs it)")
    run = Run("sweep", _args(tmp_path, "--profile", "adp"), {})
    assert run.server("adp", None, "engine").profile_path == tmp_path / "logs" / "pyspy-adp-engine.txt"
    assert run.server("baseline", None, "engine").profile_path is None


def test_profiler_records_the_server_process_stacks(tmp_path: Path) -> None:
    """The real py-spy on a real child process: its function shows up in the gzipped stacks (and nothing is written
    for a server without a profile path: the negative control)."""
    if SV.py_spy() is None:
        pytest.skip("py-spy not on PATH (requirements-dev.txt installs it)")
    code = "import time\ndef busy_serving_requests():\n    t = time.time()\n    while time.time() - t < 2.5: pass\n" \
           "busy_serving_requests()\n"
    for path in (tmp_path / "pyspy-adp-engine.txt", None):
        srv = SV.VllmServer(SV.EngineSpec(model="m", max_model_len=16), sys.executable, tmp_path / "x.log",
                            profile_path=path)
        srv.proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
        if path is not None:
            srv._start_profiler(path)
        time.sleep(0.3)
        srv.proc.wait(20)
        srv.stop()
    with gzip.open(tmp_path / "pyspy-adp-engine.txt.gz", "rt") as f:
        stacks = f.read()
    assert "busy_serving_requests" in stacks
    assert not (tmp_path / "pyspy-adp-engine.txt").exists()
    assert sorted(p.name for p in tmp_path.glob("pyspy-*.gz")) == ["pyspy-adp-engine.txt.gz"]


def test_profile_gil_needs_profile(tmp_path: Path) -> None:
    with pytest.raises(O.UsageError, match="--profile-gil needs --profile"):
        Run("sweep", _args(tmp_path, "--profile-gil"), {})
    with pytest.raises(O.UsageError, match="--profile-idle needs --profile"):
        Run("sweep", _args(tmp_path, "--profile-idle"), {})
    if SV.py_spy() is not None:
        with pytest.raises(O.UsageError, match="choose one"):
            Run("sweep", _args(tmp_path, "--profile", "adp", "--profile-gil", "--profile-idle"), {})


_WAITING = """import threading, time
def waiting_for_an_answer():
    threading.Event().wait(3.0)
def busy_holding_the_lock():
    t = time.time()
    while time.time() - t < 3.0:
        pass
th = threading.Thread(target=waiting_for_an_answer)
th.start()
busy_holding_the_lock()
th.join()
"""


@pytest.mark.parametrize("idle", [True, False])
def test_profile_idle_samples_waiting_threads(tmp_path: Path, idle: bool) -> None:
    """--profile-idle: a thread blocked on an event is sampled as often as the busy one; without it (the control)
    py-spy drops its samples."""
    stacks = _profiled_stacks(tmp_path, _WAITING, profile_idle=idle)
    busy, waiting = _samples(stacks, "busy_holding_the_lock (<string>"), _samples(stacks, "waiting_for_an_answer (<")
    assert busy > 0
    if idle:
        assert waiting > busy / 2, (waiting, busy)
    else:
        assert waiting < busy / 8, (waiting, busy)


_TWO_THREADS = """import hashlib, threading, time
def hashing_without_the_lock():
    data = bytes(1 << 24)
    t = time.time()
    while time.time() - t < 3.0:
        hashlib.sha256(data).digest()
def busy_holding_the_lock():
    t = time.time()
    while time.time() - t < 3.0:
        pass
th = threading.Thread(target=hashing_without_the_lock)
th.start()
busy_holding_the_lock()
th.join()
"""


@pytest.mark.parametrize("gil", [True, False])
def test_profile_gil_samples_only_the_lock_holder(tmp_path: Path, gil: bool) -> None:
    """--profile-gil: a thread hashing with the interpreter lock released is not sampled, the thread running
    bytecode is; without it (the control) both are."""
    stacks = _profiled_stacks(tmp_path, _TWO_THREADS, profile_gil=gil)
    busy, hashing = _samples(stacks, "busy_holding_the_lock (<string>"), _samples(stacks, "hashing_without_the_lock (<")
    assert busy > 0  # a frame, not the command line in py-spy's process header
    if gil:  # the hashing thread holds the lock only between two digests: now and then a sample, never half
        assert hashing < busy / 8, (hashing, busy)
    else:  # on 2 loaded cores the hashing thread ran for 0.41-0.67 of the busy one's samples (0 under --profile-gil)
        assert hashing > busy / 4, (hashing, busy)


def _profiled_stacks(tmp_path: Path, code: str, **flags: bool) -> str:
    """py-spy's stacks of a child running ``code`` under a server's profiler (``flags``: profile_gil, profile_idle);
    skips where py-spy is missing."""
    if SV.py_spy() is None:
        pytest.skip("py-spy not on PATH (requirements-dev.txt installs it)")
    path = tmp_path / "pyspy-adp-engine.txt"
    srv = SV.VllmServer(SV.EngineSpec(model="m", max_model_len=16), sys.executable, tmp_path / "x.log",
                        profile_path=path, **flags)
    srv.proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    srv._start_profiler(path)
    srv.proc.wait(30)
    srv.stop()
    with gzip.open(tmp_path / "pyspy-adp-engine.txt.gz", "rt") as f:
        return f.read()


def _samples(stacks: str, frame: str) -> int:
    """Samples (py-spy's raw format: ``stack count`` per line) whose stack holds ``frame``."""
    return sum(int(line.rpartition(" ")[2]) for line in stacks.splitlines() if frame in line)
