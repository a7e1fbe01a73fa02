"""The record of a running local target (`testbed up`), kept in a JSON state file.

The state directory is ``$ADP_KV_STATE_DIR`` or ``~/.local/state/adp-kv``; it holds ``target.json``
and the target's log. One target per state directory.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from adp_emulator import paths


def state_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """The state directory (:func:`adp_emulator.paths.state_dir`), created 0700 if missing."""
    d = paths.state_dir(override)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    return d


@dataclass
class TargetState:
    backend: str  # "user" | "kernel"
    traddr: str
    trsvcid: int
    subnqn: str
    pid: int
    hosted: str  # "host" (a process here) | "vm" (QEMU guest) | "host-kernel" (nvmet on this kernel)
    mgmt_url: str | None = None
    log: str | None = None
    started_at: float = field(default_factory=time.time)
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> TargetState:
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)


class StateError(Exception):
    """A user-facing problem with the state file (already up, stale, unreadable)."""


def state_path(directory: Path) -> Path:
    return directory / "target.json"


def load(directory: Path) -> TargetState | None:
    p = state_path(directory)
    if not p.exists():
        return None
    try:
        return TargetState.from_json(json.loads(p.read_text()))
    except (ValueError, TypeError) as e:
        raise StateError(f"state file {p} is unreadable ({e}); remove it or run `testbed down --force`") from e


def save(directory: Path, st: TargetState) -> None:
    p = state_path(directory)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(st.to_json(), indent=2))
    tmp.replace(p)


def clear(directory: Path) -> None:
    state_path(directory).unlink(missing_ok=True)


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child still "exists"; treat it as dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def port_busy(host: str, port: int) -> bool:
    """True if something already listens on host:port (or the port cannot be bound)."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def stop_pid(pid: int, timeout: float = 10.0) -> bool:
    """SIGTERM the process group of ``pid``, then SIGKILL after ``timeout``; True if it is gone."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 3.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return True
        except PermissionError:
            os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not pid_alive(pid):
                return True
            time.sleep(0.05)
    return not pid_alive(pid)
