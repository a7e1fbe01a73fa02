"""Serving the management API: uvicorn in a background thread, and the token file."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import threading
import time
from pathlib import Path

from fastapi import FastAPI


class TokenFileError(OSError):
    """The token file cannot be written safely (a link, someone else's directory, ...)."""


def write_token_file(path: str | os.PathLike[str], token: str) -> Path:
    """Write ``token`` to ``path``, mode 0600, in a directory only we can write to.

    The file is created fresh with ``O_EXCL | O_NOFOLLOW`` (an existing one is unlinked first, never
    opened), so a symlink planted at ``path`` is neither followed nor chmodded. A missing directory is
    created 0700; an existing one must be ours and not writable by group or others.
    """
    p = Path(path)
    d = p.parent
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.stat(d)
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise TokenFileError(f"token directory {d} must be owned by this user and not writable by others "
                             f"(mode {stat.filemode(st.st_mode)})")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(p)  # a link or an old token: removed, never written through
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (token + "\n").encode())
    finally:
        os.close(fd)
    return p


class ApiServer:
    """uvicorn serving ``app`` on ``host:port`` (0 = any free port) in a daemon thread."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((host, port))
        except OSError:
            self.sock.close()
            raise
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        h = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{h}:{self.port}"

    def start(self, timeout: float = 10.0) -> ApiServer:
        """Start serving; returns once uvicorn accepts connections."""
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name="adp-mgmt-api", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"management API did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.sock.close()
