"""The record of a running local target (`testbed up`), kept in a JSON state file.

The state directory is ``$ADP_KV_STATE_DIR`` or ``~/.local/state/adp-kv`` (:mod:`adp_emulator.paths`);
it holds ``target.json``, the target's log and ``lock`` (held by `up` and `down` while they run). One
target per state directory. The state names the target's pid together with the process's start time
and command line, so `down` never signals a process that merely reuses the pid.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from adp_emulator import paths


def state_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """The state directory (:func:`adp_emulator.paths.state_dir`), created 0700 if missing; StateError if it
    cannot be (a file is there, a read-only or pseudo file system, no permission)."""
    d = paths.state_dir(override)
    if d.exists() and not d.is_dir():
        raise StateError(f"cannot use {d} as the state directory: not a directory; pass another with --state-dir")
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise StateError(f"cannot use {d} as the state directory: {e.strerror or e}; "
                         f"pass another with --state-dir") from None
    if not d.is_dir():
        raise StateError(f"cannot use {d} as the state directory: not a directory; pass another with --state-dir")
    return d


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Hold the state directory's lock (one `up`/`down` at a time); StateError if another holds it."""
    try:
        fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        raise StateError(f"cannot use {directory} as the state directory: {e.strerror or e}; "
                         f"pass another with --state-dir") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StateError(f"another `testbed up` or `testbed down` is running on {directory}; "
                                 f"wait for it or use another --state-dir") from None
            raise StateError(f"cannot lock {directory / 'lock'}: {e.strerror or e}") from None
        yield
    finally:
        os.close(fd)


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
        """Parse a state file's object; ValueError naming the first field of the wrong type."""
        if not isinstance(d, dict):
            raise ValueError("not a JSON object")
        types = {"backend": str, "traddr": str, "trsvcid": int, "subnqn": str, "pid": int, "hosted": str,
                 "mgmt_url": (str, type(None)), "log": (str, type(None)), "started_at": (int, float),
                 "extra": dict}
        for k in ("backend", "traddr", "trsvcid", "subnqn", "pid", "hosted"):
            if k not in d:
                raise ValueError(f"no {k!r}")
        for k, t in types.items():
            if k in d and (isinstance(d[k], bool) or not isinstance(d[k], t)):
                raise ValueError(f"{k!r} is {d[k]!r}")
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
    except OSError as e:
        raise StateError(f"state file {p} cannot be read ({e.strerror or e})") from e
    except RecursionError:
        raise StateError(f"state file {p} is unreadable (nested too deeply); remove it or run "
                         f"`testbed down --force`") from None
    except (ValueError, TypeError) as e:
        raise StateError(f"state file {p} is unreadable ({e}); remove it or run `testbed down --force`") from e


def save(directory: Path, st: TargetState) -> None:
    """Write the state atomically (a unique temporary file, fsync, rename); OSError if it cannot be written."""
    p = state_path(directory)
    fd, tmp = tempfile.mkstemp(prefix=".target.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(st.to_json(), indent=2))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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


def bind_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on (busy, not an address here, privileged), or None."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"port {port} on {host} is busy (another process listens there); choose another with --port"
            if e.errno == errno.EADDRNOTAVAIL:
                return f"{host} is not an address of this machine; pass one of its addresses with --host"
            if e.errno == errno.EACCES:
                return f"port {port} needs privileges here; choose one above 1023 with --port"
            return f"cannot listen on {host}:{port}: {e.strerror or e}"
    return None


def port_busy(host: str, port: int) -> bool:
    """True if ``host:port`` cannot be listened on (see :func:`bind_problem`)."""
    return bind_problem(host, port) is not None


def process_identity(pid: int) -> dict | None:
    """What names a process beyond its pid: its start time (clock ticks since boot) and command line."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            start = int(f.read().rsplit(")", 1)[1].split()[19])
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except (OSError, ValueError, IndexError):
        return None
    return {"start_ticks": start, "cmdline": cmd}


def is_same_process(pid: int, recorded: dict | None, markers: tuple[str, ...]) -> tuple[bool, str]:
    """(True, "") if ``pid`` is still the process ``recorded`` (:func:`process_identity`); without a
    record, if its command line holds one of ``markers``. Else (False, what runs there now)."""
    now = process_identity(pid)
    if now is None:
        return False, "no such process"
    if recorded and "start_ticks" in recorded:
        ok = now["start_ticks"] == recorded["start_ticks"]
    else:
        ok = any(m in now["cmdline"] for m in markers)
    return ok, now["cmdline"][:120]


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
