"""Queue protocol state common to both ends: the ICReq/ICResp negotiation and SQ head accounting.

Sans-IO: the host and the target feed the IC PDUs they exchanged in and read the agreed transport
parameters out; nothing here touches a socket.

* :func:`accept_icreq` - the controller's checks of an ICReq (raises :class:`~adp_wire.pdu.PduError`,
  answered with a C2HTermReq).
* :func:`accept_icresp` - the host's checks of an ICResp (raises :class:`NegotiationError`).
* :class:`QueueState` - digests, the peer's PDU data alignment, MAXH2CDATA, and, once Connect is done,
  the SQ size, SQ head and whether SQ flow control is on.
"""

from __future__ import annotations

from dataclasses import dataclass

from .constants import CATTR_DISABLE_SQ_FLOW_CONTROL, FatalErrorStatus
from .pdu import ICReq, ICResp, PduError, data_offset

MAX_PDA = 31  # HPDA / CPDA are 0's based dwords, 0..31
MIN_MAXH2CDATA = 4096


class NegotiationError(ValueError):
    """The peer's IC PDU is well formed but its parameters are unacceptable."""


def accept_icreq(req: ICReq, raw: bytes, require_data_digest: bool = False) -> None:
    """The controller's checks of an ICReq (``raw``: its 128 bytes, echoed in the TermReq)."""
    if req.pfv != 0:
        raise PduError(FatalErrorStatus.UNSUPPORTED_PARAMETER, f"PFV {req.pfv}", 8, raw)
    if req.hpda > MAX_PDA:
        raise PduError(FatalErrorStatus.INVALID_HEADER_FIELD, f"HPDA {req.hpda}", 10, raw)
    if require_data_digest and not req.ddgst:
        raise PduError(FatalErrorStatus.UNSUPPORTED_PARAMETER, "data digest required", 11, raw)


def accept_icresp(resp: ICResp, hdgst: bool, ddgst: bool) -> None:
    """The host's checks of an ICResp answering an ICReq that asked for ``hdgst``/``ddgst``."""
    if resp.pfv != 0 or resp.cpda > MAX_PDA or resp.maxh2cdata < MIN_MAXH2CDATA or resp.maxh2cdata % 4:
        raise NegotiationError(f"unacceptable ICResp {resp}")
    if resp.hdgst != hdgst or resp.ddgst != ddgst:
        raise NegotiationError(f"target granted digests hdgst={resp.hdgst} ddgst={resp.ddgst}, "
                               f"asked hdgst={hdgst} ddgst={ddgst}")


@dataclass(slots=True)
class QueueState:
    """What one queue's two ends agreed on. ``pda`` is the alignment the *peer* asked for (the host
    sends with the controller's CPDA, the controller with the host's HPDA)."""

    hdgst: bool = False
    ddgst: bool = False
    pda: int = 0
    maxh2cdata: int = 0
    sqsize: int = 0  # real SQ size (Connect's SQSIZE + 1); 0 before Connect
    sqhd: int = 0
    sqflow: bool = True

    @classmethod
    def from_icreq(cls, req: ICReq, maxh2cdata: int) -> QueueState:
        """The controller's side: the digests the host asked for are granted, data aligned to its HPDA."""
        return cls(req.hdgst, req.ddgst, req.hpda, maxh2cdata)

    @classmethod
    def from_icresp(cls, resp: ICResp) -> QueueState:
        """The host's side, once :func:`accept_icresp` passed."""
        return cls(resp.hdgst, resp.ddgst, resp.cpda, resp.maxh2cdata)

    def connected(self, sqsize: int, cattr: int) -> None:
        """Fabrics Connect succeeded with this SQ size (real count) and connect attributes."""
        self.sqsize = sqsize
        self.sqhd = 0
        self.sqflow = not cattr & CATTR_DISABLE_SQ_FLOW_CONTROL

    def next_sqhd(self) -> int:
        """The SQHD of the next completion: the head advances by one per command when SQ flow control
        is on (and the queue is connected); otherwise the field is 0."""
        if self.sqflow and self.sqsize:
            self.sqhd = (self.sqhd + 1) % self.sqsize
            return self.sqhd
        return 0

    def data_offset(self, hlen: int) -> int:
        """PDO for the data PDUs this end sends on the queue."""
        return data_offset(hlen, self.hdgst, self.pda)
