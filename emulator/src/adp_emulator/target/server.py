"""The userspace NVMe/TCP target: listener, controller table, housekeeping, counters, faults."""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import threading
import time
from typing import Any

from adp_wire.constants import CSTS_CFS

from . import controller as C
from .backing import NoRoom
from .connection import Connection
from .controller import Controller
from .counters import IoCounters
from .faults import Faults
from .namespace import Namespace
from .settings import TargetSettings
from .workers import IoWorkers

log = logging.getLogger(__name__)

CNTLID_MIN, CNTLID_MAX = 1, 0xFFEF  # nvmet's default cntlid_min..cntlid_max
HOUSEKEEPING_PERIOD_S = 0.05
#: accept() errors that mean "out of a resource for now" (descriptors, buffers, memory): the listener
#: backs off and tries again instead of giving up.
TRANSIENT_ACCEPT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED,
                                     errno.EPROTO, errno.EPERM, errno.EINTR})
ACCEPT_BACKOFF_S = (0.005, 0.5)  # first and longest sleep after a failed accept


class BackingError(OSError):
    """The namespace's backing cannot be opened or mapped (a bad ``backing_path``), or cannot hold the capacity."""


class BackingTooSmall(BackingError):
    """The namespace's backing cannot hold the capacity (target/backing.py)."""


class ListenerCounters:
    """What the acceptor and the housekeeping thread count (``counters()["listener"]``)."""

    __slots__ = ("accept_errors", "handshake_timeouts", "refused_connections")

    def __init__(self) -> None:
        self.accept_errors = 0
        self.refused_connections = 0
        self.handshake_timeouts = 0

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__slots__}


class UserspaceTarget:
    """An NVMe/TCP target serving one NVM subsystem (namespace 1) plus the discovery subsystem.

    Threads: one acceptor, one per TCP connection (= queue), one housekeeping thread that expires
    keep-alive timers. Shared state (the controller table) is guarded by ``self._lock``. With
    ``settings.io_workers`` > 0, connected I/O queues are served by that many worker processes
    (:mod:`.workers`); everything else stays here.
    """

    def __init__(self, settings: TargetSettings | None = None) -> None:
        self.settings = settings or TargetSettings()
        self.settings.validate()
        self.namespaces: dict[int, Namespace] = {}
        self.faults = Faults(self.drop_connections, self._corrupt)
        self.started_at = time.monotonic()
        self._lock = threading.Lock()
        self._controllers: dict[int, Controller] = {}
        self._next_cntlid = CNTLID_MIN
        self._conns: set[Connection] = set()
        self._retired: dict[int, IoCounters] = {}
        self._listener: socket.socket | None = None
        self._address: tuple[str, int] | None = None
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._workers: IoWorkers | None = None
        self.listener_counters = ListenerCounters()
        self._accepted_at: dict[Connection, float] = {}

    # ------------------------------------------------------------------------------------------------
    # Lifecycle

    def start(self) -> UserspaceTarget:
        """Open the backing store, bind and listen; serving runs in background threads."""
        if self._listener is not None:
            return self
        s = self.settings
        try:
            self.namespaces[1] = Namespace(1, s.capacity_bytes, s.lba_size, s.backing_path,
                                           overcommit=s.backing_overcommit)
        except (OSError, ValueError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            kind = BackingTooSmall if isinstance(e, NoRoom) else BackingError
            raise kind(f"cannot use {s.backing_path or 'RAM'} as the namespace backing: {why}") from None
        self._retired[1] = IoCounters()
        family = socket.AF_INET6 if ":" in s.host else socket.AF_INET
        lst = socket.socket(family, socket.SOCK_STREAM)
        try:
            lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            lst.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            lst.bind((s.host, s.port))
            lst.listen(128)
            lst.settimeout(0.25)
        except OSError:
            lst.close()
            self.namespaces.pop(1).close()
            raise
        if s.io_workers:
            workers = IoWorkers(self, s.io_workers)
            try:
                workers.start()
            except BaseException:
                lst.close()
                self.namespaces.pop(1).close()
                raise
            self._workers = workers
            self.faults.listener = workers.push_faults
        self._listener = lst
        self._address = (s.host, lst.getsockname()[1])
        self.started_at = time.monotonic()
        self._stopping.clear()
        self._stopped.clear()
        for name, fn in (("adp-target-accept", self._accept_loop), ("adp-target-housekeeping", self._housekeeping)):
            th = threading.Thread(target=fn, name=name, daemon=True)
            th.start()
            self._threads.append(th)
        return self

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) actually listened on."""
        if self._address is None:
            raise RuntimeError("target not started")
        return self._address

    def stop(self) -> None:
        """Close the listener and every connection, flush and close the backing store."""
        if self._listener is None:
            return
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self.drop_connections()
        for th in self._threads:
            th.join(timeout=5)
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            if c.thread is not None:
                c.thread.join(timeout=5)
        self._threads.clear()
        if self._workers is not None:
            self.faults.listener = None
            self._workers.stop()
            self._workers = None
        for ns in self.namespaces.values():
            ns.close()
        self._listener = None
        self._stopped.set()

    def serve_forever(self) -> None:
        """Start (if needed) and block until :meth:`stop` is called from another thread / a signal."""
        self.start()
        self._stopped.wait()

    def __enter__(self) -> UserspaceTarget:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------------------
    # Threads

    def _accept_loop(self) -> None:
        """Accept until stopped. Running out of descriptors, buffers or threads is survived: the error is
        counted, the loop sleeps (doubling up to 0.5 s) and tries again. Past ``max_connections`` a new
        connection is closed at once."""
        lst = self._listener
        assert lst is not None
        backoff = 0.0
        while not self._stopping.is_set():
            try:
                sock, peer = lst.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._stopping.is_set() or e.errno not in TRANSIENT_ACCEPT_ERRNOS:
                    break
                backoff = self._accept_failed(f"accept: {e.strerror or e}", backoff)
                continue
            backoff = 0.0
            with self._lock:
                full = len(self._conns) >= self.settings.max_connections
            if full:
                self.listener_counters.refused_connections += 1
                log.warning("connection from %s refused: %d connections open (max_connections)", peer,
                            self.settings.max_connections)
                sock.close()
                continue
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn = Connection(self, sock, peer)
            except OSError:
                sock.close()
                continue
            th = threading.Thread(target=conn.run, name=f"adp-target-conn-{peer[1]}", daemon=True)
            conn.thread = th
            with self._lock:
                if self._stopping.is_set():
                    sock.close()
                    break
                self._conns.add(conn)
                self._accepted_at[conn] = time.monotonic()
            try:
                th.start()
            except RuntimeError as e:  # "can't start new thread"
                with self._lock:
                    self._conns.discard(conn)
                    self._accepted_at.pop(conn, None)
                sock.close()
                backoff = self._accept_failed(f"cannot start a connection thread: {e}", backoff)

    def _accept_failed(self, why: str, backoff: float) -> float:
        """Count one failed accept, sleep, and return the next back-off."""
        self.listener_counters.accept_errors += 1
        backoff = min(max(backoff * 2, ACCEPT_BACKOFF_S[0]), ACCEPT_BACKOFF_S[1])
        log.warning("%s; retrying in %.3f s", why, backoff)
        self._stopping.wait(backoff)
        return backoff

    def _housekeeping(self) -> None:
        while not self._stopping.wait(HOUSEKEEPING_PERIOD_S):
            now = time.monotonic()
            self._expire_handshakes(now)
            with self._lock:
                ctrls = list(self._controllers.values())
            for ctrl in ctrls:
                if ctrl.kato_ms and now - ctrl.last_activity > ctrl.kato_ms / 1000:
                    log.info("controller %d: keep-alive timeout (%d ms)", ctrl.cntlid, ctrl.kato_ms)
                    ctrl.csts |= CSTS_CFS  # nvmet_ctrl_fatal_error
                    self._teardown(ctrl)

    def _expire_handshakes(self, now: float) -> None:
        """Close connections that have not sent ICReq and a Fabrics Connect within the deadline."""
        limit = self.settings.handshake_timeout_s
        if not limit:
            return
        with self._lock:
            for conn in [c for c in self._accepted_at if c.qid >= 0]:  # connected: off the watch list
                del self._accepted_at[conn]
            late = [c for c, t in self._accepted_at.items() if now - t > limit]
            for conn in late:
                del self._accepted_at[conn]
        for conn in late:
            self.listener_counters.handshake_timeouts += 1
            log.info("connection %s: no ICReq/Connect within %.1f s; closed", conn.peer, limit)
            conn.shutdown()

    # ------------------------------------------------------------------------------------------------
    # I/O worker processes (used by connections and by the workers' link)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def serves_io_elsewhere(self) -> bool:
        """True when connected I/O queues go to worker processes."""
        return self._workers is not None

    def hand_off(self, conn: Connection) -> bool:
        """Pass a freshly connected I/O queue to a worker; False: serve it here."""
        return self._workers is not None and not self.stopping and self._workers.hand_off(conn)

    def note_activity(self, cntlids: list[int]) -> None:
        """Commands ran on these controllers' queues in a worker (resets their keep-alive timers)."""
        now = time.monotonic()
        with self._lock:
            ctrls = [self._controllers.get(c) for c in cntlids]
        for ctrl in ctrls:
            if ctrl is not None:
                ctrl.last_activity = now

    def log_controller_error(self, cntlid: int, **entry: int) -> None:
        with self._lock:
            ctrl = self._controllers.get(cntlid)
        if ctrl is not None:
            ctrl.log_error(**entry)

    def controller_changed(self, ctrl: Controller) -> None:
        """CC was written: workers serving this controller's I/O queues learn its new status."""
        if self._workers is not None and any(q.worker is not None for q in list(ctrl.queues.values())):
            self._workers.push_controller(ctrl.cntlid, ctrl.csts)

    # ------------------------------------------------------------------------------------------------
    # Controller table (used by connections)

    def host_allowed(self, hostnqn: str) -> bool:
        s = self.settings
        return s.allow_any or hostnqn in s.allowed_hosts

    def create_controller(self, hostnqn: str, hostid: bytes, discovery: bool, kato_ms: int) -> Controller | None:
        with self._lock:
            for _ in range(CNTLID_MAX - CNTLID_MIN + 1):
                cntlid = self._next_cntlid
                self._next_cntlid = cntlid + 1 if cntlid < CNTLID_MAX else CNTLID_MIN
                if cntlid not in self._controllers:
                    ctrl = Controller(self, cntlid, hostnqn, hostid, discovery, kato_ms)
                    self._controllers[cntlid] = ctrl
                    return ctrl
        return None

    def find_controller(self, cntlid: int, discovery: bool, hostnqn: str) -> Controller | None:
        with self._lock:
            ctrl = self._controllers.get(cntlid)
        if ctrl is None or ctrl.dead or ctrl.discovery != discovery or ctrl.hostnqn != hostnqn:
            return None
        return ctrl

    def _teardown(self, ctrl: Controller) -> None:
        """Delete a controller: every queue's socket is shut down (nvmet_ctrl_free)."""
        with self._lock:
            self._controllers.pop(ctrl.cntlid, None)
        with ctrl.lock:
            ctrl.dead = True
            queues = list(ctrl.queues.values())
            ctrl.aers.clear()
        for conn in queues:
            conn.shutdown()

    def _connection_gone(self, conn: Connection) -> None:
        with self._lock:
            self._conns.discard(conn)
            self._accepted_at.pop(conn, None)
            if conn.qid > 0:
                self._retired.setdefault(1, IoCounters()).add(conn.counters)
        ctrl = conn.ctrl
        if ctrl is None:
            return
        if conn.qid == 0:
            self._teardown(ctrl)
        else:
            with ctrl.lock:
                if ctrl.queues.get(conn.qid) is conn:
                    del ctrl.queues[conn.qid]

    # ------------------------------------------------------------------------------------------------
    # Hooks

    def drop_connections(self) -> int:
        """Shut down every open connection; returns how many."""
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            c.shutdown()
        return len(conns)

    def _corrupt(self, nsid: int, offset: int, length: int, xor: int) -> None:
        ns = self.namespaces[nsid]
        if offset < 0 or length < 0 or offset + length > ns.capacity:
            raise ValueError("corruption range outside the namespace")
        v = ns.view
        for i in range(offset, offset + length):
            v[i] ^= xor

    def notify_namespace_changed(self, nsid: int = 1) -> None:
        """Raise the Namespace Attribute Changed notice (AEN DW0 0x00040002) on every I/O controller."""
        with self._lock:
            ctrls = [c for c in self._controllers.values() if not c.discovery]
        for c in ctrls:
            c.note_namespace_changed(nsid)
            c.post_event(0x00040002, C.OAES_NS_ATTR)

    def namespace_counters(self, nsid: int = 1) -> IoCounters:
        """Totals for a namespace: closed queues plus live I/O queues."""
        if self._workers is not None:
            self._workers.sync_counters()
        return self._namespace_totals(nsid)

    def _namespace_totals(self, nsid: int) -> IoCounters:
        total = IoCounters()
        with self._lock:
            total.add(self._retired.get(nsid, IoCounters()))
            conns = [c for c in self._conns if c.qid > 0]
        for c in conns:
            total.add(c.counters)
        return total

    def counters(self) -> dict[str, Any]:
        """JSON-able snapshot: per-namespace totals, per-queue counters, controllers."""
        if self._workers is not None:
            self._workers.sync_counters()
        with self._lock:
            conns = [c for c in self._conns if c.qid >= 0 and c.ctrl is not None]
            ctrls = list(self._controllers.values())
        queues = []
        for c in conns:
            d = c.counters.as_dict()
            d.update(cntlid=c.ctrl.cntlid, qid=c.qid, peer=f"{c.peer[0]}:{c.peer[1]}")  # type: ignore[union-attr]
            queues.append(d)
        return {
            "namespaces": {str(n): self._namespace_totals(n).as_dict() for n in self.namespaces},
            "queues": sorted(queues, key=lambda d: (d["cntlid"], d["qid"])),
            "controllers": [C.counters_snapshot(c) for c in ctrls],
            "connections": len(self._conns),
            "listener": self.listener_counters.as_dict(),
        }
