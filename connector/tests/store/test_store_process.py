"""StoreProcess: a page store in a helper process over a real userspace NVMe/TCP target, pages in a shared arena."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from store_testutil import PROCESS_NQN

from adp_connector.nvmeof.host import Controller, HostConfig
from adp_connector.store import PageStatus, PageStore, StoreConfig
from adp_connector.store.process import SharedArena, StoreProcess, StoreProcessError

target_mod = pytest.importorskip("adp_emulator.target", reason="the userspace target package is not installed")
pid_alive = pytest.importorskip("adp_emulator.kernel.vm").pid_alive

NQN = PROCESS_NQN  # the subsystem of the target fixture (conftest.py)
PAGE = 64 << 10


def _host(t, **kw) -> HostConfig:
    host, port = t.address
    return HostConfig(traddr=host, trsvcid=port, subnqn=NQN, io_queues=2, queue_depth=32, reconnect_delay=0.1, **kw)


def _cfg(admission: str = "frequency") -> StoreConfig:
    return StoreConfig(writer=True, writer_id=b"w" * 16, partitions=2, avg_page_bytes=PAGE, io_threads=2,
                       admission=admission)


@pytest.fixture
def arena():
    a = SharedArena(8 * PAGE)
    yield a
    a.close()


def _page(i: int) -> bytes:
    return bytes([i % 251]) * 100 + os.urandom(PAGE - 100)


def test_pages_cross_through_the_arena_and_survive_the_process(target, arena) -> None:
    sp = StoreProcess.start(Controller.connect, (_host(target),), _cfg(), arena)
    assert sp.alive and sp.pid != os.getpid() and sp.info["partition"] is not None
    data = [_page(i) for i in range(4)]
    view = memoryview(arena.map)
    for i, d in enumerate(data):
        view[i * PAGE:(i + 1) * PAGE] = d
    keys = [bytes([i]) * 32 for i in range(4)]
    assert arena.locate(view[PAGE:2 * PAGE]) == (PAGE, PAGE)
    h = sp.save_batch(keys, [view[i * PAGE:(i + 1) * PAGE] for i in range(4)])
    assert [r.status for r in h.wait(20)] == [PageStatus.OK] * 4
    assert sp.contains([*keys, b"x" * 32]) == [True] * 4 + [False]
    view[4 * PAGE:8 * PAGE] = bytes(4 * PAGE)  # loads land in the other half
    h = sp.load_batch(keys, [view[(4 + i) * PAGE:(5 + i) * PAGE] for i in range(4)])
    assert all(r.ok and r.nbytes == PAGE for r in h.wait(20))
    assert [bytes(view[(4 + i) * PAGE:(5 + i) * PAGE]) for i in range(4)] == data
    assert sp.stats()["pages_saved"] == 4
    assert sp.discard(keys[:1]) == 1
    sp.close()
    assert not sp.alive
    view.release()
    # the pages are on the device: an in-process store reads them back (partition lease released by close)
    ctrl = Controller.connect(_host(target))
    try:
        store = PageStore(ctrl, _cfg())
        buf = bytearray(PAGE)
        assert store.load(keys[1], buf).ok and bytes(buf) == data[1]
        assert store.load(keys[0], buf).status is PageStatus.MISSING
        store.close()
    finally:
        ctrl.close()


def test_buffers_outside_the_arena_still_work(target, arena) -> None:
    sp = StoreProcess.start(Controller.connect, (_host(target),), _cfg(), arena)
    try:
        data = _page(7)
        key = b"k" * 32
        assert arena.locate(bytearray(PAGE)) is None and arena.locate(data) is None  # outside; read-only
        assert sp.save_batch([key], [data]).wait(20)[0].ok
        out = bytearray(PAGE)
        res = sp.load_batch([key, b"m" * 32], [out, bytearray(PAGE)]).wait(20)
        assert res[0].ok and bytes(out) == data and res[1].status is PageStatus.MISSING
    finally:
        sp.close()


def test_a_synchronous_call_is_answered_without_the_reader_thread(target, arena) -> None:
    """contains, stats and the other calls come back on their own socket pair, read by the calling thread: they are
    answered while the proxy's reader thread cannot hand out answers. The control: a load batch sent just before,
    whose answer that thread hands out, stays unfinished until it can."""
    sp = StoreProcess.start(Controller.connect, (_host(target),), _cfg(), arena)
    view = memoryview(arena.map)
    try:
        keys = [bytes([i]) * 32 for i in range(2)]
        view[:2 * PAGE] = b"".join(_page(i) for i in range(2))
        h = sp.save_batch(keys, [view[:PAGE], view[PAGE:2 * PAGE]])
        assert [r.status for r in h.wait(20)] == [PageStatus.OK] * 2
        load = sp.load_batch(keys, [view[4 * PAGE:5 * PAGE], view[5 * PAGE:6 * PAGE]])
        got: dict[str, object] = {}
        with sp._lock:  # the reader thread takes it for every answer it hands out
            th = threading.Thread(target=lambda: got.update(found=sp.contains([*keys, b"x" * 32]),
                                                            saved=sp.stats()["pages_saved"]))
            th.start()
            th.join(10)
            assert got == {"found": [True, True, False], "saved": 2}, got
            time.sleep(0.3)  # the load's answer has come by now; the reader waits for the lock
            assert not load.done()
        assert all(r.ok for r in load.wait(20))
    finally:
        view.release()
        sp.close()


def test_a_late_answer_of_a_call_that_timed_out_is_not_taken_for_the_next(target, arena) -> None:
    """A call that timed out leaves its answer on the calls pair; the next call skips it and gets its own (the
    first asks about a key that is missing, the second about one that is stored, so taking the late answer would
    say the stored one is missing)."""
    sp = StoreProcess.start(Controller.connect, (_host(target),), _cfg(), arena)
    view = memoryview(arena.map)
    try:
        view[:PAGE] = _page(1)
        assert [r.status for r in sp.save_batch([b"k" * 32], [view[:PAGE]]).wait(20)] == [PageStatus.OK]
        with pytest.raises(TimeoutError, match="contains not answered"):
            sp.contains([b"x" * 32], timeout=1e-9)
        assert sp.contains([b"k" * 32]) == [True]
        assert sp.contains([b"x" * 32, b"k" * 32]) == [False, True]
    finally:
        view.release()
        sp.close()


def test_a_killed_helper_fails_pending_batches_and_tells_the_owner(target, arena) -> None:
    exited = threading.Event()
    reasons: list[str] = []
    sp = StoreProcess.start(Controller.connect, (_host(target),), _cfg(), arena,
                            on_exit=lambda r: (reasons.append(r), exited.set()))
    view = memoryview(arena.map)
    try:
        target.faults.set_delay(5.0)  # the batch is in flight when the helper dies
        h = sp.save_batch([b"a" * 32], [view[:PAGE]])
        time.sleep(0.3)
        sp.kill()
        res = h.wait(10)
        assert res[0].status is PageStatus.ERROR and "exited" in res[0].detail
        assert exited.wait(5) and len(reasons) == 1 and "rc=" in reasons[0]
        assert not sp.alive
        late = sp.load_batch([b"a" * 32], [view[:PAGE]]).wait(1)  # answered at once, not hung
        assert late[0].status is PageStatus.ERROR
        with pytest.raises(StoreProcessError):
            sp.contains([b"a" * 32])
    finally:
        target.faults.set_delay(0.0)
        view.release()
        sp.close()


def test_an_unreachable_target_is_reported_with_its_cause(arena) -> None:
    with pytest.raises(StoreProcessError, match=r"[Rr]efused|[Cc]onnect"):
        StoreProcess.start(Controller.connect, (HostConfig(traddr="127.0.0.1", trsvcid=1, subnqn=NQN,
                                                           connect_timeout=1.0),), _cfg(), arena, timeout=20)


def test_arena_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        SharedArena(0)


def test_the_helper_does_not_outlive_its_owner(target, tmp_path) -> None:
    """The owning process killed (SIGKILL, no clean-up): the helper sees its socket close and exits; Ctrl-C (SIGINT
    to the process group) is left to the owner."""
    import signal
    import subprocess
    import sys

    host, port = target.address
    script = tmp_path / "owner.py"
    script.write_text(
        "import sys, time\n"
        "from adp_connector.nvmeof.host import Controller, HostConfig\n"
        "from adp_connector.store import StoreConfig\n"
        "from adp_connector.store.process import SharedArena, StoreProcess\n"
        f"hc = HostConfig(traddr={host!r}, trsvcid={port}, subnqn={NQN!r}, io_queues=1)\n"
        "sp = StoreProcess.start(Controller.connect, (hc,), StoreConfig(writer=False), SharedArena(1 << 20))\n"
        "print(sp.pid, flush=True)\n"
        "time.sleep(60)\n")
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        helper = int(owner.stdout.readline())
        os.kill(helper, signal.SIGINT)  # ignored by the helper
        time.sleep(0.5)
        assert pid_alive(helper)
        owner.kill()
        owner.wait(10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if not pid_alive(helper):
                break
            time.sleep(0.1)
        else:
            os.kill(helper, signal.SIGKILL)
            raise AssertionError("the helper outlived its owner")
    finally:
        owner.kill()
        owner.wait()



def test_group_spreads_loads_and_reloads_what_a_reader_has_not_indexed(target, arena) -> None:
    """StoreGroup: saves through the writer, load batches taken in turn by the writer and a reader; pages saved
    after the reader's last refresh (here it never refreshes on a miss) come back MISSING there and are loaded
    again through the writer, so every load succeeds with the right bytes."""
    from dataclasses import replace

    from adp_connector.store.process import StoreGroup

    cfg = replace(_cfg(), miss_refresh_gap_s=-1.0)
    g = StoreGroup.start(Controller.connect, (_host(target),), cfg, arena, readers=1)
    try:
        assert g.alive and len({g.writer.pid, g.readers[0].pid, os.getpid()}) == 3
        assert g.readers[0].info["partition"] is None and g.info["partition"] is not None
        data = [_page(i) for i in range(4)]
        view = memoryview(arena.map)
        for i, d in enumerate(data):
            view[i * PAGE:(i + 1) * PAGE] = d
        keys = [bytes([40 + i]) * 32 for i in range(4)]
        assert all(r.ok for r in g.save_batch(keys, [view[i * PAGE:(i + 1) * PAGE] for i in range(4)]).wait(20))
        for _ in range(4):  # writer, reader, writer, reader
            view[4 * PAGE:8 * PAGE] = bytes(4 * PAGE)
            h = g.load_batch(keys, [view[(4 + i) * PAGE:(5 + i) * PAGE] for i in range(4)])
            assert [r.status for r in h.wait(20)] == [PageStatus.OK] * 4
            assert [bytes(view[(4 + i) * PAGE:(5 + i) * PAGE]) for i in range(4)] == data
        reader = g.readers[0].stats()
        assert reader["misses"] == 8 and reader["pages_loaded"] == 0  # the reader never saw them ...
        assert g.writer.stats()["pages_loaded"] == 16  # ... the writer served its own turns and the retries
        view.release()
    finally:
        g.close()
    assert not g.alive


def test_group_names_pages_a_reader_read_back_to_their_writer(target, arena) -> None:
    """Restores a reader helper serves reach the writer's eviction order: the writer counts the pages as read back
    (``read_back_elsewhere``); pages the writer loads itself are its own load hits, not notices (the control). Pages
    named as about to be read (``note_reading``) reach the writer whichever helper reads them (``reading_noted``)."""
    from adp_connector.store.process import StoreGroup

    g = StoreGroup.start(Controller.connect, (_host(target),), _cfg(), arena, readers=1)
    try:
        view = memoryview(arena.map)
        keys = [bytes([60 + i]) * 32 for i in range(4)]
        for i in range(4):
            view[i * PAGE:(i + 1) * PAGE] = _page(i)
        assert all(r.ok for r in g.save_batch(keys, [view[i * PAGE:(i + 1) * PAGE] for i in range(4)]).wait(20))
        g.refresh()
        into = [view[(4 + i) * PAGE:(5 + i) * PAGE] for i in range(4)]
        g._load_member = lambda: g.writer  # type: ignore[method-assign]
        assert all(r.ok for r in g.load_batch(keys, into).wait(20))
        assert g.writer.stats()["read_back_elsewhere"] == 0
        g._load_member = lambda: g.readers[0]  # type: ignore[method-assign]
        assert all(r.ok for r in g.load_batch(keys[:3], into[:3]).wait(20))
        assert g.readers[0].stats()["pages_loaded"] == 3
        deadline = time.monotonic() + 10
        while g.writer.stats()["read_back_elsewhere"] < 3 and time.monotonic() < deadline:
            time.sleep(0.02)  # a notice, sent after the batch completed
        assert g.writer.stats()["read_back_elsewhere"] == 3
        assert g.writer.stats()["reading_noted"] == 0  # loads alone name nothing as about to be read
        g.note_reading([*keys, b"x" * 32])  # a key the writer does not own is ignored
        deadline = time.monotonic() + 10
        while g.writer.stats()["reading_noted"] < 4 and time.monotonic() < deadline:
            time.sleep(0.02)  # a notice: no reply
        assert g.writer.stats()["reading_noted"] == 4
        view.release()
    finally:
        g.close()


class _Helper:
    """A helper as StoreGroup routes to it: its outstanding requests, and the load batches it was given (answered
    OK at once)."""

    def __init__(self, outstanding: int = 0) -> None:
        self.outstanding = outstanding
        self.loads = 0
        self.info = {"partition": 0}

    def load_batch(self, keys, buffers):
        from adp_connector.store.results import BatchHandle, PageResult

        self.loads += 1
        h = BatchHandle("load", len(keys))
        h._set([PageResult(bytes(k), PageStatus.OK, 1) for k in keys])
        return h

    def note_read_back(self, keys):
        self.noted = [*getattr(self, "noted", []), *keys]

    def note_reading(self, keys):
        self.reading = [*getattr(self, "reading", []), *keys]


def test_group_sends_loads_past_a_writer_busy_with_saves() -> None:
    """The fewest outstanding requests win: two readers take every load while the writer has saves queued (in strict
    turns, the rule before, it would have taken 2 of the 6), and equals take turns."""
    from adp_connector.store.process import StoreGroup

    writer, r1, r2 = _Helper(outstanding=6), _Helper(), _Helper()
    g = StoreGroup(writer, [r1, r2])  # type: ignore[arg-type]
    for _ in range(6):
        assert [r.status for r in g.load_batch([b"k" * 32], [bytearray(1)]).wait(1)] == [PageStatus.OK]
    assert writer.loads == 0 and r1.loads == 3 and r2.loads == 3
    g.note_reading([b"k" * 32, b"j" * 32])
    assert writer.reading == [b"k" * 32, b"j" * 32]  # pages about to be read: named to their writer
    assert not hasattr(r1, "reading") and not hasattr(r2, "reading")  # readers own no pages: never told
    writer.outstanding = 0
    for _ in range(6):
        g.load_batch([b"k" * 32], [bytearray(1)]).wait(1)
    assert writer.loads == 2 and r1.loads == 5 and r2.loads == 5
    assert writer.noted == [b"k" * 32] * 10  # each load a reader served is named to the key's writer


def test_group_reports_the_first_helper_exit_once(target, arena) -> None:
    from adp_connector.store.process import StoreGroup

    exits: list[str] = []
    g = StoreGroup.start(Controller.connect, (_host(target),), _cfg(), arena, readers=2, on_exit=exits.append)
    try:
        g.readers[1].kill()
        deadline = time.monotonic() + 10
        while not exits and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(exits) == 1 and "exited" in exits[0] and not g.alive
        g.writer.kill()
        time.sleep(0.3)
        assert len(exits) == 1
    finally:
        g.close()


def _minor_faults_touching(view: memoryview) -> int:
    """Minor page faults this process takes writing one byte per 4 KiB page of ``view``."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for off in range(0, len(view), 4096):
        view[off] = 1
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.parametrize("populate", [True, False])
def test_arena_populate_faults_the_mapping_in_up_front(populate: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A helper's mapping of the arena is populated at its start: touching every page afterwards takes (almost) no
    page faults; the control (ADP_KV_ARENA_POPULATE=0) takes one per page. Both end with ``done`` set."""
    import mmap

    from adp_connector.store.process import ArenaPopulator

    a = SharedArena(64 << 20)
    try:
        a.map[:] = bytes(len(a.map))  # the owner's pages exist (as the connector's pinned arena does)
        mine = mmap.mmap(a.fd, a.nbytes)  # a second mapping: what a helper process maps
        view = memoryview(mine)
        monkeypatch.setenv("ADP_KV_ARENA_POPULATE", "1" if populate else "0")
        pop = ArenaPopulator(view)
        pop.start()
        assert pop.done.wait(30)
        faults = _minor_faults_touching(view)
        pages = a.nbytes // 4096
        if populate:
            assert pop.populated == a.nbytes and faults < pages // 20
        else:
            assert pop.populated == 0 and faults > pages // 2
        view.release()
        mine.close()
    finally:
        a.close()


def test_the_helper_reports_its_arena_populated(target) -> None:
    a = SharedArena(16 << 20)
    sp = StoreProcess.start(Controller.connect, (_host(target),), _cfg(), a)
    try:
        deadline = time.monotonic() + 20
        while (st := sp.stats())["arena_populate_done"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert st["arena_populate_done"] == 1 and st["arena_populated_bytes"] == a.nbytes
    finally:
        sp.close()
        a.close()


def test_arena_populate_falls_back_with_one_warning_on_a_kernel_without_the_advice(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """An advice the kernel refuses (as a kernel before 5.14 refuses MADV_POPULATE_WRITE): one warning line, nothing
    populated, ``done`` set (the pages fault in on first use, as before)."""
    import adp_connector.store.process as proc

    monkeypatch.setattr(proc, "_MADV_POPULATE_WRITE", 0x7FFF)  # no such advice: EINVAL
    monkeypatch.setenv("ADP_KV_ARENA_POPULATE", "1")
    a = SharedArena(8 << 20)
    try:
        pop = proc.ArenaPopulator(memoryview(a.map))
        with caplog.at_level("WARNING", logger="adp_connector.store.process"):
            pop.run()
        assert pop.done.is_set() and pop.populated == 0
        lines = [r.getMessage() for r in caplog.records if "arena populate" in r.getMessage()]
        assert len(lines) == 1 and "Invalid argument" in lines[0]
    finally:
        a.close()


def test_pages_a_helper_evicts_come_back_with_its_saves(target, arena) -> None:
    """Saves past the card's capacity evict the oldest pages; the keys evicted come back with the saves' results
    (``take_evicted``), exactly the saved keys the helper no longer has, each once. Control: before the first
    eviction there is nothing to take. Every page is admitted (each is asked for once, so ``frequency`` admission
    would keep the first ones and evict nothing)."""
    sp = StoreProcess.start(Controller.connect, (_host(target),), _cfg("always"), arena)
    try:
        view = memoryview(arena.map)
        bufs = [view[i * PAGE:(i + 1) * PAGE] for i in range(4)]
        saved: list[bytes] = []
        taken: list[bytes] = []
        n = 0
        while sp.stats()["evictions"] < 8:
            keys = [(n + i).to_bytes(4, "little") * 8 for i in range(4)]
            n += 4
            assert all(r.ok for r in sp.save_batch(keys, bufs).wait(20))
            saved += keys
            got = sp.take_evicted()
            if sp.stats()["evictions"] == 0:
                assert got == []  # control: nothing before the first eviction
            taken += got
        assert sp.take_evicted() == []
        gone = {bytes(k) for k, present in zip(saved, sp.contains(saved), strict=True) if not present}
        assert len(taken) == len({bytes(k) for k in taken}) and {bytes(k) for k in taken} == gone and len(gone) >= 8
        view.release()
    finally:
        sp.close()


@contextlib.contextmanager
def _writer_and_lookups(t, arena: SharedArena
                        ) -> Iterator[tuple[StoreProcess, memoryview, Callable[..., StoreProcess]]]:
    """A writer helper on the card, a view of its arena, and a factory of read-only helpers on the same card (the
    scheduler's lookup helper); all closed afterwards."""
    writer = StoreProcess.start(Controller.connect, (_host(t),), _cfg("always"), arena)
    lookup_arena = SharedArena(PAGE)
    readers: list[StoreProcess] = []
    view = memoryview(arena.map)

    def open_lookup(refresh_interval_s: float = 0.0) -> StoreProcess:
        cfg = StoreConfig(writer=False, partitions=2, avg_page_bytes=PAGE, io_threads=2,
                          refresh_interval_s=refresh_interval_s)
        readers.append(StoreProcess.start(Controller.connect, (_host(t),), cfg, lookup_arena))
        return readers[-1]

    try:
        yield writer, view, open_lookup
    finally:
        view.release()
        for r in readers:
            r.close()
        writer.close()
        lookup_arena.close()


def _save_pages(sp: StoreProcess, view: memoryview, keys: list[bytes]) -> None:
    view[:PAGE] = _page(3)
    assert all(r.ok for r in sp.save_batch(keys, [view[:PAGE]] * len(keys)).wait(20))


def test_a_mirrored_index_answers_lookups_in_the_callers_process(target, arena, monkeypatch) -> None:
    """With the lookup helper's index mirrored, contains makes no round trip and agrees with the helper: the whole
    index at once, then what each refresh adds and removes (a refresh returns once the copy has it). Controls:
    before mirroring, the same lookups go to the helper; the helper's own answer matches the copy."""
    with _writer_and_lookups(target, arena) as (writer, view, open_lookup):
        first = [bytes([1, i]) * 16 for i in range(5)]
        _save_pages(writer, view, first)
        reader = open_lookup()
        asked: list[str] = []
        real_ask = reader._ask
        monkeypatch.setattr(reader, "_ask", lambda op, keys, timeout: asked.append(op) or real_ask(op, keys, timeout))
        probe = [*first, b"x" * 32]
        assert reader.contains(probe) == [True] * 5 + [False] and asked == ["contains"]  # control: a round trip
        assert reader.mirror_index() == 5 and reader.mirrored
        asked.clear()
        assert reader.contains(probe) == [True] * 5 + [False] and asked == []
        more = [bytes([2, i]) * 16 for i in range(3)]
        _save_pages(writer, view, more)
        assert writer.discard(first[:2]) == 2
        assert reader.contains(more) == [False] * 3  # not refreshed yet: as stale as the helper's own index
        reader.refresh()
        want = [False, False, True, True, True, True, True, True, False]
        assert reader.contains([*first, *more, b"x" * 32]) == want
        assert asked == ["refresh"]
        monkeypatch.undo()
        reader._mirror = None  # control: the helper itself says the same
        assert reader.contains([*first, *more, b"x" * 32]) == want


def test_a_mirrored_index_follows_the_helpers_own_refresh_and_fails_with_it(target, arena) -> None:
    """Without a refresh asked for, the helper's periodic refresh brings a writer's new pages into the copy. Once
    the helper is gone, a lookup raises as before instead of answering from a copy nobody updates."""
    with _writer_and_lookups(target, arena) as (writer, view, open_lookup):
        reader = open_lookup(refresh_interval_s=0.2)
        assert reader.mirror_index() == 0
        keys = [bytes([3, i]) * 16 for i in range(4)]
        _save_pages(writer, view, keys)
        deadline = time.monotonic() + 15
        while reader.contains(keys) != [True] * 4:
            assert time.monotonic() < deadline, "the copy never got the writer's pages"
            time.sleep(0.05)
        reader.kill()
        deadline = time.monotonic() + 10
        while not reader.exit_reason:  # the proxy's reader thread has seen the helper go
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(StoreProcessError):
            reader.contains(keys)


def test_an_index_over_the_copy_limit_ends_the_copy() -> None:
    """The publisher sends changes only, and an index grown past its limit ends the copy: the owner's contains asks
    the helper again. Control: under the limit, the owner's copy follows the changes. (The publisher over a
    stand-in store: only its indexed_keys and index_changed are used.)"""
    from types import SimpleNamespace

    from adp_connector.store.process import IndexPublisher

    keys = {b"a" * 32, b"b" * 32}
    store: Any = SimpleNamespace(indexed_keys=lambda: list(keys), index_changed=threading.Event())
    sent: list[tuple] = []
    pub = IndexPublisher(store, sent.append, poll_s=60, max_keys=3)
    owner: Any = SimpleNamespace(_mirror=None, _mirror_gen=0, _mirror_cond=threading.Condition())
    apply = StoreProcess._apply_index.__get__(owner)
    try:
        assert pub.start() == 1 and sent[-1][0] == "index" and set(sent[-1][2]) == keys
        apply(*sent[-1][1:])
        assert owner._mirror == keys
        assert pub.publish() == 1 and len(sent) == 1  # nothing changed: nothing sent
        keys.add(b"c" * 32)
        keys.discard(b"a" * 32)
        assert pub.publish() == 2 and sent[-1][2:] == ([b"c" * 32], [b"a" * 32])
        apply(*sent[-1][1:])
        assert owner._mirror == keys  # control: under the limit the copy follows
        keys.update({b"d" * 32, b"e" * 32})
        assert pub.publish() == 3 and sent[-1] == ("index", 3, None, None) and not pub.active
        apply(*sent[-1][1:])
        assert owner._mirror is None and owner._mirror_gen == 3
        assert pub.publish() == 3 and len(sent) == 3  # stopped: nothing more
    finally:
        pub.stop()
