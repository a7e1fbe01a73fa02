"""The one-launch page copy: the runs that describe a group's pages, checked byte for byte against the per-layer path.

On a CPU the runs are applied by a reference that does what the kernel does (a memmove per run and page, at the
table's addresses); on a GPU the Triton kernel itself is compared with the per-layer path.
"""

from __future__ import annotations

import ctypes

import pytest

torch = pytest.importorskip("torch")

from adp_connector.pipeline import PagedKV  # noqa: E402
from adp_connector.pipeline.page_copy import MAX_RUNS, Run, layer_runs, page_runs, word_size  # noqa: E402

CUDA = torch.cuda.is_available()


def _group(device: str = "cpu", blocks: int = 10) -> list[tuple[str, torch.Tensor, int]]:
    """Layers as vLLM lays them out: FlashAttention ``(2, blocks, 16, 2, 8)`` seen block-major (K and V apart), an MLA
    latent ``(blocks, 16, 24)``, an fp32 layer through a permuted view, a wide one whose run takes two of the kernel's
    programs (the second partly masked), and a state page stored short of its block."""
    fa = torch.zeros((2, blocks, 16, 2, 8), dtype=torch.bfloat16, device=device).transpose(0, 1)
    mla = torch.zeros((blocks, 16, 24), dtype=torch.bfloat16, device=device)
    perm = torch.zeros((blocks, 8, 2, 4), dtype=torch.float32, device=device).permute(0, 2, 1, 3)
    wide = torch.zeros((blocks, 2100), dtype=torch.float32, device=device)  # 8,400 B: a run over one program's words
    state = torch.zeros((blocks, 40), dtype=torch.float32, device=device)
    layers = (("fa", fa), ("mla", mla), ("perm", perm), ("wide", wide))
    rows = [(n, t, t[0].numel() * t.element_size()) for n, t in layers]
    return [*rows, ("state", state, 96)]  # 96 of the state block's 160 bytes are stored


def _apply(runs: list[Run], pages: torch.Tensor, ids: list[int]) -> None:
    """The kernel's semantics on a CPU: each run of each page copied to its block's address."""
    src = pages.contiguous()
    for p, b in enumerate(ids):
        for r in runs:
            ctypes.memmove(r.addr + b * r.block_stride, src.data_ptr() + p * src.shape[1] + r.page_off, r.nbytes)


def _snapshot(rows: list[tuple[str, torch.Tensor, int]]) -> list[torch.Tensor]:
    return [t.detach().cpu().clone() for _, t, _ in rows]


def test_runs_write_exactly_what_the_per_layer_scatter_writes() -> None:
    ids = [7, 2, 5]  # block + 1 stays inside the 10 blocks (the negative control writes there)
    by_runs, by_layers = _group(), _group()
    page = PagedKV({0: by_layers}).page_bytes(0)
    pages = torch.randint(-128, 128, (len(ids), page), dtype=torch.int8)
    runs = page_runs(by_runs)
    assert runs is not None and len(runs) == 2 + 1 + 16 + 1 + 1  # K and V; MLA; 2 x 8 runs of 4 floats; wide; the state
    assert sum(r.nbytes for r in runs) == page
    _apply(runs, pages, ids)
    PagedKV({0: by_layers}).scatter(0, ids, pages)
    for a, b in zip(_snapshot(by_runs), _snapshot(by_layers), strict=True):
        assert torch.equal(a.view(torch.int8), b.view(torch.int8))
    assert torch.equal(PagedKV({0: by_runs}).gather(0, ids), pages)  # and the per-layer gather reads them back
    # negative control: a table one block off writes other blocks, which the comparison sees
    shifted = [Run(r.addr + r.block_stride, r.block_stride, r.page_off, r.nbytes) for r in runs]
    off = _group()
    _apply(shifted, pages, ids)
    assert not all(torch.equal(a, b) for a, b in zip(_snapshot(off), _snapshot(by_layers), strict=True))


def test_layouts_that_runs_cannot_describe_stay_on_the_per_layer_path() -> None:
    short = torch.zeros((4, 8), dtype=torch.int8)
    assert layer_runs(short, 9, 0) is None  # a block smaller than its page share
    many = torch.zeros((4, 2, MAX_RUNS + 1), dtype=torch.int8).transpose(1, 2)  # one-byte runs, too many of them
    assert layer_runs(many, 2 * (MAX_RUNS + 1), 0) is None
    assert page_runs([("ok", torch.zeros((4, 8)), 32), ("many", many, 2 * (MAX_RUNS + 1))]) is None
    kv = PagedKV({0: _group()})
    assert kv.fused(0) is None and kv.copy_paths[0] == "per_layer: the KV cache is not on a GPU"


def test_word_size_is_the_widest_that_divides_everything() -> None:
    assert word_size([Run(4096, 65536, 0, 32768), Run(8192, 65536, 32768, 32768)], 65536) == 8
    assert word_size([Run(4096, 65536, 0, 12)], 12) == 4
    assert word_size([Run(4096, 65536, 0, 6)], 6) == 2
    assert word_size([Run(4097, 65536, 0, 8)], 8) == 1  # an odd address


def test_page_copy_is_checked() -> None:
    with pytest.raises(ValueError, match="page_copy must be one of fused, per_layer, got 'fast'"):
        PagedKV({0: _group()}, page_copy="fast")


@pytest.mark.skipif(not CUDA, reason="the Triton kernel needs a GPU")
def test_fused_kernel_matches_the_per_layer_path_on_cuda() -> None:
    blocks = 4000
    ids = [7, 2, blocks - 1]
    fused_rows, layer_rows = _group("cuda", blocks), _group("cuda", blocks)
    fused, layered = PagedKV({0: fused_rows}), PagedKV({0: layer_rows}, page_copy="per_layer")
    pages = torch.randint(-128, 128, (len(ids), fused.page_bytes(0)), dtype=torch.int8).pin_memory()
    for kv in (fused, layered):
        kv.scatter(0, ids, pages).synchronize()
    assert fused.copy_paths[0] == "fused" and layered.copy_paths[0] == "per_layer: page_copy=per_layer"
    for (_, a, _), (_, b, _) in zip(fused_rows, layer_rows, strict=True):
        assert torch.equal(a.view(torch.int8), b.view(torch.int8))
    assert torch.equal(fused.gather(0, ids).cpu(), pages.cpu())
    assert torch.equal(fused.gather(0, ids[::-1]).cpu(), pages.cpu().flip(0))
    assert not fused.gather(0, [3]).cpu().any()  # control: a block never written reads back zero


_INTERPRETED = """
import json, sys, torch
from adp_connector.pipeline import PagedKV
from adp_connector.pipeline.page_copy import FusedPageCopy, page_runs
sys.path.insert(0, sys.argv[1])
from test_page_copy import _group
ids = [7, 2, 5]
fused_rows, layer_rows = _group(), _group()
layered = PagedKV({0: layer_rows})
pages = torch.randint(-128, 128, (len(ids), layered.page_bytes(0)), dtype=torch.int8)
def fused(rows):
    copy = FusedPageCopy(page_runs(rows), layered.page_bytes(0), torch.device("cpu"))
    if sys.argv[2] == "shifted":  # the negative control: every run one block further
        copy.table[:, 0] += copy.table[:, 1] * copy.word
    return copy
copy = fused(fused_rows)
copy.scatter(pages, torch.tensor(ids))
layered.scatter(0, ids, pages)
out = torch.zeros_like(pages)
fused(layer_rows).gather(torch.tensor(ids), out)  # what the per-layer path wrote, read by the kernel
print(json.dumps({"word": copy.word, "block": copy.block, "programs_per_run": -(-copy.max_words // copy.block),
                  "scatter_equal": all(torch.equal(a.view(torch.int8), b.view(torch.int8))
                  for (_, a, _), (_, b, _) in zip(fused_rows, layer_rows, strict=True)),
                  "gather_equal": torch.equal(out, pages)}))
"""


@pytest.mark.parametrize("table", ["exact", "shifted"])
def test_the_triton_kernel_itself_in_tritons_interpreter(table: str) -> None:
    """The kernel's own code on a CPU (``TRITON_INTERPRET=1``, in a fresh interpreter: Triton reads it at import), byte
    for byte against the per-layer path; a table shifted by one block (the negative control) must differ."""
    pytest.importorskip("triton")
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", _INTERPRETED, str(Path(__file__).parent), table], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["word"] == 8 and got["block"] == 1024 and got["programs_per_run"] == 2
    if table == "exact":
        assert got["scatter_equal"] and got["gather_equal"]
    else:
        assert not got["scatter_equal"] and not got["gather_equal"]


def test_a_kernel_that_fails_to_build_leaves_its_group_on_the_per_layer_path() -> None:
    class Broken:
        def gather(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("no compiler")

    kv = PagedKV({0: _group()})
    kv._fused[0] = Broken()  # as if the GPU checks had passed
    kv.prepare()
    assert kv.fused(0) is None and kv.copy_paths[0] == "per_layer: the fused kernel failed (RuntimeError: no compiler)"
    pages = torch.randint(-128, 128, (1, kv.page_bytes(0)), dtype=torch.int8)
    kv.scatter(0, [4], pages)  # and the group still moves, layer by layer
    assert torch.equal(kv.gather(0, [4]), pages)
    control = PagedKV({0: _group()})
    control.prepare()  # a CPU: nothing to build, nothing recorded as failed
    assert control.copy_paths[0] == "per_layer: the KV cache is not on a GPU"


def test_programs_are_sized_to_the_longest_run() -> None:
    from adp_connector.pipeline.page_copy import FusedPageCopy

    small = FusedPageCopy([Run(4096, 65536, 0, 512), Run(8192, 65536, 512, 512)], 1024, torch.device("cpu"))
    assert (small.block, small.num_warps) == (64, 1)  # 512-byte runs: 64 words, one program each
    big = FusedPageCopy([Run(4096, 1 << 20, 0, 32768), Run(40960, 1 << 20, 32768, 8)], 32776, torch.device("cpu"))
    assert (big.block, big.num_warps, big.max_words) == (1024, 4, 4096)  # 32 KiB K/V runs: 4 programs each


def test_a_group_with_nothing_in_its_pages_is_skipped_when_kernels_are_prepared() -> None:
    """A group of drafter layers only is registered with no rows (never saved nor restored): preparing the copy
    kernels passes over it (GPU run 19, vLLM 0.33: IndexError on such a group stopped the engine at start-up)."""
    kv = PagedKV({0: _group(), 1: []})
    kv.prepare()
    assert 1 not in kv.copy_paths and kv.copy_paths[0] == "per_layer: the KV cache is not on a GPU"
    with pytest.raises(IndexError):  # control: the group itself has no device to build a kernel for
        kv.fused(1)
