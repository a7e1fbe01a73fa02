"""Structure-aware fuzzing of the userspace NVMe/TCP target over real loopback sockets.

Each fuzz input is one TCP connection: an optional (possibly mangled) ICReq, an optional Connect
(admin queue of a new controller, an I/O queue of the witness controller, or discovery), then a
sequence of PDUs built from the codec with random command fields, lengths, offsets, digests,
out-of-order or oversized data, followed by byte-level mutations. The bytes are pipelined blindly,
the write side is half-closed and the target must answer with well-formed PDUs and close the
connection within a deadline. After every batch a long-lived "witness" association must still
serve a verified write/read, a fresh association must come up, and the target's thread count and
the process RSS must stay bounded. No ERROR record may be logged by the target.

The generator is written against :class:`Src` so the same structure drives hypothesis here and
random / atheris engines in ``scripts/fuzz-target`` (the long run).
"""

from __future__ import annotations

import logging
import os
import random
import selectors
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from target_client import HOSTID, HOSTNQN, SUBNQN, RawQueue, open_admin, open_io

from adp_connector.nvmeof.wire import (
    CapsuleCmd,
    H2CData,
    ICReq,
    ICResp,
    PduDecoder,
    PduError,
    Sqe,
    TermReq,
    encode_bytes,
)
from adp_connector.nvmeof.wire.constants import (
    DISCOVERY_NQN,
    AdminOpcode,
    FabricsType,
    IoOpcode,
    Property,
    SglId,
)
from adp_connector.nvmeof.wire.pdu import DataDigestError
from adp_connector.nvmeof.wire.sqe import connect_cmd, keep_alive_cmd, property_set_cmd, rw_cmd
from adp_connector.nvmeof.wire.structs import ConnectData
from adp_emulator.target import TargetSettings, UserspaceTarget

T = TypeVar("T")
LBA = 4096
CAPACITY = 16 << 20
NSZE = CAPACITY // LBA
MDTS = 128 << 10
MAX_IO_QUEUES = 8
WITNESS_LBA = NSZE - 64  # witness data region (rewritten before every check)
CC_ENABLE = 1 | (6 << 16) | (4 << 20)
MAX_INPUT_BYTES = 256 << 10


def fuzz_settings(**kw: Any) -> TargetSettings:
    """Target settings used by the fuzzers (small namespace, RAM backing)."""
    base: dict[str, Any] = {"port": 0, "capacity_bytes": CAPACITY, "mdts_bytes": MDTS,
                            "max_io_queues": MAX_IO_QUEUES, "queue_depth": 32}
    base.update(kw)
    return TargetSettings(**base)


# ----------------------------------------------------------------------------------------------------
# Sources of choices


class Src:
    """Where the generator's choices come from (hypothesis, random, atheris)."""

    def i(self, lo: int, hi: int) -> int:
        raise NotImplementedError

    def raw(self, n: int) -> bytes:
        raise NotImplementedError

    def b(self, p: float = 0.5) -> bool:
        """True with roughly probability ``p`` (p in 1/16 steps)."""
        return self.i(0, 15) < int(p * 16)

    def pick(self, seq: Sequence[T]) -> T:
        return seq[self.i(0, len(seq) - 1)]


class RandomSrc(Src):
    """Choices from :class:`random.Random` (fast mutational runs)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def i(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def raw(self, n: int) -> bytes:
        return self.rng.randbytes(n)


class HypothesisSrc(Src):
    """Choices drawn from a hypothesis ``data`` object (shrinkable)."""

    def __init__(self, data: Any) -> None:
        from hypothesis import strategies as st

        self.data = data
        self.st = st

    def i(self, lo: int, hi: int) -> int:
        return self.data.draw(self.st.integers(lo, hi))

    def raw(self, n: int) -> bytes:
        return self.data.draw(self.st.binary(min_size=n, max_size=n))


class ProviderSrc(Src):
    """Choices from an atheris FuzzedDataProvider (coverage-guided runs)."""

    def __init__(self, fdp: Any) -> None:
        self.fdp = fdp

    def i(self, lo: int, hi: int) -> int:
        return self.fdp.ConsumeIntInRange(lo, hi)

    def raw(self, n: int) -> bytes:
        return self.fdp.ConsumeBytes(n).ljust(n, b"\0")


# ----------------------------------------------------------------------------------------------------
# Generator


@dataclass
class Witness:
    """What the generator may know about the live witness association."""

    cntlid: int = 1
    hostnqn: str = HOSTNQN


@dataclass
class FuzzInput:
    """One connection's worth of bytes, sent in ``chunks`` (pauses between them)."""

    chunks: list[bytes]
    stage: str
    kinds: list[str] = field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(len(c) for c in self.chunks)


_INTERESTING32 = (0, 1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 63, 64, 127, 128, 255, 256, 511, 512, 1023, 1024, 4095,
                  4096, 4097, 8191, 8192, 8193, 65535, 65536, MDTS - 1, MDTS, MDTS + 4096, NSZE - 1, NSZE,
                  NSZE + 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF)


def _u32(src: Src) -> int:
    return src.pick(_INTERESTING32) if src.b(0.7) else src.i(0, 0xFFFFFFFF)


def _u16(src: Src) -> int:
    return _u32(src) & 0xFFFF


def _filler(src: Src, n: int) -> bytes:
    """``n`` data bytes (a short random seed repeated: cheap for large n)."""
    if n <= 0:
        return b""
    seed = src.raw(min(n, 16)) or b"\0"
    return (seed * (n // len(seed) + 1))[:n]


def _random_sqe(src: Src, stage: str) -> Sqe:
    """An SQE whose fields are random but biased toward commands the stage can execute."""
    if stage == "io":
        opc = src.pick((IoOpcode.READ, IoOpcode.WRITE, IoOpcode.FLUSH, IoOpcode.WRITE_ZEROES,
                        IoOpcode.DATASET_MANAGEMENT, IoOpcode.COMPARE, AdminOpcode.FABRICS, src.i(0, 255)))
    elif stage in ("admin", "discovery"):
        opc = src.pick((AdminOpcode.IDENTIFY, AdminOpcode.GET_LOG_PAGE, AdminOpcode.SET_FEATURES,
                        AdminOpcode.GET_FEATURES, AdminOpcode.ASYNC_EVENT_REQUEST, AdminOpcode.KEEP_ALIVE,
                        AdminOpcode.ABORT, AdminOpcode.FABRICS, AdminOpcode.CREATE_IO_SQ, src.i(0, 255)))
    else:
        opc = src.pick((AdminOpcode.FABRICS, AdminOpcode.FABRICS, src.i(0, 255)))
    opc = int(opc)
    sqe = Sqe(opcode=opc, cid=src.i(0, 0xFFFF))
    sqe.flags = 0x40 if src.b(0.85) else src.i(0, 255)
    if opc == AdminOpcode.FABRICS:
        sqe.nsid = src.pick((FabricsType.PROPERTY_GET, FabricsType.PROPERTY_SET, FabricsType.CONNECT,
                             FabricsType.DISCONNECT, FabricsType.AUTH_SEND, src.i(0, 255)))
        sqe.cdw10 = src.pick((0, 1, src.i(0, 7)))
        sqe.cdw11 = src.pick((Property.CAP, Property.VS, Property.CC, Property.CSTS, 0x30, _u32(src)))
        sqe.cdw12 = src.pick((CC_ENABLE, 0, 1 << 14, _u32(src)))
    else:
        sqe.nsid = src.pick((1, 1, 0, 2, 0xFFFFFFFF, _u32(src)))
        sqe.cdw10 = _u32(src)
        sqe.cdw11 = _u32(src) if src.b(0.3) else 0
        sqe.cdw12 = _u32(src) if src.b(0.5) else src.i(0, 64)
        sqe.cdw13 = _u32(src) if src.b(0.2) else 0
    if src.b(0.15):
        sqe.cdw14, sqe.cdw15, sqe.mptr, sqe.sgl_addr = _u32(src), _u32(src), _u32(src), _u32(src)
    sqe.sgl_id = src.pick((SglId.TRANSPORT_DATA_BLOCK, SglId.DATA_BLOCK_OFFSET, src.i(0, 255)))
    sqe.sgl_len = _u32(src)
    return sqe


def _rw_sqe(src: Src) -> Sqe:
    """A mostly valid Read/Write with boundary LBAs and lengths."""
    opc = src.pick((IoOpcode.READ, IoOpcode.WRITE))
    slba = src.pick((0, 1, NSZE - 1, NSZE, NSZE + 1, 1 << 32, (1 << 64) - 1, src.i(0, NSZE)))
    nlb = src.pick((1, 2, 8, 32, 33, 64, 0x10000, src.i(1, 64)))
    length = nlb * LBA if src.b(0.8) else src.pick((0, nlb * LBA - 1, nlb * LBA + 4096, _u32(src)))
    sqe = rw_cmd(opc, 1, 0, nlb, 0)
    sqe.cdw10, sqe.cdw11 = slba & 0xFFFFFFFF, slba >> 32
    sqe.sgl_len = length
    sqe.cid = src.i(0, 0xFFFF)
    if src.b(0.15):
        sqe.sgl_id = SglId.DATA_BLOCK_OFFSET
    return sqe


def _digest_choice(src: Src, hd: bool, dd: bool) -> tuple[bool, bool]:
    """Usually the negotiated digests; sometimes the wrong ones (missing or unexpected)."""
    if src.b(0.1):
        return src.b(), src.b()
    return hd, dd


def _pdu_bytes(src: Src, stage: str, hd: bool, dd: bool, kinds: list[str]) -> list[bytes]:
    """One or more encoded PDUs of a randomly chosen kind."""
    kind = src.pick(("capsule", "capsule", "rw", "rw", "write_data", "h2c", "icreq", "term", "junk", "c2h_type"))
    kinds.append(kind)
    h, d = _digest_choice(src, hd, dd)
    if kind == "capsule":
        sqe = _random_sqe(src, stage)
        n = src.pick((0, 0, sqe.sgl_len, 16, 1024, 4096, 8192, 8193, src.i(0, 9000)))
        n = n if 0 <= n <= 9000 else src.i(0, 9000)
        return [encode_bytes(CapsuleCmd(sqe.encode(), _filler(src, n)), h, d)]
    if kind in ("rw", "write_data"):
        sqe = _rw_sqe(src)
        if kind == "write_data":
            sqe.opcode = IoOpcode.WRITE
            sqe.sgl_id = SglId.TRANSPORT_DATA_BLOCK
        icd = _filler(src, min(sqe.sgl_len, 9000)) if sqe.sgl_id == SglId.DATA_BLOCK_OFFSET else b""
        out = [encode_bytes(CapsuleCmd(sqe.encode(), icd), h, d)]
        if kind == "write_data":  # blind H2CData: the target's first TTAG is 0 on a fresh queue
            total = min(sqe.sgl_len, 64 << 10)
            step = src.pick((4096, 8192, 512, total or 1, src.i(1, 16384)))
            offs = list(range(0, max(total, 1), max(step, 1)))[:24]
            if src.b(0.25):  # out of order / duplicated / skipped chunks
                order = src.i(0, 3)
                if order == 0:
                    offs.reverse()
                elif order == 1 and len(offs) > 1:
                    offs[0], offs[1] = offs[1], offs[0]
                elif order == 2:
                    offs = offs + offs[:1]
                else:
                    offs = offs[1:]
            ttag = 0 if src.b(0.8) else src.i(0, 0xFFFF)
            for off in offs:
                n = min(step, total - off) if src.b(0.9) else src.i(0, 20000)
                cccid = sqe.cid if src.b(0.9) else src.i(0, 0xFFFF)
                hh, dd2 = _digest_choice(src, hd, dd)
                pdu = H2CData(cccid, ttag, off if src.b(0.9) else _u32(src), _filler(src, max(n, 0)),
                              last=off + n >= total)
                out.append(_maybe_mutate(src, encode_bytes(pdu, hh, dd2), hh, dd2))
        return out
    if kind == "h2c":
        n = src.pick((0, 4, 4096, src.i(0, 20000)))
        pdu = H2CData(src.i(0, 0xFFFF), src.pick((0, 1, 2, src.i(0, 0xFFFF))), _u32(src), _filler(src, n),
                      last=src.b())
        return [encode_bytes(pdu, h, d)]
    if kind == "icreq":
        return [encode_bytes(ICReq(pfv=src.pick((0, 0, 1)), hpda=src.i(0, 40), hdgst=src.b(), ddgst=src.b(),
                                   maxr2t=_u32(src)))]
    if kind == "term":
        return [encode_bytes(TermReq(src.i(0, 8), _u32(src), src.raw(src.i(0, 140)), from_host=True))]
    if kind == "c2h_type":  # a controller-to-host PDU type (or an unknown one) sent by the host
        t = src.pick((1, 3, 5, 7, 8, 9, 10, 0x7F, 0xFF, src.i(0, 255)))
        hlen = src.pick((24, 72, 128, src.i(0, 255)))
        plen = src.pick((hlen, hlen + 4, 24, src.i(0, 300)))
        hdr = struct.pack("<BBBBI", t, src.i(0, 15), hlen, src.pick((0, hlen, src.i(0, 255))), plen)
        return [hdr + _filler(src, src.i(0, 300))]
    return [src.raw(src.i(1, 200))]


def _maybe_mutate(src: Src, b: bytes, hd: bool, dd: bool) -> bytes:
    """Byte-level damage: flipped bytes, bad HLEN/PDO/PLEN/flags/type, wrong digests, truncation."""
    if len(b) < 8 or not src.b(0.3):
        return b
    buf = bytearray(b)
    m = src.i(0, 9)
    if m == 0:
        for _ in range(src.i(1, 4)):
            buf[src.i(0, len(buf) - 1)] ^= src.i(1, 255)
    elif m == 1:
        buf[2] = src.pick((0, 8, 23, 24, 25, 71, 72, 73, 127, 128, 255, src.i(0, 255)))  # HLEN
    elif m == 2:
        buf[3] = src.pick((0, 4, 24, 28, 71, 72, 76, 80, 255, src.i(0, 255)))  # PDO
    elif m == 3:
        struct.pack_into("<I", buf, 4, src.pick((0, 7, 8, 24, 72, len(buf) - 1, len(buf) + 1, len(buf) + 4096,
                                                 1 << 20, 0xFFFFFFFF, _u32(src))))  # PLEN
    elif m == 4:
        buf[1] = src.i(0, 255)  # FLAGS
    elif m == 5:
        buf[0] = src.i(0, 255)  # TYPE
    elif m == 6 and hd and len(buf) >= buf[2] + 4:
        buf[buf[2] + src.i(0, 3)] ^= 0x01  # header digest
    elif m == 7 and dd:
        buf[-1 - src.i(0, 3)] ^= 0x80  # data digest
    elif m == 8:
        del buf[src.i(1, len(buf) - 1):]  # truncation: the rest of the input is desynchronised
    else:
        at = src.i(8, max(8, min(len(buf) - 1, 127)))
        buf[at:at + 4] = struct.pack("<I", _u32(src))[: len(buf[at:at + 4])]
    return bytes(buf)


def gen_input(src: Src, witness: Witness) -> FuzzInput:
    """Build one fuzz input (one connection) from ``src``."""
    stage = src.pick(("none", "ic", "admin", "admin", "io", "io", "io", "discovery"))
    kinds: list[str] = []
    out: list[bytes] = []
    hd = dd = False
    if stage != "none":
        hd, dd = src.b(0.3), src.b(0.3)
        ic = ICReq(pfv=0 if src.b(0.95) else src.i(1, 3), hpda=src.i(0, 3) if src.b(0.9) else src.i(0, 255),
                   hdgst=hd, ddgst=dd, maxr2t=_u32(src))
        out.append(_maybe_mutate(src, encode_bytes(ic), False, False) if src.b(0.2) else encode_bytes(ic))
    if stage in ("admin", "io", "discovery"):
        if stage == "io":
            qid, cntlid, hostnqn = src.i(1, MAX_IO_QUEUES + 1), witness.cntlid, witness.hostnqn
            sqsize = src.pick((2, 32, 33, 1, src.i(1, 64)))
        else:
            qid, cntlid, hostnqn = 0, 0xFFFF, HOSTNQN
            sqsize = src.pick((32, 1, 2, 0x10000, src.i(1, 128)))
        if src.b(0.05):
            cntlid = src.i(0, 0xFFFF)
        subnqn = DISCOVERY_NQN if stage == "discovery" else (SUBNQN if src.b(0.95) else "nqn.2099-01.x:other")
        sqe = connect_cmd(qid, sqsize, kato_ms=src.pick((0, 0, 1000, 5000)), cattr=src.pick((0, 0, 0, 4)))
        sqe.cid = src.i(0, 0xFFFF)
        cd = ConnectData(HOSTID, cntlid, subnqn, hostnqn).encode()
        out.append(_maybe_mutate(src, encode_bytes(CapsuleCmd(sqe.encode(), cd), hd, dd), hd, dd)
                   if src.b(0.1) else encode_bytes(CapsuleCmd(sqe.encode(), cd), hd, dd))
        if stage == "admin" and src.b(0.85):
            out.append(encode_bytes(CapsuleCmd(property_set_cmd(Property.CC, CC_ENABLE).encode()), hd, dd))
    for _ in range(src.i(0, 6)):
        for p in _pdu_bytes(src, stage, hd, dd, kinds):
            out.append(_maybe_mutate(src, p, hd, dd))
    blob = b"".join(out)[:MAX_INPUT_BYTES]
    cuts = sorted({src.i(1, len(blob) - 1) for _ in range(src.i(0, 3))}) if len(blob) > 2 else []
    chunks = [blob[a:b] for a, b in zip([0, *cuts], [*cuts, len(blob)], strict=True)]
    return FuzzInput([c for c in chunks if c] or [b""], stage, kinds)


# ----------------------------------------------------------------------------------------------------
# Execution and checks


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


# ----------------------------------------------------------------------------------------------------
# Tests

FUZZ_SECONDS = float(os.environ.get("ADP_KV_FUZZ_SECONDS", "12"))
FUZZ_EXAMPLES = int(os.environ.get("ADP_KV_FUZZ_EXAMPLES", "1000"))
BATCH = 25


@pytest.fixture(scope="module")
def harness() -> Iterator[FuzzHarness]:
    h = FuzzHarness()
    yield h
    h.close()


def test_generator_is_deterministic_for_a_seed() -> None:
    w = Witness()
    a = [gen_input(RandomSrc(random.Random(7)), w).chunks for _ in range(1)]
    b = [gen_input(RandomSrc(random.Random(7)), w).chunks for _ in range(1)]
    assert a == b


def test_fuzz_target_hypothesis(harness: FuzzHarness) -> None:
    """Hypothesis-driven inputs for ~FUZZ_SECONDS; invariants after every input and every batch."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    stop_at = time.monotonic() + FUZZ_SECONDS
    stats = {"inputs": 0, "hangs": 0}

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True, print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def one(data: Any) -> None:
        inp = gen_input(HypothesisSrc(data), harness.witness)  # always draw: keeps generation consistent
        if time.monotonic() > stop_at:
            return
        out = run_input(harness.addr, inp)
        stats["inputs"] += 1
        assert not out.hung, f"target neither answered nor closed within the deadline ({inp.stage} {inp.kinds})"
        assert not out.bad_output, out.bad_output
        assert not harness.errors.records, harness.errors.records[:3]
        if stats["inputs"] % BATCH == 0:
            harness.check()

    one()
    harness.check()
    assert stats["inputs"] >= 50, stats


def test_fuzz_target_random_mutational(harness: FuzzHarness) -> None:
    """A quick seeded random pass of the same generator (different distribution than hypothesis)."""
    rng = random.Random(int(os.environ.get("ADP_KV_FUZZ_SEED", "20261101")))
    stop_at = time.monotonic() + FUZZ_SECONDS / 3
    n = 0
    while time.monotonic() < stop_at and n < 5000:
        inp = gen_input(RandomSrc(rng), harness.witness)
        out = run_input(harness.addr, inp)
        n += 1
        assert not out.hung and not out.bad_output, (out, inp.stage, inp.kinds)
        if n % BATCH == 0:
            harness.check()
    harness.check()
    assert n >= 50


def test_other_connections_survive_concurrent_fuzzing(harness: FuzzHarness) -> None:
    """Fuzz from 3 threads while the witness keeps doing verified I/O."""
    stop = threading.Event()
    failures: list[str] = []

    def fuzzer(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(400):
            if stop.is_set():
                return
            out = run_input(harness.addr, gen_input(RandomSrc(rng), harness.witness))
            if out.hung or out.bad_output:
                failures.append(repr(out))

    threads = [threading.Thread(target=fuzzer, args=(s,), daemon=True) for s in (1, 2, 3)]
    for t in threads:
        t.start()
    t_end = time.monotonic() + 4
    rounds = 0
    try:
        while time.monotonic() < t_end:
            harness.witness_rw(harness.io, WITNESS_LBA + 16)
            rounds += 1
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not failures, failures[:3]
    assert rounds > 10
    harness.check()


# ----------------------------------------------------------------------------------------------------
# Regression tests for bugs the fuzzers found (see docs/reliability.md)


def run_regression(fn: Callable[[FuzzHarness], None]) -> None:
    """Run one regression body against a fresh harness (keeps module state clean)."""
    h = FuzzHarness()
    try:
        fn(h)
        h.check()
    finally:
        h.close()


def _bad_digest_write(h: FuzzHarness, in_capsule: bool) -> tuple[int, bytes, bytes]:
    """Store ``old`` at LBA 100, then send a Write of other bytes whose data digest is wrong."""
    old = bytes(range(256)) * 16
    cqe, _ = h.io.cmd(rw_cmd(IoOpcode.WRITE, 1, 100, 1, LBA), old)
    assert cqe.status.ok
    adm = open_admin(h.addr, ddgst=True)
    io = open_io(h.addr, adm.cntlid, qid=2, ddgst=True)
    try:
        sqe = rw_cmd(IoOpcode.WRITE, 1, 100, 1, LBA, in_capsule=in_capsule)
        sqe.cid = 9
        if in_capsule:
            raw = bytearray(encode_bytes(CapsuleCmd(sqe.encode(), b"\xee" * LBA), False, True))
        else:
            io.send_pdu(CapsuleCmd(sqe.encode()))
            r2t = io.recv_pdu()
            raw = bytearray(encode_bytes(H2CData(9, r2t.ttag, 0, b"\xee" * LBA, last=True), False, True))
        raw[-1] ^= 0x01  # wrong data digest
        io.send_raw(bytes(raw))
        while 9 not in io.done:
            io.poll()
        status = io.done[9].status.word
    finally:
        io.close()
        adm.close()
    _, got = h.io.cmd(rw_cmd(IoOpcode.READ, 1, 100, 1, LBA))
    return status, old, got


@pytest.mark.parametrize("in_capsule", [True, False], ids=["in_capsule", "r2t"])
def test_regression_write_with_bad_data_digest_leaves_media_unchanged(in_capsule: bool) -> None:
    """BUG-1: a Write failing its data digest (Transient Transport Error) must not modify the media.

    The target receives Write data straight into the namespace mmap and checks the digest only
    afterwards, so the corrupted bytes are already stored when the command fails (nvmet checks the
    digest before executing the write). Fails until fixed.
    """
    def body(h: FuzzHarness) -> None:
        status, old, got = _bad_digest_write(h, in_capsule)
        assert status != 0, "a Write with a wrong data digest must fail"
        assert got == old, "the failed Write's corrupted payload reached the media"

    run_regression(body)


def test_regression_outstanding_r2t_bounded_on_admin_queue() -> None:
    """BUG-2: more R2T-solicited commands than 65536 on one queue crash the connection (TTAG overflow).

    The admin queue accepts any SQSIZE (up to 65536) and the target keeps up to 2*SQSIZE commands
    waiting for H2CData, each with a 1 KiB buffer (~128 MiB for one connection); the 65537th
    R2T's TTAG overflows the 16-bit field, struct.error escapes into the generic handler
    ("internal error") and the connection is reset without a C2HTermReq. Correct: outstanding
    commands are bounded by SQSIZE (extra ones fail or end the connection with a TermReq), never an
    internal error. Fails until fixed.
    """
    def body(h: FuzzHarness) -> None:
        q = RawQueue(h.addr, timeout=30)
        q.icreq()
        assert q.connect(0, 0x10000).status.ok
        q.enable()
        s = connect_cmd(0, 32)
        s.sgl_id = SglId.TRANSPORT_DATA_BLOCK  # Connect data solicited by R2T, never sent
        blob = bytearray()
        for i in range(0x10000 + 8):
            s.cid = i & 0xFFFF
            blob += encode_bytes(CapsuleCmd(s.encode()))
        rss0 = rss_bytes()
        reader_out: list[BaseException] = []

        def reader() -> None:
            try:
                while True:
                    q.recv_pdu()
            except BaseException as e:
                reader_out.append(e)

        th = threading.Thread(target=reader, daemon=True)
        th.start()
        try:
            q.sock.sendall(bytes(blob))
            q.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        th.join(60)
        q.close()
        errors = list(h.errors.records)
        h.errors.records.clear()
        assert not errors, f"target hit an internal error: {errors[:2]}"
        assert rss_bytes() - rss0 < 64 << 20, "one connection pinned > 64 MiB of pending transfers"

    run_regression(body)
