"""BatchPool: loads queued behind saves run first; each kind keeps its order; shutdown drains the queue."""

from __future__ import annotations

import threading

import pytest

from adp_connector.store.batches import URGENT_RUN, BatchPool


def _blocked_pool() -> tuple[BatchPool, threading.Event, list[str]]:
    """One worker, held by a first batch until the returned event is set."""
    pool = BatchPool(1, name="test-batches")
    gate, started = threading.Event(), threading.Event()
    ran: list[str] = []

    def hold() -> None:
        started.set()
        gate.wait(10)

    pool.submit(hold)
    assert started.wait(10)
    return pool, gate, ran


def test_a_load_queued_behind_saves_runs_before_them() -> None:
    pool, gate, ran = _blocked_pool()
    for name, urgent in (("save1", False), ("save2", False), ("load1", True), ("save3", False), ("load2", True)):
        pool.submit(lambda n=name: ran.append(n), urgent=urgent)
    assert pool.waiting() == (2, 3)
    gate.set()
    pool.shutdown(wait=True)
    assert ran == ["load1", "load2", "save1", "save2", "save3"]


def test_saves_get_a_turn_after_a_run_of_loads() -> None:
    """GPU run 9: loads kept coming, the saves behind them held every staging slab, and new saves were dropped.
    After URGENT_RUN loads in a row a waiting save runs; the old rule (every load first) fails this."""
    pool, gate, ran = _blocked_pool()
    loads = [f"load{i}" for i in range(2 * URGENT_RUN + 1)]
    for name in ("save1", "save2", *loads):
        pool.submit(lambda n=name: ran.append(n), urgent=name.startswith("load"))
    gate.set()
    pool.shutdown(wait=True)
    assert ran == [*loads[:URGENT_RUN], "save1", *loads[URGENT_RUN:2 * URGENT_RUN], "save2", loads[-1]]


def test_without_urgency_the_order_is_first_come() -> None:
    """Control: the same submissions, none urgent, run in submission order (what a plain FIFO pool does)."""
    pool, gate, ran = _blocked_pool()
    for name in ("save1", "save2", "load1", "save3", "load2"):
        pool.submit(lambda n=name: ran.append(n))
    gate.set()
    pool.shutdown(wait=True)
    assert ran == ["save1", "save2", "load1", "save3", "load2"]


def test_shutdown_runs_what_was_queued_and_refuses_more() -> None:
    pool, gate, ran = _blocked_pool()
    pool.submit(lambda: ran.append("queued"))
    gate.set()
    pool.shutdown(wait=True)
    assert ran == ["queued"]
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(lambda: None)


def test_several_workers_run_batches_at_once() -> None:
    pool = BatchPool(2, name="test-batches")
    both = threading.Barrier(2, timeout=10)
    done: list[int] = []
    for i in range(2):
        pool.submit(lambda i=i: (both.wait(), done.append(i)))
    pool.shutdown(wait=True)
    assert sorted(done) == [0, 1]
