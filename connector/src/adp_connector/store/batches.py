"""The store's batch workers: restores before saves.

A request waits on every page of its restore, while a save only has to land before its staging slab is needed
again. With one FIFO, a restore queued behind a burst of saves (a long prefill, the warm-up of many documents) waits
for all of them: on the H200 a 671 MB restore queued behind ~22 GB of saves took 2.2 s (GPU run 8, sweep, 1 user).
So loads are taken first; saves run whenever no load waits.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable


class BatchPool:
    """``threads`` workers running submitted batches, urgent ones (loads) before the others, each kind in order."""

    def __init__(self, threads: int, name: str = "adpkv-store") -> None:
        self._urgent: deque[Callable[[], None]] = deque()
        self._other: deque[Callable[[], None]] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
                         for i in range(max(1, threads))]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[[], None], urgent: bool = False) -> None:
        """Run ``fn`` on a worker (``fn`` handles its own errors)."""
        with self._cond:
            if self._closing:
                raise RuntimeError("batch pool is shut down")
            (self._urgent if urgent else self._other).append(fn)
            self._cond.notify()

    def waiting(self) -> tuple[int, int]:
        """(urgent, other) batches queued and not started."""
        with self._cond:
            return len(self._urgent), len(self._other)

    def shutdown(self, wait: bool = True) -> None:
        """Refuse new batches; the queued ones still run. ``wait``: until all have."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if wait:
            for t in self._threads:
                if t is not threading.current_thread():
                    t.join()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not (self._urgent or self._other or self._closing):
                    self._cond.wait()
                if self._urgent:
                    fn = self._urgent.popleft()
                elif self._other:
                    fn = self._other.popleft()
                else:  # closing and drained
                    return
            try:
                fn()
            except Exception:  # pragma: no cover - batch functions catch their own errors
                pass
