"""SavePipeline stages the right bytes: every saved page equals the block gathered on its own, on the CPU and (where
one is present) on a CUDA GPU, where a step's pages are gathered at once and copied out slab by slab.

A unit test of the pipeline layer: the store is a stand-in that keeps what it is given.
"""

from __future__ import annotations

import threading

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
