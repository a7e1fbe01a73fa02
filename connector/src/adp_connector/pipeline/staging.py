"""Host staging buffers for page I/O: fixed-size slabs, pinned when the KV cache is on a GPU, reused.

Pinning memory (``cudaHostAlloc``) costs about as much as copying it, so a connector that pins a fresh buffer per
step pays that on the critical path; slabs are allocated once and recycled. Beyond ``max_bytes`` of slabs a request
gets a temporary (unpooled, unpinned) buffer: the I/O still works, only slower.

With an ``arena`` (host memory shared with the store's helper process, :class:`adp_connector.store.process.SharedArena`)
the slabs are carved out of it, so the helper reads and writes them directly; the arena is pinned once
(``cudaHostRegister``) when ``pinned``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

log = logging.getLogger("vllm.adp_kv.staging")  # under "vllm": shown by vLLM's log handler


class StagingPool:
    """Slabs of ``slab_bytes`` bytes (int8 tensors); ``take``/``give`` are thread-safe."""

    def __init__(self, slab_bytes: int, max_bytes: int, pinned: bool, arena: torch.Tensor | None = None) -> None:
        if slab_bytes <= 0:
            raise ValueError("slab_bytes must be positive")
        self.slab_bytes = slab_bytes
        self.pinned = pinned
        self._arena = arena
        if arena is not None:
            self.max_slabs = arena.numel() * arena.element_size() // slab_bytes
            if pinned and self.max_slabs:
                self.pinned = _register_host_memory(arena)
        else:
            self.max_slabs = max(1, max_bytes // slab_bytes)
        self._free: list[torch.Tensor] = []
        self._slabs: set[int] = set()  # data pointers of the pool's own slabs
        self._allocated = 0
        self._lock = threading.Lock()
        self.temporary = 0  # buffers handed out beyond the cap (a sizing hint: raise ``staging_mb``)
        self.on_give: Callable[[], None] | None = None  # called when a slab comes back (the restore driver's wake)

    def take(self, nbytes: int, temporary: bool = True) -> torch.Tensor | None:
        """A buffer of at least ``nbytes`` bytes: a pooled slab when it fits, else a temporary tensor (or None
        when ``temporary`` is False)."""
        if nbytes <= self.slab_bytes:
            with self._lock:
                if self._free:
                    return self._free.pop()
                grow = self._allocated < self.max_slabs
                if grow:
                    idx = self._allocated
                    self._allocated += 1
            if grow:
                try:
                    if self._arena is not None:
                        slab = self._arena.view(torch.int8)[idx * self.slab_bytes:(idx + 1) * self.slab_bytes]
                    else:
                        slab = torch.empty(self.slab_bytes, dtype=torch.int8, pin_memory=self.pinned)
                except Exception:
                    with self._lock:
                        self._allocated -= 1
                    raise
                with self._lock:
                    self._slabs.add(slab.data_ptr())
                return slab
        if not temporary:
            return None
        with self._lock:
            self.temporary += 1
        return torch.empty(nbytes, dtype=torch.int8)

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer from :meth:`take` (temporary ones are simply dropped; a slab already free is ignored)."""
        ptr = buf.data_ptr()
        with self._lock:
            freed = ptr in self._slabs and all(f.data_ptr() != ptr for f in self._free)
            if freed:
                self._free.append(buf)
        if freed and self.on_give is not None:
            self.on_give()

    @property
    def allocated_bytes(self) -> int:
        return self._allocated * self.slab_bytes


def _register_host_memory(t: torch.Tensor) -> bool:
    """Page-lock ``t``'s memory for DMA (``cudaHostRegister``, as vLLM's CPU offloading does); False if refused
    (copies then still work, through pageable memory, slower)."""
    nbytes = t.numel() * t.element_size()
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
    code = int(getattr(rc, "value", rc))
    if code != 0:
        log.warning("ADP KV: cudaHostRegister of %d staging bytes failed (CUDA error %d); staging is not pinned",
                    nbytes, code)
    return code == 0
