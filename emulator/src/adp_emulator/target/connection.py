"""One NVMe/TCP connection (= one queue): framing, data movement and completions.

What each command does is in :mod:`.commands` (Fabrics, Admin, NVM); this module asks
:func:`.commands.parse` what a command needs, moves its data and runs the handler it names.

Runs in its own thread with a blocking socket. Every PDU goes through the shared codec
(:mod:`adp_wire`): the IC exchange through its :class:`~adp_wire.stream.PduDecoder`, later headers
through the queue's :class:`~adp_wire.hotpath.HeaderCheck`, and what the target sends through its
:class:`~adp_wire.hotpath.PduPacker`. Headers are read into a small reusable buffer; data lands
with ``recv_into`` straight in the namespace mmap (writes) and leaves with ``sendmsg`` from slices
of it (reads). A malformed PDU ends this connection only, after a C2HTermReq (as SPDK does).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Protocol

from adp_wire.constants import (
    AdminOpcode,
    FatalErrorStatus,
    IoOpcode,
    PduType,
    SglId,
)
from adp_wire.digest import crc32c, read_digest
from adp_wire.hotpath import DATA_FIELDS, HeaderCheck, PduPacker
from adp_wire.negotiate import QueueState, accept_icreq
from adp_wire.pdu import ICResp, PduError, TermReq, encode_bytes
from adp_wire.sqe import Sqe
from adp_wire.stream import PduDecoder

from . import commands
from .commands.result import (
    DIR_IN,
    DIR_OUT,
    SC_INTERNAL,
    SC_INVALID_FIELD,
    SC_SGL_INVALID_DATA,
    SC_SGL_INVALID_OFFSET,
    SC_SGL_INVALID_TYPE,
    SC_TRANSIENT,
    Handler,
    Result,
)
from .counters import IoCounters
from .settings import ADMIN_IN_CAPSULE

if TYPE_CHECKING:  # pragma: no cover
    from .controller import Controller
    from .namespace import Namespace
    from .settings import TargetSettings

log = logging.getLogger(__name__)

_RBUF = 64 * 1024  # read-ahead buffer for headers and small payloads
_DIRECT_RECV = 4096  # payloads at least this large are received straight into their destination
_IC_MAX_PLEN = 24 + 128  # before the IC exchange: an ICReq (128) or an H2CTermReq with its data
_T_CMD, _T_H2C = int(PduType.CAPSULE_CMD), int(PduType.H2C_DATA)
_FABRICS = int(AdminOpcode.FABRICS)
_READ, _WRITE = int(IoOpcode.READ), int(IoOpcode.WRITE)



class FaultSource(Protocol):
    """The per-command faults a connection applies (the target's :class:`~.faults.Faults`, or a worker's
    mirror of them)."""

    armed: bool  # any per-command fault active: the only field read on the hot path
    delay_s: float
    device_full: bool

    def take_failure(self) -> int:
        """The status word to fail the next command with, or 0."""
        ...

    def take_read_corruption(self) -> bool:
        """Whether to corrupt the next read's data."""
        ...


class ConnectionTarget(Protocol):
    """What a :class:`Connection` and the command handlers (:mod:`.commands`) need from their target.

    Served by :class:`~.server.UserspaceTarget` and, in an I/O worker process, by
    :class:`~.worker.WorkerTarget` (which only ever serves connected I/O queues, so its association
    methods refuse).
    """

    settings: TargetSettings
    namespaces: dict[int, Namespace]
    faults: FaultSource

    def host_allowed(self, hostnqn: str) -> bool: ...

    def create_controller(self, hostnqn: str, hostid: bytes, discovery: bool, kato_ms: int) -> Controller | None:
        """A new association's controller, or None when no controller id is free."""
        ...

    def find_controller(self, cntlid: int, discovery: bool, hostnqn: str) -> Controller | None:
        """The live controller an I/O queue's Connect names, or None."""
        ...

    def controller_changed(self, ctrl: Controller) -> None:
        """Property Set changed ``ctrl``'s registers (CC)."""
        ...

    def serves_io_elsewhere(self) -> bool:
        """Whether connected I/O queues are handed to worker processes."""
        ...

    def hand_off(self, conn: Connection) -> bool:
        """Take ``conn``'s socket to serve it elsewhere; False keeps it on this connection's thread."""
        ...

    def _connection_gone(self, conn: Connection) -> None:
        """``conn`` closed (called from its thread)."""
        ...


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

    def __init__(self, target: ConnectionTarget, sock: socket.socket, peer: tuple) -> None:
        self.target: ConnectionTarget = target
        self.settings = target.settings
        self.sock = sock
        self.peer = peer
        self.local_addr = sock.getsockname()
        self.state = QueueState()  # digests, the host's PDU alignment, SQ size/head/flow control
        self.qid = -1  # not connected yet
        self.ctrl: Controller | None = None
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
        self.plen_limits = {_T_CMD: 72 + 4 + 255 + self.max_icd + 4,
                            _T_H2C: 24 + 4 + 255 + self.settings.maxh2cdata + 4}
        self.packer = PduPacker()
        self.rx = HeaderCheck(receiver_is_host=False, max_plen=_IC_MAX_PLEN, limits=self.plen_limits)
        self.pending: dict[int, _Xfer] = {}
        self.free_ttags: list[int] = []
        self.ns = target.namespaces.get(1)
        self.faults = target.faults
        self.mdts = self.settings.mdts_bytes
        self.splice_reads = self.settings.splice_reads
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
        while got < n:  # MSG_WAITALL: one call fills the payload (the loop resumes only after a signal)
            r = recv_into(view[got:], n - got, socket.MSG_WAITALL)
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

    def _sendmsg(self, bufs: list, total: int, flags: int = 0) -> None:
        sent = self.sock.sendmsg(bufs, (), flags)
        if sent == total:
            return
        for b in bufs:  # partial send (signal / shutdown): finish piece by piece
            lb = len(b)
            if sent >= lb:
                sent -= lb
                continue
            self.sock.sendall(memoryview(b)[sent:], flags)
            sent = 0

    def _resp(self, cid: int, status: int, dw0: int, dw1: int, sqhd: int | None = None) -> bytes:
        """A CapsuleResp PDU (call with send_lock held: it advances SQHD)."""
        if sqhd is None:
            sqhd = self.state.next_sqhd()
        return self.packer.capsule_resp(cid, status, dw0, dw1, sqhd, self.qid if self.qid >= 0 else 0)

    def send_response(self, cid: int, status: int = 0, dw0: int = 0, dw1: int = 0, sqhd: int | None = None) -> None:
        """Send a CapsuleResp now (thread-safe); ``sqhd`` None reports the advanced SQ head."""
        with self.send_lock:
            self.sock.sendall(self._resp(cid, status, dw0, dw1, sqhd))

    def send_completion(self, cid: int, status: int = 0, dw0: int = 0, dw1: int = 0) -> None:
        """Send a CapsuleResp, ignoring a closed socket (used for deferred AER completions)."""
        try:
            self.send_response(cid, status, dw0, dw1)
        except OSError:
            pass

    def _send_data(self, cid: int, data: bytes | memoryview, dw0: int = 0, corrupt: bool = False) -> None:
        """C2HData (one PDU, LAST_PDU) then CapsuleResp, or C2HData with SUCCESS when SQ flow control is off."""
        use_success = not self.state.sqflow
        bufs = self.packer.c2h_data(cid, 0, data, last=True, success=use_success)
        if corrupt:  # the digest (if any) stays that of the real data
            bad = bytearray(data)
            bad[0] ^= 0xFF
            bufs[1] = bad
        total = len(bufs[0]) + len(data) + (4 if self.state.ddgst else 0)
        with self.send_lock:
            if not use_success:
                r = self._resp(cid, 0, dw0, 0)
                bufs.append(r)
                total += len(r)
            self._sendmsg(bufs, total)

    # ------------------------------------------------------------------------------------------------
    # Connection setup

    def _read_header(self) -> tuple[int, int, int, int, bool]:
        """Read one PDU header into ``hbuf``, validated by the codec's :class:`HeaderCheck`:
        (type, header span, PDO, data length, DDGST)."""
        hv = self.hview
        self._recv_exact(hv[:8])
        t, span, pdo, dlen, has_dd = self.rx.common(hv)
        self._recv_exact(hv[8:span])
        self.rx.complete(hv, t, span, dlen)
        return t, span, pdo, dlen, has_dd

    def _handshake(self) -> None:
        dec = PduDecoder(receiver_is_host=False, max_plen=_IC_MAX_PLEN)
        raw = bytearray()
        req = None
        while req is None:  # exactly the bytes of the one PDU: the rest stays in the read-ahead buffer
            chunk = self.hview[:dec.needed]
            self._recv_exact(chunk)
            raw += chunk
            dec.feed(chunk)
            req = dec.next_pdu()
        if isinstance(req, TermReq):  # the host gives up before it started
            raise ConnectionClosed
        accept_icreq(req, bytes(raw), self.settings.require_data_digest)
        self._set_transport(QueueState.from_icreq(req, self.settings.maxh2cdata))
        resp = ICResp(0, 0, req.hdgst, req.ddgst, self.settings.maxh2cdata)
        with self.send_lock:
            self.sock.sendall(encode_bytes(resp))

    # ------------------------------------------------------------------------------------------------
    # Main loop

    def _set_transport(self, state: QueueState) -> None:
        """Digests and host PDU alignment as negotiated by ICReq/ICResp."""
        self.state = state
        self.packer = PduPacker(state.hdgst, state.ddgst, state.pda)
        self.rx = HeaderCheck(receiver_is_host=False, hdgst=state.hdgst, ddgst=state.ddgst, max_plen=_IC_MAX_PLEN,
                              limits=self.plen_limits)
        if len(self.rview) < _RBUF:  # keep what was read ahead (a pipelined Connect)
            grown = memoryview(bytearray(_RBUF))
            grown[:self.rend] = self.rview[:self.rend]
            self.rview = grown

    def handoff_state(self) -> dict:
        """What a worker process needs to go on serving this connected I/O queue (see :meth:`adopt`)."""
        st = self.state
        return {"hd": st.hdgst, "dd": st.ddgst, "hpda": st.pda, "maxh2cdata": st.maxh2cdata, "qid": self.qid,
                "sqsize": st.sqsize, "sqhd": st.sqhd, "sqflow": st.sqflow, "peer": list(self.peer[:2]),
                "readahead": bytes(self.rview[self.rpos:self.rend])}

    def adopt(self, state: dict, ctrl: Controller) -> None:
        """Take over a connection another process connected (its :meth:`handoff_state`)."""
        self._set_transport(QueueState(state["hd"], state["dd"], state["hpda"], state["maxh2cdata"], state["sqsize"],
                                       state["sqhd"], state["sqflow"]))
        self.qid = state["qid"]
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
            else:  # H2CTermReq (a second ICReq is the codec's sequence error): the host gives up
                raise ConnectionClosed

    def _on_capsule(self, span: int, pdo: int, icl: int, has_dd: bool) -> None:
        t0 = time.perf_counter_ns()
        sqe = Sqe.decode(self.hbuf, 8)
        ctrl = self.ctrl
        if ctrl is not None:
            ctrl.last_activity = time.monotonic()
        io = self.qid > 0 and sqe.opcode != _FABRICS
        status, direction, dest, handler = commands.parse(self, sqe)
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
                if read_digest(self.hbuf, 256) != crc32c(stage):
                    status = status or SC_TRANSIENT
                elif not status:
                    dest[:icl] = stage
            else:
                self._recv_exact(dest[:icl])
        if status:
            self._complete(sqe, (status, 0, 0, None), t0, io)
            return
        if direction == DIR_OUT and not icl and dest is not None and len(dest):
            self._start_r2t(sqe, dest, handler, t0)
            return
        if direction == DIR_IN and sqe.opcode == _READ and io:
            self._read_done(sqe, dest, t0)
            return
        try:
            res = handler(self, sqe, dest if direction == DIR_OUT else None)
        except Exception:
            log.exception("command %#x failed", sqe.opcode)
            res = (SC_INTERNAL, 0, 0, None)
        if res is not None:
            self._complete(sqe, res, t0, io)

    def _check_sgl(self, sqe: Sqe, direction: int, icl: int, dest: memoryview | None) -> int:
        sid = sqe.sgl_id
        if sid == SglId.DATA_BLOCK_OFFSET:
            if direction != DIR_OUT:
                return SC_INVALID_FIELD
            limit = self.settings.in_capsule_bytes if self.qid > 0 and sqe.opcode != _FABRICS else ADMIN_IN_CAPSULE
            if sqe.sgl_len > limit:
                return SC_SGL_INVALID_OFFSET
            if icl != sqe.sgl_len:
                return SC_SGL_INVALID_DATA
        elif sid == SglId.TRANSPORT_DATA_BLOCK:
            if icl:
                return SC_SGL_INVALID_DATA
        else:
            return SC_SGL_INVALID_TYPE
        return 0

    def _complete(self, sqe: Sqe, res: Result, t0: int, io: bool) -> None:
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
        ns = self.ns
        if self.splice_reads and not corrupt and not self.state.ddgst and ns is not None:
            self._send_data_spliced(sqe.cid, view, ns.fd, sqe.slba << ns.lba_shift)
        else:
            self._send_data(sqe.cid, view, 0, corrupt)

    def _send_data_spliced(self, cid: int, view: memoryview, fd: int, offset: int) -> None:
        """As :meth:`_send_data` without data digest, the payload spliced from the namespace's ``fd`` at ``offset``
        by ``os.sendfile``: the socket references the pages (tmpfs, memfd or page cache) instead of this process
        copying them (``view``, the same bytes, only sizes the PDU)."""
        use_success = not self.state.sqflow
        hdr = self.packer.c2h_data(cid, 0, view, last=True, success=use_success)[0]
        n = len(view)
        sock = self.sock
        with self.send_lock:
            self._sendmsg([hdr], len(hdr), socket.MSG_MORE)
            out, sent = sock.fileno(), 0
            while sent < n:  # one call moves it all on a blocking socket; a signal can cut it short
                k = os.sendfile(out, fd, offset + sent, n - sent)
                if k == 0:
                    raise ConnectionClosed
                sent += k
            if not use_success:
                sock.sendall(self._resp(cid, 0, 0, 0))

    # ------------------------------------------------------------------------------------------------
    # Solicited data (R2T / H2CData)

    def _start_r2t(self, sqe: Sqe, dest: memoryview, handler: Handler, t0: int) -> None:
        if not self.free_ttags:
            # A host never has more than SQSIZE commands outstanding; the bound also keeps a hostile peer
            # from pinning memory with transfers it never sends (and keeps TTAGs within 16 bits).
            if len(self.pending) >= min(max(self.state.sqsize, 1), self.settings.queue_depth, 0xFFFF):
                self._complete(sqe, (SC_INTERNAL, 0, 0, None), t0, self.qid > 0)
                return
            self.free_ttags.append(len(self.pending))
        ttag = self.free_ttags.pop()
        x = _Xfer(sqe, dest, handler, t0, staged=self.state.ddgst)
        self.pending[ttag] = x
        self._send_r2t(ttag, x)

    def _send_r2t(self, ttag: int, x: _Xfer) -> None:
        n = min(x.total - x.received, self.settings.maxh2cdata)
        x.r2t_end = x.received + n
        pdu = self.packer.r2t(x.cid, ttag, x.received, n)
        with self.send_lock:
            self.sock.sendall(pdu)

    def _on_h2c(self, span: int, pdo: int, datal: int, has_dd: bool) -> None:
        cccid, ttag, datao, _ = DATA_FIELDS.unpack_from(self.hbuf, 0)
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
            if read_digest(self.hbuf, 256) != crc32c(dst):
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
            self._complete(sqe, (SC_TRANSIENT, 0, 0, None), x.t0, io)
            return
        if x.stage is not None:
            x.dest[:] = x.stage
        try:
            res = x.handler(self, sqe, x.dest)
        except Exception:
            log.exception("command %#x failed", sqe.opcode)
            res = (SC_INTERNAL, 0, 0, None)
        if res is not None:
            self._complete(sqe, res, x.t0, io)
