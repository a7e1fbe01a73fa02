"""The ceiling for the data-path benchmark: plain Python loopback TCP streams.

A server process (``python -m adp_testbed.bench.stream``) accepts connections; each asks it to send
or to receive a number of bytes. The client side lives in the benchmark process, one thread per
stream, using the same primitives the NVMe/TCP client uses (``recv_into`` a preallocated buffer,
``sendmsg`` of memoryviews), so the ratio measures protocol overhead, not Python's socket speed.
"""

from __future__ import annotations

import argparse
import socket
import struct
import subprocess
import sys
import threading
import time

_REQ = struct.Struct("<4sQI")  # mode b"SEND"/b"RECV", total bytes, chunk size


def _serve_conn(conn: socket.socket) -> None:
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hdr = bytearray(_REQ.size)
        view = memoryview(hdr)
        got = 0
        while got < len(hdr):
            n = conn.recv_into(view[got:])
            if not n:
                return
            got += n
        mode, total, chunk = _REQ.unpack(hdr)
        buf = memoryview(bytearray(chunk))
        left = total
        if mode == b"SEND":
            while left:
                n = min(chunk, left)
                conn.sendall(buf[:n])
                left -= n
        else:
            while left:
                n = conn.recv_into(buf[: min(chunk, left)])
                if not n:
                    return
                left -= n
            conn.sendall(b"D")


def serve(host: str, port: int) -> None:
    srv = socket.create_server((host, port))
    print(f"STREAM READY {srv.getsockname()[1]}", flush=True)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=_serve_conn, args=(conn,), daemon=True).start()


class StreamServer:
    """Runs the stream server in a child process for the duration of a ``with`` block."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = 0
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> StreamServer:
        self._proc = subprocess.Popen([sys.executable, "-u", "-m", "adp_testbed.bench.stream", "--host", self.host],
                                      stdout=subprocess.PIPE, text=True)
        line = self._proc.stdout.readline() if self._proc.stdout else ""
        if not line.startswith("STREAM READY"):
            raise RuntimeError(f"stream server failed to start: {line!r}")
        self.port = int(line.split()[2])
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()

    def measure(self, streams: int, total_bytes: int, chunk: int, mode: str = "read") -> float:
        """Aggregate GB/s of ``streams`` parallel streams moving ``total_bytes`` in all."""
        per = total_bytes // streams
        ready = threading.Barrier(streams + 1)
        errors: list[BaseException] = []

        def run() -> None:
            try:
                with socket.create_connection((self.host, self.port)) as s:
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    buf = memoryview(bytearray(chunk))
                    ready.wait()
                    s.sendall(_REQ.pack(b"SEND" if mode == "read" else b"RECV", per, chunk))
                    left = per
                    if mode == "read":
                        while left:
                            n = s.recv_into(buf[: min(chunk, left)])
                            if not n:
                                raise ConnectionError("stream closed early")
                            left -= n
                    else:
                        while left:
                            n = min(chunk, left)
                            s.sendmsg([buf[:n]])
                            left -= n
                        s.recv(1)
            except BaseException as e:  # reported below
                errors.append(e)
                ready.abort()

        threads = [threading.Thread(target=run, daemon=True) for _ in range(streams)]
        for t in threads:
            t.start()
        ready.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        dt = time.perf_counter() - t0
        if errors:
            raise errors[0]
        return per * streams / dt / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    a = ap.parse_args()
    serve(a.host, a.port)


if __name__ == "__main__":
    main()
