"""Host staging buffers for page I/O: fixed-size slabs, pinned when the KV cache is on a GPU, reused.

Pinning memory (``cudaHostAlloc``) costs about as much as copying it, so a connector that pins a fresh buffer per
step pays that on the critical path; slabs are allocated once and recycled. Beyond ``max_bytes`` of slabs a request
gets a temporary (unpooled, unpinned) buffer: the I/O still works, only slower.
"""

from __future__ import annotations

import threading

import torch


class StagingPool:
    """Slabs of ``slab_bytes`` bytes (int8 tensors); ``take``/``give`` are thread-safe."""

    def __init__(self, slab_bytes: int, max_bytes: int, pinned: bool) -> None:
        if slab_bytes <= 0:
            raise ValueError("slab_bytes must be positive")
        self.slab_bytes = slab_bytes
        self.max_slabs = max(1, max_bytes // slab_bytes)
        self.pinned = pinned
        self._free: list[torch.Tensor] = []
        self._slabs: set[int] = set()  # data pointers of the pool's own slabs
        self._allocated = 0
        self._lock = threading.Lock()
        self.temporary = 0  # buffers handed out beyond the cap (a sizing hint: raise ``staging_mb``)

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` bytes: a pooled slab when it fits, else a temporary tensor."""
        if nbytes <= self.slab_bytes:
            with self._lock:
                if self._free:
                    return self._free.pop()
                if self._allocated < self.max_slabs:
                    self._allocated += 1
                    grow = True
                else:
                    grow = False
            if grow:
                try:
                    slab = torch.empty(self.slab_bytes, dtype=torch.int8, pin_memory=self.pinned)
                except Exception:
                    with self._lock:
                        self._allocated -= 1
                    raise
                with self._lock:
                    self._slabs.add(slab.data_ptr())
                return slab
        with self._lock:
            self.temporary += 1
        return torch.empty(nbytes, dtype=torch.int8)

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer from :meth:`take` (temporary ones are simply dropped)."""
        with self._lock:
            if buf.data_ptr() in self._slabs and len(self._free) < self._allocated:
                self._free.append(buf)

    def forget(self, buf: torch.Tensor) -> None:
        """Let go of a slab that cannot be reused (I/O may still write into it); the pool may allocate anew."""
        with self._lock:
            if buf.data_ptr() in self._slabs:
                self._slabs.discard(buf.data_ptr())
                self._allocated -= 1

    @property
    def allocated_bytes(self) -> int:
        return self._allocated * self.slab_bytes
