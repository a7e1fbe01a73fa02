"""I/O worker processes: the userspace target's data plane spread over several interpreters.

The target process keeps the listener, every admin and discovery queue, the controller table,
keep-alive and the management plane. When an I/O queue's Connect succeeds, the connection's socket
and the little state it negotiated (digests, PDU alignment, SQ size and head) go to a worker
process over a Unix SEQPACKET socket (SCM_RIGHTS); the worker maps the same namespace (the memfd
or file the target maps) and serves the queue's commands from then on. I/O queues then no longer
share one interpreter lock: one Python process serves ~20k commands/s.

The target keeps its own descriptor of every handed-off socket, so tearing a controller down
(keep-alive expiry, admin queue gone, ``drop_connections``) still shuts the queue down from here.

Messages are pickled dicts, one per packet. Target -> worker: ``setup`` (settings, namespace fd),
``conn`` (socket fd + state), ``faults`` and ``csts`` (mirrored state, acknowledged), ``counters``
(a request), ``reply`` (to ``take``), ``stop``. Worker -> target: ``gone`` (a queue ended, with its
counters), ``active`` (controllers with commands since the last report: traffic keeps them alive),
``error`` (an error log entry), ``take`` (consume a per-command fault), ``ack``, ``counters``.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import adp_emulator
import adp_wire

from .counters import IoCounters

if TYPE_CHECKING:  # pragma: no cover
    from .connection import Connection
    from .server import UserspaceTarget

log = logging.getLogger(__name__)

MAX_MESSAGE = 1 << 20
REPLY_TIMEOUT_S = 5.0


class Link:
    """One end of a target <-> worker SEQPACKET socket: whole messages, optional descriptors."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._waiting: dict[int, list[Any]] = {}
        self._waiting_lock = threading.Lock()

    def send(self, msg: dict[str, Any], fds: list[int] | tuple[int, ...] = ()) -> bool:
        """Send one message; False when the other end is gone."""
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            with self._send_lock:
                if fds:
                    socket.send_fds(self.sock, [data], list(fds))
                else:
                    self.sock.send(data)
            return True
        except OSError:
            return False

    def recv(self) -> tuple[dict[str, Any], list[int]] | None:
        """The next message and the descriptors it carried; None at EOF."""
        try:
            data, fds, _flags, _addr = socket.recv_fds(self.sock, MAX_MESSAGE, 4)
        except OSError:
            return None
        if not data:
            for fd in fds:
                os.close(fd)
            return None
        return pickle.loads(data), fds

    def request(self, msg: dict[str, Any], timeout: float = REPLY_TIMEOUT_S) -> Any:
        """Send ``msg`` with a fresh ``req`` id and wait for :meth:`answer` (None on timeout / EOF)."""
        req = next(self._ids)
        slot: list[Any] = [threading.Event(), None]
        with self._waiting_lock:
            self._waiting[req] = slot
        try:
            if not self.send({**msg, "req": req}):
                return None
            slot[0].wait(timeout)
            return slot[1]
        finally:
            with self._waiting_lock:
                self._waiting.pop(req, None)

    def answer(self, req: int, value: Any) -> None:
        """Deliver a reply to the :meth:`request` waiting on ``req`` (the receiving thread calls this)."""
        with self._waiting_lock:
            slot = self._waiting.get(req)
        if slot is not None:
            slot[1] = value
            slot[0].set()

    def fail_waiters(self) -> None:
        with self._waiting_lock:
            slots = list(self._waiting.values())
        for slot in slots:
            slot[0].set()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class _Worker:
    """The target's handle on one worker process."""

    def __init__(self, index: int, proc: subprocess.Popen, link: Link) -> None:
        self.index = index
        self.proc = proc
        self.link = link
        self.conns: dict[int, Connection] = {}
        self.alive = True
        self.reader: threading.Thread | None = None


def _child_env() -> dict[str, str]:
    """The worker imports this package and the wire codec from wherever this process found them."""
    env = dict(os.environ)
    roots = [os.path.dirname(os.path.dirname(os.path.abspath(m.__file__ or ""))) for m in (adp_emulator, adp_wire)]
    old = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*roots, *([old] if old else [])]))
    return env


class IoWorkers:
    """Spawns ``count`` worker processes and hands them connected I/O queues (least loaded first)."""

    def __init__(self, target: UserspaceTarget, count: int) -> None:
        self.target = target
        self.count = count
        self.workers: list[_Worker] = []
        self._lock = threading.Lock()  # worker table and connection maps
        self._state_lock = threading.Lock()  # mirrored state is sent in the order it was read
        self._ids = itertools.count(1)

    # ------------------------------------------------------------------------------------------------
    # Lifecycle

    def start(self) -> None:
        ns = self.target.namespaces[1]
        settings = asdict(self.target.settings)
        env = _child_env()
        try:
            for i in range(self.count):
                ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                try:
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "adp_emulator.target.worker", str(theirs.fileno())],
                        pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
                finally:
                    theirs.close()
                w = _Worker(i, proc, Link(ours))
                self.workers.append(w)
                if not w.link.send({"op": "setup", "settings": settings, "capacity": ns.capacity,
                                    "lba_size": ns.lba_size, "faults": self.target.faults.snapshot()}, [ns.fd]):
                    raise OSError(f"I/O worker {i} did not start (exit status {proc.poll()})")
                w.reader = threading.Thread(target=self._read_loop, args=(w,), name=f"adp-target-worker-{i}",
                                            daemon=True)
                w.reader.start()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop every worker; connections still open there are closed."""
        for w in self.workers:
            w.link.send({"op": "stop"})
        for w in self.workers:
            try:
                w.proc.wait(5)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
            try:
                w.link.sock.shutdown(socket.SHUT_RDWR)  # ends the reader, which closes what is left
            except OSError:
                pass
            if w.reader is not None:
                w.reader.join(timeout=5)
            w.link.close()
        self.workers.clear()

    # ------------------------------------------------------------------------------------------------
    # Used by the target

    def hand_off(self, conn: Connection) -> bool:
        """Give ``conn`` (a connected I/O queue) to the least loaded live worker; False if none took it."""
        ctrl = conn.ctrl
        if ctrl is None or conn.pending:
            return False
        with self._lock:
            live = [w for w in self.workers if w.alive]
            if not live:
                return False
            w = min(live, key=lambda x: len(x.conns))
            cid = next(self._ids)
            conn.worker = w
            conn.handoff_id = cid
            w.conns[cid] = conn
        msg = {"op": "conn", "id": cid, "cntlid": ctrl.cntlid, "csts": ctrl.csts, "state": conn.handoff_state()}
        if w.link.send(msg, [conn.sock.fileno()]):
            return True
        with self._lock:
            w.conns.pop(cid, None)
        conn.worker = None
        return False

    def push_faults(self, wait: bool) -> None:
        """Mirror the fault state in every worker; with ``wait``, return once each has applied it."""
        with self._state_lock:
            snap = self.target.faults.snapshot()
            self._broadcast({"op": "faults", **snap}, wait)

    def push_controller(self, cntlid: int, csts: int) -> None:
        """A controller's status changed (enable / disable / shutdown): its I/O queues see it next command."""
        with self._state_lock:
            self._broadcast({"op": "csts", "cntlid": cntlid, "csts": csts}, True)

    def sync_counters(self) -> None:
        """Fetch every handed-off queue's counters into its :class:`Connection`."""
        for w in list(self.workers):
            if not w.alive or not w.conns:
                continue
            got = w.link.request({"op": "counters"})
            if not got:
                continue
            with self._lock:
                for cid, st in got.items():
                    conn = w.conns.get(cid)
                    if conn is not None:
                        conn.counters = IoCounters.from_state(st)

    # ------------------------------------------------------------------------------------------------

    def _broadcast(self, msg: dict[str, Any], wait: bool) -> None:
        if not wait:
            for w in self.workers:
                if w.alive:
                    w.link.send(msg)
            return
        threads = [threading.Thread(target=w.link.request, args=(msg,)) for w in self.workers if w.alive]
        for th in threads:
            th.start()
        for th in threads:
            th.join()

    def _read_loop(self, w: _Worker) -> None:
        t = self.target
        while True:
            got = w.link.recv()
            if got is None:
                break
            msg, fds = got
            for fd in fds:
                os.close(fd)
            op = msg.get("op")
            try:
                if op == "gone":
                    with self._lock:
                        conn = w.conns.pop(msg["id"], None)
                    if conn is not None:
                        conn.counters = IoCounters.from_state(msg["counters"])
                        self._forget(conn)
                elif op == "active":
                    t.note_activity(msg["cntlids"])
                elif op == "error":  # the worker holds the command's CQE until this is answered
                    try:
                        t.log_controller_error(**msg["entry"])
                    finally:
                        w.link.send({"op": "reply", "req": msg["req"], "value": True})
                elif op == "take":
                    f = t.faults
                    value = f.take_failure() if msg["what"] == "failure" else f.take_read_corruption()
                    w.link.send({"op": "reply", "req": msg["req"], "value": value})
                elif op in ("ack", "counters"):
                    w.link.answer(msg["req"], msg.get("value"))
            except Exception:  # a bad message must not stop the reader
                log.exception("I/O worker %d: message %r", w.index, op)
        w.alive = False
        w.link.fail_waiters()
        with self._lock:
            orphans = list(w.conns.values())
            w.conns.clear()
        if orphans and not t.stopping:
            log.error("I/O worker %d exited (status %s): closing its %d queue(s)", w.index, w.proc.poll(),
                      len(orphans))
        for conn in orphans:
            self._forget(conn)

    def _forget(self, conn: Connection) -> None:
        conn.shutdown()
        conn.close()
        self.target._connection_gone(conn)

