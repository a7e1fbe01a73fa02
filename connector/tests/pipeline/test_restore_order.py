"""RestorePipeline hands staging slabs out oldest restore first, at most ``max_inflight`` batches at a time.

A unit test of the pipeline layer alone: the store is a stand-in whose batches the test completes by hand (the real
stores are exercised by the connector tests); the KV cache and the staging pool are the real ones, on the CPU.
"""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from stub_store import StubStore  # noqa: E402

from adp_connector.pipeline import Cause, Counters, LoadJob, PagedKV, RestorePipeline, StagingPool  # noqa: E402

PAGE = 64  # bytes per page: one layer, 64 int8 per block
BLOCKS = 32


class _Store(StubStore):
    """The stand-in store at this module's page size (records the order batches were submitted in)."""

    def __init__(self) -> None:
        super().__init__(PAGE)


def _setup(max_inflight: int | None):
    kv = torch.zeros(BLOCKS, PAGE, dtype=torch.int8)
    sink = PagedKV({0: [("layer0", kv, PAGE)]})
    pool = StagingPool(2 * PAGE, 4 * 2 * PAGE, pinned=False)  # 4 slabs of 2 pages
    pipe = RestorePipeline(sink, pool, {0: PAGE}, Counters(), timeout_s=30.0, max_inflight=max_inflight)
    return kv, pipe, _Store()


def _taken(pipe: RestorePipeline) -> None:
    """Wait until the driver applied the caller's queued calls (a start returns before its batches are submitted)."""
    deadline = time.monotonic() + 5.0
    while pipe._inbox and time.monotonic() < deadline:
        time.sleep(0.001)
    with pipe._lock:  # the pass that took them has ended
        pass


def _job(rid: str, first_page: int, n: int, first_block: int) -> LoadJob:
    return LoadJob(rid, [(0, first_block + i, bytes([first_page + i]) * 8) for i in range(n)], [], t0=time.monotonic())


def test_the_oldest_restore_gets_the_slabs_and_finishes_first() -> None:
    kv, pipe, store = _setup(max_inflight=2)
    pipe.start(_job("A", 10, 6, 0), store)  # 3 batches
    pipe.start(_job("B", 20, 4, 8), store)  # 2 batches
    assert store.submitted() == [10, 12]  # the cap: two batches, both A's; B waits
    store.batches[0].land()
    assert pipe.poll(store) == [] and store.submitted() == [10, 12, 14]  # the freed slab goes to A, not B
    store.batches[1].land()
    store.batches[2].land()
    done = pipe.poll(store)
    assert [j.req_id for j in done] == ["A"] and not done[0].failed
    assert store.submitted() == [10, 12, 14, 20, 22]
    for b in store.batches[3:]:
        b.land()
    done = pipe.poll(store)
    assert [j.req_id for j in done] == ["B"] and not done[0].failed
    for i in range(6):
        assert int(kv[i, 0]) == 10 + i and bool((kv[i] == 10 + i).all())
    for i in range(4):
        assert int(kv[8 + i, 0]) == 20 + i


def test_a_restore_names_all_its_pages_before_its_first_batch() -> None:
    """The store hears of every page of a restore when it starts, ahead of the saves that follow, although its later
    batches wait for slabs (on a full card those saves would evict exactly the pages still to be read). The
    control: the batches submitted at that point hold only the first pages."""
    _, pipe, store = _setup(max_inflight=2)
    pipe.start(_job("A", 10, 6, 0), store)
    assert store.reading == [bytes([10 + i]) * 8 for i in range(6)]
    assert sum(len(b.keys) for b in store.batches) == 4  # control: two batches of two pages so far


def test_without_a_cap_a_later_restore_takes_slabs_while_an_older_one_waits() -> None:
    """Negative control: no max_inflight, as before, B takes the fourth slab while A's batches are in flight."""
    _, pipe, store = _setup(max_inflight=None)
    pipe.start(_job("A", 10, 6, 0), store)
    pipe.start(_job("B", 20, 4, 8), store)
    assert store.submitted() == [10, 12, 14, 20]


def test_a_failed_older_restore_does_not_hold_back_the_next() -> None:
    _, pipe, store = _setup(max_inflight=1)
    a = _job("A", 10, 4, 0)
    pipe.start(a, store)
    pipe.start(_job("B", 20, 2, 8), store)
    assert store.submitted() == [10]
    a.fail(Cause.IO_ERROR, "test")
    store.batches[0].land()
    done = pipe.poll(store)
    assert [j.req_id for j in done] == ["A"] and done[0].failed
    assert store.submitted() == [10, 20]



def _clock(monkeypatch: pytest.MonkeyPatch, start: float = 1000.0) -> list[float]:
    """A settable clock for the restore pipeline alone (returns the list holding the time); the process's own
    time.monotonic is left alone."""
    import adp_connector.pipeline.restore as restore

    now = [start]
    monkeypatch.setattr(restore, "_now", lambda: now[0])
    return now


def test_a_restore_queued_behind_moving_ones_waits_past_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """B waits for slabs 3 timeouts long while A's batches keep landing: not a failure (it used to fail as
    no_staging at timeout_s whatever moved ahead of it); then it is restored."""
    now = _clock(monkeypatch)
    kv, pipe, store = _setup(max_inflight=1)
    pipe.timeout_s = 10.0
    pipe.start(LoadJob("A", [(0, i, bytes([10 + i]) * 8) for i in range(16)], [], t0=now[0]), store)  # 8 batches
    pipe.start(LoadJob("B", [(0, 20, bytes([40]) * 8)], [], t0=now[0]), store)
    done: list[LoadJob] = []
    for i in range(8):  # one of A's batches lands every 4 s: 32 s in all
        now[0] += 4.0
        store.batches[i].land()
        done += pipe.poll(store)
    assert [j.req_id for j in done] == ["A"] and not done[0].failed
    now[0] += 4.0
    store.batches[-1].land()
    done = pipe.poll(store)
    assert [j.req_id for j in done] == ["B"] and not done[0].failed and int(kv[20, 0]) == 40


def test_a_restore_short_of_slabs_says_so_until_it_gets_them() -> None:
    """``wants_staging`` (which waiting saves yield to) is set while a batch finds no free slab, cleared once every
    batch has one; the cap on batches in flight (``max_inflight``) is not a want of staging (the control)."""
    _, pipe, store = _setup(max_inflight=None)
    pipe.start(_job("A", 10, 10, 0), store)  # 5 batches for 4 slabs
    assert len(store.batches) == 4 and pipe.wants_staging
    store.batches[0].land()
    pipe.poll(store)
    assert len(store.batches) == 5 and not pipe.wants_staging
    _, capped, store = _setup(max_inflight=1)
    capped.start(_job("B", 20, 4, 8), store)
    assert len(store.batches) == 1 and not capped.wants_staging


def test_no_progress_for_the_timeout_fails_with_the_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    """Controls: a batch in flight that does not land within the timeout fails its restore as timed_out, and the
    restore queued behind it, with nothing landing anywhere, as no_staging."""
    now = _clock(monkeypatch)
    _, pipe, store = _setup(max_inflight=1)
    pipe.timeout_s = 10.0
    pipe.start(LoadJob("A", [(0, 0, bytes([10]) * 8)], [], t0=now[0]), store)
    pipe.start(LoadJob("B", [(0, 8, bytes([20]) * 8)], [], t0=now[0]), store)
    now[0] += 9.0
    assert pipe.poll(store) == []  # within the timeout
    now[0] += 2.0
    done = {j.req_id: j for j in pipe.poll(store)}
    assert done["A"].cause is Cause.TIMED_OUT and done["B"].cause is Cause.NO_STAGING, done
    assert "none for 10.0 s" in done["A"].failed and "no restore landed for 10.0 s" in done["B"].failed


def _land_as_submitted(store: _Store, stop: float) -> None:
    """The store's side: land every batch soon after it is submitted (what the helpers do)."""
    seen = 0
    while time.monotonic() < stop:
        while seen < len(store.batches):
            store.batches[seen].land()
            seen += 1
        time.sleep(0.001)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


def _restore_without_polls(driver: bool, device: str = "cpu") -> tuple[int, torch.Tensor, RestorePipeline]:
    """A restore of 12 batches through 2 slabs in flight, no caller poll for 0.5 s: how many batches were submitted.
    On a GPU the KV cache is CUDA memory, the slabs pinned, and the driver scatters on the side stream."""
    import threading

    if device == "cpu":
        kv, pipe, store = _setup(max_inflight=2)
    else:
        kv = torch.zeros(BLOCKS, PAGE, dtype=torch.int8, device=device)
        pool = StagingPool(2 * PAGE, 4 * 2 * PAGE, pinned=True)
        pipe = RestorePipeline(PagedKV({0: [("layer0", kv, PAGE)]}), pool, {0: PAGE}, Counters(), timeout_s=30.0,
                               max_inflight=2)
        store = _Store()
    if driver:
        pipe.run_driver(lambda: store, on_start=None if device == "cpu" else lambda: torch.cuda.set_device(kv.device))
    try:
        pipe.start(_job("A", 0, 24, 0), store)  # 24 pages, 12 batches of 2
        lander = threading.Thread(target=_land_as_submitted, args=(store, time.monotonic() + 0.5))
        lander.start()
        lander.join()
        return len(store.batches), kv, pipe
    finally:
        pipe.stop_driver()


@pytest.mark.parametrize("device", DEVICES)
def test_the_driver_moves_a_restore_between_the_callers_polls(device: str) -> None:
    """On a GPU the engine polls once per step, and a long step held every slab; with the driver the whole restore
    lands while the caller does not poll, and the caller's next poll finishes it, pages in place."""
    submitted, kv, pipe = _restore_without_polls(driver=True, device=device)
    assert submitted == 12
    [job] = pipe.poll(_Store())  # nothing is left to feed (the driver stopped after its last copy)
    assert not job.failed
    assert kv[:24, 0].cpu().tolist() == list(range(24)) and int(kv[24:].abs().sum()) == 0


@pytest.mark.parametrize("driver", [True, False], ids=["driver", "control-no-driver"])
def test_with_the_driver_the_callers_poll_launches_no_copy(driver: bool) -> None:
    """The engine's poll only finishes jobs while the driver runs: every copy into the KV cache is launched from the
    driver's thread (GPU run 25: the poll took 1.2 s of the engine's thread at 8 agents copying read-aheads). The
    control: without the driver the caller's poll launches them all."""
    import threading

    kv, pipe, store = _setup(max_inflight=None)
    threads: list[str] = []
    scatter = pipe.sink.scatter

    def recording_scatter(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return scatter(*args, **kwargs)

    pipe.sink.scatter = recording_scatter  # type: ignore[method-assign]
    if driver:
        pipe.run_driver(lambda: store)
    try:
        pipe.start(_job("A", 0, 4, 0), store)
        done: list[LoadJob] = []
        deadline = time.monotonic() + 5.0
        while not done and time.monotonic() < deadline:
            for b in store.batches:
                if not b.done():
                    b.land()
            done = pipe.poll(store)
            time.sleep(0.001)
    finally:
        pipe.stop_driver()
    assert [bool(j.failed) for j in done] == [False] and kv[:4, 0].tolist() == [0, 1, 2, 3]
    assert threads and set(threads) == {"adpkv-restore" if driver else threading.current_thread().name}, threads


def _call_while_held(pipe: RestorePipeline, call, hold_s: float) -> float:
    """Run ``call`` while another thread holds the pipeline (as a driver's pass does) for ``hold_s``: how long it
    took."""
    import threading

    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with pipe._lock:
            held.set()
            release.wait(5.0)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        held.wait(5.0)
        threading.Timer(hold_s, release.set).start()
        t0 = time.monotonic()
        call()
        return time.monotonic() - t0
    finally:
        release.set()
        holder.join()


def _poll_while_held(pipe: RestorePipeline, store: _Store, hold_s: float) -> tuple[list[LoadJob], float]:
    """Poll while another thread holds the pipeline for ``hold_s``: what the poll returned and how long it took."""
    got: list[LoadJob] = []
    took = _call_while_held(pipe, lambda: got.extend(pipe.poll(store)), hold_s)
    return got, took


def _poll_until_done(pipe: RestorePipeline, store: _Store, first: list[LoadJob]) -> list[LoadJob]:
    done, deadline = first, time.monotonic() + 5.0
    while not done and time.monotonic() < deadline:
        done = pipe.poll(store)
        time.sleep(0.001)
    return done


@pytest.mark.parametrize("driver", [True, False], ids=["driver", "control-no-driver"])
def test_the_callers_poll_does_not_wait_while_the_driver_holds_the_pipeline(driver: bool) -> None:
    """While the driver holds the pipeline and no restore is finished the engine's poll returns at once, and a later
    poll finishes the restore once it landed. The control: without the driver the poll waits for whoever holds it."""
    kv, pipe, store = _setup(max_inflight=None)
    if driver:
        pipe.run_driver(lambda: store)
    try:
        pipe.start(_job("A", 0, 2, 0), store)
        _taken(pipe)
        first, waited = _poll_while_held(pipe, store, 0.3)
        for b in store.batches:
            b.land()
        done = _poll_until_done(pipe, store, first)
    finally:
        pipe.stop_driver()
    if driver:
        assert first == [] and waited < 0.2, waited
    else:
        assert waited >= 0.25, waited
    assert [bool(j.failed) for j in done] == [False] and kv[:2, 0].tolist() == [0, 1]


@pytest.mark.parametrize("flag", [True, False], ids=["finished", "control-flag-never-set"])
def test_a_poll_waits_for_the_drivers_pass_when_a_restore_is_finished(flag: bool,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the driver's pass left a restore in place, a poll that finds the driver holding the pipeline waits for
    that pass and returns the restore, rather than leaving it to the engine's next step. The control: with the
    driver's flag never set the same poll returns nothing at once."""
    if not flag:
        monkeypatch.setattr(RestorePipeline, "_finishable", property(lambda self: False, lambda self, v: None),
                            raising=False)
    kv, pipe, store = _setup(max_inflight=None)
    pipe.run_driver(lambda: store)
    try:
        pipe.start(_job("A", 0, 2, 0), store)
        _taken(pipe)
        for b in store.batches:
            b.land()
        deadline = time.monotonic() + 5.0  # the driver copies the landed batches into place
        while not bool((kv[:2, 0] == torch.tensor([0, 1], dtype=torch.int8)).all()) and time.monotonic() < deadline:
            time.sleep(0.005)
        while flag and not pipe._finishable and time.monotonic() < deadline:
            time.sleep(0.005)
        first, waited = _poll_while_held(pipe, store, 0.3)
        done = _poll_until_done(pipe, store, first)
    finally:
        pipe.stop_driver()
    if flag:
        assert [j.req_id for j in first] == ["A"] and waited >= 0.25, (first, waited)
    else:
        assert first == [] and waited < 0.2, waited
    assert [bool(j.failed) for j in done] == [False] and kv[:2, 0].tolist() == [0, 1]


def test_without_the_driver_a_restore_waits_for_the_callers_polls() -> None:
    """Control: the same restore, polled by nobody, stays at its first two batches."""
    submitted, _kv, pipe = _restore_without_polls(driver=False)
    assert submitted == 2
    assert pipe.poll(_Store()) == []  # landed, in place, but the remaining batches only now get slabs


@pytest.mark.parametrize("hook", [True, False], ids=["woken", "control-no-hook"])
def test_a_slab_given_back_by_a_save_feeds_a_waiting_restore_at_once(monkeypatch: pytest.MonkeyPatch,
                                                                       hook: bool) -> None:
    """Saves hold every slab and a restore waits; when a save gives one back the driver feeds the restore at once,
    not at its next idle wake (made 30 s long here). The control: without the pool's hook it is still waiting."""
    import adp_connector.pipeline.restore as restore

    monkeypatch.setattr(restore, "DRIVER_IDLE_WAIT_S", 30.0)
    _, pipe, store = _setup(max_inflight=None)
    held = [pipe.pool.take(2 * PAGE, temporary=False) for _ in range(4)]  # the saves' slabs
    assert all(h is not None for h in held)
    pipe.run_driver(lambda: store)
    if not hook:
        pipe.pool.on_give = None
    try:
        pipe.start(_job("A", 10, 2, 0), store)
        _taken(pipe)
        assert store.batches == [] and pipe.wants_staging
        time.sleep(0.2)  # the driver is in its idle wait
        pipe.pool.give(held.pop())  # a save's slab written and back
        deadline = time.monotonic() + 3.0
        while not store.batches and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(store.batches) == (1 if hook else 0)
    finally:
        pipe.stop_driver()


def test_a_restores_time_splits_into_its_phases(monkeypatch) -> None:
    """queued (no slab for its first batch), io (first slab to last landing, slab_wait within it), copy and
    step_wait add up to the restore's time; counted per successful restore. On the pipeline's own clock, polled."""
    from adp_connector.pipeline import restore as R

    clock = [100.0]
    monkeypatch.setattr(R, "_now", lambda: clock[0])
    kv = torch.zeros(BLOCKS, PAGE, dtype=torch.int8)
    pool = StagingPool(2 * PAGE, 4 * 2 * PAGE, pinned=False)
    counters = Counters()
    pipe = RestorePipeline(PagedKV({0: [("layer0", kv, PAGE)]}), pool, {0: PAGE}, counters, timeout_s=30.0)
    store = _Store()
    held = [pool.take(2 * PAGE, temporary=False) for _ in range(4)]  # saves hold every slab
    pipe.start(_job("A", 10, 6, 0), store)
    job = pipe.jobs[0]
    job.t0 = 100.0
    assert store.batches == [] and pipe.wants_staging
    clock[0] = 101.0
    pool.give(held.pop())
    assert pipe.poll(store) == [] and store.submitted() == [10]  # first slab at 101: queued 1 s
    clock[0] = 103.0
    store.batches[0].land()
    assert pipe.poll(store) == [] and store.submitted() == [10, 12]  # its slab comes back: waited 101 -> 103
    clock[0] = 104.0
    for b in held:
        pool.give(b)
    assert pipe.poll(store) == [] and store.submitted() == [10, 12, 14]  # waited 103 -> 104
    clock[0] = 107.0
    store.batches[1].land()
    store.batches[2].land()
    done = pipe.poll(store)
    assert [j.req_id for j in done] == ["A"] and not done[0].failed
    got = {k.removeprefix(R.PHASE_COUNTER_PREFIX): v for k, v in counters.drain().items()
           if k.startswith(R.PHASE_COUNTER_PREFIX)}
    assert got == {"queued": 1.0, "io": 6.0, "copy": 0.0, "step_wait": 0.0, "slab_wait": 3.0}
    assert sum(v for k, v in got.items() if k != "slab_wait") == 7.0  # the restore's time, 100 -> 107


def test_a_restore_with_free_slabs_waits_for_none(monkeypatch) -> None:
    """Control: the same restore with every slab free is neither queued nor kept waiting for a slab."""
    from adp_connector.pipeline import restore as R

    clock = [100.0]
    monkeypatch.setattr(R, "_now", lambda: clock[0])
    _, pipe, store = _setup(max_inflight=None)
    pipe.start(_job("A", 10, 6, 0), store)
    pipe.jobs[0].t0 = 100.0
    assert store.submitted() == [10, 12, 14]
    clock[0] = 102.0
    for b in store.batches:
        b.land()
    assert [j.req_id for j in pipe.poll(store)] == ["A"]
    got = {k.removeprefix(R.PHASE_COUNTER_PREFIX): v for k, v in pipe.counters.drain().items()
           if k.startswith(R.PHASE_COUNTER_PREFIX)}
    assert got == {"queued": 0.0, "io": 2.0, "copy": 0.0, "step_wait": 0.0, "slab_wait": 0.0}


def test_restore_phases_put_the_copy_and_the_step_wait_apart() -> None:
    """A restore whose pages were seen in place (the driver's pass) before the caller's poll finished it."""
    from adp_connector.pipeline.restore import restore_phases

    job = LoadJob("A", [], [], t0=10.0)
    job.first_slab_t, job.landed_t, job.placed_t, job.slab_wait_s = 10.5, 12.0, 12.25, 0.75
    assert restore_phases(job, 13.0) == {"queued": 0.5, "io": 1.5, "copy": 0.25, "step_wait": 0.75,
                                         "slab_wait": 0.75}
    job.first_slab_t = job.landed_t = job.placed_t = None  # never got a slab (finished by failing elsewhere)
    assert restore_phases(job, 13.0) == {"queued": 3.0, "io": 0.0, "copy": 0.0, "step_wait": 0.0, "slab_wait": 0.75}


@pytest.mark.parametrize("driver", [True, False], ids=["driver", "control-no-driver"])
def test_with_the_driver_the_callers_start_waits_for_no_pass(driver: bool) -> None:
    """vLLM's engine thread starts restores and read-aheads every step; with the driver it only queues them and
    the driver applies them in the order given (a dropped read-ahead, then a restore, then a new read-ahead), so the
    engine never waits for a driver's pass nor submits batches (GPU run 30: ``start_load_kv`` 7.2 s of an 83 s
    point). The control: without the driver the same calls wait for whoever holds the pipeline."""
    kv, pipe, store = _setup(max_inflight=None)
    pipe.ahead_max_bytes = 8 * PAGE
    pipe.read_ahead("B", [(0, bytes([20 + i]) * 8) for i in range(2)], store)
    if driver:
        pipe.run_driver(lambda: store)
    try:
        def calls() -> None:
            pipe.drop_read_ahead("B")
            pipe.start(_job("A", 10, 2, 0), store)
            pipe.read_ahead("C", [(0, bytes([30 + i]) * 8) for i in range(2)], store)

        took = _call_while_held(pipe, calls, 0.3)
        _taken(pipe)
        assert [j.req_id for j in pipe.jobs] == ["A", "C"] and "B" not in pipe._ahead
        assert store.submitted() == [20, 10, 30]  # B's read-ahead went first; its slab then went to A
        for b in store.batches:
            b.land()
        done = _poll_until_done(pipe, store, [])
    finally:
        pipe.stop_driver()
    if driver:
        assert took < 0.1, took
    else:
        assert took >= 0.25, took
    assert [(j.req_id, j.failed) for j in done] == [("A", "")] and kv[:2, 0].tolist() == [10, 11]


@pytest.mark.parametrize("read_ahead", [False, True], ids=["started", "taking-over-a-read-ahead"])
def test_a_start_the_driver_cannot_apply_fails_its_restore(read_ahead: bool) -> None:
    """A restore whose start raises in the driver (here the store refuses the read notice) fails with a cause and
    finishes at a poll, so its request recomputes instead of waiting for a restore nobody runs; a read-ahead it was
    taking over (one of its two pages; the job holds its batch by then) gives its slab back."""
    _, pipe, store = _setup(max_inflight=None)
    if read_ahead:
        pipe.ahead_max_bytes = 8 * PAGE
        pipe.read_ahead("A", [(0, bytes([10]) * 8)], store)
        store.land_all()

    def refuse(keys: list[bytes]) -> None:
        raise RuntimeError("helper went away")

    store.note_reading = refuse  # type: ignore[method-assign]
    pipe.run_driver(lambda: store)
    try:
        pipe.start(_job("A", 10, 2, 0), store)
        _taken(pipe)
        done = _poll_until_done(pipe, store, [])
    finally:
        pipe.stop_driver()
    assert [j.req_id for j in done] == ["A"] and done[0].cause is Cause.SUBMIT_FAILED
    assert "helper went away" in done[0].failed
    assert pipe.jobs == [] and pipe._ahead == {}
    assert len(pipe.pool._free) == len(pipe.pool._slabs) == (1 if read_ahead else 0)  # every slab taken is back


@pytest.mark.parametrize("stop", [True, False], ids=["stop_driver", "control-thread-ended-only"])
def test_stopping_the_driver_applies_what_it_had_not_taken(stop: bool) -> None:
    """A start queued for a driver that never took it (here held in its start-up hook) is applied by stop_driver,
    not lost. The control: the driver thread ended without stop_driver, and the start was never applied."""
    import threading

    _, pipe, store = _setup(max_inflight=None)
    gate = threading.Event()
    pipe.run_driver(lambda: store, on_start=lambda: gate.wait(5.0))
    thread = pipe._driver
    assert thread is not None
    pipe.start(_job("A", 10, 2, 0), store)
    if stop:
        pipe.stop_driver(timeout=0.2)  # the driver is still in its hook: the join times out
    else:
        pipe._stopping = True
        pipe._wake.set()
    gate.set()
    thread.join(5.0)
    assert [j.req_id for j in pipe.jobs] == (["A"] if stop else [])
    assert store.submitted() == ([10] if stop else [])
