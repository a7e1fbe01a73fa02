"""An I/O worker process of the userspace target (``python -m adp_emulator.target.worker FD``).

Serves the I/O queues its target hands over (see :mod:`.workers`): the same :class:`Connection`
code, resumed after Connect, over the namespace mapped from the target's descriptor. What the
target owns (controller state, fault counters, error log, keep-alive) is mirrored or asked for
over the link. Exits when the target says so or when the link closes (the target died).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from .connection import Connection
from .namespace import Namespace
from .settings import TargetSettings
from .workers import Link

log = logging.getLogger(__name__)

ACTIVITY_PERIOD_S = 0.1


class WorkerController:
    """A worker's view of one controller: its status, last command time and error log sink."""

    def __init__(self, link: Link, cntlid: int, csts: int) -> None:
        self.link = link
        self.cntlid = cntlid
        self.csts = csts
        self.last_activity = 0.0
        self.reported = 0.0
        self.lock = threading.Lock()

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    def log_error(self, sqid: int, cid: int, status: int, opcode: int, nsid: int = 0, lba: int = 0) -> None:
        """Add an entry to the target's error log; returns once it is there (before the command's CQE goes
        out), so a host that reads the log after seeing the error finds the entry."""
        self.link.request({"op": "error", "entry": {"cntlid": self.cntlid, "sqid": sqid, "cid": cid,
                                                    "status": status, "opcode": opcode, "nsid": nsid, "lba": lba}})


class WorkerFaults:
    """The target's fault state as last pushed; per-command faults are taken from the target itself."""

    def __init__(self, link: Link, state: dict[str, Any]) -> None:
        self.link = link
        self.armed = False
        self.delay_s = 0.0
        self.device_full = False
        self.apply(state)

    def apply(self, state: dict[str, Any]) -> None:
        self.delay_s = state["delay_s"]
        self.device_full = state["device_full"]
        self.armed = state["armed"]

    def take_failure(self) -> int:
        return self.link.request({"op": "take", "what": "failure"}) or 0

    def take_read_corruption(self) -> bool:
        return bool(self.link.request({"op": "take", "what": "read_corruption"}))


class WorkerTarget:
    """What a :class:`Connection` needs of its target (:class:`~.connection.ConnectionTarget`), inside a
    worker process. Workers serve only I/O queues that are already connected, so the association
    methods (Connect, Property Set) are never reached here and refuse."""

    stopping = False

    def __init__(self, link: Link, settings: TargetSettings, ns: Namespace, faults: WorkerFaults) -> None:
        self.link = link
        self.settings = settings
        self.namespaces = {1: ns}
        self.faults = faults
        self.controllers: dict[int, WorkerController] = {}
        self.conns: dict[int, Connection] = {}
        self.lock = threading.Lock()

    def serves_io_elsewhere(self) -> bool:
        return False

    def host_allowed(self, hostnqn: str) -> bool:
        return False

    def create_controller(self, hostnqn: str, hostid: bytes, discovery: bool, kato_ms: int) -> None:
        return None

    def find_controller(self, cntlid: int, discovery: bool, hostnqn: str) -> None:
        return None

    def controller_changed(self, ctrl: object) -> None:
        pass

    def hand_off(self, conn: Connection) -> bool:
        return False

    def adopt(self, cid: int, sock: socket.socket, cntlid: int, csts: int, state: dict[str, Any]) -> None:
        """Serve a handed-over queue in a new thread."""
        with self.lock:
            ctrl = self.controllers.get(cntlid)
            if ctrl is None:
                ctrl = self.controllers[cntlid] = WorkerController(self.link, cntlid, csts)
            conn = Connection(self, sock, tuple(state["peer"]))  # type: ignore[arg-type]
            conn.adopt(state, ctrl)  # type: ignore[arg-type]
            conn.handoff_id = cid
            self.conns[cid] = conn
        th = threading.Thread(target=conn.run, kwargs={"handshake": False}, name=f"adp-worker-conn-{cid}",
                              daemon=True)
        conn.thread = th
        th.start()

    def _connection_gone(self, conn: Connection) -> None:
        cid = conn.handoff_id
        with self.lock:
            self.conns.pop(cid, None)
            cntlid = conn.ctrl.cntlid if conn.ctrl is not None else None
            if cntlid is not None and not any(c.ctrl is conn.ctrl for c in self.conns.values()):
                self.controllers.pop(cntlid, None)
        self.link.send({"op": "gone", "id": cid, "counters": conn.counters.state()})

    def set_csts(self, cntlid: int, csts: int) -> None:
        with self.lock:
            ctrl = self.controllers.get(cntlid)
        if ctrl is not None:
            ctrl.csts = csts

    def counters(self) -> dict[int, tuple]:
        with self.lock:
            conns = list(self.conns.items())
        return {cid: c.counters.state() for cid, c in conns}

    def report_activity(self, stop: threading.Event) -> None:
        """Tell the target which controllers saw commands (traffic counts as keep-alive, like nvmet)."""
        while not stop.wait(ACTIVITY_PERIOD_S):
            with self.lock:
                ctrls = list(self.controllers.values())
            busy = []
            for c in ctrls:
                if c.last_activity > c.reported:
                    c.reported = c.last_activity
                    busy.append(c.cntlid)
            if busy:
                self.link.send({"op": "active", "cntlids": busy})

    def close_all(self) -> None:
        with self.lock:
            conns = list(self.conns.values())
        for c in conns:
            c.shutdown()
        for c in conns:
            if c.thread is not None:
                c.thread.join(timeout=2)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the target process decides when its workers stop
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s adp-worker %(name)s: %(message)s")
    link = Link(socket.socket(fileno=int(argv[0])))
    got = link.recv()
    if got is None:
        return 1
    setup, fds = got
    settings = TargetSettings(**setup["settings"])
    ns = Namespace(1, setup["capacity"], setup["lba_size"], fd=fds[0])
    os.close(fds[0])
    target = WorkerTarget(link, settings, ns, WorkerFaults(link, setup["faults"]))
    stop = threading.Event()
    threading.Thread(target=target.report_activity, args=(stop,), name="adp-worker-activity", daemon=True).start()
    while True:
        got = link.recv()
        if got is None:
            break
        msg, fds = got
        op = msg["op"]
        if op == "conn":
            target.adopt(msg["id"], socket.socket(fileno=fds[0]), msg["cntlid"], msg["csts"], msg["state"])
        elif op == "reply":
            link.answer(msg["req"], msg["value"])
        elif op in ("faults", "csts"):
            if op == "faults":
                target.faults.apply(msg)
            else:
                target.set_csts(msg["cntlid"], msg["csts"])
            if "req" in msg:
                link.send({"op": "ack", "req": msg["req"]})
        elif op == "counters":
            link.send({"op": "counters", "req": msg["req"], "value": target.counters()})
        elif op == "stop":
            break
        else:
            log.warning("unknown message %r", op)
    stop.set()
    link.fail_waiters()
    target.close_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
