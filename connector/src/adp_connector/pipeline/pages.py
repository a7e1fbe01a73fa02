"""Pages of KV-cache blocks: gather a block's bytes from every layer of a group into one page row, scatter back.

A page of group ``g`` is the concatenation, layer by layer, of the first ``nbytes`` bytes of block ``b`` of each
layer tensor (``tensor[b]`` in logical order; tensors may be strided views). On a GPU, gathers are queued on the
current (compute) stream and restores copied and scattered on a side stream, by default of a higher priority than
the compute stream: the scatter's kernels then start ahead of queued prefill kernels instead of waiting until a long
prefill step drains, and a request waiting for its restore waits less (the compute stream loses as much GPU time as
the scatter takes, which it would spend anyway). On a GPU a batch's pages move between the staging copy and every
layer in one kernel launch where the layout allows (:mod:`.page_copy`, ``page_copy="fused"``); otherwise, and on a
CPU, with tensor calls per layer.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from .page_copy import FusedPageCopy, page_runs, triton_missing

log = logging.getLogger("vllm.adp_kv.pages")
Rows = list[tuple[str, torch.Tensor, int]]  # (layer name, block-major tensor, page bytes of that layer)
RESTORE_STREAM_PRIORITIES = {"high": -1, "normal": 0}  # CUDA stream priority (lower is sooner; compute runs at 0)
PAGE_COPIES = ("fused", "per_layer")  # GPU: one kernel per batch for every layer (where allowed), or calls per layer


class PageSink(Protocol):
    """Where restored pages land (:class:`PagedKV`, or a benchmark's stand-in)."""

    def scatter(self, gid: int, block_ids: list[int], pages: torch.Tensor) -> Any:
        """Write host pages ``[n, page_bytes]`` at ``block_ids``; a CUDA event marking them done, or None."""
        ...

    def gather(self, gid: int, block_ids: list[int]) -> torch.Tensor:
        """The pages at ``block_ids`` as host int8 ``[n, page_bytes]`` (audit)."""
        ...

    def zero(self, gid: int, block_id: int) -> None:
        """Zero-fill the layers of ``gid`` that pages do not carry (drafter layers) at ``block_id``."""
        ...


class PagedKV:
    """The registered KV tensors of every group, as pages (``rows[gid]``; ``unstored[gid]``: zero-filled layers)."""

    def __init__(self, rows: dict[int, Rows], unstored: dict[int, list[torch.Tensor]] | None = None,
                 restore_priority: str = "high", page_copy: str = "fused") -> None:
        if restore_priority not in RESTORE_STREAM_PRIORITIES:
            raise ValueError(f"restore_priority must be one of {', '.join(RESTORE_STREAM_PRIORITIES)}, "
                             f"got {restore_priority!r}")
        if page_copy not in PAGE_COPIES:
            raise ValueError(f"page_copy must be one of {', '.join(PAGE_COPIES)}, got {page_copy!r}")
        self.rows = rows
        self.unstored = unstored or {}
        self.restore_priority = restore_priority
        self.page_copy = page_copy
        self._h2d_stream: Any = None
        self._fused: dict[int, FusedPageCopy | None] = {}
        self.copy_paths: dict[int, str] = {}  # group -> "fused" or "per_layer: <why>", once the group first moved

    def fused(self, gid: int) -> FusedPageCopy | None:
        """The group's one-launch copy, or None (a CPU, ``page_copy="per_layer"``, no Triton, or a layout that runs
        cannot describe); decided on the group's first copy and logged once."""
        if gid in self._fused:
            return self._fused[gid]
        copy, why = None, ""
        if self.device(gid).type != "cuda":
            why = "the KV cache is not on a GPU"
        elif self.page_copy != "fused":
            why = f"page_copy={self.page_copy}"
        elif (missing := triton_missing()) is not None:
            why = f"no Triton ({missing})"
        elif (runs := page_runs(self.rows[gid])) is None:
            why = "a layer's block is not a list of contiguous runs"
        else:
            copy = FusedPageCopy(runs, self.page_bytes(gid), self.device(gid))
        self._fused[gid] = copy
        self.copy_paths[gid] = "fused" if copy is not None else f"per_layer: {why}"
        if copy is not None:
            log.info("ADP KV: group %d pages move in one kernel per batch (%d runs, %d-byte words)", gid, copy.runs,
                     copy.word)
        elif self.device(gid).type == "cuda":
            log.info("ADP KV: group %d pages move layer by layer (%s)", gid, why)
        return copy

    def prepare(self) -> None:
        """Decide every group's copy path now and compile the fused kernels (a Triton JIT takes seconds), so the
        first save or restore does not wait for it: block 0's bytes are gathered and written back in place (call
        it before the engine's first step, while nothing else writes the cache). A kernel that fails to build leaves
        its group on the per-layer path, logged."""
        for gid, rows in self.rows.items():
            if not rows:
                continue  # a group with nothing in its pages (drafter layers only): never saved nor restored
            fused = self.fused(gid)
            if fused is None:
                continue
            dev = self.device(gid)
            try:
                ids = index_tensor([0], dev)
                page = fused.gather(ids, torch.empty((1, self.page_bytes(gid)), dtype=torch.int8, device=dev))
                fused.scatter(page, ids)
                torch.cuda.synchronize(dev)
            except Exception as exc:  # a Triton or driver that cannot build or run the kernel
                self._fused[gid] = None
                self.copy_paths[gid] = f"per_layer: the fused kernel failed ({type(exc).__name__}: {exc})"
                log.warning("ADP KV: group %d pages move layer by layer: %s", gid, self.copy_paths[gid])

    def device(self, gid: int) -> torch.device:
        return self.rows[gid][0][1].device

    def page_bytes(self, gid: int) -> int:
        return sum(b for _, _, b in self.rows[gid])

    def gather(self, gid: int, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Pages of ``block_ids`` as one host int8 tensor ``[n, page_bytes]`` (into ``out``), synchronously. On a
        GPU the page rows are assembled on the device and cross PCIe in one copy."""
        dev = self.device(gid)
        if out is None:
            out = torch.empty((len(block_ids), self.page_bytes(gid)), dtype=torch.int8, pin_memory=dev.type == "cuda")
        if dev.type == "cpu":
            self.gather_on_device(gid, block_ids, out)
        else:
            out.copy_(self.gather_on_device(gid, block_ids))
        return out

    def gather_on_device(self, gid: int, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Pages as ``[n, page_bytes]`` int8 on the KV cache's device, queued on the current stream."""
        rows = self.rows[gid]
        dev = self.device(gid)
        n = len(block_ids)
        ids = index_tensor(block_ids, dev)
        dst = out if out is not None else torch.empty((n, self.page_bytes(gid)), dtype=torch.int8, device=dev)
        fused = self.fused(gid)
        if fused is not None and dst.is_contiguous():
            return fused.gather(ids, dst)
        off = 0
        for _, t, nb in rows:
            dst[:, off:off + nb].copy_(t.index_select(0, ids).reshape(n, -1).view(torch.int8)[:, :nb])
            off += nb
        return dst

    def scatter(self, gid: int, block_ids: list[int], pages: torch.Tensor) -> Any:
        """Write host pages ``[n, page_bytes]`` into the group's layers at ``block_ids``.

        On a GPU: one host -> device copy and the scatter, queued on a side stream (the compute stream keeps
        running other requests' steps); returns the CUDA event marking them done (None on a CPU: done on return).
        """
        dev = self.device(gid)
        fused = self.fused(gid)
        if dev.type == "cpu":
            self._scatter_rows(gid, index_tensor(block_ids, dev), pages)
            return None
        with torch.cuda.stream(self.restore_stream(dev)):
            ids, src = index_tensor(block_ids, dev), pages.to(dev, non_blocking=True)
            if fused is not None and src.is_contiguous():
                fused.scatter(src, ids)
            else:
                self._scatter_rows(gid, ids, src)
            done = torch.cuda.Event()
            done.record()
        return done

    def restore_stream(self, dev: torch.device) -> Any:
        """The side stream restores are copied and scattered on (created on first use, at ``restore_priority``)."""
        if self._h2d_stream is None:
            self._h2d_stream = torch.cuda.Stream(device=dev, priority=RESTORE_STREAM_PRIORITIES[self.restore_priority])
        return self._h2d_stream

    def _scatter_rows(self, gid: int, ids: torch.Tensor, src: torch.Tensor) -> None:
        off = 0
        n = src.shape[0]
        for _, t, nb in self.rows[gid]:
            per_block = t[0].numel() * t.element_size()
            if nb == per_block:  # page bytes are the block in logical order (gather); index_copy_ takes any strides
                t.index_copy_(0, ids, _rows_as(src[:, off:off + nb], t, n))
            else:  # a padded page: only the real bytes are stored
                cur = t.index_select(0, ids).contiguous()
                flat = cur.reshape(n, -1).view(torch.int8)
                flat[:, :nb].copy_(src[:, off:off + nb])
                t.index_copy_(0, ids, cur)
            off += nb

    def zero(self, gid: int, block_id: int) -> None:
        for t in self.unstored.get(gid, ()):
            t[block_id].zero_()


def index_tensor(block_ids: list[int], dev: torch.device) -> torch.Tensor:
    """Block ids on ``dev``; on a GPU through pinned memory, so the host does not wait for the stream."""
    ids = torch.tensor(block_ids, dtype=torch.long)
    if dev.type == "cpu":
        return ids
    return ids.pin_memory().to(dev, non_blocking=True)


def _rows_as(cols: torch.Tensor, like: torch.Tensor, n: int) -> torch.Tensor:
    """The byte columns ``cols`` ``[n, nb]`` (a strided slice of the pages) as ``n`` blocks of ``like``: a view
    when the slice allows one (its rows stay in place, so the scatter reads the pages directly), else a copy."""
    try:
        return cols.view(like.dtype).view(n, *like.shape[1:])
    except RuntimeError:  # a slice the dtype view cannot describe (offset or stride not a multiple of the element)
        return cols.contiguous().view(like.dtype).reshape(n, *like.shape[1:])
