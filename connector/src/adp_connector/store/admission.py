"""Frequency-based admission of new pages into a full card (format.md §10).

A writer whose segments are full must evict a page to save one. Plain recency admits every new page, which on a
cyclic workload larger than the card (agents taking turns over more history than fits) evicts exactly the pages
asked for next, and nothing is ever read back. ``frequency`` admission lets a new page displace the next victim
only if the page was asked for more often: its key's estimated count must exceed the victim's. A tie keeps the
victim, so a stable part of the working set stays on the card and is read back every round, while the rest is
recomputed as it would be without a cache.

Counts are approximate: a count-min sketch (four rows of byte counters, each saturating at ``MAX_COUNT``) over the
keys, which are already uniform hashes, so each row indexes by four of the key's bytes. A key counts once per
save asked for it (the engine computed it, so it was wanted) and once per page read back. Every ``period``
counts, all counters are halved, so pages that stopped being asked for lose their standing and new ones get in:
the writer sets ``period`` to ten times its own pages once the card is full. Faster than that, a victim untouched for
longer than any reuse seen lately goes whatever its count (``OwnPages.outlived``, recency.py): the writer checks that
before asking the sketch.
"""

from __future__ import annotations

from collections.abc import Iterable

MAX_COUNT = 15
ROWS = 4
_HALVE = bytes(i >> 1 for i in range(256))


class FrequencySketch:
    """Approximate per-key request counts with periodic halving (not thread-safe: the store calls it under its
    lock)."""

    def __init__(self, width: int = 1 << 18, period: int = 1 << 20) -> None:
        if width <= 0 or width & (width - 1):
            raise ValueError(f"FrequencySketch width must be a power of two, got {width}")
        self.width = width
        self.period = max(1, period)
        self._mask = width - 1
        self._rows = [bytearray(width) for _ in range(ROWS)]
        self._since_halving = 0
        self.halvings = 0

    def _slots(self, key: bytes) -> list[int]:
        return [int.from_bytes(key[4 * r:4 * r + 4], "little") & self._mask for r in range(ROWS)]

    def record(self, keys: Iterable[bytes]) -> None:
        """Count one request for each of ``keys``."""
        rows = self._rows
        n = 0
        for k in keys:
            n += 1
            for row, i in zip(rows, self._slots(k), strict=True):
                if row[i] < MAX_COUNT:
                    row[i] += 1
        self._since_halving += n
        while self._since_halving >= self.period:
            self._since_halving -= self.period
            for row in rows:
                row[:] = row.translate(_HALVE)
            self.halvings += 1

    def estimate(self, key: bytes) -> int:
        """The key's count (never below its true count since the last halving, up to ``MAX_COUNT``)."""
        return min(row[i] for row, i in zip(self._rows, self._slots(key), strict=True))

    def admits(self, candidate: bytes, victim: bytes) -> bool:
        """Whether ``candidate`` was asked for more often than ``victim`` (a tie keeps the victim)."""
        return self.estimate(candidate) > self.estimate(victim)
