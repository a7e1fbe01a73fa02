"""The card's own counters, seen from the engine: what the store's writers evicted, and why.

The writers keep their counters in their helper processes (``StoreStats``); a thread of the worker reads them every
``CARD_STATS_INTERVAL_S`` (and once more at close) and adds what changed to the connector's counters, so they reach
vLLM's stats log and ``/metrics`` with the rest: ``card_evictions`` (pages a save evicted from a full card) and
``card_evictions_outlived`` (of which pages untouched past their reuse, evicted without weighing their counts,
docs/format.md §10). A new store (the helpers started again) counts from zero.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from ..pipeline.counters import Counters
from ..store.api import Store

log = logging.getLogger("vllm.adp_kv.card_stats")

CARD_STATS_INTERVAL_S = 2.0
CARD_COUNTERS = {"evictions": "card_evictions", "evictions_outlived": "card_evictions_outlived"}  # store -> ours


def writer_totals(store: Store) -> dict[str, float]:
    """The store's writers' counters named in :data:`CARD_COUNTERS`, summed (a helper group: one round trip to each
    writer; an in-process store: its own)."""
    members: list[Any] = list(getattr(store, "writers", None) or [store])
    out = dict.fromkeys(CARD_COUNTERS, 0.0)
    for m in members:
        st = m.stats() if callable(m.stats) else m.stats.snapshot()
        for k in CARD_COUNTERS:
            out[k] += float(st.get(k, 0))
    return out


class CardStatsWatch:
    """Adds the change in the writers' counters to ``counters`` every ``interval_s``, in a thread of its own."""

    def __init__(self, store_of: Callable[[], Store | None], counters: Counters,
                 interval_s: float = CARD_STATS_INTERVAL_S) -> None:
        self.store_of = store_of
        self.counters = counters
        self.interval_s = interval_s
        self._seen: tuple[Store, dict[str, float]] | None = None  # the store last read and its totals then
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="adpkv-card-stats", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def poll(self) -> None:
        """Read the writers' totals now and add their change since the last read (of the same store)."""
        store = self.store_of()
        if store is None:
            return
        with self._lock:
            try:
                now = writer_totals(store)
            except Exception as exc:  # a helper going away: the next read, of the next store, counts from there
                log.debug("ADP KV: reading the card's counters failed: %s", exc)
                return
            before = self._seen[1] if self._seen is not None and self._seen[0] is store else {}
            self._seen = (store, now)
        delta = {ours: now[k] - before.get(k, 0.0) for k, ours in CARD_COUNTERS.items()}
        if any(delta.values()):
            self.counters.add(**delta)

    def close(self) -> None:
        """Stop the thread and count what changed since its last read."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
        self.poll()
