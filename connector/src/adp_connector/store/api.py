"""The typed ``Store`` protocol: what the connector and its pipelines need from a page store.

:class:`~adp_connector.store.PageStore` (in-process), :class:`~adp_connector.store.process.StoreProcess` (one I/O
helper process) and :class:`~adp_connector.store.process.StoreGroup` (a writer helper plus read-only helpers) all
satisfy it; code above the store (``adp_connector.pipeline``, ``adp_connector.vllm``) is typed against it only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

from .results import BatchHandle

Buffer = Any  # a writable (loads) or readable (saves) buffer: memoryview, bytearray, numpy array, torch CPU tensor


@runtime_checkable
class Store(Protocol):
    """A content-keyed page store: presence lookups, asynchronous batch save/load, discard and close."""

    def contains(self, keys: Iterable[bytes]) -> list[bool]:
        """Presence of every key in the store's index (committed pages only)."""
        ...

    def save_batch(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> BatchHandle:
        """Start saving ``buffers[i]`` under ``keys[i]`` (unchanged until the handle is done)."""
        ...

    def load_batch(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> BatchHandle:
        """Start loading ``keys[i]`` into ``buffers[i]``."""
        ...

    def discard(self, keys: Iterable[bytes]) -> int:
        """Drop this writer's own pages of ``keys``; returns how many were removed."""
        ...

    def note_reading(self, keys: Sequence[bytes]) -> int | None:
        """A hint: ``keys`` are about to be read, so their writer evicts other pages first (no reply needed)."""
        ...

    def take_evicted(self) -> list[bytes]:
        """Own pages evicted since the last call (to tell an index that may still list them)."""
        ...

    def close(self, release: bool = True) -> None:
        """Stop the store (``release``: hand the writer lease back)."""
        ...
