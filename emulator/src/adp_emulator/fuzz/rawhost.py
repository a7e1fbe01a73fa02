"""A tiny raw-socket NVMe/TCP host for driving a target PDU by PDU (the fuzzers, the target's tests).

Built only on the wire codec, deliberately independent of adp_connector.nvmeof.host so target and host are tested
separately. Protocol surprises raise AssertionError, :class:`TermReceived` or :class:`Closed`.
"""

from __future__ import annotations

import socket
from typing import Any

from adp_wire import (
    C2HData,
    CapsuleCmd,
    CapsuleResp,
    Cqe,
    H2CData,
    ICReq,
    ICResp,
    PduDecoder,
    Sqe,
    TermReq,
    encode,
    encode_bytes,
)
from adp_wire.constants import CC_EN, DISCOVERY_NQN, Property, SglId
from adp_wire.pdu import R2T
from adp_wire.sqe import connect_cmd, property_get_cmd, property_set_cmd
from adp_wire.structs import ConnectData

HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555"
HOSTID = bytes(range(16))
SUBNQN = "nqn.2026-11.io.awide:adp-kv"
CC_ENABLE = CC_EN | (6 << 16) | (4 << 20)  # EN | IOSQES 6 | IOCQES 4, CSS 0


class TermReceived(Exception):
    def __init__(self, term: TermReq) -> None:
        super().__init__(f"C2HTermReq fes={term.fes:#x} fei={term.fei:#x}")
        self.term = term


class Closed(Exception):
    pass


class RawQueue:
    """One TCP connection speaking NVMe/TCP through the codec."""

    def __init__(self, addr: tuple[str, int], timeout: float = 5.0) -> None:
        self.sock = socket.create_connection(addr, timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.dec = PduDecoder(receiver_is_host=True)
        self.hd = self.dd = False
        self.maxh2cdata = 0
        self._cid = 0
        self.outgoing: dict[int, tuple[bytes, int]] = {}
        self.inbound: dict[int, bytearray] = {}
        self.done: dict[int, Cqe] = {}
        self.cntlid = 0

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transport --------------------------------------------------------------------------------
    def icreq(self, hdgst: bool = False, ddgst: bool = False, hpda: int = 0) -> ICResp:
        self.send_raw(encode_bytes(ICReq(hpda=hpda, hdgst=hdgst, ddgst=ddgst)))
        resp = self.recv_pdu()
        assert isinstance(resp, ICResp), resp
        self.hd, self.dd, self.maxh2cdata = resp.hdgst, resp.ddgst, resp.maxh2cdata
        self.dec.set_digests(self.hd, self.dd)
        return resp

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send_pdu(self, pdu: Any) -> None:
        self.sock.sendmsg(encode(pdu, hdgst=self.hd, ddgst=self.dd))

    def recv_pdu(self) -> Any:
        while True:
            pdu = self.dec.next_pdu()
            if pdu is not None:
                if isinstance(pdu, TermReq):
                    raise TermReceived(pdu)
                return pdu
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise Closed("connection closed by target")
            self.dec.feed(chunk)

    def expect_term(self) -> TermReq:
        """Read until a C2HTermReq arrives (then the target must close)."""
        try:
            while True:
                self.recv_pdu()
        except TermReceived as e:
            return e.term

    def closed_by_peer(self, timeout: float = 3.0) -> bool:
        self.sock.settimeout(timeout)
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    # -- commands -----------------------------------------------------------------------------------
    def next_cid(self) -> int:
        self._cid = (self._cid + 1) & 0xFFFF
        if self._cid == 31:  # keep CID 31 for AERs like Linux
            self._cid = 32
        return self._cid

    def submit(self, sqe: Sqe, data: bytes = b"", cid: int | None = None, h2c_chunk: int | None = None) -> int:
        """Send a command; in-capsule data goes along when the SGL says so, else R2Ts are served from it."""
        sqe.cid = self.next_cid() if cid is None else cid
        self.outgoing[sqe.cid] = (data, h2c_chunk or self.maxh2cdata or 4096)
        if sqe.sgl_id == SglId.DATA_BLOCK_OFFSET:
            self.send_pdu(CapsuleCmd(sqe.encode(), data))
        else:
            self.send_pdu(CapsuleCmd(sqe.encode()))
        return sqe.cid

    def poll(self) -> None:
        """Handle one PDU: serve an R2T, collect C2HData, or record a completion."""
        pdu = self.recv_pdu()
        if isinstance(pdu, R2T):
            data, chunk = self.outgoing[pdu.cccid]
            end = pdu.r2to + pdu.r2tl
            off = pdu.r2to
            while off < end:
                n = min(chunk, end - off)
                self.send_pdu(H2CData(pdu.cccid, pdu.ttag, off, data[off:off + n], last=off + n == end))
                off += n
        elif isinstance(pdu, C2HData):
            buf = self.inbound.setdefault(pdu.cccid, bytearray())
            assert pdu.datao == len(buf), pdu
            buf += pdu.data
            if pdu.success:
                assert pdu.last
                self.done[pdu.cccid] = Cqe(pdu.cccid)
        elif isinstance(pdu, CapsuleResp):
            cqe = Cqe.decode(pdu.cqe)
            self.done[cqe.cid] = cqe
        else:
            raise AssertionError(f"unexpected PDU {pdu!r}")

    def wait(self, cid: int) -> tuple[Cqe, bytes]:
        """Run :meth:`poll` until ``cid`` completes; return (CQE, data read)."""
        while cid not in self.done:
            self.poll()
        self.outgoing.pop(cid, None)
        return self.done.pop(cid), bytes(self.inbound.pop(cid, b""))

    def cmd(self, sqe: Sqe, data: bytes = b"", h2c_chunk: int | None = None) -> tuple[Cqe, bytes]:
        return self.wait(self.submit(sqe, data, h2c_chunk=h2c_chunk))

    def connect(self, qid: int = 0, sqsize: int = 32, cntlid: int = 0xFFFF, subnqn: str = SUBNQN,
                hostnqn: str = HOSTNQN, kato_ms: int = 0, cattr: int = 0) -> Cqe:
        sqe = connect_cmd(qid, sqsize, kato_ms, cattr)
        cqe, _ = self.cmd(sqe, ConnectData(HOSTID, cntlid, subnqn, hostnqn).encode())
        if cqe.status.ok:
            self.cntlid = cqe.dw0 & 0xFFFF
        return cqe

    def prop_get(self, offset: int, size8: bool = False) -> int:
        cqe, _ = self.cmd(property_get_cmd(offset, size8))
        assert cqe.status.ok, cqe
        return cqe.dw0 | (cqe.dw1 << 32)

    def enable(self, cc: int = CC_ENABLE) -> None:
        cqe, _ = self.cmd(property_set_cmd(Property.CC, cc))
        assert cqe.status.ok, cqe


def open_admin(addr: tuple[str, int], hdgst: bool = False, ddgst: bool = False, enable: bool = True,
               kato_ms: int = 0, subnqn: str = SUBNQN, hostnqn: str = HOSTNQN) -> RawQueue:
    q = RawQueue(addr)
    q.icreq(hdgst, ddgst)
    cqe = q.connect(0, 32, subnqn=subnqn, hostnqn=hostnqn, kato_ms=kato_ms)
    assert cqe.status.ok, cqe
    if enable:
        q.enable()
    return q


def open_io(addr: tuple[str, int], cntlid: int, qid: int = 1, sqsize: int = 32, hdgst: bool = False,
            ddgst: bool = False, cattr: int = 0, hostnqn: str = HOSTNQN, subnqn: str = SUBNQN) -> RawQueue:
    q = RawQueue(addr)
    q.icreq(hdgst, ddgst)
    cqe = q.connect(qid, sqsize, cntlid=cntlid, subnqn=subnqn, cattr=cattr, hostnqn=hostnqn)
    assert cqe.status.ok, cqe
    return q


def discovery_admin(addr: tuple[str, int], hostnqn: str = HOSTNQN) -> RawQueue:
    return open_admin(addr, subnqn=DISCOVERY_NQN, hostnqn=hostnqn)

