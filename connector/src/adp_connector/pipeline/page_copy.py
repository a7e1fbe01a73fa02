"""Page <-> KV-cache copies of a whole batch in one GPU kernel launch, every layer of a group at once.

A page of a group is, layer by layer, the first ``nb`` bytes of block ``b`` of each layer tensor in logical order
(:mod:`.pages`). Within one layer those bytes are a few contiguous runs at fixed distances from the block's start:
a FlashAttention layer ``(2, num_blocks, ...)`` seen block-major gives two runs (K, then V, ``num_blocks`` blocks
apart), an MLA layer one. :func:`page_runs` lists every run of every layer once, as a table of (address in block 0,
bytes between blocks, offset in the page, length), and :class:`FusedPageCopy` copies every run of every page of a
batch with one Triton launch. The per-layer path issues about four tensor calls per layer, each a trip through the
interpreter lock of the engine's process, which its scheduler holds for long stretches; a 32-layer page batch is
then ~130 calls against one.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

Rows = list[tuple[str, torch.Tensor, int]]  # (layer name, block-major tensor, page bytes of that layer)
MAX_RUNS = 4096  # a group whose pages need more runs than this stays on the per-layer path
WORD_SIZES = (8, 4, 2, 1)  # the widest element that every address, stride, offset and length is a multiple of
MAX_BLOCK = 1024  # words per Triton program at most (a run longer than this takes several programs)


@dataclass(frozen=True)
class Run:
    """One contiguous span of a page in a layer tensor (bytes)."""

    addr: int  # where the span is in block 0
    block_stride: int  # bytes from one block to the next
    page_off: int  # where it is in the page
    nbytes: int


def layer_runs(t: torch.Tensor, nb: int, page_off: int) -> list[Run] | None:
    """The runs holding the first ``nb`` bytes of ``t[b]`` in logical order, at ``page_off`` in the page; None when
    ``t`` has a negative stride or its block holds fewer than ``nb`` bytes."""
    esize = t.element_size()
    if any(s < 0 for s in t.stride()) or t[0].numel() * esize < nb:
        return None
    dims = [(size, stride) for size, stride in zip(t.shape[1:], t.stride()[1:], strict=True) if size != 1]
    run_elems = 1  # the contiguous innermost dims make one run
    while dims and dims[-1][1] == run_elems:
        run_elems *= dims.pop()[0]
    starts = [0]  # element offsets of the runs in logical order: the outer dims, slowest first
    for size, stride in dims:
        starts = [s + i * stride for s in starts for i in range(size)]
        if len(starts) > MAX_RUNS:
            return None
    runs: list[Run] = []
    base, step, left, off = t.data_ptr(), t.stride(0) * esize, nb, page_off
    for s in starts:
        if left <= 0:
            break
        n = min(run_elems * esize, left)
        runs.append(Run(base + s * esize, step, off, n))
        off, left = off + n, left - n
    return runs


def page_runs(rows: Rows) -> list[Run] | None:
    """Every run of a group's page (see :func:`layer_runs`), or None when a layer cannot be described by runs."""
    runs: list[Run] = []
    off = 0
    for _, t, nb in rows:
        lr = layer_runs(t, nb, off)
        if lr is None:
            return None
        runs += lr
        off += nb
    return runs if len(runs) <= MAX_RUNS else None


def word_size(runs: list[Run], page_bytes: int) -> int:
    """The widest word that every address, stride, offset and length of ``runs`` (and the page size) divides."""
    common = math.gcd(page_bytes, *(math.gcd(r.addr, r.block_stride, r.page_off, r.nbytes) for r in runs))
    return next(w for w in WORD_SIZES if common % w == 0)


_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


@functools.cache
def _kernel() -> Any:
    """The Triton kernel (imported on first use: only a GPU host needs Triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy_runs(pages, ids, table, page_words, TO_KV: tl.constexpr, BLOCK: tl.constexpr):
        p = tl.program_id(0)  # page of the batch
        r = tl.program_id(1)  # run
        c = tl.program_id(2)  # BLOCK-word chunk of the run
        addr = tl.load(table + r * 4)
        block_stride = tl.load(table + r * 4 + 1)
        page_off = tl.load(table + r * 4 + 2)
        nwords = tl.load(table + r * 4 + 3)
        block = tl.load(ids + p)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        mask = offs < nwords
        kv = addr.to(tl.pointer_type(pages.dtype.element_ty)) + block * block_stride + offs
        pg = pages + p.to(tl.int64) * page_words + page_off + offs
        if TO_KV:
            tl.store(kv, tl.load(pg, mask=mask), mask=mask)
        else:
            tl.store(pg, tl.load(kv, mask=mask), mask=mask)

    return copy_runs


def triton_missing() -> str | None:
    """Why the fused copy cannot run here (Triton not importable), or None."""
    try:
        _kernel()
    except Exception as exc:  # ImportError, or a Triton too old for the kernel
        return f"{type(exc).__name__}: {exc}"
    return None


class FusedPageCopy:
    """One group's page runs on its device: :meth:`scatter` and :meth:`gather` move a batch in one launch each.

    The table holds raw addresses of the layer tensors: they must stay where they are (vLLM allocates the KV cache
    once, before the connector registers it).
    """

    def __init__(self, runs: list[Run], page_bytes: int, device: torch.device) -> None:
        self.word = word_size(runs, page_bytes)
        w = self.word
        self.page_words = page_bytes // w
        self.max_words = max(r.nbytes for r in runs) // w
        # a program per (page, run, chunk), sized to the longest run: short runs (a layer whose block is many small
        # spans) leave few lanes idle
        self.block = min(MAX_BLOCK, 1 << max(5, (self.max_words - 1).bit_length()))
        self.num_warps = max(1, min(4, self.block // 256))
        rows = [(r.addr, r.block_stride // w, r.page_off // w, r.nbytes // w) for r in runs]
        self.table = torch.tensor(rows, dtype=torch.int64).to(device)
        self.runs = len(runs)

    def _launch(self, pages: torch.Tensor, ids: torch.Tensor, to_kv: bool) -> None:
        n = ids.numel()
        if not n:
            return
        words = pages.view(_WORD_DTYPES[self.word])
        grid = (n, self.runs, -(-self.max_words // self.block))
        _kernel()[grid](words, ids, self.table, self.page_words, TO_KV=to_kv, BLOCK=self.block,
                        num_warps=self.num_warps)

    def scatter(self, pages: torch.Tensor, ids: torch.Tensor) -> None:
        """Write device pages ``[n, page_bytes]`` (int8, contiguous) into the blocks ``ids`` (int64, on the device),
        queued on the current stream."""
        self._launch(pages, ids, True)

    def gather(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The pages of blocks ``ids`` into ``out`` (device int8 ``[n, page_bytes]``, contiguous), queued on the
        current stream."""
        self._launch(out, ids, False)
        return out
