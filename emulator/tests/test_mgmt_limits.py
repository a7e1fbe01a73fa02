"""The management API against large and unauthenticated bodies (issue 18 item 3), over a real uvicorn
server in a real ``adp_emulator serve`` process: the token is checked and the size capped before the
body is read, so the process's peak RSS does not follow the body."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from adp_emulator.mgmt import MAX_BODY_BYTES

TOKEN = "limits-test-token-0123456789abcdef"
MiB = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen, str, int]]:
    env = {**os.environ, "ADP_KV_MGMT_TOKEN": TOKEN,
           "ADP_KV_STATE_DIR": str(tmp_path_factory.mktemp("state"))}
    proc = subprocess.Popen([sys.executable, "-u", "-m", "adp_emulator", "serve", "--port", "0", "--capacity", "16M",
                             "--mgmt-port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("ADP-EMULATOR MGMT "), line
    hostport = line.split()[2].removeprefix("http://")
    host, _, port = hostport.rpartition(":")
    proc.stdout.readline()
    yield proc, host, int(port)
    proc.terminate()
    proc.communicate(timeout=10)


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def _post(host: str, port: int, headers: dict[str, str], body_bytes: int, chunked: bool = False) -> int:
    """POST ``body_bytes`` of JSON-ish filler from a thread while reading the answer; its status code."""
    s = socket.create_connection((host, port), timeout=30)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    if chunked:
        head += "Transfer-Encoding: chunked\r\n"
    else:
        head += f"Content-Length: {body_bytes}\r\n"
    s.sendall(f"POST /api/v1/faults/delay HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{head}\r\n".encode())

    def send_body() -> None:
        chunk = b" " * MiB
        sent = 0
        try:
            while sent < body_bytes:
                if chunked:
                    s.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
                else:
                    s.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass

    th = threading.Thread(target=send_body, daemon=True)
    th.start()
    try:
        status = s.recv(64).split(b" ", 2)[1]
    finally:
        s.close()
        th.join(30)
    return int(status)


def test_unauthenticated_huge_body_gets_401_without_being_read(server: tuple[subprocess.Popen, str, int]) -> None:
    proc, host, port = server
    before = _peak_rss(proc.pid)
    t0 = time.monotonic()
    assert _post(host, port, {}, 512 * MiB) == 401
    assert _post(host, port, {"Authorization": "Bearer wrong"}, 256 * MiB) == 403
    assert _post(host, port, {"Authorization": f"Basic {TOKEN}"}, 256 * MiB) == 401
    took = time.monotonic() - t0
    grown = _peak_rss(proc.pid) - before
    assert grown < 64 * MiB, f"peak RSS grew {grown / MiB:.0f} MiB"
    assert took < 20


def test_authenticated_oversized_body_gets_413(server: tuple[subprocess.Popen, str, int]) -> None:
    proc, host, port = server
    before = _peak_rss(proc.pid)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert _post(host, port, auth, 256 * MiB) == 413  # Content-Length over the cap
    assert _post(host, port, auth, 64 * MiB, chunked=True) == 413  # no length: cut off while streaming
    assert _peak_rss(proc.pid) - before < 64 * MiB
    import httpx

    r = httpx.post(f"http://{host}:{port}/api/v1/faults/delay", json={"seconds": 0}, headers=auth, timeout=10)
    assert r.status_code == 200  # a normal request still works
    r = httpx.post(f"http://{host}:{port}/api/v1/faults/delay", content=b" " * (MAX_BODY_BYTES + 1),
                   headers={**auth, "Content-Type": "application/json"}, timeout=10)
    assert r.status_code == 413
