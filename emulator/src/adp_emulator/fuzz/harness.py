"""Running fuzz inputs against a live userspace target, and the invariants checked between batches.

The bytes of one input are pipelined blindly, the write side is half-closed and the target must answer with
well-formed PDUs and close the connection within a deadline. After every batch a long-lived "witness" association
must still serve a verified write/read, a fresh association must come up, and the target's thread count and the
process RSS must stay bounded. No ERROR record may be logged by the target.
"""

from __future__ import annotations

import logging
import random
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from adp_wire import ICResp, PduDecoder, PduError, TermReq
from adp_wire.constants import IoOpcode
from adp_wire.pdu import DataDigestError
from adp_wire.sqe import keep_alive_cmd, rw_cmd

from ..target import TargetSettings, UserspaceTarget
from .generator import CAPACITY, LBA, MAX_IO_QUEUES, MDTS, NSZE, FuzzInput, Witness
from .rawhost import HOSTNQN, RawQueue, open_admin, open_io

WITNESS_LBA = NSZE - 64  # witness data region (rewritten before every check)


def fuzz_settings(**kw: Any) -> TargetSettings:
    """Target settings used by the fuzzers (small namespace, RAM backing)."""
    base: dict[str, Any] = {"port": 0, "capacity_bytes": CAPACITY, "mdts_bytes": MDTS,
                            "max_io_queues": MAX_IO_QUEUES, "queue_depth": 32}
    base.update(kw)
    return TargetSettings(**base)


@dataclass
class Outcome:
    """What one input did: hung (no close within the deadline), output PDUs, output problems."""

    hung: bool = False
    pdus: int = 0
    terms: int = 0
    bad_output: str = ""
    seconds: float = 0.0


def run_input(addr: tuple[str, int], inp: FuzzInput, deadline_s: float = 5.0,
              pause_s: float = 0.0005) -> Outcome:
    """Send the input (reading concurrently), half-close, then read until the target closes."""
    out = Outcome()
    t0 = time.monotonic()
    sock = socket.create_connection(addr, timeout=deadline_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    dec = PduDecoder(receiver_is_host=True)
    rx = bytearray()
    sel = selectors.DefaultSelector()
    end = t0 + deadline_s
    try:
        sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
        pending = [memoryview(c) for c in inp.chunks if c]
        wr_open = True
        eof = False
        while not eof and time.monotonic() < end:
            if wr_open and not pending:
                try:
                    sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                wr_open = False
                sel.modify(sock, selectors.EVENT_READ)
            for _key, ev in sel.select(timeout=max(0.0, min(0.05, end - time.monotonic()))):
                if ev & selectors.EVENT_READ:
                    try:
                        chunk = sock.recv(1 << 20)
                    except (BlockingIOError, InterruptedError):
                        chunk = None
                    except OSError:
                        chunk = b""
                    if chunk == b"":
                        eof = True
                        break
                    if chunk:
                        rx += chunk
                if ev & selectors.EVENT_WRITE and pending:
                    try:
                        n = sock.send(pending[0])
                    except (BlockingIOError, InterruptedError):
                        n = 0
                    except OSError:  # reset by the target after a TermReq: nothing more to send
                        pending = []
                        n = 0
                    if pending:
                        if n >= len(pending[0]):
                            pending.pop(0)
                            if pending and pause_s:
                                time.sleep(pause_s)
                        else:
                            pending[0] = pending[0][n:]
        out.hung = not eof
    finally:
        sel.close()
        sock.close()
    out.seconds = time.monotonic() - t0
    _check_output(dec, bytes(rx), out)
    return out


def _check_output(dec: PduDecoder, rx: bytes, out: Outcome) -> None:
    """Every byte the target sent must decode as a well-formed controller-to-host PDU stream."""
    dec.feed(rx)
    try:
        while True:
            pdu = dec.next_pdu()
            if pdu is None:
                break
            out.pdus += 1
            if isinstance(pdu, ICResp):
                dec.set_digests(pdu.hdgst, pdu.ddgst)
            elif isinstance(pdu, TermReq):
                out.terms += 1
                if dec.buffered:
                    out.bad_output = f"{dec.buffered} bytes after C2HTermReq"
                return
    except (PduError, DataDigestError) as e:
        out.bad_output = f"target sent a malformed PDU: {e}"
        return
    if dec.buffered:
        out.bad_output = f"connection closed inside a PDU ({dec.buffered} bytes left)"


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def max_rss_bytes() -> int:
    """Peak resident set size of this process (Linux /proc)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class ErrorLog(logging.Handler):
    """Collects ERROR records logged by the target (an internal exception is always a bug)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(self.format(record) if record.exc_info is None else
                            f"{record.getMessage()}: {record.exc_info[1]!r}")


class FuzzHarness:
    """A live target plus the witness association and the per-batch invariant checks."""

    def __init__(self, settings: TargetSettings | None = None, rss_slack: int = 256 << 20,
                 thread_slack: int = 8) -> None:
        self.target = UserspaceTarget(settings or fuzz_settings()).start()
        self.addr = self.target.address
        self.errors = ErrorLog()
        self._log = logging.getLogger("adp_emulator")
        self._log.addHandler(self.errors)
        self.admin = open_admin(self.addr, hdgst=True, ddgst=True)
        self.io = open_io(self.addr, self.admin.cntlid, qid=1, hdgst=True, ddgst=True)
        self.witness = Witness(self.admin.cntlid, HOSTNQN)
        self.rng = random.Random(1234)
        self.checks = 0
        time.sleep(0.05)
        self.base_threads = threading.active_count()
        self.base_rss = rss_bytes()
        self.rss_slack = rss_slack
        self.thread_slack = thread_slack

    def close(self) -> None:
        for q in (self.io, self.admin):
            q.close()
        self._log.removeHandler(self.errors)
        self.target.stop()

    def witness_rw(self, q: RawQueue, lba: int) -> None:
        """Write a fresh pattern through ``q`` and read it back byte for byte."""
        data = self.rng.randbytes(2 * LBA)
        cqe, _ = q.cmd(rw_cmd(IoOpcode.WRITE, 1, lba, 2, len(data)), data)
        assert cqe.status.ok, cqe
        cqe, got = q.cmd(rw_cmd(IoOpcode.READ, 1, lba, 2, len(data)))
        assert cqe.status.ok and got == data, "witness read returned wrong bytes"

    def check(self, settle_s: float = 3.0) -> dict[str, int]:
        """The invariants after a batch; raises AssertionError naming the broken one."""
        self.checks += 1
        assert not self.errors.records, f"target logged errors: {self.errors.records[:3]}"
        cqe, _ = self.admin.cmd(keep_alive_cmd())
        assert cqe.status.ok, cqe
        self.witness_rw(self.io, WITNESS_LBA)
        fresh = open_admin(self.addr)
        try:
            fio = open_io(self.addr, fresh.cntlid, qid=1)
            try:
                self.witness_rw(fio, WITNESS_LBA + 8)
            finally:
                fio.close()
        finally:
            fresh.close()
        deadline = time.monotonic() + settle_s
        while threading.active_count() > self.base_threads + self.thread_slack and time.monotonic() < deadline:
            time.sleep(0.02)
        threads = threading.active_count()
        assert threads <= self.base_threads + self.thread_slack, (
            f"{threads} threads alive (baseline {self.base_threads}): connection threads leak")
        rss = rss_bytes()
        assert rss <= self.base_rss + self.rss_slack, f"RSS {rss >> 20} MiB (baseline {self.base_rss >> 20} MiB)"
        return {"threads": threads, "rss": rss, "connections": self.target.counters()["connections"]}
