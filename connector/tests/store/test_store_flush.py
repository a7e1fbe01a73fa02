"""Group commit: concurrent save batches share device flushes, and every caller is covered by a later flush."""

from __future__ import annotations

import threading
import time

import pytest
from memdevice import MemDevice
from store_testutil import fast_config

from adp_connector.store import KeyNamespace, PageStore
from adp_connector.store.flush import FlushGroup


def _run(n: int, group: bool) -> tuple[int, list[tuple[float, float]], list[tuple[float, float]]]:
    flushes: list[tuple[float, float]] = []

    def slow_flush(_timeout: float | None) -> None:
        t0 = time.monotonic()
        time.sleep(0.05)
        flushes.append((t0, time.monotonic()))

    g = FlushGroup(slow_flush)
    calls: list[tuple[float, float]] = []
    barrier = threading.Barrier(n)

    def caller() -> None:
        barrier.wait()
        t0 = time.monotonic()
        g.flush(5) if group else slow_flush(5)
        calls.append((t0, time.monotonic()))

    ts = [threading.Thread(target=caller) for _ in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return len(flushes), flushes, calls


def test_concurrent_callers_share_flushes_and_each_is_covered() -> None:
    issued, flushes, calls = _run(8, group=True)
    assert issued <= 2
    for c0, c1 in calls:  # durability: a flush that started after the call ended before the return
        assert any(f0 >= c0 and f1 <= c1 for f0, f1 in flushes)
    issued, _, _ = _run(8, group=False)  # the control: without the group every caller flushes
    assert issued == 8


def test_a_failed_flush_fails_its_waiters_and_the_next_one_is_fresh() -> None:
    fail = [True]

    def flush(_t: float | None) -> None:
        if fail[0]:
            fail[0] = False
            raise OSError("flush failed")

    g = FlushGroup(flush)
    with pytest.raises(OSError):
        g.flush()
    g.flush()  # a new flush, not the failed one's result
    assert g.issued == 2


def test_concurrent_save_batches_issue_fewer_flushes() -> None:
    ns = KeyNamespace("flush", "bf16", "L", 8)
    keys = ns.chain_tokens(list(range(8 * 16)))
    dev = MemDevice(16 << 20, 512)
    s = PageStore(dev, fast_config(io_threads=8))
    dev.delay_s = 0.005  # after the claims (their settle time is 10 ms)
    before = dev.commands["flush"]
    hs = [s.save_batch([k], [k * 100]) for k in keys]
    assert sum(h.ok_count(10) for h in hs) == len(keys)
    concurrent = dev.commands["flush"] - before
    before = dev.commands["flush"]
    more = ns.with_group(1).chain_tokens(list(range(8 * 16)))
    for k in more:  # the control: one batch at a time, two flushes each
        assert s.save_batch([k], [k * 100]).ok_count(10) == 1
    sequential = dev.commands["flush"] - before
    assert sequential >= 2 * len(more) and concurrent < sequential * 3 // 4, (concurrent, sequential)
    assert s.lookup(keys) == len(keys) and s.lookup(more) == len(more)
    s.close()
