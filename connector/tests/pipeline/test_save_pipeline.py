"""SavePipeline stages the right bytes: every saved page equals the block gathered on its own, on the CPU and (where
one is present) on a CUDA GPU, where a step's pages are gathered at once and copied out slab by slab.

A unit test of the pipeline layer: the store is a stand-in that keeps what it is given.
"""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")

from adp_connector.pipeline import Counters, PagedKV, SavePipeline, StagingPool  # noqa: E402
from adp_connector.pipeline import save as save_mod  # noqa: E402
from adp_connector.store.results import BatchHandle, PageResult, PageStatus  # noqa: E402

BLOCKS, BS, HEADS, DIM, LAYERS = 64, 16, 2, 32, 3
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class _KeepingStore:
    def __init__(self) -> None:
        self.saved: dict[bytes, bytes] = {}
        self.lock = threading.Lock()

    def save_batch(self, keys, buffers) -> BatchHandle:
        h = BatchHandle("save", len(keys))
        with self.lock:
            for k, b in zip(keys, buffers, strict=True):
                self.saved[bytes(k)] = bytes(memoryview(b).cast("B"))
        h._set([PageResult(bytes(k), PageStatus.OK, len(memoryview(b).cast("B"))) for k, b in zip(keys, buffers,
                                                                                                  strict=True)])
        return h


def _kv(device: str) -> tuple[PagedKV, list[torch.Tensor]]:
    """vLLM's flash-attention layout per layer, [2, blocks, block, heads, dim], seen block-major (a strided view)."""
    g = torch.Generator().manual_seed(0)
    raw = [torch.randn(2, BLOCKS, BS, HEADS, DIM, generator=g).to(torch.bfloat16).to(device) for _ in range(LAYERS)]
    views = [t.permute(1, 0, 2, 3, 4) for t in raw]
    nb = 2 * BS * HEADS * DIM * 2
    return PagedKV({0: [(f"l{i}", v, nb) for i, v in enumerate(views)]}), views


def _expected(views: list[torch.Tensor], block: int) -> bytes:
    return b"".join(bytes(v[block].contiguous().cpu().view(torch.int8).numpy().tobytes()) for v in views)


def _save_all(device: str, blocks: list[int], step_gather: bool | None = None
              ) -> tuple[_KeepingStore, list[torch.Tensor], Counters]:
    kv, views = _kv(device)
    pb = kv.page_bytes(0)
    pool = StagingPool(4 * pb, 64 * pb, pinned=device == "cuda")  # 4 pages a slab: a save of 20 is 5 slabs
    counters = Counters()
    pipe = SavePipeline(kv, pool, counters, max_pending_bytes=1 << 30, slab_required=False, step_gather=step_gather)
    store = _KeepingStore()
    refs = [(0, b, bytes([b]) * 32) for b in blocks]
    pipe.save(store, 0, refs, {})
    pipe.close(30)
    return store, views, counters


@pytest.mark.parametrize("step_gather", [None, True, False], ids=["device-default", "step-gather", "per-slab"])
@pytest.mark.parametrize("device", DEVICES)
def test_every_saved_page_is_its_block(device: str, step_gather: bool | None) -> None:
    blocks = [3, 17, 5, 40, 41, 42, 9, 0, 63, 12, 33, 34, 35, 36, 2, 50, 51, 7, 8, 60]
    store, views, counters = _save_all(device, blocks, step_gather)
    assert counters["pages_saved"] == len(blocks)
    for b in blocks:
        assert store.saved[bytes([b]) * 32] == _expected(views, b), b
    assert store.saved[bytes([3]) * 32] != _expected(views, 17)  # control: another block's bytes differ


@pytest.mark.parametrize("device", DEVICES)
def test_one_gather_per_step_or_one_per_slab_give_the_same_bytes(device: str, monkeypatch) -> None:
    """The step-wide gather (the GPU default; forced here so the CPU runs it too) against a gather per slab (as
    before; GATHER_MAX_BYTES 0): the pages saved are byte-identical."""
    blocks = list(range(5, 27))
    together, _, _ = _save_all(device, blocks, step_gather=True)
    monkeypatch.setattr(save_mod, "GATHER_MAX_BYTES", 0)
    apart, _, _ = _save_all(device, blocks, step_gather=True)
    assert together.saved == apart.saved and len(apart.saved) == len(blocks)


class _HeldStore(_KeepingStore):
    """Keeps what it is given, but completes each batch only when :meth:`release` is called (a card that writes
    slower than the engine computes)."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[tuple[BatchHandle, list[PageResult]]] = []

    def save_batch(self, keys, buffers) -> BatchHandle:
        h = BatchHandle("save", len(keys))
        res = []
        with self.lock:
            for k, b in zip(keys, buffers, strict=True):
                self.saved[bytes(k)] = bytes(memoryview(b).cast("B"))
                res.append(PageResult(bytes(k), PageStatus.OK, len(memoryview(b).cast("B"))))
            self.held.append((h, res))
        return h

    def release(self) -> None:
        with self.lock:
            held, self.held = self.held, []
        for h, res in held:
            h._set(res)


def _burst(device: str, spill_pages: int, blocks: list[int]):
    """One slab of staging (4 pages) and a store that writes nothing until released: a save of ``blocks`` finds no
    room past its first slab. Then the engine reuses the blocks (overwritten) and the store catches up."""
    kv, views = _kv(device)
    pb = kv.page_bytes(0)
    before = {b: _expected(views, b) for b in blocks}
    pool = StagingPool(4 * pb, 4 * pb, pinned=device == "cuda")
    counters = Counters()
    pipe = SavePipeline(kv, pool, counters, max_pending_bytes=1 << 30, slab_required=True, step_gather=False,
                        max_spill_bytes=spill_pages * pb)
    store = _HeldStore()
    pipe.save(store, 0, [(0, b, bytes([b]) * 32) for b in blocks], {})
    waited = pipe.waiting_pages
    for v in views:  # vLLM frees the blocks and computes other requests into them
        v[blocks].fill_(7.0)
    for _ in range(50):
        store.release()
        time.sleep(0.01)
        pipe.drain()
        if not pipe.waiting_pages and not pipe.pending_bytes:
            break
    store.release()
    pipe.close(30)
    return store, before, counters, waited


@pytest.mark.parametrize("device", DEVICES)
def test_saves_wait_for_staging_instead_of_being_dropped(device: str) -> None:
    """Issue 14 item 4: a burst over the staging waits in copies taken when it was asked for, and every page is
    written with the bytes its block had then, though the blocks were reused before staging came back."""
    blocks = list(range(10, 30))
    store, before, counters, waited = _burst(device, spill_pages=64, blocks=blocks)
    assert waited == 16 and counters["saves_waited"] == 16
    assert counters["saves_dropped"] == 0 and counters["pages_saved"] == 20
    for b in blocks:
        assert store.saved[bytes([b]) * 32] == before[b], b


@pytest.mark.parametrize("device", DEVICES)
def test_saves_past_the_spill_bound_are_dropped_with_their_cause(device: str) -> None:
    """The control: with room for 8 waiting pages, 8 of the 16 that found no staging are dropped (no_staging), the
    rest written; with no spill at all (save_spill_mb 0) all 16 are dropped, as before."""
    blocks = list(range(10, 30))
    store, _, counters, _ = _burst(device, spill_pages=8, blocks=blocks)
    assert counters["saves_waited"] == 8 and counters["saves_dropped"] == 8
    assert counters[save_mod.DROP_COUNTER_PREFIX + "no_staging"] == 8 and len(store.saved) == 12
    store, _, counters, _ = _burst(device, spill_pages=0, blocks=blocks)
    assert counters["saves_waited"] == 0 and counters["saves_dropped"] == 16 and len(store.saved) == 4


def test_saves_still_waiting_at_close_are_dropped_as_closed() -> None:
    """A store that never writes: close() waits its bound, then drops what still waits (cause ``closed``)."""
    kv, _ = _kv("cpu")
    pb = kv.page_bytes(0)
    counters = Counters()
    pipe = SavePipeline(kv, StagingPool(4 * pb, 4 * pb, pinned=False), counters, max_pending_bytes=1 << 30,
                        slab_required=True, step_gather=False, max_spill_bytes=64 * pb)
    pipe.save(_HeldStore(), 0, [(0, b, bytes([b]) * 32) for b in range(12)], {})
    pipe.close(0.2)
    assert counters["saves_dropped"] == 8 and counters[save_mod.DROP_COUNTER_PREFIX + "closed"] == 8
    assert pipe.waiting_pages == 0 and pipe.spill_bytes == 0


def test_waiting_saves_let_restores_take_the_slabs_first() -> None:
    """While a restore waits for a slab (``yield_staging``), drain() stages nothing; then it does."""
    kv, _ = _kv("cpu")
    pb = kv.page_bytes(0)
    counters = Counters()
    restores_waiting = [True]
    pipe = SavePipeline(kv, StagingPool(4 * pb, 4 * pb, pinned=False), counters, max_pending_bytes=1 << 30,
                        slab_required=True, step_gather=False, max_spill_bytes=64 * pb,
                        yield_staging=lambda: restores_waiting[0])
    store = _HeldStore()
    pool = pipe.pool
    pipe.save(store, 0, [(0, b, bytes([b]) * 32) for b in range(8)], {})
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the first slab written and back in the pool
        store.release()
        slab = pool.take(pb, temporary=False)
        if slab is not None:
            pool.give(slab)
            break
        time.sleep(0.01)
    assert pipe.drain() == 0 and pipe.waiting_pages == 4  # the slab is free, but a restore wants it
    restores_waiting[0] = False
    assert pipe.drain() == 4 and pipe.waiting_pages == 0
    deadline = time.monotonic() + 10
    while pipe.pending_bytes and time.monotonic() < deadline:  # the submitter thread hands it to the store
        store.release()
        time.sleep(0.01)
    pipe.close(10)
    assert counters["pages_saved"] == 8 and counters["saves_dropped"] == 0


class _FullCardStore(_KeepingStore):
    """Declines pages 1 and 3 as a full card under ``frequency`` admission would, and fails page 2 (an I/O error)."""

    _STATUS = (PageStatus.OK, PageStatus.NOT_ADMITTED, PageStatus.ERROR, PageStatus.NOT_ADMITTED)

    def save_batch(self, keys, buffers) -> BatchHandle:
        h = BatchHandle("save", len(keys))
        h._set([PageResult(bytes(k), st, len(memoryview(b).cast("B")) if st is PageStatus.OK else 0)
                for k, b, st in zip(keys, buffers, self._STATUS, strict=True)])
        return h


def test_pages_a_full_card_declines_are_counted_apart_and_not_reported_as_failed() -> None:
    """A page the card does not admit is neither an error nor a drop: counted in ``saves_not_admitted``, recorded in
    the ledger as such (a restore that misses it names why), and not reported as a failed save, which would make the
    scheduler plan it again at once and re-walk the local hits over it (the request that next computes it asks
    again instead). Control: the page that failed with an error in the same batch is reported."""
    kv, _views = _kv("cpu")
    pb = kv.page_bytes(0)
    counters = Counters()
    pipe = SavePipeline(kv, StagingPool(4 * pb, 64 * pb, pinned=False), counters, max_pending_bytes=1 << 30,
                        slab_required=False)
    refs = [(0, b, bytes([b]) * 32) for b in range(4)]
    pipe.save(_FullCardStore(), 0, refs, {})
    pipe.close(30)
    assert counters["pages_saved"] == 1 and counters["saves_not_admitted"] == 2 and counters["save_errors"] == 1
    assert pipe.take_failed_keys() == [bytes([2]) * 32]
    declined = pipe.take_declined_keys()  # for the scheduler to forget it asked (not to plan them again at once)
    assert len(declined) == 2 and bytes([2]) * 32 not in declined and bytes([0]) * 32 not in declined
    assert pipe.take_declined_keys() == []
    outcome = pipe.ledger.get(bytes([1]) * 32)
    assert outcome is not None and outcome[0].startswith("was not admitted")
    assert pipe.ledger.get(bytes([0]) * 32)[0] == "committed"  # control: an admitted page of the same batch


class _CopyEvent:
    """A device -> host copy's event that never completes by itself; records waits on it."""

    def __init__(self, waits: list[_CopyEvent]) -> None:
        self.waits = waits
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waits.append(self)
        self.done = True


def _queued(pipe: SavePipeline, waits: list[_CopyEvent], nbytes: int) -> _CopyEvent:
    ev = _CopyEvent(waits)
    pipe._d2h_inflight.append((ev, nbytes, pipe._step))
    return ev


@pytest.mark.parametrize("earlier_step", [False, True], ids=["this-step", "control-earlier-step"])
def test_the_copies_bound_waits_only_for_earlier_steps(earlier_step: bool) -> None:
    """A step's copies start only once its forward has run: waiting for them held the engine thread until the GPU
    finished the step. Past the bound, only copies of earlier steps are waited for, oldest first. The control: the
    same bytes queued by the step before are waited for until the rest fits the bound."""
    kv, _ = _kv("cpu")
    pipe = SavePipeline(kv, StagingPool(1024, 4096, pinned=False), Counters(), max_pending_bytes=1 << 30,
                        slab_required=False)
    waits: list[_CopyEvent] = []
    pipe.new_step()
    first = [_queued(pipe, waits, save_mod.D2H_INFLIGHT_BYTES // 2) for _ in range(3)]  # 1.5x the bound
    if earlier_step:
        pipe.new_step()
    pipe._bound_d2h()
    assert waits == (first[:1] if earlier_step else []), waits
    assert len(pipe._d2h_inflight) == (2 if earlier_step else 3)
