"""The ceiling for the data-path benchmark: plain Python loopback TCP streams.

A server process (``python -m adp_testbed.bench.stream``) accepts connections; each asks it to send
or to receive a number of bytes. The client side lives in the benchmark process, one thread per
stream, using the same primitives the NVMe/TCP client uses (``recv_into`` a preallocated buffer,
``sendmsg`` of memoryviews), so the ratio measures protocol overhead, not Python's socket speed.
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

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
        buf = memoryview(bytearray(b"\xa5") * chunk)  # not zeros: a receiver's landing region shows what arrived
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


@dataclass(frozen=True)
class StreamResult:
    """One ceiling measurement: the rate, and the CPU both ends spent (kernel copies included)."""

    bytes: int
    seconds: float
    receiver_cpu_s: float  # the receiving end's threads (user + system)
    sender_cpu_s: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9

    @property
    def receiver_cpu_s_per_gb(self) -> float:
        return self.receiver_cpu_s / (self.bytes / 1e9)

    @property
    def sender_cpu_s_per_gb(self) -> float:
        return self.sender_cpu_s / (self.bytes / 1e9)

    def as_row(self, prefix: str = "ceiling_") -> dict[str, float]:
        """The fields a benchmark row carries (``ceiling_gbps``, ``ceiling_receiver_cpu_s_per_gb``, ...)."""
        return {f"{prefix}gbps": round(self.gbps, 2),
                f"{prefix}receiver_cpu_s_per_gb": round(self.receiver_cpu_s_per_gb, 3),
                f"{prefix}sender_cpu_s_per_gb": round(self.sender_cpu_s_per_gb, 3)}


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads; Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def receive(sock: socket.socket, buf: memoryview, total: int, chunk: int, advance: bool) -> None:
    """Receive ``total`` bytes from ``sock`` into ``buf``, at most ``chunk`` per call: each into the start of ``buf``,
    or with ``advance`` one after another across it, from the start again once it is full (a short receive never
    leaves a tail of ``buf`` unwritten)."""
    at, left = 0, total
    while left:
        n = sock.recv_into(buf[at:at + min(chunk, left, len(buf) - at)])
        if not n:
            raise ConnectionError("stream closed early")
        left -= n
        if advance:
            at += n
            if at == len(buf):
                at = 0


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
        return self.measure_cpu(streams, total_bytes, chunk, mode).gbps

    def measure_cpu(self, streams: int, total_bytes: int, chunk: int, mode: str = "read",
                    land: memoryview | None = None) -> StreamResult:
        """``streams`` parallel streams moving ``total_bytes`` in all: the rate and the CPU of both ends.

        The client end runs here, one thread per stream, its CPU taken per thread (``time.thread_time``:
        user + system of that thread alone); the server end is the server process (all its threads, from
        /proc, clock-tick resolution). ``mode`` "read": the server sends, the threads here receive.

        By default a receiving thread reuses one ``chunk`` buffer, which stays in its core's cache. With ``land``
        (read mode; a writable buffer of at least ``streams * chunk`` bytes, faulted in by the caller) each thread
        lands its bytes one after another across its own share of it, from the start again once full, as a restore
        lands pages across its staging memory: the kernel's receive copy then writes memory that is not in cache,
        which costs more.
        """
        if land is not None and (mode != "read" or len(land) < streams * chunk):
            raise ValueError(f"land needs read mode and at least streams x chunk ({streams * chunk} bytes)")
        per = total_bytes // streams
        span = (len(land) // streams) // chunk * chunk if land is not None else 0
        ready = threading.Barrier(streams + 1)
        errors: list[BaseException] = []
        thread_cpu: list[float] = []

        def run(i: int) -> None:
            try:
                with socket.create_connection((self.host, self.port)) as s:
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    buf = memoryview(bytearray(chunk)) if land is None else land[i * span:(i + 1) * span]
                    ready.wait()
                    c0 = time.thread_time()
                    s.sendall(_REQ.pack(b"SEND" if mode == "read" else b"RECV", per, chunk))
                    left = per
                    if mode == "read":
                        receive(s, buf, per, chunk, land is not None)
                    else:
                        while left:
                            n = min(chunk, left)
                            s.sendmsg([buf[:n]])
                            left -= n
                        s.recv(1)
                    thread_cpu.append(time.thread_time() - c0)
            except BaseException as e:  # reported below
                errors.append(e)
                ready.abort()

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(streams)]
        for t in threads:
            t.start()
        server_pid = self._proc.pid if self._proc is not None else 0
        s0 = _process_cpu_s(server_pid) if server_pid else 0.0
        ready.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        dt = time.perf_counter() - t0
        if errors:
            raise errors[0]
        server = (_process_cpu_s(server_pid) - s0) if server_pid else 0.0
        client = sum(thread_cpu)
        recv_cpu, send_cpu = (client, server) if mode == "read" else (server, client)
        return StreamResult(per * streams, dt, recv_cpu, send_cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    a = ap.parse_args()
    serve(a.host, a.port)


if __name__ == "__main__":
    main()
