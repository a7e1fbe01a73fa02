"""Userspace target with I/O worker processes: hand-off, what stays with the target, failures.

test_target_io.py runs its whole I/O suite against both data planes; this module covers what only
the worker processes have: where queues go, keep-alive by traffic, controller status, the error
log, a worker dying, and shutdown.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from target_client import open_admin, open_io, running_target, w

from adp_emulator.target import TargetSettings
from adp_wire.constants import IoOpcode, Property
from adp_wire.sqe import get_log_page_cmd, property_set_cmd, rw_cmd
from adp_wire.structs import ErrorLogEntry

R, W = IoOpcode.READ, IoOpcode.WRITE


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _until(pred, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _worker_pids(t) -> list[int]:
    return [w.proc.pid for w in t._workers.workers]


def _served_by(t, cntlid: int, qids: tuple[int, ...]) -> dict[int, int]:
    """qid -> worker index for a controller's I/O queues ``qids``.

    A queue moves to its worker just after its Connect response, so this waits for the hand-offs.
    """
    def handed_off() -> dict[int, int]:
        queues = list(t._controllers[cntlid].queues.items())
        return {qid: q.worker.index for qid, q in queues if qid in qids and q.worker is not None}

    assert _until(lambda: len(handed_off()) == len(qids)), f"queues {qids} not all handed off"
    return handed_off()


def test_queues_spread_over_workers_and_share_the_namespace() -> None:
    with running_target(io_workers=2) as t:
        a = open_admin(t.address)
        queues = [open_io(t.address, a.cntlid, qid) for qid in (1, 2, 3, 4)]
        assert sorted(_served_by(t, a.cntlid, (1, 2, 3, 4)).values()) == [0, 0, 1, 1]  # least loaded first
        data = bytes(range(256)) * 32
        assert queues[0].cmd(rw_cmd(W, 1, 8, 2, 8192), data)[0].status.ok
        for q in queues[1:]:  # written through one process, read through the others
            assert q.cmd(rw_cmd(R, 1, 8, 2, 8192))[1] == data
        assert bytes(t.namespaces[1].view[8 * 4096:10 * 4096]) == data  # and the target maps the same bytes
        qs = [q for q in t.counters()["queues"] if q["qid"] > 0]
        assert sorted(q["reads"] for q in qs) == [0, 1, 1, 1] and sum(q["writes"] for q in qs) == 1
        for q in queues:
            q.close()
        a.close()
        # closed queues hand their counters back to the namespace totals
        assert _until(lambda: not t._workers.workers[0].conns and not t._workers.workers[1].conns)
        assert t.namespace_counters().reads == 3


def test_io_traffic_counts_as_keep_alive() -> None:
    with running_target(io_workers=1) as t:
        a = open_admin(t.address, kato_ms=1000)
        io = open_io(t.address, a.cntlid)
        with a, io:
            t0 = time.monotonic()
            while time.monotonic() - t0 < 2.5:  # no Keep Alive on the admin queue, only reads in the worker
                assert io.cmd(rw_cmd(R, 1, 0, 1, 4096))[0].status.ok
                time.sleep(0.2)
            t1 = time.monotonic()
            assert a.closed_by_peer(timeout=4) and io.closed_by_peer(timeout=2)  # silence: expires
            assert 0.5 < time.monotonic() - t1 < 3.5


def test_controller_status_and_error_log_reach_workers() -> None:
    with running_target(io_workers=1) as t:
        a = open_admin(t.address)
        io = open_io(t.address, a.cntlid)
        with a, io:
            assert io.cmd(rw_cmd(R, 1, 1 << 40, 1, 4096))[0].status.word != 0  # LBA out of range
            c, page = a.cmd(get_log_page_cmd(0x01, 64))
            e = ErrorLogEntry.decode(page)
            assert c.status.ok and e.sqid == 1 and e.opcode == int(R)
            assert a.cmd(property_set_cmd(Property.CC, 0))[0].status.ok  # disable the controller
            status = io.cmd(rw_cmd(R, 1, 0, 1, 4096))[0].status
            assert status.word == w("COMMAND_SEQUENCE_ERROR")  # as nvmet for a disabled controller


def test_dead_worker_closes_its_queues_and_the_target_goes_on() -> None:
    with running_target(io_workers=2) as t:
        a = open_admin(t.address)
        q1, q2 = open_io(t.address, a.cntlid, 1), open_io(t.address, a.cntlid, 2)
        victim = t._workers.workers[_served_by(t, a.cntlid, (1,))[1]]
        os.kill(victim.proc.pid, signal.SIGKILL)
        assert q1.closed_by_peer(timeout=5)
        assert q2.cmd(rw_cmd(R, 1, 0, 1, 4096))[0].status.ok
        assert _until(lambda: 1 not in t._controllers[a.cntlid].queues)
        q3 = open_io(t.address, a.cntlid, 1)  # a reconnect goes to the live worker
        assert q3.cmd(rw_cmd(R, 1, 0, 1, 4096))[0].status.ok
        assert _served_by(t, a.cntlid, (1,))[1] != victim.index
        for q in (q2, q3, a):
            q.close()


def test_stop_ends_workers() -> None:
    with running_target(io_workers=2) as t:
        pids = _worker_pids(t)
        a = open_admin(t.address)
        io = open_io(t.address, a.cntlid)
    assert _until(lambda: not any(_alive(p) for p in pids))
    assert io.closed_by_peer(timeout=2)
    a.close()


def test_io_workers_setting_is_checked() -> None:
    with pytest.raises(ValueError, match="io_workers"):
        TargetSettings(io_workers=-1)
