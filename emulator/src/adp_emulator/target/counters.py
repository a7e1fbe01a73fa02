"""Per-queue and per-namespace statistics: commands, bytes, errors and a latency histogram.

Each queue's counters are written by that queue's thread only (no locks on the hot path);
namespace totals are the sum of live queues plus what closed queues left behind.
"""

from __future__ import annotations

from typing import Any

#: Histogram bucket i counts commands whose latency in microseconds has bit_length() == i,
#: i.e. bucket 0: < 1 us, 1: 1 us, 2: 2-3 us, ..., 10: 512-1023 us, ... (capped at the last bucket).
HIST_BUCKETS = 32


class IoCounters:
    """Counters for one queue (or one namespace aggregate)."""

    __slots__ = ("bytes_read", "bytes_written", "commands", "errors", "hist", "latency_ns", "reads", "writes")

    def __init__(self) -> None:
        self.commands = 0
        self.reads = 0
        self.writes = 0
        self.bytes_read = 0
        self.bytes_written = 0
        self.errors = 0
        self.hist = [0] * HIST_BUCKETS
        self.latency_ns = 0  # sum of every recorded latency (the histogram's _sum)

    def record_latency(self, ns: int) -> None:
        self.latency_ns += ns
        b = (ns // 1000).bit_length()
        self.hist[b if b < HIST_BUCKETS else HIST_BUCKETS - 1] += 1

    def add(self, other: IoCounters) -> None:
        self.commands += other.commands
        self.reads += other.reads
        self.writes += other.writes
        self.bytes_read += other.bytes_read
        self.bytes_written += other.bytes_written
        self.errors += other.errors
        self.latency_ns += other.latency_ns
        for i, v in enumerate(other.hist):
            self.hist[i] += v

    def state(self) -> tuple:
        """Plain values, for crossing a process boundary (:meth:`from_state`)."""
        return (self.commands, self.reads, self.writes, self.bytes_read, self.bytes_written, self.errors,
                list(self.hist), self.latency_ns)

    @classmethod
    def from_state(cls, state: tuple) -> IoCounters:
        c = cls()
        c.commands, c.reads, c.writes, c.bytes_read, c.bytes_written, c.errors, hist = state[:7]
        c.latency_ns = state[7] if len(state) > 7 else 0
        c.hist = list(hist)
        return c

    def as_dict(self) -> dict[str, Any]:
        """JSON-able snapshot; ``latency_us_log2`` maps a bucket's lower bound (us) to its count."""
        return {
            "commands": self.commands,
            "reads": self.reads,
            "writes": self.writes,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "errors": self.errors,
            "latency_us_log2": {str((1 << i) >> 1): n for i, n in enumerate(self.hist) if n},
            "latency_seconds_sum": self.latency_ns / 1e9,
        }
