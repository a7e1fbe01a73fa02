"""The store's batch workers: restores before saves.

A request waits on every page of its restore, while a save only has to land before its staging slab is needed
again. With one FIFO, a restore queued behind a burst of saves (a long prefill, the warm-up of many documents) waits
for all of them: on the H200 a 671 MB restore queued behind ~22 GB of saves took 2.2 s (GPU run 8, sweep, 1 user).
So loads are taken first, but not forever: after :data:`URGENT_RUN` loads in a row while a save waits, a worker
takes one save. Saves hold staging slabs until they land; starved behind a long run of loads they fill the staging
and new saves are dropped (GPU run 9, 8 agents: 344 pages dropped for want of a slab in the 10 s the restores
started, after 0 dropped in run 8's first-come order). So under both kinds of load, saves keep at least
1 / (URGENT_RUN + 1) of the workers, and a load waits behind at most one save per worker.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

URGENT_RUN = 3  # urgent batches a worker runs in a row while an other batch waits


class BatchPool:
    """``threads`` workers running submitted batches, urgent ones (loads) before the others (at most
    :data:`URGENT_RUN` in a row while another waits), each kind in order."""

    def __init__(self, threads: int, name: str = "adpkv-store") -> None:
        self._urgent: deque[Callable[[], None]] = deque()
        self._other: deque[Callable[[], None]] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._urgent_run = 0  # urgent batches taken in a row while another waited
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
                if self._urgent and not (self._other and self._urgent_run >= URGENT_RUN):
                    fn = self._urgent.popleft()
                    self._urgent_run = self._urgent_run + 1 if self._other else 0
                elif self._other:
                    fn = self._other.popleft()
                    self._urgent_run = 0
                else:  # closing and drained
                    return
            try:
                fn()
            except Exception:  # pragma: no cover - batch functions catch their own errors
                pass
