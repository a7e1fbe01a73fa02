"""Thread-safe counters and samples of one interval, drained into running totals.

Counters add up (``add``); samples (``observe``: one latency or size per restore or save) are kept as lists, the
raw material of histograms, under :data:`SAMPLE_PREFIX` + their name in the drained interval.
"""

from __future__ import annotations

import threading
from collections import defaultdict

SAMPLE_PREFIX = "sample_"  # drained key of a sample list: SAMPLE_PREFIX + name


class Counters:
    """Named float counters and sample lists: ``add`` / ``observe`` from any thread, ``drain`` the interval
    (counters kept in ``totals``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.interval: defaultdict[str, float] = defaultdict(float)
        self.totals: defaultdict[str, float] = defaultdict(float)
        self.samples: defaultdict[str, list[float]] = defaultdict(list)

    def add(self, **deltas: float) -> None:
        with self._lock:
            for k, v in deltas.items():
                self.interval[k] += v

    def observe(self, **values: float) -> None:
        """One sample of each named quantity (e.g. ``restore_seconds=0.02, restore_bytes=4 << 20``)."""
        with self._lock:
            for k, v in values.items():
                self.samples[k].append(float(v))

    def __getitem__(self, name: str) -> float:
        """This interval's value of ``name`` (0 if never counted)."""
        with self._lock:
            return self.interval.get(name, 0.0)

    def any(self) -> bool:
        with self._lock:
            return any(self.interval.values()) or any(self.samples.values())

    def drain(self) -> dict[str, float | list[float]]:
        """Move this interval's counters into the running totals; returns the interval's counters and samples."""
        with self._lock:
            counts = dict(self.interval)
            self.interval.clear()
            for k, v in counts.items():
                self.totals[k] += v
            data: dict[str, float | list[float]] = dict(counts)
            data.update({SAMPLE_PREFIX + k: v for k, v in self.samples.items() if v})
            self.samples.clear()
        return data

    def snapshot_totals(self) -> dict[str, float]:
        with self._lock:
            return dict(self.totals)
