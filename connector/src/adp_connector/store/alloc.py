"""First-fit extent allocator over a range of LBAs (one segment's data area)."""

from __future__ import annotations

import bisect
from collections.abc import Iterable


class ExtentAllocator:
    """Free space as sorted, coalesced ``[start, start+length)`` extents; first fit, O(free extents)."""

    def __init__(self, start: int, end: int, used: Iterable[tuple[int, int]] = ()) -> None:
        """Manage ``[start, end)``; ``used`` lists (start, length) extents already taken (must not overlap)."""
        self.start, self.end = start, end
        self._starts: list[int] = []
        self._lens: list[int] = []
        pos = start
        for s, n in sorted(used):
            if s > pos:
                self._starts.append(pos)
                self._lens.append(s - pos)
            pos = max(pos, s + n)
        if end > pos:
            self._starts.append(pos)
            self._lens.append(end - pos)
        self._free = sum(self._lens)

    @property
    def free_lbas(self) -> int:
        """Total free LBAs."""
        return self._free

    def alloc(self, n: int) -> int | None:
        """Take ``n`` contiguous LBAs; returns the first LBA or None when no extent is large enough."""
        for i, ln in enumerate(self._lens):
            if ln >= n:
                s = self._starts[i]
                if ln == n:
                    del self._starts[i]
                    del self._lens[i]
                else:
                    self._starts[i] = s + n
                    self._lens[i] = ln - n
                self._free -= n
                return s
        return None

    def free(self, s: int, n: int) -> None:
        """Return ``[s, s+n)``; coalesces with its neighbours. Raises ValueError on a double free."""
        if n <= 0:
            return
        if s < self.start or s + n > self.end:
            raise ValueError("extent outside the managed range")
        i = bisect.bisect_left(self._starts, s)
        if (i < len(self._starts) and self._starts[i] < s + n) or (
                i > 0 and self._starts[i - 1] + self._lens[i - 1] > s):
            raise ValueError(f"double free of [{s}, {s + n})")
        self._free += n
        if i > 0 and self._starts[i - 1] + self._lens[i - 1] == s:
            i -= 1
            self._lens[i] += n
        else:
            self._starts.insert(i, s)
            self._lens.insert(i, n)
        if i + 1 < len(self._starts) and self._starts[i] + self._lens[i] == self._starts[i + 1]:
            self._lens[i] += self._lens[i + 1]
            del self._starts[i + 1]
            del self._lens[i + 1]

    def extents(self) -> list[tuple[int, int]]:
        """The free extents, for tests."""
        return list(zip(self._starts, self._lens, strict=True))
