"""The structure-aware input generator of the target fuzzers.

Each fuzz input is one TCP connection: an optional (possibly mangled) ICReq, an optional Connect (admin queue of a
new controller, an I/O queue of the witness controller, or discovery), then a sequence of PDUs built from the codec
with random command fields, lengths, offsets, digests, out-of-order or oversized data, followed by byte-level
mutations.

The generator is written against :class:`Src` so the same structure drives hypothesis (the emulator's tests) and the
random / atheris engines of ``scripts/fuzz-target`` (the long run).
"""

from __future__ import annotations

import random
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from adp_wire import CapsuleCmd, H2CData, ICReq, Sqe, TermReq, encode_bytes
from adp_wire.constants import DISCOVERY_NQN, AdminOpcode, FabricsType, IoOpcode, Property, SglId
from adp_wire.sqe import connect_cmd, property_set_cmd, rw_cmd
from adp_wire.structs import ConnectData

from .rawhost import CC_ENABLE, HOSTID, HOSTNQN, SUBNQN

# the target the generator is written for (fuzz_settings in .harness): its namespace and limits
T = TypeVar("T")
LBA = 4096
CAPACITY = 16 << 20
NSZE = CAPACITY // LBA
MDTS = 128 << 10
MAX_IO_QUEUES = 8
MAX_INPUT_BYTES = 256 << 10


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
