"""A sans-IO NVMe/TCP PDU decoder: feed bytes, take whole PDUs out. No sockets anywhere.

    dec = PduDecoder(receiver_is_host=False)
    dec.feed(chunk)
    while (pdu := dec.next_pdu()) is not None:
        ...

The decoder tracks the connection-level rule that the first PDU is the receiver's IC PDU (ICReq for
a controller, ICResp for a host; a TermReq may come instead) and that no second one follows;
:attr:`PduDecoder.needed` says how many more bytes the next PDU needs (a caller reading exactly that
much never reads past a PDU); digests are switched on with :meth:`PduDecoder.set_digests` after the exchange.
Fatal problems raise :class:`~adp_wire.pdu.PduError` (the caller answers with a
TermReq built from it and closes); a data digest mismatch raises
:class:`~adp_wire.pdu.DataDigestError`, after which the stream stays usable.
"""

from __future__ import annotations

from .constants import FatalErrorStatus, PduType
from .pdu import (
    CH,
    COMMON_HEADER_SIZE,
    DIGEST_SIZE,
    CommonHeader,
    Pdu,
    PduError,
    PduHeader,
    check_common_header,
    check_data_digest,
    decode_header,
    header_span,
)


class PduDecoder:
    """Incremental PDU decoder for one direction of one connection."""

    def __init__(self, receiver_is_host: bool, max_plen: int = 1 << 30) -> None:
        self.receiver_is_host = receiver_is_host
        self.max_plen = max_plen
        self.hdgst = False
        self.ddgst = False
        self._buf = bytearray()
        self._pos = 0
        self._ic_seen = False

    def set_digests(self, hdgst: bool, ddgst: bool) -> None:
        """Switch on the digests negotiated in ICReq/ICResp (applies to every following PDU)."""
        self.hdgst, self.ddgst = hdgst, ddgst

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._pos and self._pos > len(self._buf) // 2:
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as PDUs."""
        return len(self._buf) - self._pos

    def next_pdu(self) -> Pdu | None:
        """The next complete PDU, or None if more bytes are needed."""
        avail = len(self._buf) - self._pos
        if avail < COMMON_HEADER_SIZE:
            return None
        view = memoryview(self._buf)[self._pos :]
        try:
            ch = CommonHeader.parse(view)
            raw8 = bytes(view[:COMMON_HEADER_SIZE])
            self._check_sequence(ch, raw8)
            check_common_header(ch, raw8, self.receiver_is_host, self.hdgst, self.ddgst, self.max_plen)
            if avail < ch.plen:
                return None
            hdr = decode_header(view[: header_span(ch, self.hdgst)], self.receiver_is_host, self.hdgst,
                                self.ddgst, self.max_plen)
            self._pos += ch.plen
            self._ic_seen = True
            return self._attach_data(hdr, view)
        finally:
            view.release()

    @property
    def needed(self) -> int:
        """Bytes still missing before :meth:`next_pdu` can return the next PDU (at least 1).

        Until the common header is in that is what completes it, then the rest of the PDU (its PLEN,
        validated by the :meth:`next_pdu` call that returned None)."""
        avail = len(self._buf) - self._pos
        if avail < COMMON_HEADER_SIZE:
            return COMMON_HEADER_SIZE - avail
        return max(1, CH.unpack_from(self._buf, self._pos)[4] - avail)

    def _check_sequence(self, ch: CommonHeader, raw8: bytes) -> None:
        is_ic = ch.type in (PduType.IC_REQ, PduType.IC_RESP)
        if not self._ic_seen:
            if self.receiver_is_host and ch.type not in (PduType.IC_RESP, PduType.C2H_TERM_REQ):
                raise PduError(FatalErrorStatus.PDU_SEQUENCE_ERROR, "first PDU must be ICResp", 0, raw8)
            if not self.receiver_is_host and ch.type not in (PduType.IC_REQ, PduType.H2C_TERM_REQ):
                raise PduError(FatalErrorStatus.PDU_SEQUENCE_ERROR, "first PDU must be ICReq", 0, raw8)
        elif is_ic:
            raise PduError(FatalErrorStatus.PDU_SEQUENCE_ERROR, "second ICReq/ICResp", 0, raw8)

    @staticmethod
    def _attach_data(hdr: PduHeader, view: memoryview) -> Pdu:
        pdu = hdr.pdu
        if not hdr.data_len:
            return pdu
        start = hdr.data_offset
        data = bytes(view[start : start + hdr.data_len])
        if hdr.has_ddgst:
            check_data_digest(hdr, data, view[start + hdr.data_len : start + hdr.data_len + DIGEST_SIZE])
        pdu.data = data  # type: ignore[union-attr]
        return pdu
