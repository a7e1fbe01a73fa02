"""RestorePipeline.read_ahead: a request's pages read into staging before its blocks exist, then only copied.

A unit test of the pipeline layer alone: the store is a stand-in whose batches the test lands by hand, the KV cache
and the staging pool are the real ones, on the CPU. Every page's bytes say which page it is, so the checks compare
the KV cache's bytes with the pages that belong there.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from stub_store import StubStore  # noqa: E402

from adp_connector.pipeline import Cause, Counters, LoadJob, PagedKV, RestorePipeline, StagingPool  # noqa: E402
from adp_connector.pipeline import restore as R  # noqa: E402

PAGE = 64  # bytes per page: one layer, 64 int8 per block
BLOCKS = 32


def _key(page: int) -> bytes:
    return bytes([page]) * 8


def _setup(ahead_bytes: int, slabs: int = 4):
    kv = torch.zeros(BLOCKS, PAGE, dtype=torch.int8)
    pool = StagingPool(2 * PAGE, slabs * 2 * PAGE, pinned=False)  # slabs of 2 pages
    pipe = RestorePipeline(PagedKV({0: [("layer0", kv, PAGE)]}), pool, {0: PAGE}, Counters(), timeout_s=30.0)
    pipe.ahead_max_bytes = ahead_bytes
    return kv, pool, pipe


def _counters(pipe: RestorePipeline) -> dict[str, float]:
    pipe.counters.drain()
    return {k: v for k, v in pipe.counters.snapshot_totals().items() if k.startswith("read_ahead")}


def test_pages_read_ahead_are_only_copied_when_the_restore_starts() -> None:
    """Six pages read ahead land before the request has blocks; its restore then submits nothing and finishes at
    the next poll with every page in its block."""
    kv, _, pipe = _setup(ahead_bytes=1 << 20)
    store = StubStore(PAGE)
    pipe.read_ahead("A", [(0, _key(10 + i)) for i in range(6)], store)
    assert store.submitted_pages() == [[10, 11], [12, 13], [14, 15]]
    store.land_all()
    assert pipe.poll(store) == [] and int(kv.abs().sum()) == 0  # landed, but no block is known yet
    pipe.start(LoadJob("A", [(0, 20 + i, _key(10 + i)) for i in range(6)], [], t0=0.0), store)
    [job] = pipe.poll(store)
    assert not job.failed and len(store.batches) == 3  # no batch of its own: all were read ahead
    assert [int(kv[20 + i, 0]) for i in range(6)] == [10 + i for i in range(6)]
    assert bool((kv[20:26] == kv[20:26, :1]).all()) and int(kv[:20].abs().sum()) == int(kv[26:].abs().sum()) == 0
    assert _counters(pipe) == {"read_ahead_pages": 6, "read_ahead_used_pages": 6, "read_ahead_unused_pages": 0}


def test_a_restore_takes_the_pages_it_needs_and_reads_the_rest() -> None:
    """The restore needs pages 11-13 of the six read ahead, and page 30 that was not: 11 goes alone from its slab
    (10 stays out of the KV cache), the batch of 14-15 goes back unused, 30 gets a batch of its own."""
    kv, pool, pipe = _setup(ahead_bytes=1 << 20)
    store = StubStore(PAGE)
    pipe.read_ahead("A", [(0, _key(10 + i)) for i in range(6)], store)
    store.land_all()
    pipe.poll(store)
    pipe.start(LoadJob("A", [(0, 5, _key(11)), (0, 6, _key(12)), (0, 7, _key(13)), (0, 9, _key(30))], [], t0=0.0),
               store)
    assert store.submitted_pages()[3:] == [[30]]
    assert pipe.poll(store) == []  # page 30 is still in flight
    store.land_all()
    [job] = pipe.poll(store)
    assert not job.failed
    assert [int(kv[b, 0]) for b in (5, 6, 7, 9)] == [11, 12, 13, 30]
    assert int(kv.abs().sum()) == sum(64 * p for p in (11, 12, 13, 30))  # nothing else was written
    assert len(pool._free) == pool.allocated_bytes // pool.slab_bytes  # every slab came back
    assert _counters(pipe) == {"read_ahead_pages": 6, "read_ahead_used_pages": 3, "read_ahead_unused_pages": 3}


def test_a_read_ahead_takes_only_its_budget_and_slabs_no_restore_waits_for() -> None:
    """With a budget of two slabs the read-ahead submits two of its three batches; another request's restore,
    started later, gets the two other slabs and, as a slab frees, the next one before the read-ahead."""
    _, _, pipe = _setup(ahead_bytes=2 * 2 * PAGE)
    store = StubStore(PAGE)
    pipe.read_ahead("A", [(0, _key(10 + i)) for i in range(6)], store)
    assert store.submitted_pages() == [[10, 11], [12, 13]]
    pipe.start(LoadJob("B", [(0, 20 + i, _key(40 + i)) for i in range(6)], [], t0=0.0), store)
    assert store.submitted_pages()[2:] == [[40, 41], [42, 43]]
    store.batches[2].land()
    pipe.poll(store)
    assert store.submitted_pages()[4:] == [[44, 45]]  # B's third batch, not A's


def test_a_read_ahead_never_used_is_dropped_and_its_slabs_come_back(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(R, "_now", lambda: now[0])
    _, pool, pipe = _setup(ahead_bytes=1 << 20)
    pipe.ahead_ttl_s = 5.0
    store = StubStore(PAGE)
    pipe.read_ahead("A", [(0, _key(10 + i)) for i in range(4)], store)
    store.land_all()
    now[0] = 104.0
    pipe.poll(store)
    assert not pool._free  # held for its restore
    now[0] = 106.0
    assert pipe.poll(store) == [] and pipe.jobs == []
    assert len(pool._free) == 2
    assert _counters(pipe) == {"read_ahead_pages": 4, "read_ahead_expired_pages": 4}
    pipe.read_ahead("B", [(0, _key(20))], store)
    pipe.drop_read_ahead("B")  # its request finished without a restore
    assert pipe.jobs == [] and _counters(pipe)["read_ahead_unused_pages"] == 1


def test_without_a_budget_nothing_is_read_ahead() -> None:
    """Control: ahead_max_bytes 0 (read-ahead off): no batch until the restore starts, which reads every page."""
    kv, _, pipe = _setup(ahead_bytes=0)
    store = StubStore(PAGE)
    pipe.read_ahead("A", [(0, _key(10 + i)) for i in range(6)], store)
    assert store.batches == [] and pipe.jobs == []
    pipe.start(LoadJob("A", [(0, 20 + i, _key(10 + i)) for i in range(6)], [], t0=0.0), store)
    assert len(store.batches) == 3
    store.land_all()
    [job] = pipe.poll(store)
    assert not job.failed and [int(kv[20 + i, 0]) for i in range(6)] == [10 + i for i in range(6)]


def test_a_page_read_ahead_and_missing_fails_the_restore_only_if_it_needs_it() -> None:
    """Page 11 was not on the card when read ahead: a restore that needs it fails with the cause (the request
    recomputes); one that does not (page 10 of the same batch only) succeeds."""
    store = StubStore(PAGE, missing={_key(11)})
    _, _, pipe = _setup(ahead_bytes=1 << 20)
    pipe.read_ahead("A", [(0, _key(10)), (0, _key(11))], store)
    store.land_all()
    pipe.start(LoadJob("A", [(0, 3, _key(10)), (0, 4, _key(11))], [], t0=0.0), store)
    [job] = pipe.poll(store)
    assert job.cause is Cause.NOT_INDEXED and "1/2 page(s) not restored" in job.failed
    kv2, _, pipe2 = _setup(ahead_bytes=1 << 20)
    pipe2.read_ahead("B", [(0, _key(10)), (0, _key(11))], store)
    store.land_all()
    pipe2.start(LoadJob("B", [(0, 3, _key(10))], [], t0=0.0), store)
    [job2] = pipe2.poll(store)
    assert not job2.failed and int(kv2[3, 0]) == 10 and int(kv2.abs().sum()) == 64 * 10


def test_a_page_wanted_in_two_blocks_fills_both() -> None:
    """Should a restore list one page for two blocks, the read-ahead's copy fills one and a read of its own the
    other: no block of the restore is left unfilled."""
    kv, _, pipe = _setup(ahead_bytes=1 << 20)
    store = StubStore(PAGE)
    pipe.read_ahead("A", [(0, _key(10)), (0, _key(11))], store)
    store.land_all()
    pipe.start(LoadJob("A", [(0, 3, _key(10)), (0, 4, _key(11)), (0, 5, _key(10))], [], t0=0.0), store)
    assert store.submitted_pages()[1:] == [[10]]
    store.land_all()
    [job] = pipe.poll(store)
    assert not job.failed and [int(kv[b, 0]) for b in (3, 4, 5)] == [10, 11, 10]
