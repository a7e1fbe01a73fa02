"""Thread-safe counters of one interval, drained into running totals."""

from __future__ import annotations

import threading
from collections import defaultdict


class Counters:
    """Named float counters: ``add`` from any thread, ``drain`` the interval (kept in ``totals``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.interval: defaultdict[str, float] = defaultdict(float)
        self.totals: defaultdict[str, float] = defaultdict(float)

    def add(self, **deltas: float) -> None:
        with self._lock:
            for k, v in deltas.items():
                self.interval[k] += v

    def __getitem__(self, name: str) -> float:
        """This interval's value of ``name`` (0 if never counted)."""
        with self._lock:
            return self.interval.get(name, 0.0)

    def any(self) -> bool:
        with self._lock:
            return any(self.interval.values())

    def drain(self) -> dict[str, float]:
        """Move this interval's counters into the running totals; returns the interval's counters."""
        with self._lock:
            data = dict(self.interval)
            self.interval.clear()
            for k, v in data.items():
                self.totals[k] += v
        return data

    def snapshot_totals(self) -> dict[str, float]:
        with self._lock:
            return dict(self.totals)
