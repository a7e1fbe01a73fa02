"""One NVMe/TCP queue pair: a TCP connection, its ICReq/ICResp exchange, Connect, and pipelined commands.

Threading model (documented in docs/host-client.md):

* Any thread may call :meth:`QueuePair.submit`; it takes a command slot (blocking while ``depth``
  commands are in flight), sends the capsule under the queue's send lock and returns a
  :class:`~concurrent.futures.Future`.
* One reader thread per queue receives PDUs. C2HData payloads are received with ``recv_into``
  (``MSG_WAITALL``: one call per payload) directly into the caller's buffer (no intermediate copy).
  CapsuleResp completes the future.
* R2T-solicited H2CData is sent by a per-queue sender thread, never by the reader, so a large write
  can never deadlock against a large read on the same connection.
* Any transport or protocol failure fails every in-flight command with
  :class:`~.errors.NvmeTransportError` and closes the queue; the controller decides about reconnecting.
"""

from __future__ import annotations

import collections
import queue
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from adp_wire import pdu as P
from adp_wire.constants import CATTR_DISABLE_SQ_FLOW_CONTROL, PduFlags, PduType, SglId
from adp_wire.hotpath import CQE_FIELDS, DATA_FIELDS, HeaderCheck, PduPacker, payload_digest
from adp_wire.negotiate import NegotiationError, QueueState, accept_icresp
from adp_wire.sqe import Cqe, Sqe, connect_cmd
from adp_wire.status import Status
from adp_wire.stream import PduDecoder
from adp_wire.structs import ConnectData

from ...device import DeviceError, ScatterList
from .errors import NvmeConnectError, NvmeProtocolError, NvmeStatusError, NvmeTimeoutError, NvmeTransportError

_ADMIN_IN_CAPSULE = 8192  # fabrics and admin commands may always carry this much in-capsule
_LAST_SUCCESS = int(PduFlags.DATA_LAST | PduFlags.DATA_SUCCESS)
_IC_MAX_PLEN = 24 + 128  # before the IC exchange: an ICResp (128) or a C2HTermReq with its data
_T_RESP, _T_C2H, _T_R2T, _T_TERM = (int(PduType.CAPSULE_RESP), int(PduType.C2H_DATA), int(PduType.R2T),
                                    int(PduType.C2H_TERM_REQ))


@dataclass(slots=True)
class QueueParams:
    """What a queue negotiates and uses."""

    hdgst: bool = False
    ddgst: bool = False
    connect_timeout: float = 10.0
    in_capsule_bytes: int = _ADMIN_IN_CAPSULE  # I/O queues: from IOCCSZ once known


class _Request:
    __slots__ = ("buf", "c2h", "cid", "deadline", "error", "future", "on_done", "received", "what")

    def __init__(self, cid: int, buf: memoryview | ScatterList | None, c2h: bool, what: str, deadline: float,
                 on_done: Callable[[BaseException | None], None] | None) -> None:
        self.cid = cid
        self.c2h = c2h
        self.buf = buf
        self.what = what
        self.deadline = deadline
        self.on_done = on_done
        self.received = 0
        self.error: BaseException | None = None
        self.future: Future[Cqe] | None = None if on_done else Future()


_WAITALL = socket.MSG_WAITALL


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` completely from ``sock``; EOF raises NvmeTransportError.

    MSG_WAITALL: the kernel fills the whole view in one call (a 1 MiB payload is one syscall and one GIL
    release, not one per segment the socket happens to hold); the loop only resumes after a signal.
    """
    pos, end = 0, len(view)
    while pos < end:
        n = sock.recv_into(view[pos:], end - pos, _WAITALL)
        if n == 0:
            raise NvmeTransportError("connection closed by the target")
        pos += n


def _consume(views: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of ``views`` (in place): what one vectored send or receive moved."""
    while n:
        if n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        else:
            views[0] = views[0][n:]
            n = 0


def _recv_exact_v(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every view in ``views``, in order (one ``recvmsg_into`` with MSG_WAITALL per pass over what is left)."""
    views = list(views)
    while views:
        n = sock.recvmsg_into(views, 0, _WAITALL)[0]
        if n == 0:
            raise NvmeTransportError("connection closed by the target")
        _consume(views, n)


def _send_all(sock: socket.socket, bufs: list) -> None:
    """sendmsg that survives partial sends."""
    views = [memoryview(b).cast("B") for b in bufs if len(b)]
    while views:
        _consume(views, sock.sendmsg(views))


def _payload(buf: memoryview | ScatterList) -> memoryview | list[memoryview]:
    """``buf`` as the codec's packers take data: one buffer, or a scatter list's buffers in order."""
    return buf.views if type(buf) is ScatterList else buf


class QueuePair:
    """A connected admin (qid 0) or I/O queue."""

    def __init__(self, sock: socket.socket, qid: int, depth: int, params: QueueParams,
                 on_failure: Callable[[QueuePair, BaseException], None] | None = None) -> None:
        self.sock = sock
        self.qid = qid
        self.depth = depth
        self.params = params
        self.state = QueueState()  # what the ICReq/ICResp exchange and Connect agreed
        self.packer = PduPacker()
        self.rx = HeaderCheck(receiver_is_host=True)
        self._on_failure = on_failure
        self._send_lock = threading.Lock()
        # free command ids: taking one is taking a slot (a submitter blocks while ``depth`` are in flight); a C-level
        # queue, so a completion hands its id back without the Python Condition a Semaphore would notify
        self._free_cids: queue.SimpleQueue[int] = queue.SimpleQueue()
        for cid in range(depth):
            self._free_cids.put(cid)
        self._inflight: dict[int, _Request] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._failure: BaseException | None = None
        self._r2t_jobs: collections.deque[tuple[_Request, int, int, int, int]] = collections.deque()
        self._r2t_cv = threading.Condition()
        self._reader: threading.Thread | None = None
        self._sender: threading.Thread | None = None
        self.commands = 0
        self.max_in_flight = 0

    # ------------------------------------------------------------------------------------------------
    # Bring-up

    @property
    def hdgst(self) -> bool:
        return self.state.hdgst

    @property
    def ddgst(self) -> bool:
        return self.state.ddgst

    @property
    def cpda(self) -> int:
        return self.state.pda

    @property
    def maxh2cdata(self) -> int:
        return self.state.maxh2cdata

    def initialize(self) -> None:
        """ICReq/ICResp exchange (synchronously, before any thread starts)."""
        p = self.params
        self.sock.settimeout(p.connect_timeout)
        dec = PduDecoder(receiver_is_host=True, max_plen=_IC_MAX_PLEN)
        try:
            _send_all(self.sock, P.encode(P.ICReq(hdgst=p.hdgst, ddgst=p.ddgst)))
            resp = None
            while resp is None:  # exactly the bytes of the one PDU, so nothing after it is read here
                chunk = bytearray(dec.needed)
                _recv_exact(self.sock, memoryview(chunk))
                dec.feed(chunk)
                resp = dec.next_pdu()
        except OSError as e:
            raise NvmeTransportError(f"ICReq/ICResp exchange failed: {e}") from e
        except P.PduError as e:
            raise NvmeProtocolError(f"bad ICResp: {e}") from e
        if isinstance(resp, P.TermReq):
            raise NvmeTransportError(f"target refused the connection with C2HTermReq FES {resp.fes:#x}")
        assert isinstance(resp, P.ICResp)  # the decoder's sequence rule
        try:
            accept_icresp(resp, p.hdgst, p.ddgst)
        except NegotiationError as e:
            raise NvmeProtocolError(str(e)) from None
        self.state = QueueState.from_icresp(resp)
        self.packer = PduPacker(resp.hdgst, resp.ddgst, resp.cpda)
        self.rx = HeaderCheck(receiver_is_host=True, hdgst=resp.hdgst, ddgst=resp.ddgst)
        self.sock.settimeout(None)
        self._reader = threading.Thread(target=self._read_loop, name=f"nvme-q{self.qid}-rx", daemon=True)
        self._reader.start()
        self._sender = threading.Thread(target=self._send_loop, name=f"nvme-q{self.qid}-tx", daemon=True)
        self._sender.start()

    def connect(self, subnqn: str, hostnqn: str, hostid: bytes, cntlid: int, kato_ms: int,
                timeout: float, disable_sq_flow_control: bool = False) -> int:
        """Fabrics Connect; returns the controller id.

        ``disable_sq_flow_control`` (CATTR bit 2) lets the controller end a successful read with the
        C2HData SUCCESS flag instead of a separate CapsuleResp (one PDU less per read).
        """
        cattr = CATTR_DISABLE_SQ_FLOW_CONTROL if disable_sq_flow_control else 0
        sqe = connect_cmd(self.qid, self.depth + 1, kato_ms if self.qid == 0 else 0, cattr=cattr)
        data = ConnectData(hostid, cntlid, subnqn, hostnqn).encode()
        fut = self.submit(sqe, data=memoryview(data), what=f"Connect (qid {self.qid})", timeout=timeout)
        try:
            cqe = fut.result(timeout + 1)
        except NvmeStatusError as e:
            raise NvmeConnectError(e.status, f"Connect to {subnqn} as {hostnqn} (qid {self.qid})") from None
        self.state.connected(self.depth + 1, cattr)
        return cqe.dw0 & 0xFFFF

    # ------------------------------------------------------------------------------------------------
    # Submission

    def _take_slot(self, buf: memoryview | ScatterList | None, c2h: bool, what: str, timeout: float,
                   on_done: Callable[[BaseException | None], None] | None, cid: int | None = None) -> _Request:
        """Register a command under a free id (``cid``: one the caller already took; else wait for one)."""
        if self._failure is not None:
            if cid is not None:
                self._free_cids.put(cid)
            raise NvmeTransportError(f"queue {self.qid} is down: {self._failure}")
        if cid is None:
            cid = self._free_cids.get()
        with self._lock:
            if self._closed:
                self._free_cids.put(cid)
                raise NvmeTransportError(f"queue {self.qid} is closed: {self._failure}")
            req = _Request(cid, buf, c2h, what, time.monotonic() + timeout, on_done)
            inflight = self._inflight
            inflight[cid] = req
            if len(inflight) > self.max_in_flight:
                self.max_in_flight = len(inflight)
        self.commands += 1
        return req

    def _send_capsule(self, bufs: list) -> None:
        try:
            with self._send_lock:
                _send_all(self.sock, bufs)
        except OSError as e:
            self._fail(NvmeTransportError(f"send failed on queue {self.qid}: {e}"))

    def submit(self, sqe: Sqe, data: memoryview | None = None, read_into: memoryview | None = None,
               what: str = "", timeout: float = 30.0) -> Future[Cqe]:
        """Send ``sqe``; ``data`` is host-to-controller payload, ``read_into`` the destination of C2H data.

        The returned future yields the :class:`Cqe` on success and raises NvmeStatusError otherwise.
        """
        buf = data if data is not None else read_into
        req = self._take_slot(buf, read_into is not None, what or f"opcode {sqe.opcode:#x}", timeout, None)
        sqe.cid = req.cid
        length = len(buf) if buf is not None else 0
        sqe.sgl_len = length
        limit = _ADMIN_IN_CAPSULE if self.qid == 0 or sqe.opcode == 0x7F else self.params.in_capsule_bytes
        in_capsule = data is not None and length <= limit
        sqe.sgl_id = SglId.DATA_BLOCK_OFFSET if in_capsule else SglId.TRANSPORT_DATA_BLOCK
        sqe.sgl_addr = 0
        self._send_capsule(self.packer.capsule(sqe.encode(), data if in_capsule else b""))
        assert req.future is not None
        return req.future

    def submit_rw_many(self, opcode: int, nsid: int, parts: list[tuple[int, int, memoryview | ScatterList]],
                       timeout: float, on_done: Callable[[BaseException | None], None]) -> int:
        """Read (opcode 2, C2H into each buffer) or Write (opcode 1) commands (``parts``: slba, nlb, buffer) with one
        send for as many as there are free slots (a queue that is full gets what is pending first, then the caller
        waits for a slot). ``on_done(error_or_None)`` runs once per command, on the queue's reader thread; it must
        be quick.

        Returns how many were not submitted: for each of those ``on_done`` has already been called with the error.
        """
        c2h = opcode == 0x02
        what = "Read" if c2h else "Write"
        pending: list = []
        for i, (slba, nlb, buf) in enumerate(parts):
            try:
                cid: int | None = self._free_cids.get_nowait()
            except queue.Empty:
                cid = None
            if cid is None and pending:
                self._send_capsule(pending)
                pending = []
            try:
                req = self._take_slot(buf, c2h, what, timeout, on_done, cid=cid)
            except DeviceError as e:
                if pending:
                    self._send_capsule(pending)
                for _ in range(len(parts) - i):
                    on_done(e)
                return len(parts) - i
            pending += self._rw_capsule(opcode, nsid, slba, nlb, buf, req.cid)
        if pending:
            self._send_capsule(pending)
        return 0

    def _rw_capsule(self, opcode: int, nsid: int, slba: int, nlb: int, buf: memoryview | ScatterList,
                    cid: int) -> list:
        """The buffers of one Read/Write CapsuleCmd PDU (in-capsule data included for small writes)."""
        n = len(buf)
        if opcode != 0x02 and n <= self.params.in_capsule_bytes:
            return self.packer.rw_capsule(opcode, cid, nsid, slba, nlb, n, _payload(buf))
        return self.packer.rw_capsule(opcode, cid, nsid, slba, nlb, n)

    def _complete(self, req: _Request, status: int, dw0: int = 0, dw1: int = 0, sqhd: int = 0,
                  error: BaseException | None = None) -> None:
        with self._lock:
            if self._inflight.pop(req.cid, None) is None:
                return  # already failed by _fail
        self._free_cids.put(req.cid)
        self._resolve(req, status, dw0, dw1, sqhd, error)

    def _resolve(self, req: _Request, status: int, dw0: int, dw1: int, sqhd: int,
                 error: BaseException | None) -> None:
        err = error or req.error
        if err is None and status & 0xFFFE:
            err = NvmeStatusError(Status.from_word(status), req.what)
        if err is None and req.c2h and req.buf is not None and req.received != len(req.buf):
            err = NvmeProtocolError(f"{req.what}: short data-in ({req.received} of {len(req.buf)} bytes)")
        if req.on_done is not None:
            req.on_done(err)
        elif req.future is not None:
            if err is not None:
                req.future.set_exception(err)
            else:
                req.future.set_result(Cqe(cid=req.cid, status=Status.from_word(status), dw0=dw0, dw1=dw1,
                                          sqhd=sqhd, sqid=self.qid))

    # ------------------------------------------------------------------------------------------------
    # Receive path

    def _read_loop(self) -> None:
        sock = self.sock
        hdr = bytearray(_IC_MAX_PLEN)
        hv = memoryview(hdr)
        h24 = hv[:24]  # every controller-to-host PDU but ICResp has a 24-byte header
        dgv = memoryview(bytearray(4))
        inflight = self._inflight
        common, complete = self.rx.common, self.rx.complete
        try:
            while True:
                _recv_exact(sock, h24)
                t, span, pdo, dlen, has_dd = common(hdr)
                if span > 24:
                    _recv_exact(sock, hv[24:span])
                complete(hdr, t, span, dlen)
                if t == _T_RESP:
                    dw0, dw1, sqhd, _sqid, cid, status = CQE_FIELDS.unpack_from(hdr, 0)
                    req = inflight.get(cid)
                    if req is None:
                        raise NvmeProtocolError(f"completion for unknown command id {cid}")
                    self._complete(req, status, dw0, dw1, sqhd)
                elif t == _T_C2H:
                    cid, _ttag, datao, _ = DATA_FIELDS.unpack_from(hdr, 0)
                    if pdo > span:
                        _recv_exact(sock, memoryview(bytearray(pdo - span)))
                    self._recv_c2h(cid, datao, dlen, hdr[1], has_dd, dgv)
                elif t == _T_R2T:
                    self._queue_r2t(*DATA_FIELDS.unpack_from(hdr, 0))
                else:
                    self._on_term(hv, span, dlen)
        except P.PduError as e:
            self._fail(NvmeProtocolError(f"malformed PDU from target: {e}"))
        except NvmeTransportError as e:
            self._fail(e)
        except OSError as e:
            self._fail(NvmeTransportError(f"receive failed on queue {self.qid}: {e}"))
        except Exception as e:  # a bug must not leave callers hanging
            self._fail(NvmeTransportError(f"queue {self.qid} reader crashed: {e!r}"))

    def _recv_c2h(self, cid: int, datao: int, datal: int, flags: int, has_dd: bool, dgv: memoryview) -> None:
        req = self._inflight.get(cid)
        if req is None or not req.c2h or req.buf is None:
            raise NvmeProtocolError(f"C2HData for unknown or data-less command id {cid}")
        end = datao + datal
        if datao != req.received or end > len(req.buf):
            raise NvmeProtocolError(f"C2HData out of range: offset {datao} length {datal} "
                                    f"(expected offset {req.received}, buffer {len(req.buf)})")
        dest = req.buf[datao:end]
        if type(dest) is ScatterList:
            _recv_exact_v(self.sock, dest.views)
        else:
            _recv_exact(self.sock, dest)
        if has_dd:
            _recv_exact(self.sock, dgv)
            if dgv != payload_digest(_payload(dest)):
                req.error = NvmeStatusError(Status.named("DATA_TRANSFER_ERROR"), f"{req.what}: C2HData digest mismatch")
        req.received = end
        if flags & _LAST_SUCCESS == _LAST_SUCCESS:  # no CapsuleResp follows
            self._complete(req, 0)

    def _on_term(self, hv: memoryview, span: int, dlen: int) -> None:
        """A C2HTermReq: the target ends the connection."""
        term = P.decode_header(hv[:span], receiver_is_host=True, hdgst=self.hdgst, ddgst=self.ddgst)
        if dlen:
            _recv_exact(self.sock, memoryview(bytearray(dlen)))
        pdu = term.pdu
        raise NvmeTransportError(f"target terminated the connection: C2HTermReq FES {pdu.fes:#x} FEI {pdu.fei:#x}")

    # ------------------------------------------------------------------------------------------------
    # R2T -> H2CData

    def _queue_r2t(self, cccid: int, ttag: int, r2to: int, r2tl: int) -> None:
        req = self._inflight.get(cccid)
        if req is None or req.c2h or req.buf is None or r2tl == 0 or r2to + r2tl > len(req.buf):
            raise NvmeProtocolError(f"R2T out of range or for unknown command: cccid {cccid} ttag {ttag} "
                                    f"offset {r2to} length {r2tl}")
        with self._r2t_cv:
            self._r2t_jobs.append((req, cccid, ttag, r2to, r2tl))
            self._r2t_cv.notify()

    def _send_loop(self) -> None:
        try:
            while True:
                with self._r2t_cv:
                    while not self._r2t_jobs and not self._closed:
                        self._r2t_cv.wait()
                    if self._closed:
                        return
                    job = self._r2t_jobs.popleft()
                self._send_h2c(*job)
        except OSError as e:
            self._fail(NvmeTransportError(f"send failed on queue {self.qid}: {e}"))

    def _send_h2c(self, req: _Request, cccid: int, ttag: int, r2to: int, r2tl: int) -> None:
        buf = req.buf
        assert buf is not None
        chunk = self.maxh2cdata
        off, end = r2to, r2to + r2tl
        h2c = self.packer.h2c_data
        with self._send_lock:
            while off < end:
                n = min(chunk, end - off)
                _send_all(self.sock, h2c(cccid, ttag, off, _payload(buf[off:off + n]), off + n == end))
                off += n

    # ------------------------------------------------------------------------------------------------
    # Failure, timeouts, shutdown

    def expire(self, now: float) -> bool:
        """Fail the queue if any command is past its deadline; returns True if it did."""
        with self._lock:
            late = [r for r in self._inflight.values() if r.deadline < now]
        if not late:
            return False
        r = late[0]
        self._fail(NvmeTimeoutError(f"{r.what} timed out on queue {self.qid}"), timeout=True)
        return True

    @property
    def alive(self) -> bool:
        return self._failure is None and not self._closed

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def _fail(self, error: BaseException, timeout: bool = False) -> None:
        with self._lock:
            first = self._failure is None
            if first:
                self._failure = error
            self._closed = True
            pending = list(self._inflight.values())
            self._inflight.clear()
        with self._r2t_cv:
            self._r2t_cv.notify_all()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        for req in pending:
            self._free_cids.put(req.cid)
            err = error if timeout else NvmeTransportError(f"{req.what}: {error}")
            self._resolve(req, 0, 0, 0, 0, err)
        if first and self._on_failure is not None:
            self._on_failure(self, error)

    def close(self) -> None:
        """Close the connection; in-flight commands fail."""
        if not self._closed:
            self._on_failure = None
            self._fail(NvmeTransportError(f"queue {self.qid} closed by the host"))
        try:
            self.sock.close()
        except OSError:
            pass
        for t in (self._reader, self._sender):
            if t is not None and t is not threading.current_thread():
                t.join(timeout=2)
