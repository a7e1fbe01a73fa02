"""One NVMe/TCP connection (= one queue): PDU transport, admin/Fabrics/NVM command execution.

Runs in its own thread with a blocking socket. Headers are read into a small reusable buffer and
validated with the shared codec (:func:`check_common_header` / :func:`decode_header`); data lands
with ``recv_into`` straight in the namespace mmap (writes) and leaves with ``sendmsg`` from slices
of it (reads). A malformed PDU ends this connection only, after a C2HTermReq (notes §1.7, SPDK style).
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from adp_connector.nvmeof.wire.constants import (
    CATTR_DISABLE_SQ_FLOW_CONTROL,
    CNTLID_DYNAMIC,
    CONNECT_DATA_SIZE,
    CSTS_RDY,
    DISCOVERY_NQN,
    AdminOpcode,
    Cns,
    FabricsType,
    FatalErrorStatus,
    Feature,
    IoOpcode,
    LogPage,
    PduFlags,
    PduType,
    Property,
    SglId,
)
from adp_connector.nvmeof.wire.digest import crc32c
from adp_connector.nvmeof.wire.pdu import (
    CH,
    R2T,
    CommonHeader,
    ICResp,
    PduError,
    TermReq,
    check_common_header,
    decode_header,
    encode,
    encode_bytes,
)
from adp_connector.nvmeof.wire.sqe import DSM_ATTR_DEALLOCATE, DSM_RANGE, Sqe, connect_fields
from adp_connector.nvmeof.wire.structs import ConnectData, encode_ns_list

from . import controller as C
from .counters import IoCounters
from .settings import ADMIN_IN_CAPSULE

if TYPE_CHECKING:  # pragma: no cover
    from .controller import Controller
    from .server import UserspaceTarget

log = logging.getLogger(__name__)

_U32 = struct.Struct("<I")
_CH_UNPACK = CH.unpack_from
_RBUF = 64 * 1024  # read-ahead buffer for headers and small payloads
_DIRECT_RECV = 4096  # payloads at least this large are received straight into their destination
_DATA_HDR = struct.Struct("<HHII")  # H2CData: cccid, ttag, datao, datal (at offset 8)
_RESP = struct.Struct("<BBBBIIIHHHH")  # common header + CQE
_C2H = struct.Struct("<BBBBIHHII")  # common header + cccid, ttag, datao, datal
_HDGSTF, _DDGSTF, _LAST, _SUCCESS = (int(PduFlags.HDGSTF), int(PduFlags.DDGSTF), int(PduFlags.DATA_LAST),
                                     int(PduFlags.DATA_SUCCESS))
_T_CMD, _T_H2C, _T_ICREQ, _T_H2CTERM = (int(PduType.CAPSULE_CMD), int(PduType.H2C_DATA), int(PduType.IC_REQ),
                                        int(PduType.H2C_TERM_REQ))
_DIR_NONE, _DIR_OUT, _DIR_IN = 0, 1, 2
_FABRICS = int(AdminOpcode.FABRICS)
_READ, _WRITE = int(IoOpcode.READ), int(IoOpcode.WRITE)

# A handler gets the SQE and the command's host->controller data (or None) and returns a Result,
# or None when the completion is deferred (AER).
Handler = Callable[[Sqe, "memoryview | None"], "C.Result | None"]


class ConnectionClosed(Exception):
    """The peer closed the connection (or we were told to stop)."""


class _Xfer:
    """A command waiting for solicited (R2T) data."""

    __slots__ = ("bad_digest", "cid", "dest", "handler", "r2t_end", "received", "sqe", "stage", "t0", "total")

    def __init__(self, sqe: Sqe, dest: memoryview, handler: Handler, t0: int, staged: bool = False) -> None:
        self.sqe = sqe
        self.cid = sqe.cid
        self.dest = dest
        # With data digests the payload lands in a staging buffer and reaches ``dest`` (the media) only
        # once every PDU's digest checked out: a corrupted write never changes stored data (as nvmet).
        self.stage: memoryview | None = memoryview(bytearray(len(dest))) if staged else None
        self.handler = handler
        self.total = len(dest)
        self.received = 0
        self.r2t_end = 0
        self.t0 = t0
        self.bad_digest = False


class Connection:
    """State and thread body of one TCP connection (one NVMe queue once connected)."""

    def __init__(self, target: UserspaceTarget, sock: socket.socket, peer: tuple) -> None:
        self.target = target
        self.settings = target.settings
        self.sock = sock
        self.peer = peer
        self.local_addr = sock.getsockname()
        self.hd = False
        self.dd = False
        self.fl_h = 0  # HDGSTF when header digests are on
        self.fl_hd = 0  # HDGSTF|DDGSTF as negotiated (data-carrying PDUs)
        self.hpda = 0
        self.qid = -1  # not connected yet
        self.ctrl: Controller | None = None
        self.sqsize = 0
        self.sqhd = 0
        self.sqflow = True
        self.counters = IoCounters()
        self.closed = False
        self.send_lock = threading.Lock()
        self.hbuf = bytearray(512)
        self.hview = memoryview(self.hbuf)
        self.rview = memoryview(bytearray(512))  # enough for ICReq; _set_transport grows it to _RBUF
        self.rpos = self.rend = 0
        self.max_icd = max(self.settings.in_capsule_bytes, ADMIN_IN_CAPSULE)
        self.scratch = bytearray(4096)  # grown by _scratch() to what a capsule really carries
        self.sview = memoryview(self.scratch)
        self.cmd_max_plen = 72 + 4 + 255 + self.max_icd + 4
        self.h2c_max_plen = 24 + 4 + 255 + self.settings.maxh2cdata + 4
        self.pending: dict[int, _Xfer] = {}
        self.free_ttags: list[int] = []
        self.c2h_pdo = 24
        self.c2h = bytearray(24)
        self.ns = target.namespaces.get(1)
        self.faults = target.faults
        self.mdts = self.settings.mdts_bytes
        self.thread: threading.Thread | None = None
        self.handoff = False  # set by an I/O queue's Connect when the target serves it in a worker process
        self.handed_off = False
        self.worker: object | None = None  # the I/O worker serving this connection (set by the target)
        self.handoff_id = 0  # names the connection between the target and its worker

    # ------------------------------------------------------------------------------------------------
    # Lifecycle

    def run(self, handshake: bool = True) -> None:
        """Thread body: handshake, then PDUs until the peer leaves or a fatal error.

        An I/O queue whose Connect the target wants served elsewhere (:attr:`handoff`) leaves the loop
        right after its Connect response; the target then hands the socket to an I/O worker process.
        ``handshake=False`` resumes such a connection in the worker (state set by :meth:`adopt`).
        """
        try:
            if handshake:
                self._handshake()
            self._loop()
            if self.handoff and self.target.hand_off(self):
                self.handed_off = True
                return
            self.handoff = False
            self._loop()
        except PduError as e:
            log.debug("connection %s: %s", self.peer, e)
            self._send_term(e)
        except (ConnectionClosed, OSError):
            pass
        except Exception:  # never let a client crash the target
            log.exception("connection %s: internal error", self.peer)
        finally:
            if not self.handed_off:  # the socket lives on in a worker process
                self.close()
                self.target._connection_gone(self)

    def shutdown(self) -> None:
        """Wake the connection thread (from any thread) so it closes the connection."""
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass

    def _send_term(self, e: PduError) -> None:
        try:
            with self.send_lock:
                self.sock.sendall(encode_bytes(TermReq(int(e.fes), e.fei, e.header)))
            self.sock.shutdown(socket.SHUT_WR)
            # Let the peer read the TermReq before the close turns into a reset.
            self.sock.settimeout(0.5)
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline and self.sock.recv(65536):
                pass
        except OSError:
            pass

    # ------------------------------------------------------------------------------------------------
    # Socket helpers

    def _recv_exact(self, view: memoryview) -> None:
        """Fill ``view``: first from the read-ahead buffer, then small reads through it (many
        pipelined headers per syscall), large ones straight from the socket into ``view``."""
        n = len(view)
        pos = self.rpos
        avail = self.rend - pos
        if avail >= n:
            view[:] = self.rview[pos:pos + n]
            self.rpos = pos + n
            return
        if avail:
            view[:avail] = self.rview[pos:self.rend]
            view = view[avail:]
            n -= avail
        self.rpos = self.rend = 0
        recv_into = self.sock.recv_into
        if n < _DIRECT_RECV:
            got = 0
            while got < n:
                r = recv_into(self.rview[got:], len(self.rview) - got)
                if not r:
                    raise ConnectionClosed
                got += r
            view[:] = self.rview[:n]
            self.rpos, self.rend = n, got
            return
        got = 0
        while got < n:
            r = recv_into(view[got:], n - got)
            if not r:
                raise ConnectionClosed
            got += r

    def _scratch(self, n: int) -> memoryview:
        """``n`` bytes of scratch space: allocated when a PDU needs them, not per connection up front."""
        if n > len(self.scratch):
            self.scratch = bytearray(n)
            self.sview = memoryview(self.scratch)
        return self.sview[:n]

    def _discard(self, n: int) -> None:
        while n > 0:
            k = min(n, len(self.scratch))
            self._recv_exact(self.sview[:k])
            n -= k

    def _sendmsg(self, bufs: list, total: int) -> None:
        sent = self.sock.sendmsg(bufs)
        if sent == total:
            return
        for b in bufs:  # partial send (signal / shutdown): finish piece by piece
            lb = len(b)
            if sent >= lb:
                sent -= lb
                continue
            self.sock.sendall(memoryview(b)[sent:])
            sent = 0

    def _resp(self, cid: int, status: int, dw0: int, dw1: int, sqhd: int | None = None) -> bytes:
        """A CapsuleResp PDU (call with send_lock held: it advances SQHD)."""
        if sqhd is None:
            if self.sqflow and self.sqsize:
                self.sqhd = (self.sqhd + 1) % self.sqsize
                sqhd = self.sqhd
            else:
                sqhd = 0
        qid = self.qid if self.qid >= 0 else 0
        if self.hd:
            hdr = _RESP.pack(5, _HDGSTF, 24, 0, 28, dw0, dw1, sqhd, qid, cid, status)
            return hdr + _U32.pack(crc32c(hdr))
        return _RESP.pack(5, 0, 24, 0, 24, dw0, dw1, sqhd, qid, cid, status)

    def send_completion(self, cid: int, status: int = 0, dw0: int = 0, dw1: int = 0) -> None:
        """Send a CapsuleResp (thread-safe; used for deferred AER completions)."""
        try:
            with self.send_lock:
                self.sock.sendall(self._resp(cid, status, dw0, dw1))
        except OSError:
            pass

    def _send_data(self, cid: int, data: bytes | memoryview, dw0: int = 0, corrupt: bool = False) -> None:
        """C2HData (one PDU, LAST_PDU) then CapsuleResp, or C2HData with SUCCESS when SQ flow control is off."""
        n = len(data)
        pdo = self.c2h_pdo
        flags = _LAST
        if self.hd:
            flags |= _HDGSTF
        bufs: list = [self.c2h, data]
        total = pdo + n
        if self.dd:
            flags |= _DDGSTF
            bufs.append(_U32.pack(crc32c(data)))
            total += 4
        plen = total
        if corrupt:
            bad = bytearray(data)
            bad[0] ^= 0xFF
            bufs[1] = bad
        use_success = not self.sqflow
        if use_success:
            flags |= _SUCCESS
        with self.send_lock:
            _C2H.pack_into(self.c2h, 0, 7, flags, 24, pdo, plen, cid, 0, 0, n)
            if self.hd:
                _U32.pack_into(self.c2h, 24, crc32c(self.hview_c2h))
            if not use_success:
                r = self._resp(cid, 0, dw0, 0)
                bufs.append(r)
                total += len(r)
            self._sendmsg(bufs, total)

    # ------------------------------------------------------------------------------------------------
    # Connection setup

    def _read_header(self) -> tuple[int, int, int, int, bool]:
        """Read and validate one PDU header into ``hbuf``: (type, header span, PDO, data length, DDGST).

        The common well-formed shapes are checked inline (the same rules as the codec, which costs
        ~25 us per PDU); anything else goes through :func:`check_common_header` /
        :func:`decode_header`, so the codec decides every error.
        """
        hv = self.hview
        hb = self.hbuf
        self._recv_exact(hv[:8])
        t, flags, hlen, pdo, plen = _CH_UNPACK(hb)
        h = 4 if self.hd else 0
        d = 4 if self.dd else 0
        dlen = -1
        if t == _T_CMD and hlen == 72:
            if flags == self.fl_h and pdo == 0 and plen == 72 + h:
                dlen = 0
            elif flags == self.fl_hd and pdo >= 72 + h and not pdo & 3 and pdo + d < plen <= self.cmd_max_plen:
                dlen = plen - pdo - d
        elif (t == _T_H2C and hlen == 24 and flags & ~_LAST == self.fl_hd and pdo >= 24 + h and not pdo & 3
              and pdo + d < plen <= self.h2c_max_plen):
            dlen = plen - pdo - d
        if dlen >= 0:
            span = hlen + h
            self._recv_exact(hv[8:span])
            if (not h or crc32c(hv[:hlen]) == _U32.unpack_from(hb, hlen)[0]) and (
                    t != _T_H2C or _U32.unpack_from(hb, 16)[0] == dlen):
                return t, span, pdo if dlen else 0, dlen, bool(d and dlen)
            hdr = decode_header(hv[:span], False, self.hd, self.dd, plen)  # raises the codec's error
            return t, hdr.header_span, hdr.data_offset, hdr.data_len, hdr.has_ddgst
        raw8 = bytes(hv[:8])
        if t == _T_CMD:
            bound = self.cmd_max_plen
        elif t == _T_H2C:
            bound = self.h2c_max_plen
        else:
            bound = 152
        if ((t == _T_CMD and hlen == 72) or (t == _T_H2C and hlen == 24)) and plen < hlen + h:
            # The codec would blame PDO (FEI 3) here; the bad field is PLEN (offset 4).
            raise PduError(FatalErrorStatus.INVALID_HEADER_FIELD, f"PLEN {plen} shorter than the header", 4, raw8)
        check_common_header(CommonHeader(t, flags, hlen, pdo, plen), raw8, False, self.hd, self.dd, bound)
        span = hlen + (4 if flags & _HDGSTF else 0)
        self._recv_exact(hv[8:span])
        hdr = decode_header(hv[:span], False, self.hd, self.dd, bound)
        return t, hdr.header_span, hdr.data_offset, hdr.data_len, hdr.has_ddgst

    def _handshake(self) -> None:
        hv = self.hview
        self._recv_exact(hv[:8])
        t = self.hbuf[0]
        if t == _T_H2CTERM:
            raise ConnectionClosed
        if t != _T_ICREQ:
            raise PduError(FatalErrorStatus.PDU_SEQUENCE_ERROR, "first PDU must be ICReq", 0, bytes(hv[:8]))
        ch = CommonHeader(*CH.unpack_from(self.hbuf))
        check_common_header(ch, bytes(hv[:8]), False, False, False, 128)
        self._recv_exact(hv[8:128])
        hdr = decode_header(hv[:128], False)
        req = hdr.pdu
        raw = bytes(hv[:128])
        if req.pfv != 0:
            raise PduError(FatalErrorStatus.UNSUPPORTED_PARAMETER, f"PFV {req.pfv}", 8, raw)
        if req.hpda > 31:
            raise PduError(FatalErrorStatus.INVALID_HEADER_FIELD, f"HPDA {req.hpda}", 10, raw)
        if self.settings.require_data_digest and not req.ddgst:
            raise PduError(FatalErrorStatus.UNSUPPORTED_PARAMETER, "data digest required", 11, raw)
        self._set_transport(req.hdgst, req.ddgst, req.hpda)
        resp = ICResp(0, 0, self.hd, self.dd, self.settings.maxh2cdata)
        with self.send_lock:
            self.sock.sendall(encode_bytes(resp))

    # ------------------------------------------------------------------------------------------------
    # Main loop

    def _set_transport(self, hd: bool, dd: bool, hpda: int) -> None:
        """Digests and host PDU alignment as negotiated by ICReq/ICResp."""
        self.hd, self.dd, self.hpda = hd, dd, hpda
        if len(self.rview) < _RBUF:  # keep what was read ahead (a pipelined Connect)
            grown = memoryview(bytearray(_RBUF))
            grown[:self.rend] = self.rview[:self.rend]
            self.rview = grown
        self.fl_h = _HDGSTF if hd else 0
        self.fl_hd = self.fl_h | (_DDGSTF if dd else 0)
        pdo = 24 + (4 if hd else 0)
        if hpda:
            align = (hpda + 1) * 4
            pdo = -(-pdo // align) * align
        self.c2h_pdo = pdo
        self.c2h = bytearray(pdo)
        self.hview_c2h = memoryview(self.c2h)[:24]

    def handoff_state(self) -> dict:
        """What a worker process needs to go on serving this connected I/O queue (see :meth:`adopt`)."""
        return {"hd": self.hd, "dd": self.dd, "hpda": self.hpda, "qid": self.qid, "sqsize": self.sqsize,
                "sqhd": self.sqhd, "sqflow": self.sqflow, "peer": list(self.peer[:2]),
                "readahead": bytes(self.rview[self.rpos:self.rend])}

    def adopt(self, state: dict, ctrl: Controller) -> None:
        """Take over a connection another process connected (its :meth:`handoff_state`)."""
        self._set_transport(state["hd"], state["dd"], state["hpda"])
        self.qid, self.sqsize, self.sqhd, self.sqflow = state["qid"], state["sqsize"], state["sqhd"], state["sqflow"]
        self.ctrl = ctrl
        ahead = state["readahead"]
        self.rview[:len(ahead)] = ahead
        self.rpos, self.rend = 0, len(ahead)

    def _loop(self) -> None:
        while not self.handoff:
            t, span, pdo, dlen, has_dd = self._read_header()
            if t == _T_CMD:
                self._on_capsule(span, pdo, dlen, has_dd)
            elif t == _T_H2C:
                self._on_h2c(span, pdo, dlen, has_dd)
            elif t == _T_ICREQ:
                raise PduError(FatalErrorStatus.PDU_SEQUENCE_ERROR, "second ICReq", 0, bytes(self.hbuf[:8]))
            else:  # H2CTermReq: the host gives up on this connection
                raise ConnectionClosed

    def _on_capsule(self, span: int, pdo: int, icl: int, has_dd: bool) -> None:
        t0 = time.perf_counter_ns()
        sqe = Sqe.decode(self.hbuf, 8)
        ctrl = self.ctrl
        if ctrl is not None:
            ctrl.last_activity = time.monotonic()
        io = self.qid > 0 and sqe.opcode != _FABRICS
        status, direction, dest, handler = self._parse(sqe)
        if io and not status and self.faults.armed:
            f = self.faults
            if f.delay_s:
                time.sleep(f.delay_s)
            status = f.take_failure()
        if not status:
            status = self._check_sgl(sqe, direction, icl, dest)
        if icl:
            if status or dest is None:
                dest = self._scratch(icl)
            self._discard(pdo - span)
            if has_dd:  # stage, check, then apply: a write with a bad digest never reaches the media
                stage = memoryview(bytearray(icl)) if not status else dest[:icl]
                self._recv_exact(stage)
                self._recv_exact(self.hview[256:260])
                if _U32.unpack_from(self.hbuf, 256)[0] != crc32c(stage):
                    status = status or C.SC_TRANSIENT
                elif not status:
                    dest[:icl] = stage
            else:
                self._recv_exact(dest[:icl])
        if status:
            self._complete(sqe, (status, 0, 0, None), t0, io)
            return
        if direction == _DIR_OUT and not icl and dest is not None and len(dest):
            self._start_r2t(sqe, dest, handler, t0)
            return
        if direction == _DIR_IN and sqe.opcode == _READ and io:
            self._read_done(sqe, dest, t0)
            return
        try:
            res = handler(sqe, dest if direction == _DIR_OUT else None)
        except Exception:
            log.exception("command %#x failed", sqe.opcode)
            res = (C.SC_INTERNAL, 0, 0, None)
        if res is not None:
            self._complete(sqe, res, t0, io)

    def _check_sgl(self, sqe: Sqe, direction: int, icl: int, dest: memoryview | None) -> int:
        sid = sqe.sgl_id
        if sid == SglId.DATA_BLOCK_OFFSET:
            if direction != _DIR_OUT:
                return C.SC_INVALID_FIELD
            limit = self.settings.in_capsule_bytes if self.qid > 0 and sqe.opcode != _FABRICS else ADMIN_IN_CAPSULE
            if sqe.sgl_len > limit:
                return C.SC_SGL_INVALID_OFFSET
            if icl != sqe.sgl_len:
                return C.SC_SGL_INVALID_DATA
        elif sid == SglId.TRANSPORT_DATA_BLOCK:
            if icl:
                return C.SC_SGL_INVALID_DATA
        else:
            return C.SC_SGL_INVALID_TYPE
        return 0

    def _complete(self, sqe: Sqe, res: C.Result, t0: int, io: bool) -> None:
        status, dw0, dw1, data = res
        if status and self.ctrl is not None:
            nsid = sqe.nsid if sqe.opcode != _FABRICS else 0
            self.ctrl.log_error(max(self.qid, 0), sqe.cid, status, sqe.opcode, nsid)
        if io:
            c = self.counters
            c.commands += 1
            if status:
                c.errors += 1
            c.record_latency(time.perf_counter_ns() - t0)
        if data is not None and not status:
            self._send_data(sqe.cid, data, dw0)
            return
        with self.send_lock:
            self.sock.sendall(self._resp(sqe.cid, status, dw0, dw1))

    def _read_done(self, sqe: Sqe, view: memoryview, t0: int) -> None:
        corrupt = self.faults.armed and self.faults.take_read_corruption()
        c = self.counters
        c.commands += 1
        c.reads += 1
        c.bytes_read += len(view)
        c.record_latency(time.perf_counter_ns() - t0)
        self._send_data(sqe.cid, view, 0, corrupt)

    # ------------------------------------------------------------------------------------------------
    # Solicited data (R2T / H2CData)

    def _start_r2t(self, sqe: Sqe, dest: memoryview, handler: Handler, t0: int) -> None:
        if not self.free_ttags:
            # A host never has more than SQSIZE commands outstanding; the bound also keeps a hostile peer
            # from pinning memory with transfers it never sends (and keeps TTAGs within 16 bits).
            if len(self.pending) >= min(max(self.sqsize, 1), self.settings.queue_depth, 0xFFFF):
                self._complete(sqe, (C.SC_INTERNAL, 0, 0, None), t0, self.qid > 0)
                return
            self.free_ttags.append(len(self.pending))
        ttag = self.free_ttags.pop()
        x = _Xfer(sqe, dest, handler, t0, staged=self.dd)
        self.pending[ttag] = x
        self._send_r2t(ttag, x)

    def _send_r2t(self, ttag: int, x: _Xfer) -> None:
        n = min(x.total - x.received, self.settings.maxh2cdata)
        x.r2t_end = x.received + n
        bufs = encode(R2T(x.cid, ttag, x.received, n), hdgst=self.hd)
        with self.send_lock:
            self.sock.sendall(bufs[0])

    def _on_h2c(self, span: int, pdo: int, datal: int, has_dd: bool) -> None:
        cccid, ttag, datao, _ = _DATA_HDR.unpack_from(self.hbuf, 8)
        x = self.pending.get(ttag)
        if x is None or x.cid != cccid or datal > self.settings.maxh2cdata or datao != x.received:
            raw = bytes(self.hbuf[:24])
            if x is None:
                raise PduError(FatalErrorStatus.INVALID_HEADER_FIELD, f"H2CData with unknown TTAG {ttag}", 10, raw)
            if x.cid != cccid:
                raise PduError(FatalErrorStatus.INVALID_HEADER_FIELD, f"H2CData CCCID {cccid} != {x.cid}", 8, raw)
            if datal > self.settings.maxh2cdata:
                raise PduError(FatalErrorStatus.DATA_TRANSFER_LIMIT_EXCEEDED, f"DATAL {datal} > MAXH2CDATA", 16, raw)
            raise PduError(FatalErrorStatus.DATA_TRANSFER_OUT_OF_RANGE, f"DATAO {datao} != {x.received}", 12, raw)
        end = datao + datal
        if end > x.r2t_end:
            raise PduError(FatalErrorStatus.DATA_TRANSFER_OUT_OF_RANGE, f"data end {end} > R2T end {x.r2t_end}",
                           16, bytes(self.hbuf[:24]))
        self._discard(pdo - span)
        dst = (x.stage if x.stage is not None else x.dest)[datao:end]
        self._recv_exact(dst)
        if has_dd:
            self._recv_exact(self.hview[256:260])
            if _U32.unpack_from(self.hbuf, 256)[0] != crc32c(dst):
                x.bad_digest = True
        x.received = end
        if end < x.r2t_end:
            return
        if end < x.total:
            self._send_r2t(ttag, x)
            return
        del self.pending[ttag]
        self.free_ttags.append(ttag)
        sqe = x.sqe
        io = self.qid > 0 and sqe.opcode != _FABRICS
        if x.bad_digest:
            self._complete(sqe, (C.SC_TRANSIENT, 0, 0, None), x.t0, io)
            return
        if x.stage is not None:
            x.dest[:] = x.stage
        try:
            res = x.handler(sqe, x.dest)
        except Exception:
            log.exception("command %#x failed", sqe.opcode)
            res = (C.SC_INTERNAL, 0, 0, None)
        if res is not None:
            self._complete(sqe, res, x.t0, io)

    # ------------------------------------------------------------------------------------------------
    # Command parsing: (status, direction, data buffer, handler)

    def _parse(self, sqe: Sqe) -> tuple[int, int, memoryview | None, Handler]:
        if sqe.flags & 0xC3 != 0x40:  # PSDT must be SGL (01b), no fused operations (nvmet_req_init)
            return C.SC_INVALID_FIELD, _DIR_NONE, None, self._h_none
        if sqe.opcode == _FABRICS:
            return self._parse_fabrics(sqe)
        if self.qid < 0:  # only Connect before Connect
            return C.SC_INVALID_OPCODE, _DIR_NONE, None, self._h_none
        if self.qid == 0:
            return self._parse_admin(sqe)
        return self._parse_io(sqe)

    @staticmethod
    def _h_none(sqe: Sqe, data: memoryview | None) -> C.Result:
        return C.OK

    def _expect(self, sqe: Sqe, length: int, direction: int, handler: Handler) -> tuple:
        """Checks the SGL length a command implies (nvmet_check_transfer_len)."""
        if sqe.sgl_len != length:
            return C.SC_SGL_INVALID_DATA, direction, None, handler
        dest = memoryview(bytearray(length)) if direction == _DIR_OUT and length else None
        return 0, direction, dest, handler

    # -- Fabrics --------------------------------------------------------------------------------------
    def _parse_fabrics(self, sqe: Sqe) -> tuple:
        fct = sqe.fctype
        if fct == FabricsType.CONNECT:
            return self._expect(sqe, CONNECT_DATA_SIZE, _DIR_OUT, self._h_connect)
        if self.qid != 0:  # Property Get/Set only on a connected admin queue; nothing else implemented
            return C.SC_INVALID_OPCODE, _DIR_NONE, None, self._h_none
        if fct == FabricsType.PROPERTY_GET:
            return self._expect(sqe, 0, _DIR_NONE, self._h_prop_get)
        if fct == FabricsType.PROPERTY_SET:
            return self._expect(sqe, 0, _DIR_NONE, self._h_prop_set)
        return C.SC_INVALID_OPCODE, _DIR_NONE, None, self._h_none

    def _h_connect(self, sqe: Sqe, data: memoryview | None) -> C.Result:
        if self.qid >= 0:
            return C._err(C.SC_CONNECT_BUSY)
        recfmt, qid, sqsize, cattr, kato = connect_fields(sqe)
        if recfmt != 0:
            return C._err(C.SC_CONNECT_FORMAT)
        cd = ConnectData.decode(data)
        t = self.target
        s = self.settings
        raw_sqsize = sqsize - 1
        if cd.subnqn not in (s.subnqn, DISCOVERY_NQN):
            return C._err(C.SC_CONNECT_INVALID_PARAM, C.IATTR_DATA | C.CONNECT_OFF_SUBNQN)
        discovery = cd.subnqn == DISCOVERY_NQN
        if qid == 0:
            if cd.cntlid != CNTLID_DYNAMIC:
                return C._err(C.SC_CONNECT_INVALID_PARAM, C.IATTR_DATA | C.CONNECT_OFF_CNTLID)
            if not discovery and not t.host_allowed(cd.hostnqn):
                return C._err(C.SC_CONNECT_INVALID_HOST, C.IATTR_DATA | C.CONNECT_OFF_HOSTNQN)
            if raw_sqsize == 0:
                return C._err(C.SC_CONNECT_INVALID_PARAM, C.SQE_OFF_SQSIZE)
            if kato == 0:
                kato = C.DISC_KATO_MS if discovery else s.keep_alive_default_ms
            ctrl = t.create_controller(cd.hostnqn, cd.hostid, discovery, -(-kato // 1000) * 1000)
            if ctrl is None:
                return C._err(C.SC_CONNECT_BUSY)
            ctrl.queues[0] = self
        else:
            ctrl = t.find_controller(cd.cntlid, discovery, cd.hostnqn)
            if ctrl is None:
                return C._err(C.SC_CONNECT_INVALID_PARAM, C.IATTR_DATA | C.CONNECT_OFF_CNTLID)
            if qid > ctrl.max_qid:
                return C._err(C.SC_CONNECT_INVALID_PARAM, C.SQE_OFF_QID)
            if raw_sqsize == 0 or raw_sqsize > s.queue_depth - 1:
                return C._err(C.SC_CONNECT_INVALID_PARAM, C.SQE_OFF_SQSIZE)
            with ctrl.lock:
                if qid in ctrl.queues or ctrl.dead:
                    return C._err(C.SC_CMD_SEQ)
                ctrl.queues[qid] = self
            self.handoff = not discovery and t.serves_io_elsewhere()
        self.ctrl = ctrl
        self.qid = qid
        self.sqsize = sqsize
        self.sqflow = not cattr & CATTR_DISABLE_SQ_FLOW_CONTROL
        ctrl.touch()
        if not self.sqflow:
            with self.send_lock:
                self.sock.sendall(self._resp(sqe.cid, 0, ctrl.cntlid, 0, sqhd=0xFFFF))
            return None  # type: ignore[return-value]
        return (0, ctrl.cntlid, 0, None)

    def _h_prop_get(self, sqe: Sqe, data: memoryview | None) -> C.Result:
        ctrl = self.ctrl
        assert ctrl is not None
        off = sqe.cdw11
        if sqe.cdw10 & 0x7 == 1:
            if off == Property.CAP:
                cap = ctrl.cap()
                return (0, cap & 0xFFFFFFFF, cap >> 32, None)
            return C._err(C.SC_INVALID_FIELD)
        if sqe.cdw10 & 0x7 != 0:
            return C._err(C.SC_INVALID_FIELD)
        val = {Property.VS: C.VS_VALUE, Property.CC: ctrl.cc, Property.CSTS: ctrl.csts,
               Property.CRTO: 0x000F000F}.get(off)
        if val is None:
            return C._err(C.SC_INVALID_FIELD)
        return (0, val, 0, None)

    def _h_prop_set(self, sqe: Sqe, data: memoryview | None) -> C.Result:
        ctrl = self.ctrl
        assert ctrl is not None
        if sqe.cdw10 & 0x7 != 0 or sqe.cdw11 != Property.CC:
            return C._err(C.SC_INVALID_FIELD)
        ctrl.set_cc(sqe.cdw12)
        self.target.controller_changed(ctrl)
        return C.OK

    # -- Admin ----------------------------------------------------------------------------------------
    def _parse_admin(self, sqe: Sqe) -> tuple:
        ctrl = self.ctrl
        assert ctrl is not None
        opc = sqe.opcode
        if not ctrl.discovery and not ctrl.csts & CSTS_RDY:  # nvmet_check_ctrl_status (not for discovery)
            return C.SC_CMD_SEQ, _DIR_NONE, None, self._h_none
        if opc == AdminOpcode.IDENTIFY:
            return self._expect(sqe, 4096, _DIR_IN, self._h_identify)
        if opc == AdminOpcode.GET_LOG_PAGE:
            numd = ((sqe.cdw10 >> 16) | ((sqe.cdw11 & 0xFFFF) << 16)) + 1
            if numd * 4 > self.mdts:  # never build an unbounded buffer for a host
                return C.SC_INVALID_FIELD, _DIR_IN, None, self._h_none
            return self._expect(sqe, numd * 4, _DIR_IN, self._h_get_log)
        if opc == AdminOpcode.SET_FEATURES:
            return self._expect(sqe, 0, _DIR_NONE, self._h_set_features)
        if opc == AdminOpcode.GET_FEATURES:
            n = 16 if sqe.cdw10 & 0xFF == 0x81 else 0
            return self._expect(sqe, n, _DIR_IN if n else _DIR_NONE, self._h_get_features)
        if opc == AdminOpcode.ASYNC_EVENT_REQUEST:
            return self._expect(sqe, 0, _DIR_NONE, self._h_aer)
        if opc == AdminOpcode.KEEP_ALIVE:
            return self._expect(sqe, 0, _DIR_NONE, self._h_keep_alive)
        if opc == AdminOpcode.ABORT and not ctrl.discovery:
            return self._expect(sqe, 0, _DIR_NONE, self._h_abort)
        return C.SC_INVALID_OPCODE, _DIR_NONE, None, self._h_none

    def _h_identify(self, sqe: Sqe, data: memoryview | None) -> C.Result:
        ctrl = self.ctrl
        assert ctrl is not None
        cns = sqe.cdw10 & 0xFF
        nsid = sqe.nsid
        t = self.target
        if cns == Cns.CONTROLLER:
            return (0, 0, 0, ctrl.identify_controller())
        if ctrl.discovery:
            return C._err(C.SC_INVALID_FIELD)
        if cns == Cns.NAMESPACE:
            if nsid == 0xFFFFFFFF:
                return C._err(C.SC_INVALID_NS)
            return (0, 0, 0, C.identify_namespace(t, nsid) or bytes(4096))
        if cns == Cns.ACTIVE_NS_LIST:
            if nsid >= 0xFFFFFFFE:
                return C._err(C.SC_INVALID_NS)
            return (0, 0, 0, encode_ns_list([n for n in t.namespaces if n > nsid]))
        csi = sqe.cdw11 >> 24
        if cns in (Cns.CSI_NAMESPACE, Cns.CSI_CONTROLLER) and csi != 0:
            return C._err(C.SC_INVALID_FIELD)
        if cns == Cns.CSI_CONTROLLER:
            return (0, 0, 0, bytes(4096))
        if cns in (Cns.NS_DESCRIPTORS, Cns.CSI_NAMESPACE, Cns.CSI_INDEPENDENT_NAMESPACE):
            if nsid not in t.namespaces:
                return C._err(C.SC_INVALID_NS)
            if cns == Cns.NS_DESCRIPTORS:
                return (0, 0, 0, C.ns_descriptors(t, nsid))
            if cns == Cns.CSI_NAMESPACE:
                return (0, 0, 0, bytes(4096))
            buf = bytearray(4096)
            buf[1] = 1  # NMIC shared
            buf[14] = 1  # NSTAT: namespace ready
            return (0, 0, 0, bytes(buf))
        return C._err(C.SC_INVALID_FIELD)

    def _h_get_log(self, sqe: Sqe, data: memoryview | None) -> C.Result:
        ctrl = self.ctrl
        assert ctrl is not None
        lid = sqe.cdw10 & 0xFF
        length = sqe.sgl_len
        offset = sqe.cdw12 | (sqe.cdw13 << 32)
        if offset & 3:
            return C._err(C.SC_INVALID_FIELD)
        if ctrl.discovery:
            if lid != LogPage.DISCOVERY:
                return C._err(C.SC_INVALID_FIELD)
            page = ctrl.discovery_log(self)
        elif lid == LogPage.SUPPORTED_LOGS:
            page = C.supported_logs(False)
        elif lid == LogPage.ERROR:
            page = ctrl.error_log()
        elif lid == LogPage.SMART:
            # Per-namespace SMART: an NSID that is neither 0, "all" nor active is Invalid Namespace (nvmet).
            if sqe.nsid not in (0, 0xFFFFFFFF) and sqe.nsid not in self.target.namespaces:
                return C._err(C.SC_INVALID_NS)
            page = ctrl.smart_log()
        elif lid == LogPage.CHANGED_NS:
            page = ctrl.changed_ns_log(retain=bool(sqe.cdw10 & (1 << 15)))
        elif lid == LogPage.FIRMWARE_SLOT:
            page = bytes(512)
        else:
            return C._err(C.SC_INVALID_FIELD)
        return (0, 0, 0, C.slice_log(page, offset, length))

    def _h_set_features(self, sqe: Sqe, data: memoryview | None) -> C.Result:
        ctrl = self.ctrl
        assert ctrl is not None
        fid = sqe.cdw10 & 0xFF
        val = sqe.cdw11
        if fid == Feature.NUMBER_OF_QUEUES and not ctrl.discovery:
            if val & 0xFFFF == 0xFFFF or val >> 16 == 0xFFFF:
                return C._err(C.SC_INVALID_FIELD)
            n = ctrl.max_qid - 1
            return (0, n | (n << 16), 0, None)
        if fid == Feature.ASYNC_EVENT_CONFIG:
            mask = C.OAES_DISC_CHANGE if ctrl.discovery else C.OAES_NS_ATTR
            if val & ~mask:
                return C._err(C.SC_INVALID_FIELD)
            ctrl.aec = val
            return C.OK
        if fid == Feature.KEEP_ALIVE_TIMER:
            ctrl.kato_ms = -(-val // 1000) * 1000  # nvmet keeps whole seconds
            ctrl.touch()
            return C.OK
        return C._err(C.SC_INVALID_FIELD)

    def _h_get_features(self, sqe: Sqe, data: memoryview | None) -> C.Result:
        ctrl = self.ctrl
        assert ctrl is not None
        fid = sqe.cdw10 & 0xFF
        if fid == Feature.NUMBER_OF_QUEUES and not ctrl.discovery:
            n = ctrl.max_qid - 1
            return (0, n | (n << 16), 0, None)
        if fid == Feature.ASYNC_EVENT_CONFIG:
            return (0, ctrl.aec, 0, None)
        if fid == Feature.KEEP_ALIVE_TIMER:
            return (0, ctrl.kato_ms, 0, None)
        if fid == Feature.VOLATILE_WRITE_CACHE and not ctrl.discovery:
            return (0, 1, 0, None)
        if fid == 0x81 and not ctrl.discovery:  # host identifier: 128-bit only (EXHID)
            if not sqe.cdw11 & 1:
                return C._err(C.SC_INVALID_FIELD)
            return (0, 0, 0, ctrl.hostid.ljust(16, b"\0")[:16])
        return C._err(C.SC_INVALID_FIELD)

    def _h_aer(self, sqe: Sqe, data: memoryview | None) -> C.Result | None:
        ctrl = self.ctrl
        assert ctrl is not None
        with ctrl.lock:
            if ctrl.pending_events:
                return (0, ctrl.pending_events.popleft(), 0, None)
            if len(ctrl.aers) > C.AERL:
                return C._err(C.SC_AER_LIMIT)
            ctrl.aers.append((self, sqe.cid))
        return None

    def _h_keep_alive(self, sqe: Sqe, data: memoryview | None) -> C.Result:
        ctrl = self.ctrl
        assert ctrl is not None
        if not ctrl.kato_ms:
            return C._err(C.SC_KA_INVALID)
        ctrl.touch()
        return C.OK

    @staticmethod
    def _h_abort(sqe: Sqe, data: memoryview | None) -> C.Result:
        return (0, 1, 0, None)  # "command not aborted", like nvmet

    # -- NVM I/O --------------------------------------------------------------------------------------
    def _parse_io(self, sqe: Sqe) -> tuple:
        ctrl = self.ctrl
        assert ctrl is not None
        if not ctrl.csts & CSTS_RDY:
            return C.SC_CMD_SEQ, _DIR_NONE, None, self._h_none
        ns = self.ns
        if ns is None or sqe.nsid != ns.nsid:
            return C.SC_INVALID_NS, _DIR_NONE, None, self._h_none
        opc = sqe.opcode
        if opc in (_READ, _WRITE):
            nlb = (sqe.cdw12 & 0xFFFF) + 1
            length = nlb << ns.lba_shift
            direction = _DIR_IN if opc == _READ else _DIR_OUT
            if sqe.sgl_len != length:
                return C.SC_SGL_INVALID_DATA, direction, None, self._h_none
            if length > self.mdts:
                return C.SC_INVALID_FIELD, direction, None, self._h_none
            slba = sqe.cdw10 | (sqe.cdw11 << 32)
            if slba + nlb > ns.nsze:
                return C.SC_LBA_RANGE, direction, None, self._h_none
            if opc == _WRITE and self.faults.device_full:
                return C.SC_CAP_EXCEEDED, direction, None, self._h_none
            off = slba << ns.lba_shift
            return 0, direction, ns.view[off:off + length], self._h_write_done
        if opc == IoOpcode.FLUSH:
            return self._expect(sqe, 0, _DIR_NONE, self._h_flush)
        if opc == IoOpcode.WRITE_ZEROES:
            nlb = (sqe.cdw12 & 0xFFFF) + 1
            slba = sqe.cdw10 | (sqe.cdw11 << 32)
            if sqe.sgl_len:
                return C.SC_SGL_INVALID_DATA, _DIR_NONE, None, self._h_none
            if slba + nlb > ns.nsze:
                return C.SC_LBA_RANGE, _DIR_NONE, None, self._h_none
            if self.faults.device_full:
                return C.SC_CAP_EXCEEDED, _DIR_NONE, None, self._h_none
            return 0, _DIR_NONE, None, self._h_write_zeroes
        if opc == IoOpcode.DATASET_MANAGEMENT:
            nr = (sqe.cdw10 & 0xFF) + 1
            if sqe.sgl_len == 0 or sqe.sgl_len > nr * 16:  # nvmet_check_data_len_lte
                return C.SC_SGL_INVALID_DATA, _DIR_OUT, None, self._h_none
            return 0, _DIR_OUT, memoryview(bytearray(sqe.sgl_len)), self._h_dsm
        return C.SC_INVALID_OPCODE, _DIR_NONE, None, self._h_none

    def _h_write_done(self, sqe: Sqe, data: memoryview | None) -> C.Result:
        c = self.counters
        c.writes += 1
        c.bytes_written += (sqe.cdw12 & 0xFFFF) + 1 << self.ns.lba_shift  # type: ignore[union-attr]
        return C.OK

    def _h_flush(self, sqe: Sqe, data: memoryview | None) -> C.Result:
        self.ns.flush()  # type: ignore[union-attr]
        return C.OK

    def _h_write_zeroes(self, sqe: Sqe, data: memoryview | None) -> C.Result:
        ns = self.ns
        assert ns is not None
        nlb = (sqe.cdw12 & 0xFFFF) + 1
        slba = sqe.cdw10 | (sqe.cdw11 << 32)
        ns.zero(slba << ns.lba_shift, nlb << ns.lba_shift)
        self.counters.writes += 1
        return C.OK

    def _h_dsm(self, sqe: Sqe, data: memoryview | None) -> C.Result:
        ns = self.ns
        assert ns is not None and data is not None
        if not sqe.cdw11 & DSM_ATTR_DEALLOCATE:
            return C.OK  # IDR/IDW hints only: no-op (nvmet)
        ranges = [(slba, nlb) for _, nlb, slba in DSM_RANGE.iter_unpack(bytes(data[:len(data) // 16 * 16]))]
        for slba, nlb in ranges:
            if slba + nlb > ns.nsze:
                return C._err(C.SC_LBA_RANGE)
        for slba, nlb in ranges:
            if nlb:
                ns.zero(slba << ns.lba_shift, nlb << ns.lba_shift)
        return C.OK
