"""Capacity management: LRU eviction, never blocking, pinned pages, slot exhaustion."""

from __future__ import annotations

import threading

import pytest
from memdevice import MemDevice
from store_testutil import fast_config

from adp_connector.store import KeyNamespace, PageStatus, PageStore

NS = KeyNamespace("m", "bf16", "L", 4)


def _d(k: bytes, n: int) -> bytes:
    return (k * (n // 32 + 1))[:n]


def test_lru_eviction_never_blocks(device_factory) -> None:
    dev = device_factory(2 << 20)
    s = PageStore(dev, fast_config(partitions=1))
    keys = NS.chain_tokens(list(range(4 * 200)))
    n = 20_000
    for i in range(0, 40, 4):
        assert s.save_batch(keys[i:i + 4], [_d(k, n) for k in keys[i:i + 4]]).ok_count(5) == 4
    hot = keys[0]
    for i in range(40, 200, 4):
        out = bytearray(n)
        assert s.load(hot, out).ok and bytes(out) == _d(hot, n)  # keep the first page hot
        res = s.save_batch(keys[i:i + 4], [_d(k, n) for k in keys[i:i + 4]]).wait(5)
        assert all(r.ok for r in res)
    st = s.stats.snapshot()
    assert st["evictions"] > 100
    assert s.contains([hot]) == [True]  # LRU kept the hot page
    assert not any(s.contains(keys[1:40]))  # cold old pages went first
    assert all(s.contains(keys[190:200]))
    big = NS.with_group(1).chain_tokens(list(range(4)))[0]
    assert s.save(big, bytes(3 << 20)).status is PageStatus.NO_SPACE  # larger than the partition
    s.close()
    s2 = PageStore(device_factory(2 << 20, reopen=True), fast_config(partitions=1))
    assert s2.lookup([hot]) == 1 and all(s2.contains(keys[190:200]))
    s2.close()


@pytest.mark.parametrize("policy", ["slru", "lru"])
def test_pinned_page_survives_eviction(policy: str) -> None:
    dev = MemDevice(1 << 20, 512, 4096)
    s = PageStore(dev, fast_config(partitions=1, eviction=policy))
    keys = NS.chain_tokens(list(range(4 * 100)))
    n = 60_000
    assert s.save(keys[0], _d(keys[0], n)).ok
    dev.delay_s = 0.002  # the load below takes ~30 ms
    out = bytearray(n)
    h = s.load_batch([keys[0]], [out])
    saver = threading.Thread(target=lambda: [s.save(k, _d(k, n)) for k in keys[1:30]])
    saver.start()
    saver.join()
    assert h.wait(10)[0].ok and bytes(out) == _d(keys[0], n)
    dev.delay_s = 0
    assert s.stats.evictions > 0
    s.close()


def test_whole_batch_larger_than_capacity() -> None:
    s = PageStore(MemDevice(1 << 20, 512), fast_config(partitions=1))
    keys = NS.chain_tokens(list(range(4 * 40)))
    res = s.save_batch(keys, [_d(k, 50_000) for k in keys]).wait(10)
    assert any(r.ok for r in res) and any(r.status is PageStatus.NO_SPACE for r in res)
    s.close()


def test_slot_exhaustion_evicts() -> None:
    s = PageStore(MemDevice(4 << 20, 512), fast_config(partitions=1, slots_per_partition=64, segment_bytes=4 << 20))
    assert s.geometry.slots_per_segment == 64 and s.geometry.segments == 1  # one segment: 64 slots on the card
    keys = NS.chain_tokens(list(range(4 * 200)))
    for i in range(0, 200, 10):
        assert s.save_batch(keys[i:i + 10], [b"x" * 10] * 10).ok_count(5) == 10
    assert s.info()["own_pages"] == 64 and s.stats.evictions == 200 - 64
    s.close()
