"""Launching targets as child processes: the userspace emulator (and, through the CLI, the kernel one).

Benchmarks and the demo use :class:`LocalTarget` (a target for the duration of a ``with`` block);
``testbed up`` uses :func:`launch_userspace` directly and detaches.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import state as S

READY_MARK = "ADP-EMULATOR READY"


class LaunchError(Exception):
    """The target process did not come up; the message carries the tail of its log."""


@dataclass
class Launched:
    proc: subprocess.Popen
    traddr: str
    trsvcid: int
    subnqn: str
    log: Path


def userspace_command(host: str = "127.0.0.1", port: int = 0, nqn: str | None = None, capacity: int | None = None,
                      lba_size: int | None = None, mdts: int | None = None, backing: str | None = None,
                      config: str | None = None, allow_hosts: list[str] | None = None,
                      allow_any_host: bool = False) -> list[str]:
    cmd = [sys.executable, "-u", "-m", "adp_emulator", "serve", "--host", host, "--port", str(port)]
    if config:
        cmd += ["--config", str(Path(config).resolve())]
    for flag, value in (("--nqn", nqn), ("--capacity", capacity), ("--lba-size", lba_size), ("--mdts", mdts)):
        if value is not None:
            cmd += [flag, str(value)]
    if backing:
        cmd += ["--backing", str(Path(backing).resolve())]
    for h in allow_hosts or []:
        cmd += ["--allow-host", h]
    if allow_any_host:
        cmd.append("--allow-any-host")
    return cmd


def launch_userspace(cmd: list[str], log_path: Path, timeout: float = 20.0, detach: bool = True) -> Launched:
    """Start ``cmd`` (an ``adp_emulator serve`` command line) and wait for its READY line."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=detach)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        for line in text.splitlines():
            if line.startswith(READY_MARK):
                _, _, host, port, nqn = line.split(maxsplit=4)
                return Launched(proc, host, int(port), nqn.strip(), log_path)
        if proc.poll() is not None:
            tail = "\n".join(text.splitlines()[-15:])
            raise LaunchError(f"the userspace target exited with status {proc.returncode} before it was ready:\n"
                              f"{tail}")
        time.sleep(0.05)
    S.stop_pid(proc.pid)
    raise LaunchError(f"the userspace target was not ready within {timeout} s (log: {log_path})")


class LocalTarget:
    """A userspace target child process for the duration of a ``with`` block."""

    def __init__(self, **kw: object) -> None:
        self.cmd = userspace_command(**kw)  # type: ignore[arg-type]
        self._tmp = tempfile.TemporaryDirectory(prefix="adp-kv-target-")
        self.launched: Launched | None = None

    def __enter__(self) -> Launched:
        self.launched = launch_userspace(self.cmd, Path(self._tmp.name) / "target.log", detach=False)
        return self.launched

    def __exit__(self, *exc: object) -> None:
        if self.launched is not None:
            p = self.launched.proc
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._tmp.cleanup()
