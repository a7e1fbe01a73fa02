"""StoreGroup with several writer helpers (``save_processes``): saves split by key over writers sharing one card
(format v2), over a real userspace NVMe/TCP target, pages in a shared arena."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
from store_testutil import PROCESS_NQN, all_overlap, open_spans, timed_connect

from adp_connector.nvmeof.host import Controller, HostConfig
from adp_connector.store import PageStatus, PageStore, StoreConfig
from adp_connector.store.process import SharedArena, StoreGroup, StoreProcess, member_writer_id, save_owner

target_mod = pytest.importorskip("adp_emulator.target", reason="the userspace target package is not installed")

NQN = PROCESS_NQN  # the subsystem of the target fixture (conftest.py)
PAGE = 64 << 10
N = 8  # pages saved per test: keys with first bytes 0..7, so W=2 owns 4 each


@pytest.fixture
def arena():
    a = SharedArena(2 * N * PAGE)
    yield a
    a.close()


def _host(t) -> HostConfig:
    host, port = t.address
    return HostConfig(traddr=host, trsvcid=port, subnqn=NQN, io_queues=2, queue_depth=32, reconnect_delay=0.1)


def _cfg() -> StoreConfig:
    # no refresh on a miss: a helper that has not indexed a page must hand it to the key's writer
    return StoreConfig(writer=True, writer_id=b"g" * 16, partitions=4, avg_page_bytes=PAGE, io_threads=2,
                       miss_refresh_gap_s=-1.0)


def _keys() -> list[bytes]:
    return [bytes([i]) + os.urandom(31) for i in range(N)]


def _fill(arena: SharedArena) -> tuple[memoryview, list[bytes]]:
    view = memoryview(arena.map)
    data = [bytes([i]) * 64 + os.urandom(PAGE - 64) for i in range(N)]
    for i, d in enumerate(data):
        view[i * PAGE:(i + 1) * PAGE] = d
    return view, data


def _src(view: memoryview) -> list[memoryview]:
    return [view[i * PAGE:(i + 1) * PAGE] for i in range(N)]


def _load_all(g: StoreGroup, view: memoryview, keys: list[bytes], data: list[bytes], rounds: int) -> None:
    """Every key loads back byte-exact through the group, ``rounds`` batches (every helper takes turns)."""
    for _ in range(rounds):
        view[N * PAGE:2 * N * PAGE] = bytes(N * PAGE)
        res = g.load_batch(keys, [view[(N + i) * PAGE:(N + 1 + i) * PAGE] for i in range(N)]).wait(20)
        assert [r.status for r in res] == [PageStatus.OK] * N
        assert [bytes(view[(N + i) * PAGE:(N + 1 + i) * PAGE]) for i in range(N)] == data


def test_owner_and_writer_ids_are_stable_functions() -> None:
    assert [save_owner(bytes([b]) * 32, 2) for b in range(4)] == [0, 1, 0, 1]
    assert {save_owner(bytes([b]) * 32, 1) for b in range(256)} == {0}
    assert [save_owner(bytes([b]) * 32, 4) for b in (0, 5, 10, 255)] == [0, 1, 2, 3]
    base = b"e" * 16
    ids = [member_writer_id(base, i) for i in range(4)]
    assert ids[0] == base and len(set(ids)) == 4 and all(len(i) == 16 for i in ids)
    assert ids == [member_writer_id(base, i) for i in range(4)]  # a restart derives the same ids
    assert member_writer_id(b"f" * 16, 1) != ids[1]


def test_two_writers_split_saves_by_key_and_every_page_loads_back(target, arena) -> None:
    keys = _keys()
    view, data = _fill(arena)
    g = StoreGroup.start(Controller.connect, (_host(target),), _cfg(), arena, readers=1, writers=2)
    try:
        assert len(g.writers) == 2 and len(g.readers) == 1 and len(set(g.pids)) == 3
        slots = [w.info["partition"] for w in g.writers]
        assert None not in slots and len(set(slots)) == 2  # each writer holds its own writer slot
        assert g.readers[0].info["partition"] is None
        res = g.save_batch(keys, _src(view)).wait(20)
        assert [r.status for r in res] == [PageStatus.OK] * N and [r.key for r in res] == keys
        saved = [w.stats()["pages_saved"] for w in g.writers]
        assert saved == [4, 4]  # both writers hold pages: even first bytes on writer 0, odd on writer 1
        for w, mine in ((0, keys[0::2]), (1, keys[1::2])):
            assert g.writers[w].contains(mine) == [True] * 4
        # the same key goes to the same writer: a second save is `exists`, nothing is written twice
        again = g.save_batch(keys, _src(view)).wait(20)
        assert [r.status for r in again] == [PageStatus.EXISTS] * N
        assert [w.stats()["pages_saved"] for w in g.writers] == [4, 4]
        assert g.contains([*keys, b"\x01" + b"z" * 31]) == [True] * N + [False]
        _load_all(g, view, keys, data, rounds=3)  # writer 0, writer 1, reader: each misses the others' pages
        st = g.stats()
        assert st["pages_saved"] == N and st["pages_loaded"] >= 3 * N
        # negative control: a discarded key is gone, through its own writer
        assert g.discard(keys[:2]) == 2
        lost = g.load_batch(keys[:2], [view[N * PAGE:(N + 1) * PAGE], view[(N + 1) * PAGE:(N + 2) * PAGE]]).wait(20)
        assert [r.status for r in lost] == [PageStatus.MISSING] * 2
        g.save_batch(keys[:2], _src(view)[:2]).wait(20)
    finally:
        g.close()
    assert not g.alive
    # a fresh in-process reader sees every writer's pages, byte-exact
    ctrl = Controller.connect(_host(target))
    try:
        store = PageStore(ctrl, replace(_cfg(), writer=False))
        buf = bytearray(PAGE)
        for k, d in zip(keys, data, strict=True):
            assert store.load(k, buf).ok and bytes(buf) == d
        assert store.load(b"\x02" + b"y" * 31, buf).status is PageStatus.MISSING  # negative control
        store.close()
    finally:
        ctrl.close()
    view.release()


@pytest.mark.parametrize("release", [True, False], ids=["closed", "crashed"])
def test_a_restarted_group_with_the_same_ids_finds_every_page(target, arena, release) -> None:
    keys = _keys()
    view, data = _fill(arena)
    g = StoreGroup.start(Controller.connect, (_host(target),), _cfg(), arena, readers=0, writers=2)
    try:
        slots = [w.info["partition"] for w in g.writers]
        assert all(r.ok for r in g.save_batch(keys, _src(view)).wait(20))
    finally:
        g.close(release=release)  # False: the writers' leases stay held, as after a crash
    g = StoreGroup.start(Controller.connect, (_host(target),), _cfg(), arena, readers=1, writers=2)
    try:
        assert [w.info["partition"] for w in g.writers] == slots  # each id reclaims its own slot
        assert g.contains(keys) == [True] * N
        assert [r.status for r in g.save_batch(keys, _src(view)).wait(20)] == [PageStatus.EXISTS] * N
        _load_all(g, view, keys, data, rounds=3)
    finally:
        g.close()
    view.release()


def test_one_writer_group_is_todays_group(target, arena) -> None:
    """W=1 control: every save on the single writer (the engine's own writer id), readers read-only."""
    keys = _keys()
    view, data = _fill(arena)
    g = StoreGroup.start(Controller.connect, (_host(target),), _cfg(), arena, readers=1)
    try:
        assert g.writers == [g.writer] and g.readers[0].info["partition"] is None
        assert all(r.ok for r in g.save_batch(keys, _src(view)).wait(20))
        assert g.writer.stats()["pages_saved"] == N
        _load_all(g, view, keys, data, rounds=2)
        assert g.readers[0].stats()["pages_loaded"] == 0  # never refreshed: its turn was served by the writer
    finally:
        g.close()
    view.release()


def test_several_writers_need_a_writer_config(arena) -> None:
    with pytest.raises(ValueError, match="writer config"):
        StoreGroup.start(Controller.connect, (None,), replace(_cfg(), writer=False), arena, readers=0, writers=2)
    with pytest.raises(ValueError, match="at least one writer"):
        StoreGroup.start(Controller.connect, (None,), _cfg(), arena, readers=0, writers=0)


def test_extra_writers_without_a_free_slot_read_and_the_group_saves_with_the_rest(target, arena, caplog) -> None:
    """A card with 2 writer slots and a group asking for 3 writers (+1 reader): 2 writers, 2 readers, a warning,
    and every save lands (before, the whole start failed and the engine served without a cache)."""
    cfg = replace(_cfg(), partitions=2)
    keys = _keys()
    view, data = _fill(arena)
    with caplog.at_level("WARNING", logger="adp_connector.store.process"):
        g = StoreGroup.start(Controller.connect, (_host(target),), cfg, arena, readers=1, writers=3)
    try:
        assert len(g.writers) == 2 and len(g.readers) == 2
        assert all(w.info["partition"] is not None for w in g.writers)
        assert "2 of 3 writer helpers got a writer slot" in caplog.text
        assert all(r.ok for r in g.save_batch(keys, _src(view)).wait(20))
        assert sum(w.stats()["pages_saved"] for w in g.writers) == N
        _load_all(g, view, keys, data, rounds=1)
    finally:
        g.close()
    g = StoreGroup.start(Controller.connect, (_host(target),), cfg, arena, readers=0, writers=2)  # slots released
    try:
        assert len(g.writers) == 2 and not g.readers
    finally:
        g.close()
    view.release()


def test_after_the_first_writer_the_other_helpers_open_their_stores_together(target, arena, tmp_path,
                                                                               monkeypatch) -> None:
    """The first writer opens alone (it formats a blank card); the other writer and the readers then open at the
    same time: every one of their opens overlaps every other (one after the other, 12 helpers took 13 s on the
    H200, past the engine's connect_timeout_s). Negative control: two helpers started in turn do not overlap."""
    here = str(Path(__file__).resolve().parent)  # the helpers import store_testutil.timed_connect from here
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p))
    log = str(tmp_path / "opens")
    g = StoreGroup.start(timed_connect, (_host(target), log, 3.0), _cfg(), arena, readers=3, writers=2)
    try:
        spans = open_spans(log)
        assert [p for p, _, _ in spans].count(g.writer.pid) == 1 and len(spans) == 5
        first, others = spans[0], spans[1:]
        assert first[0] == g.writer.pid and first[2] <= min(s for _, s, _ in others)
        assert all_overlap(others) and len(g.writers) == 2 and len(g.readers) == 3
    finally:
        g.close()
    log2 = str(tmp_path / "in-turn")
    rc = replace(_cfg(), writer=False)
    one = StoreProcess.start(timed_connect, (_host(target), log2, 0.5), rc, arena)
    two = StoreProcess.start(timed_connect, (_host(target), log2, 0.5), rc, arena)
    try:
        assert not all_overlap(open_spans(log2))
    finally:
        one.close()
        two.close()
