"""Launching targets as child processes: the userspace emulator (and, through the CLI, the kernel one).

Benchmarks and the demo use :class:`LocalTarget` (a target for the duration of a ``with`` block);
``testbed up`` uses :func:`launch_userspace` directly and detaches.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from . import state as S

T = TypeVar("T")

READY_MARK = "ADP-EMULATOR READY"
MGMT_MARK = "ADP-EMULATOR MGMT"


class LaunchError(Exception):
    """The target process did not come up; the message carries the tail of its log."""


class TargetError(Exception):
    """A user-facing problem with an existing target (unreachable, holds data we must not destroy)."""


#: Where :func:`namespace_contents` looks for data: the first MiB and this many 4 KiB samples spread over
#: the rest of the namespace.
PROBE_HEAD_BYTES = 1 << 20
PROBE_SAMPLES = 16


def namespace_contents(ctrl: object) -> str | None:
    """What an existing namespace holds as far as a quick look tells: ``"a page store"`` (its superblock
    at offset 0), ``"data"`` (a non-zero byte in the first MiB or in :data:`PROBE_SAMPLES` spread 4 KiB
    samples) or None (all of that is zero: it looks unused)."""
    from adp_connector.store.format import SB_MAGIC

    cap = ctrl.capacity_bytes  # type: ignore[attr-defined]
    head = bytearray(min(PROBE_HEAD_BYTES, cap))
    ctrl.read_into(0, memoryview(head))  # type: ignore[attr-defined]
    if head[:len(SB_MAGIC)] == SB_MAGIC:
        return "a page store"
    if any(head):
        return "data"
    step = max(cap // PROBE_SAMPLES, 4096) // 4096 * 4096
    for off in range(len(head) // 4096 * 4096, cap - 4096 + 1, step):
        if any(ctrl.read(off, 4096)):  # type: ignore[attr-defined]
            return "data"
    return None


def refuse_to_destroy(ctrl: object, where: str, command: str, allow: bool, flag: str = "--yes-destroy") -> None:
    """TargetError if ``ctrl``'s namespace holds a page store or data and ``allow`` is not set."""
    found = namespace_contents(ctrl)
    if found is not None and not allow:
        raise TargetError(f"{command}: the namespace of {where} holds {found}; this command overwrites it. "
                          f"Pass {flag} to go ahead (its content is lost)")


def refuse_foreign_data(traddr: str, trsvcid: int, subnqn: str | None, refusal: str, allow: bool = False) -> None:
    """TargetError unless the existing target at ``traddr:trsvcid`` can be reached and its namespace holds a page store
    or nothing (or anything, with ``allow``); ``refusal`` is the message when it holds other data."""
    with connect_existing(traddr, trsvcid, subnqn, io_queues=1) as ctrl:  # type: ignore[attr-defined]
        found = namespace_contents(ctrl)
    if found == "data" and not allow:
        raise TargetError(refusal)


def refuse_to_overwrite_file(path: str | Path | None, command: str, allow: bool, flag: str = "--yes-destroy") -> None:
    """TargetError if ``path`` (a backing file the command formats) exists and holds a non-zero byte in
    its first MiB or in :data:`PROBE_SAMPLES` spread 4 KiB samples, unless ``allow``."""
    if not path or allow:
        return
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            found = any(f.read(PROBE_HEAD_BYTES))
            step = max(size // PROBE_SAMPLES, 4096)
            for off in range(PROBE_HEAD_BYTES, size, step):
                if found:
                    break
                f.seek(off)
                found = any(f.read(4096))
    except FileNotFoundError:
        return
    except OSError as e:
        raise TargetError(f"{command}: cannot read {p}: {e.strerror or e}") from None
    if found:
        raise TargetError(f"{command}: {p} holds data; this command formats it. Pass {flag} to go ahead "
                          f"(its content is lost)")


def connect_existing(traddr: str, trsvcid: int, subnqn: str | None, **kw: object) -> object:
    """Connect the host client to an existing target; TargetError (one line) if it cannot be reached."""
    from adp_connector.device import DeviceError
    from adp_connector.nvmeof.host import Controller, HostConfig

    try:
        return Controller.connect(HostConfig(traddr=traddr, trsvcid=trsvcid, subnqn=subnqn, **kw))  # type: ignore[arg-type]
    except (DeviceError, OSError) as e:
        raise TargetError(f"cannot reach the target at {traddr}:{trsvcid}"
                          f"{' (' + subnqn + ')' if subnqn else ''}: {e}") from None


@dataclass
class Launched:
    proc: subprocess.Popen
    traddr: str
    trsvcid: int
    subnqn: str
    log: Path
    mgmt_url: str | None = None  # the management API (``serve --mgmt-port``), if enabled


def userspace_command(host: str | None = "127.0.0.1", port: int | None = 0, nqn: str | None = None,
                      capacity: int | None = None, lba_size: int | None = None, mdts: int | None = None,
                      backing: str | None = None, config: str | None = None, allow_hosts: list[str] | None = None,
                      allow_any_host: bool = False, mgmt_port: int | None = None,
                      mgmt_token_file: str | None = None, io_workers: int | None = None,
                      copy_reads: bool = False, overcommit: bool = False) -> list[str]:
    """``adp_emulator serve`` with these options; ``host``/``port`` None: not given (a --config's own)."""
    cmd = [sys.executable, "-u", "-m", "adp_emulator", "serve"]
    if host is not None:
        cmd += ["--host", host]
    if port is not None:
        cmd += ["--port", str(port)]
    if mgmt_port is not None:
        cmd += ["--mgmt-port", str(mgmt_port)]
    if mgmt_token_file:
        cmd += ["--mgmt-token-file", str(Path(mgmt_token_file).resolve())]
    if config:
        cmd += ["--config", str(Path(config).resolve())]
    for flag, value in (("--nqn", nqn), ("--capacity", capacity), ("--lba-size", lba_size), ("--mdts", mdts),
                        ("--io-workers", io_workers)):
        if value is not None:
            cmd += [flag, str(value)]
    if backing:
        cmd += ["--backing", str(Path(backing).resolve())]
    for h in allow_hosts or []:
        cmd += ["--allow-host", h]
    if allow_any_host:
        cmd.append("--allow-any-host")
    if copy_reads:
        cmd.append("--copy-reads")
    if overcommit:
        cmd.append("--overcommit")
    return cmd


def _spawn_and_wait(cmd: list[str], log_path: Path, timeout: float, detach: bool, what: str,
                    ready: Callable[[list[str]], T | None]) -> tuple[subprocess.Popen, T]:
    """Start ``cmd`` with its output in ``log_path`` and wait until ``ready(log lines)`` returns a value."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=detach)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        found = ready(text.splitlines())
        if found is not None:
            return proc, found
        if proc.poll() is not None:
            lines = text.splitlines()
            if len(lines) == 1 and lines[0].startswith("adp-emulator: "):  # its own one-line error
                raise LaunchError(f"{what} exited with status {proc.returncode} before it was ready: {lines[0]}")
            tail = "\n".join(lines[-15:])
            raise LaunchError(f"{what} exited with status {proc.returncode} before it was ready:\n{tail}")
        time.sleep(0.05)
    S.stop_pid(proc.pid)
    raise LaunchError(f"{what} was not ready within {timeout} s (log: {log_path})")


def launch_userspace(cmd: list[str], log_path: Path, timeout: float = 20.0, detach: bool = True) -> Launched:
    """Start ``cmd`` (an ``adp_emulator serve`` command line) and wait for its READY line
    (the MGMT line, when the management API is on, comes before it)."""

    def ready(lines: list[str]) -> tuple[str, int, str, str | None] | None:
        mgmt_url = None
        for line in lines:
            if line.startswith(MGMT_MARK + " "):
                mgmt_url = line.split()[2]
            if line.startswith(READY_MARK):
                _, _, host, port, nqn = line.split(maxsplit=4)
                return host, int(port), nqn.strip(), mgmt_url
        return None

    proc, (host, port, nqn, mgmt_url) = _spawn_and_wait(cmd, log_path, timeout, detach, "the userspace target", ready)
    return Launched(proc, host, port, nqn, log_path, mgmt_url)


def mgmt_command(kernel_workdir: str | Path, token_file: str | Path, port: int = 0) -> list[str]:
    """``adp_emulator mgmt``: the management API process for a kernel target."""
    return [sys.executable, "-u", "-m", "adp_emulator", "mgmt", "--kernel-workdir", str(Path(kernel_workdir).resolve()),
            "--mgmt-port", str(port), "--mgmt-token-file", str(Path(token_file).resolve())]


def launch_mgmt(cmd: list[str], log_path: Path, timeout: float = 20.0) -> tuple[subprocess.Popen, str]:
    """Start a detached ``adp_emulator mgmt`` process and wait for its MGMT line; (process, URL)."""

    def ready(lines: list[str]) -> str | None:
        return next((line.split()[2] for line in lines if line.startswith(MGMT_MARK + " ")), None)

    return _spawn_and_wait(cmd, log_path, timeout, True, "the management API", ready)


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
