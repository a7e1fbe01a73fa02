"""A stand-in store for the restore pipeline's layer tests: batches the test lands by hand.

A landed page's bytes all equal its key's first byte, so a test can tell which page is where.
"""

from __future__ import annotations

from typing import Any

from adp_connector.store.results import PageResult, PageStatus


class StubBatch:
    """One store batch: lands when the test says, every page OK but those in ``missing``."""

    def __init__(self, keys: list[bytes], bufs: list, page_bytes: int, missing: set[bytes]) -> None:
        self.keys, self.bufs, self.page_bytes, self.missing = keys, bufs, page_bytes, missing
        self._done = False
        self._callbacks: list = []

    def land(self) -> None:
        for k, b in zip(self.keys, self.bufs, strict=True):
            b[:] = k[0]  # the page's bytes say which page it is
        self._done = True
        for cb in self._callbacks:
            cb(self)

    def add_done_callback(self, cb: Any) -> None:
        self._callbacks.append(cb)

    def done(self) -> bool:
        return self._done

    def wait(self, timeout: float | None = None) -> list[PageResult]:
        assert self._done
        return [PageResult(k, PageStatus.MISSING if k in self.missing else PageStatus.OK, self.page_bytes)
                for k in self.keys]


class StubStore:
    """Records the batches submitted, in order, and the keys it heard restores would read."""

    def __init__(self, page_bytes: int, missing: set[bytes] | None = None) -> None:
        self.page_bytes = page_bytes
        self.missing = missing or set()
        self.batches: list[StubBatch] = []
        self.reading: list[bytes] = []

    def note_reading(self, keys: list[bytes]) -> None:
        self.reading += keys

    def load_batch(self, keys: list[bytes], bufs: list) -> StubBatch:
        b = StubBatch(list(keys), bufs, self.page_bytes, self.missing)
        self.batches.append(b)
        return b

    def submitted(self) -> list[int]:
        """The first page id (key byte) of each batch, in submission order."""
        return [b.keys[0][0] for b in self.batches]

    def submitted_pages(self) -> list[list[int]]:
        """Every batch's page ids, in submission order."""
        return [[k[0] for k in b.keys] for b in self.batches]

    def land_all(self) -> None:
        for b in self.batches:
            if not b.done():
                b.land()
