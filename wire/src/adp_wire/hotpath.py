"""Per-queue fast paths of the codec: precompiled packers and header checks for the PDUs of every command.

:func:`~adp_wire.pdu.encode` and :func:`~adp_wire.pdu.decode_header` build and validate any PDU
through dataclasses (~10-25 us a PDU); an I/O queue moving GB/s needs the same rules cheaper. This
module holds them, bound once to what a queue negotiated:

* :class:`PduPacker` - CapsuleCmd (any SQE, or a Read/Write built in one ``struct`` call), CapsuleResp,
  H2CData, C2HData and R2T, byte for byte what :func:`~adp_wire.pdu.encode` produces.
* :class:`HeaderCheck` - validates each received header: the canonical shapes on a precompiled fast
  path, anything else through :func:`~adp_wire.pdu.check_common_header` /
  :func:`~adp_wire.pdu.decode_header`, so the codec decides every error and its FES/FEI.
* ``CQE_FIELDS`` / ``DATA_FIELDS`` - the fields of a CapsuleResp and of an H2CData/C2HData/R2T header.

Still sans-IO: bytes and tuples in and out, no sockets.
"""

from __future__ import annotations

import struct

from .constants import SQE_FLAGS_SGL, FatalErrorStatus, PduFlags, PduType, SglId
from .digest import crc32c, digest_bytes, read_digest
from .pdu import (
    CH,
    CONTROLLER_TO_HOST,
    DIGEST_SIZE,
    HLEN,
    HOST_TO_CONTROLLER,
    CommonHeader,
    Data,
    PduError,
    check_common_header,
    data_offset,
    decode_header,
)

_CAPSULE_RW = struct.Struct("<BBBBIBBHIIIQQI3xBIIIIII")  # common header + a Read/Write SQE (72 bytes)
_RESP = struct.Struct("<BBBBIIIHHHH")  # common header + CQE (24 bytes)
_DATA = struct.Struct("<BBBBIHHII4x")  # common header + cccid, ttag, datao/r2to, datal/r2tl (24 bytes)
CQE_FIELDS = struct.Struct("<8xIIHHHH")  # dw0, dw1, sqhd, sqid, cid, status of a CapsuleResp
DATA_FIELDS = struct.Struct("<8xHHII")  # cccid, ttag, datao, datal of H2CData/C2HData (r2to, r2tl of R2T)
_CH_UNPACK = CH.unpack_from
_U32_AT16 = struct.Struct("<I").unpack_from  # DATAL of H2CData/C2HData (offset 16)

_HDGSTF, _DDGSTF = int(PduFlags.HDGSTF), int(PduFlags.DDGSTF)
_LAST, _SUCCESS = int(PduFlags.DATA_LAST), int(PduFlags.DATA_SUCCESS)
_CMD, _RSP, _H2C, _C2H, _R2T = (int(PduType.CAPSULE_CMD), int(PduType.CAPSULE_RESP), int(PduType.H2C_DATA),
                                int(PduType.C2H_DATA), int(PduType.R2T))
_IC = (int(PduType.IC_REQ), int(PduType.IC_RESP))
_TERM = (int(PduType.H2C_TERM_REQ), int(PduType.C2H_TERM_REQ))

Payload = Data | list  # one buffer, or a list of buffers that follow each other (a scatter list)


def payload_digest(data: Payload) -> bytes:
    """The data digest field of ``data`` (one buffer or a list of consecutive buffers)."""
    if type(data) is list:
        value = 0
        for part in data:
            value = crc32c(part, value)
        return value.to_bytes(4, "little")
    return digest_bytes(data)


class PduPacker:
    """Encodes the PDUs of one queue with its negotiated digests and the peer's data alignment ``pda``.

    Every method returns the buffers of one PDU (header [+ digest + pad], data..., data digest), ready
    for ``socket.sendmsg``; a list ``data`` (consecutive buffers) is spliced in, never copied.
    """

    __slots__ = ("_d", "_fl_h", "_fl_hd", "_h", "cmd_pdo", "data_pdo", "ddgst", "hdgst")

    def __init__(self, hdgst: bool = False, ddgst: bool = False, pda: int = 0) -> None:
        self.hdgst, self.ddgst = hdgst, ddgst
        self._h = DIGEST_SIZE if hdgst else 0
        self._d = DIGEST_SIZE if ddgst else 0
        self._fl_h = _HDGSTF if hdgst else 0
        self._fl_hd = self._fl_h | (_DDGSTF if ddgst else 0)
        self.cmd_pdo = data_offset(72, hdgst, pda)
        self.data_pdo = data_offset(24, hdgst, pda)

    def _finish(self, hdr: bytes, pdo: int) -> bytes:
        if self._h:
            hdr += digest_bytes(hdr)
        if pdo > len(hdr):
            hdr += bytes(pdo - len(hdr))
        return hdr

    def _with_data(self, hdr: bytes, data: Payload) -> list:
        bufs = [hdr, *data] if type(data) is list else [hdr, data]
        if self._d:
            bufs.append(payload_digest(data))
        return bufs

    def capsule(self, sqe: bytes, data: Payload = b"") -> list:
        """CapsuleCmd carrying the 64-byte ``sqe`` and in-capsule ``data`` (may be empty)."""
        n = len(data) if type(data) is not list else sum(len(b) for b in data)
        if not n:
            return [self._finish(CH.pack(_CMD, self._fl_h, 72, 0, 72 + self._h) + sqe, 0)]
        pdo = self.cmd_pdo
        return self._with_data(self._finish(CH.pack(_CMD, self._fl_hd, 72, pdo, pdo + n + self._d) + sqe, pdo), data)

    def rw_capsule(self, opcode: int, cid: int, nsid: int, slba: int, nlb: int, length: int,
                   data: Payload | None = None) -> list:
        """A Read/Write CapsuleCmd: the SQE :func:`~adp_wire.sqe.rw_cmd` builds (with ``cid``), carrying
        ``data`` in-capsule when given (``length`` = its size), else a transport SGL of ``length`` bytes."""
        if data is None:
            plen, pdo, flags, sgl = 72 + self._h, 0, self._fl_h, SglId.TRANSPORT_DATA_BLOCK
        else:
            pdo, flags, sgl = self.cmd_pdo, self._fl_hd, SglId.DATA_BLOCK_OFFSET
            plen = pdo + length + self._d
        hdr = _CAPSULE_RW.pack(_CMD, flags, 72, pdo, plen, opcode, SQE_FLAGS_SGL, cid, nsid, 0, 0, 0, 0, length,
                               sgl, slba & 0xFFFFFFFF, slba >> 32, nlb - 1, 0, 0, 0)
        if self._h or pdo > 72:
            hdr = self._finish(hdr, pdo)
        return [hdr] if data is None else self._with_data(hdr, data)

    def capsule_resp(self, cid: int, status: int, dw0: int = 0, dw1: int = 0, sqhd: int = 0, sqid: int = 0) -> bytes:
        """CapsuleResp for command ``cid`` (``status``: the status word, phase bit 0)."""
        hdr = _RESP.pack(_RSP, self._fl_h, 24, 0, 24 + self._h, dw0, dw1, sqhd, sqid, cid, status)
        return hdr + digest_bytes(hdr) if self._h else hdr

    def r2t(self, cccid: int, ttag: int, r2to: int, r2tl: int) -> bytes:
        hdr = _DATA.pack(_R2T, self._fl_h, 24, 0, 24 + self._h, cccid, ttag, r2to, r2tl)
        return hdr + digest_bytes(hdr) if self._h else hdr

    def h2c_data(self, cccid: int, ttag: int, datao: int, data: Payload, last: bool) -> list:
        """H2CData of ``data`` (not empty) at offset ``datao`` of the command's transfer."""
        n = len(data) if type(data) is not list else sum(len(b) for b in data)
        pdo = self.data_pdo
        flags = self._fl_hd | (_LAST if last else 0)
        return self._with_data(self._finish(_DATA.pack(_H2C, flags, 24, pdo, pdo + n + self._d, cccid, ttag, datao,
                                                       n), pdo), data)

    def c2h_data(self, cccid: int, datao: int, data: Payload, last: bool, success: bool = False) -> list:
        """C2HData of ``data`` (not empty); ``success`` (with ``last``) stands in for the CapsuleResp."""
        n = len(data) if type(data) is not list else sum(len(b) for b in data)
        pdo = self.data_pdo
        flags = self._fl_hd | (_LAST if last else 0) | (_SUCCESS if success else 0)
        return self._with_data(self._finish(_DATA.pack(_C2H, flags, 24, pdo, pdo + n + self._d, cccid, 0, datao, n),
                                            pdo), data)


class HeaderCheck:
    """Validates the PDU headers one end receives once the IC exchange is done.

    Use: read the 8-byte common header, :meth:`common` says how many header bytes to have (it also
    rejects a second ICReq/ICResp), read them, :meth:`complete` checks the header digest and DATAL.
    ``limits`` bounds PLEN per PDU type (default ``max_plen``). Errors are :class:`PduError`, exactly
    those :func:`check_common_header` / :func:`decode_header` raise.
    """

    __slots__ = ("_fast", "_h", "_limits", "ddgst", "hdgst", "max_plen", "receiver_is_host")

    def __init__(self, receiver_is_host: bool, hdgst: bool = False, ddgst: bool = False, max_plen: int = 1 << 30,
                 limits: dict[int, int] | None = None) -> None:
        self.receiver_is_host = receiver_is_host
        self.hdgst, self.ddgst = hdgst, ddgst
        self.max_plen = max_plen
        self._limits = {int(t): v for t, v in (limits or {}).items()}
        h = self._h = DIGEST_SIZE if hdgst else 0
        d = DIGEST_SIZE if ddgst else 0
        fl_h = _HDGSTF if hdgst else 0
        fl_hd = fl_h | (_DDGSTF if ddgst else 0)
        # Indexed by PDU type: None, or (HLEN, header span, flags without data, flags with data, data-PDU extra
        # flags or -1 when the PDU never carries data, may omit data, PLEN bound, data digest size, has it).
        self._fast: list[tuple[int, int, int, int, int, bool, int, int, bool] | None] = [None] * 256
        allowed = CONTROLLER_TO_HOST if receiver_is_host else HOST_TO_CONTROLLER
        for t in allowed:
            t = int(t)
            if t in _IC or t in _TERM:
                continue
            extra = {_CMD: 0, _H2C: _LAST, _C2H: _LAST | _SUCCESS}.get(t, -1)
            self._fast[t] = (HLEN[t], HLEN[t] + h, fl_h, fl_hd, extra, t not in (_H2C, _C2H), self._limit(t), d,
                             bool(d))

    def _limit(self, t: int) -> int:
        return self._limits.get(t, self.max_plen)

    def common(self, buf: Data) -> tuple[int, int, int, int, bool]:
        """Validate the common header in ``buf[:8]``: (type, header span, PDO, data length, data digest follows).

        The header span counts HLEN plus the header digest; PDO is 0 for a PDU without data.
        """
        t, flags, hlen, pdo, plen = _CH_UNPACK(buf, 0)
        f = self._fast[t]
        if f is not None and hlen == f[0]:
            span = f[1]
            if plen == span and flags == f[2] and not pdo and f[5]:
                return t, span, 0, 0, False
            extra = f[4]
            if extra >= 0 and flags & ~extra == f[3] and pdo >= span and not pdo & 3 and pdo + f[7] < plen <= f[6]:
                return t, span, pdo, plen - pdo - f[7], f[8]
        return self._common_slow(buf, t, flags, hlen, pdo, plen)

    def _common_slow(self, buf: Data, t: int, flags: int, hlen: int, pdo: int, plen: int) -> tuple:
        raw8 = bytes(buf[:8])
        if t in _IC:
            raise PduError(FatalErrorStatus.PDU_SEQUENCE_ERROR, "second ICReq/ICResp", 0, raw8)
        check_common_header(CommonHeader(t, flags, hlen, pdo, plen), raw8, self.receiver_is_host, self.hdgst,
                            self.ddgst, self._limit(t))
        span = hlen + (DIGEST_SIZE if flags & _HDGSTF else 0)
        if t in _TERM:
            dlen = plen - 24
            return t, span, 24 if dlen else 0, dlen, False
        if plen == span:
            return t, span, 0, 0, False
        has_d = bool(flags & _DDGSTF)
        return t, span, pdo, plen - pdo - (DIGEST_SIZE if has_d else 0), has_d

    def complete(self, buf: Data, t: int, span: int, dlen: int) -> None:
        """Check the complete header ``buf[:span]`` (:meth:`common`'s results): header digest, DATAL."""
        h = self._h
        if (not h or t in _TERM or crc32c(buf[:span - h]) == read_digest(buf, span - h)) and (
                (t != _H2C and t != _C2H) or _U32_AT16(buf, 16)[0] == dlen):
            return
        decode_header(buf[:span], self.receiver_is_host, self.hdgst, self.ddgst, self._limit(t))  # raises
        raise AssertionError("decode_header accepted a header the fast check refused")  # pragma: no cover
