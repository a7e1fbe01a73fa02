"""The writers' eviction counters reach the connector's counters (card_stats.py), with a real in-process store on
an in-memory device: a full card evicts, the watch adds what changed, and a new store counts from zero."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "store"))

from memdevice import MemDevice
from store_testutil import fast_config

from adp_connector.pipeline import Counters
from adp_connector.store import KeyNamespace, PageStore
from adp_connector.vllm.card_stats import CardStatsWatch

NS = KeyNamespace("card-stats", "bf16", "L", 4)
PAGE = 20_000


def _store() -> PageStore:
    return PageStore(MemDevice(1 << 20, 512), fast_config(partitions=1, admission="always"))


def _fill(s: PageStore, first: int, n: int) -> None:
    for k in NS.chain_tokens(list(range(first, first + 4 * n))):
        s.save_batch([k], [(k * (PAGE // 32 + 1))[:PAGE]]).wait(5)


def test_evictions_on_the_card_reach_the_connectors_counters() -> None:
    s = _store()
    counters = Counters()
    watch = CardStatsWatch(lambda: s, counters, interval_s=3600)
    try:
        watch.poll()
        assert counters["card_evictions"] == 0  # nothing evicted yet: nothing added
        _fill(s, 0, 60)  # a 1 MiB card holds ~36 pages of 20 kB
        evicted = s.stats.evictions
        assert evicted > 0
        watch.poll()
        watch.poll()  # a second read with nothing new adds nothing
        assert counters["card_evictions"] == evicted
        _fill(s, 10_000, 5)
        watch.close()  # close reads once more
        assert counters["card_evictions"] == s.stats.evictions == evicted + 5
        assert counters["card_evictions_outlived"] == 0  # admission "always" weighs nothing
    finally:
        s.close()


def test_a_new_store_counts_from_zero() -> None:
    """The helpers started again: the new writers' counters start at zero, and none of it is subtracted."""
    first, second = _store(), _store()
    current = [first]
    counters = Counters()
    watch = CardStatsWatch(lambda: current[0], counters, interval_s=3600)
    try:
        _fill(first, 0, 60)
        watch.poll()
        _fill(second, 0, 45)
        current[0] = second
        watch.poll()
        assert counters["card_evictions"] == first.stats.evictions + second.stats.evictions
        assert 0 < second.stats.evictions < first.stats.evictions
    finally:
        first.close()
        second.close()
