"""NVMe/TCP PDUs: typed values, encoding to buffers, and strict header decoding.

Every PDU starts with an 8-byte common header (type, flags, HLEN, PDO, PLEN). On the wire:
header (HLEN bytes) -> header digest (4, if HDGSTF) -> zero pad up to PDO -> data -> data digest
(4, if DDGSTF). Encoding returns a list of buffers suitable for ``socket.sendmsg`` so payloads are
never concatenated. Decoding is split in two steps so an I/O layer can land data straight in its
final buffer: :func:`decode_header` validates a complete header and says how many data bytes follow
and where; the caller reads them wherever it wants and checks the data digest with
:func:`check_data_digest`. :class:`~adp_wire.stream.PduDecoder` wraps both for
callers that simply feed bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from .constants import FatalErrorStatus, PduFlags, PduType
from .digest import crc32c, digest_bytes, read_digest

CH = struct.Struct("<BBBBI")  # type, flags, hlen, pdo, plen
_IC = struct.Struct("<HBBI")  # pfv, hpda|cpda, dgst, maxr2t|maxh2cdata (at offset 8)
_TERM = struct.Struct("<HI")  # fes, fei (at offset 8)
_DATA = struct.Struct("<HHII")  # cccid, ttag, datao, datal (at offset 8)
_R2T = struct.Struct("<HHII")  # cccid, ttag, r2to, r2tl (at offset 8)

COMMON_HEADER_SIZE = 8
DIGEST_SIZE = 4
MAX_TERM_DATA = 128

HLEN: dict[int, int] = {
    PduType.IC_REQ: 128,
    PduType.IC_RESP: 128,
    PduType.H2C_TERM_REQ: 24,
    PduType.C2H_TERM_REQ: 24,
    PduType.CAPSULE_CMD: 72,
    PduType.CAPSULE_RESP: 24,
    PduType.H2C_DATA: 24,
    PduType.C2H_DATA: 24,
    PduType.R2T: 24,
}
HOST_TO_CONTROLLER = frozenset({PduType.IC_REQ, PduType.H2C_TERM_REQ, PduType.CAPSULE_CMD, PduType.H2C_DATA})
CONTROLLER_TO_HOST = frozenset(
    {PduType.IC_RESP, PduType.C2H_TERM_REQ, PduType.CAPSULE_RESP, PduType.C2H_DATA, PduType.R2T}
)
# PDUs that carry a header digest once negotiated (IC and TermReq PDUs never do).
_HDGST_CAPABLE = frozenset(
    {PduType.CAPSULE_CMD, PduType.CAPSULE_RESP, PduType.H2C_DATA, PduType.C2H_DATA, PduType.R2T}
)
# PDUs that may carry data (and then a data digest once negotiated).
_DATA_CAPABLE = frozenset({PduType.CAPSULE_CMD, PduType.H2C_DATA, PduType.C2H_DATA})


class PduError(Exception):
    """A fatal transport error: the connection must be terminated with a TermReq carrying these fields."""

    def __init__(self, fes: FatalErrorStatus, message: str, fei: int = 0, header: bytes = b"") -> None:
        super().__init__(f"{fes.name}: {message}")
        self.fes = fes
        self.fei = fei
        self.header = header[:MAX_TERM_DATA]


class DataDigestError(Exception):
    """The data digest of a data-carrying PDU did not match its data."""

    def __init__(self, cccid: int, received: int, computed: int) -> None:
        super().__init__(f"data digest mismatch for cid {cccid}: received {received:#010x}, computed {computed:#010x}")
        self.cccid = cccid


Data = bytes | bytearray | memoryview


@dataclass(slots=True)
class ICReq:
    pfv: int = 0
    hpda: int = 0
    hdgst: bool = False
    ddgst: bool = False
    maxr2t: int = 0
    type = PduType.IC_REQ


@dataclass(slots=True)
class ICResp:
    pfv: int = 0
    cpda: int = 0
    hdgst: bool = False
    ddgst: bool = False
    maxh2cdata: int = 0
    type = PduType.IC_RESP


@dataclass(slots=True)
class CapsuleCmd:
    sqe: bytes
    data: Data = b""
    type = PduType.CAPSULE_CMD


@dataclass(slots=True)
class CapsuleResp:
    cqe: bytes
    type = PduType.CAPSULE_RESP


@dataclass(slots=True)
class H2CData:
    cccid: int
    ttag: int
    datao: int
    data: Data = b""
    last: bool = False
    datal: int = 0  # filled in by the decoder; encoders use len(data)
    type = PduType.H2C_DATA


@dataclass(slots=True)
class C2HData:
    cccid: int
    datao: int
    data: Data = b""
    last: bool = False
    success: bool = False
    datal: int = 0
    type = PduType.C2H_DATA


@dataclass(slots=True)
class R2T:
    cccid: int
    ttag: int
    r2to: int
    r2tl: int
    type = PduType.R2T


@dataclass(slots=True)
class TermReq:
    """H2CTermReq (``from_host``) or C2HTermReq."""

    fes: int
    fei: int = 0
    data: bytes = b""
    from_host: bool = False

    @property
    def type(self) -> PduType:
        return PduType.H2C_TERM_REQ if self.from_host else PduType.C2H_TERM_REQ


Pdu = ICReq | ICResp | CapsuleCmd | CapsuleResp | H2CData | C2HData | R2T | TermReq


# ----------------------------------------------------------------------------------------------------
# Encoding


def data_offset(hlen: int, hdgst: bool, pda: int) -> int:
    """PDO for a data PDU: right after header (+digest), rounded up to (pda+1) dwords when pda > 0."""
    off = hlen + (DIGEST_SIZE if hdgst else 0)
    if pda:
        align = (pda + 1) * 4
        off = -(-off // align) * align
    return off


def encode(pdu: Pdu, hdgst: bool = False, ddgst: bool = False, pda: int = 0) -> list[Data]:
    """Encode ``pdu`` as a list of buffers (header [+ digest + pad], data, data digest).

    ``hdgst``/``ddgst`` are the negotiated digests (ignored for PDUs that never carry them);
    ``pda`` is the peer's required data alignment (CPDA or HPDA, 0's based dwords).
    """
    t = pdu.type
    hlen = HLEN[t]
    if t in (PduType.IC_REQ, PduType.IC_RESP):
        hdr = bytearray(128)
        CH.pack_into(hdr, 0, t, 0, 128, 0, 128)
        dgst = (1 if pdu.hdgst else 0) | (2 if pdu.ddgst else 0)
        if t == PduType.IC_REQ:
            _IC.pack_into(hdr, 8, pdu.pfv, pdu.hpda, dgst, pdu.maxr2t)
        else:
            _IC.pack_into(hdr, 8, pdu.pfv, pdu.cpda, dgst, pdu.maxh2cdata)
        return [bytes(hdr)]
    if t in (PduType.H2C_TERM_REQ, PduType.C2H_TERM_REQ):
        data = bytes(pdu.data[:MAX_TERM_DATA])
        hdr = bytearray(24)
        CH.pack_into(hdr, 0, t, 0, 24, 0, 24 + len(data))
        _TERM.pack_into(hdr, 8, pdu.fes, pdu.fei)
        return [bytes(hdr) + data]

    use_h = hdgst and t in _HDGST_CAPABLE
    data = getattr(pdu, "data", b"") if t in _DATA_CAPABLE else b""
    dlen = len(data)
    use_d = ddgst and dlen > 0
    flags = (PduFlags.HDGSTF if use_h else 0) | (PduFlags.DDGSTF if use_d else 0)
    hdr = bytearray(hlen)
    if t == PduType.CAPSULE_CMD:
        hdr[8:72] = pdu.sqe
    elif t == PduType.CAPSULE_RESP:
        hdr[8:24] = pdu.cqe
    elif t == PduType.H2C_DATA:
        flags |= PduFlags.DATA_LAST if pdu.last else 0
        _DATA.pack_into(hdr, 8, pdu.cccid, pdu.ttag, pdu.datao, dlen)
    elif t == PduType.C2H_DATA:
        flags |= (PduFlags.DATA_LAST if pdu.last else 0) | (PduFlags.DATA_SUCCESS if pdu.success else 0)
        _DATA.pack_into(hdr, 8, pdu.cccid, 0, pdu.datao, dlen)
    elif t == PduType.R2T:
        _R2T.pack_into(hdr, 8, pdu.cccid, pdu.ttag, pdu.r2to, pdu.r2tl)
    if dlen:
        pdo = data_offset(hlen, use_h, pda)
        plen = pdo + dlen + (DIGEST_SIZE if use_d else 0)
    else:
        pdo = 0
        plen = hlen + (DIGEST_SIZE if use_h else 0)
    CH.pack_into(hdr, 0, t, flags, hlen, pdo, plen)
    if use_h:
        hdr += digest_bytes(hdr)
    if not dlen:
        return [hdr]
    if pdo > len(hdr):
        hdr += bytes(pdo - len(hdr))
    return [hdr, data, digest_bytes(data)] if use_d else [hdr, data]


def encode_bytes(pdu: Pdu, hdgst: bool = False, ddgst: bool = False, pda: int = 0) -> bytes:
    """Encode ``pdu`` into one bytes object (tests, small PDUs)."""
    return b"".join(bytes(b) for b in encode(pdu, hdgst, ddgst, pda))


# ----------------------------------------------------------------------------------------------------
# Decoding


@dataclass(slots=True)
class CommonHeader:
    type: int
    flags: int
    hlen: int
    pdo: int
    plen: int

    @classmethod
    def parse(cls, buf: Data) -> CommonHeader:
        return cls(*CH.unpack_from(buf, 0))


@dataclass(slots=True)
class PduHeader:
    """A validated PDU header: the PDU (its ``data`` still empty) and where its data lies."""

    pdu: Pdu
    ch: CommonHeader
    header_span: int  # bytes from PDU start to the end of the header digest
    data_offset: int  # PDO (0 when no data)
    data_len: int
    has_ddgst: bool
    raw: bytes = field(repr=False, default=b"")


def header_span(ch: CommonHeader, hdgst: bool) -> int:
    """Bytes to read from the PDU start to have the full header (and header digest, if flagged)."""
    return ch.hlen + (DIGEST_SIZE if (ch.flags & PduFlags.HDGSTF) else 0)


def check_common_header(ch: CommonHeader, raw: bytes, receiver_is_host: bool, hdgst: bool, ddgst: bool,
                        max_plen: int) -> None:
    """Validate the common header before reading more; raises :class:`PduError`."""
    allowed = CONTROLLER_TO_HOST if receiver_is_host else HOST_TO_CONTROLLER
    if ch.type not in allowed:
        raise PduError(FatalErrorStatus.INVALID_HEADER_FIELD, f"unexpected PDU type {ch.type:#x}", 0, raw)
    t = PduType(ch.type)
    if ch.hlen != HLEN[t]:
        raise PduError(FatalErrorStatus.INVALID_HEADER_FIELD, f"{t.name} with HLEN {ch.hlen}", 2, raw)
    if t in (PduType.IC_REQ, PduType.IC_RESP, PduType.H2C_TERM_REQ, PduType.C2H_TERM_REQ):
        known = 0
    else:
        known = int(PduFlags.HDGSTF | PduFlags.DDGSTF)
    if t in (PduType.H2C_DATA, PduType.C2H_DATA):
        known |= int(PduFlags.DATA_LAST) | (int(PduFlags.DATA_SUCCESS) if t == PduType.C2H_DATA else 0)
    if ch.flags & (0xFF ^ known):
        raise PduError(FatalErrorStatus.INVALID_HEADER_FIELD, f"{t.name} with flags {ch.flags:#x}", 1, raw)
    want_h = hdgst and t in _HDGST_CAPABLE
    if bool(ch.flags & PduFlags.HDGSTF) != want_h:
        raise PduError(FatalErrorStatus.INVALID_HEADER_FIELD,
                       f"{t.name}: HDGSTF {'missing' if want_h else 'not negotiated'}", 1, raw)
    has_h = DIGEST_SIZE if want_h else 0
    if t in (PduType.IC_REQ, PduType.IC_RESP):
        if ch.plen != 128 or ch.pdo != 0:
            raise PduError(FatalErrorStatus.INVALID_HEADER_FIELD, f"{t.name} with PLEN {ch.plen}", 4, raw)
        return
    if t in (PduType.H2C_TERM_REQ, PduType.C2H_TERM_REQ):
        if not 24 <= ch.plen <= 24 + MAX_TERM_DATA:
            raise PduError(FatalErrorStatus.INVALID_HEADER_FIELD, f"{t.name} with PLEN {ch.plen}", 4, raw)
        return
    if ch.plen > max_plen:
        raise PduError(FatalErrorStatus.DATA_TRANSFER_LIMIT_EXCEEDED,
                       f"{t.name} PLEN {ch.plen} exceeds the limit {max_plen}", 4, raw)
    if ch.plen == ch.hlen + has_h:  # no data
        if ch.pdo != 0 or ch.flags & PduFlags.DDGSTF:
            raise PduError(FatalErrorStatus.INVALID_HEADER_FIELD, f"{t.name} without data has PDO/DDGSTF", 3, raw)
        if t in (PduType.H2C_DATA, PduType.C2H_DATA):
            raise PduError(FatalErrorStatus.INVALID_HEADER_FIELD, f"{t.name} without data", 4, raw)
        return
    if t not in _DATA_CAPABLE or ch.plen < ch.hlen + has_h:
        raise PduError(FatalErrorStatus.INVALID_HEADER_FIELD, f"{t.name} with PLEN {ch.plen}", 4, raw)
    if bool(ch.flags & PduFlags.DDGSTF) != ddgst:
        raise PduError(FatalErrorStatus.INVALID_HEADER_FIELD,
                       f"{t.name}: DDGSTF {'missing' if ddgst else 'not negotiated'}", 1, raw)
    if ch.pdo < ch.hlen + has_h or ch.pdo % 4:
        raise PduError(FatalErrorStatus.INVALID_HEADER_FIELD, f"{t.name} with PDO {ch.pdo}", 3, raw)
    if ch.plen <= ch.pdo + (DIGEST_SIZE if ddgst else 0):
        raise PduError(FatalErrorStatus.INVALID_HEADER_FIELD, f"{t.name} PLEN {ch.plen} <= PDO {ch.pdo}", 4, raw)


def decode_header(raw: Data, receiver_is_host: bool, hdgst: bool = False, ddgst: bool = False,
                  max_plen: int = 1 << 30) -> PduHeader:
    """Validate and decode a complete PDU header (``raw`` holds at least :func:`header_span` bytes).

    Raises :class:`PduError` for anything a conforming peer would never send.
    """
    raw = bytes(raw)
    ch = CommonHeader.parse(raw)
    check_common_header(ch, raw[:COMMON_HEADER_SIZE], receiver_is_host, hdgst, ddgst, max_plen)
    t = PduType(ch.type)
    span = header_span(ch, hdgst)
    if len(raw) < span:
        raise ValueError(f"need {span} header bytes, got {len(raw)}")
    if ch.flags & PduFlags.HDGSTF:
        received = read_digest(raw, ch.hlen)
        computed = crc32c(raw[: ch.hlen])
        if received != computed:
            raise PduError(FatalErrorStatus.HEADER_DIGEST_ERROR,
                           f"header digest {received:#010x} != {computed:#010x}", received, raw[: ch.hlen])
    has_d = bool(ch.flags & PduFlags.DDGSTF)
    data_len = ch.plen - ch.pdo - (DIGEST_SIZE if has_d else 0) if ch.pdo else 0
    if t in (PduType.H2C_TERM_REQ, PduType.C2H_TERM_REQ):
        data_len = ch.plen - 24
    pdu: Pdu
    if t == PduType.IC_REQ:
        pfv, hpda, dg, maxr2t = _IC.unpack_from(raw, 8)
        pdu = ICReq(pfv, hpda, bool(dg & 1), bool(dg & 2), maxr2t)
    elif t == PduType.IC_RESP:
        pfv, cpda, dg, maxdata = _IC.unpack_from(raw, 8)
        pdu = ICResp(pfv, cpda, bool(dg & 1), bool(dg & 2), maxdata)
    elif t in (PduType.H2C_TERM_REQ, PduType.C2H_TERM_REQ):
        fes, fei = _TERM.unpack_from(raw, 8)
        pdu = TermReq(fes, fei, b"", from_host=t == PduType.H2C_TERM_REQ)
    elif t == PduType.CAPSULE_CMD:
        pdu = CapsuleCmd(raw[8:72])
    elif t == PduType.CAPSULE_RESP:
        pdu = CapsuleResp(raw[8:24])
    elif t in (PduType.H2C_DATA, PduType.C2H_DATA):
        cccid, ttag, datao, datal = _DATA.unpack_from(raw, 8)
        if datal != data_len:
            raise PduError(FatalErrorStatus.INVALID_HEADER_FIELD,
                           f"DATAL {datal} != PLEN-derived data length {data_len}", 16, raw[: ch.hlen])
        last = bool(ch.flags & PduFlags.DATA_LAST)
        if t == PduType.H2C_DATA:
            pdu = H2CData(cccid, ttag, datao, b"", last, datal)
        else:
            pdu = C2HData(cccid, datao, b"", last, bool(ch.flags & PduFlags.DATA_SUCCESS), datal)
    else:
        cccid, ttag, r2to, r2tl = _R2T.unpack_from(raw, 8)
        pdu = R2T(cccid, ttag, r2to, r2tl)
    if t in (PduType.H2C_TERM_REQ, PduType.C2H_TERM_REQ):
        return PduHeader(pdu, ch, span, 24 if data_len else 0, data_len, False, raw[:span])
    return PduHeader(pdu, ch, span, ch.pdo if data_len else 0, data_len, has_d, raw[:span])


def check_data_digest(header: PduHeader, data: Data, received: Data) -> None:
    """Raise :class:`DataDigestError` unless ``received`` (4 bytes) is the CRC-32C of ``data``."""
    got = read_digest(received)
    want = crc32c(data)
    if got != want:
        raise DataDigestError(getattr(header.pdu, "cccid", 0xFFFF), got, want)
