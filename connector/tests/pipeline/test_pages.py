"""PagedKV: pages scattered into layers of several dtypes and layouts come back byte for byte."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from adp_connector.pipeline import PagedKV  # noqa: E402
from adp_connector.pipeline.pages import _rows_as  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _layers(device: str) -> list[tuple[str, torch.Tensor, int]]:
    """Three layers of one group: bf16 K/V, fp32, and a bf16 layer seen through a permuted (non-contiguous) view."""
    blocks = 12
    a = torch.zeros((blocks, 2, 4, 2, 8), dtype=torch.bfloat16, device=device)
    b = torch.zeros((blocks, 4, 6), dtype=torch.float32, device=device)
    c = torch.zeros((blocks, 8, 2, 4), dtype=torch.bfloat16, device=device).permute(0, 2, 1, 3)
    return [(name, t, t[0].numel() * t.element_size()) for name, t in (("a", a), ("b", b), ("c", c))]


@pytest.mark.parametrize("priority", ["high", "normal"])
@pytest.mark.parametrize("device", DEVICES)
def test_scatter_then_gather_is_byte_identical(device: str, priority: str) -> None:
    rows = _layers(device)
    kv = PagedKV({0: rows}, restore_priority=priority)
    page = kv.page_bytes(0)
    pages = torch.randint(-128, 128, (3, page), dtype=torch.int8)
    done = kv.scatter(0, [7, 2, 9], pages)
    if done is not None:
        done.synchronize()
    assert torch.equal(kv.gather(0, [7, 2, 9]).cpu(), pages)
    assert torch.equal(kv.gather(0, [2]).cpu(), pages[1:2])
    # negative control: the blocks not written are still zero, and other ids read back other bytes
    assert not kv.gather(0, [3]).cpu().any()
    assert not torch.equal(kv.gather(0, [2, 7, 9]).cpu(), pages)


def test_rows_are_read_in_place_when_the_slice_allows_it() -> None:
    """The scatter's source is a view of the pages (no per-layer copy); a slice the dtype cannot describe copies."""
    pages = torch.randint(-128, 128, (3, 96), dtype=torch.int8)
    like = torch.zeros((5, 2, 4, 2), dtype=torch.bfloat16)
    v = _rows_as(pages[:, 64:96], like, 3)
    assert v.shape == (3, 2, 4, 2) and v.data_ptr() == pages[:, 64:].data_ptr()
    odd = torch.randint(-128, 128, (3, 97), dtype=torch.int8)  # rows 97 bytes apart: no bf16 view exists
    w = _rows_as(odd[:, 65:97], like, 3)
    assert w.shape == (3, 2, 4, 2) and w.data_ptr() != odd[:, 65:].data_ptr()
    assert torch.equal(w.contiguous().view(torch.int8).reshape(3, 32), odd[:, 65:97])


def test_restore_priority_is_checked() -> None:
    with pytest.raises(ValueError, match="restore_priority must be one of high, normal, got 'urgent'"):
        PagedKV({0: _layers("cpu")}, restore_priority="urgent")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA stream priorities need a GPU")
def test_restores_run_on_a_stream_above_the_compute_streams_priority() -> None:
    """high: the restore stream outranks the default (compute) stream; normal (the negative control): it does not."""
    compute = torch.cuda.current_stream().priority
    dev = torch.device("cuda")
    assert PagedKV({0: _layers("cuda")}, restore_priority="high").restore_stream(dev).priority < compute
    assert PagedKV({0: _layers("cuda")}, restore_priority="normal").restore_stream(dev).priority == compute
