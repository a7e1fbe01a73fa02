"""Restart: stop the store and the "target" (file-backed device), start again, pages hit with identical bytes."""

from __future__ import annotations

import os

from store_testutil import fast_config

from adp_connector.store import KeyNamespace, PageStatus, PageStore

NS = KeyNamespace("Qwen/Qwen3-8B", "bfloat16", "LBHNC", 16, tp_rank=1, tp_size=2)


def test_restart_everything(device_factory) -> None:
    keys = NS.chain_tokens(list(range(16 * 40)))
    data = {k: os.urandom(1000 + 997 * i) for i, k in enumerate(keys)}
    dev = device_factory(16 << 20)
    s = PageStore(dev, fast_config(writer_id=b"engine-A-rank-01"))
    assert s.save_batch(keys, list(data.values())).ok_count(10) == len(keys)
    part = s.partition
    s.close()
    dev.close()  # the target process stops too
    dev2 = device_factory(16 << 20, reopen=True)
    s2 = PageStore(dev2, fast_config(writer_id=b"engine-A-rank-01"))
    assert s2.partition == part  # a restarted writer gets its own partition (and its pages) back
    assert s2.lookup(keys) == len(keys)
    outs = [bytearray(len(v)) for v in data.values()]
    assert s2.load_batch(keys, outs).ok_count(10) == len(keys)
    assert [bytes(o) for o in outs] == list(data.values())
    # the restarted writer keeps going: new saves, a discard, and the LRU continues from the sequence order
    more = NS.chain_tokens(list(range(16 * 45)))[40:]
    assert s2.save_batch(more, [b"m" * 100] * 5).ok_count(10) == 5
    assert s2.discard(keys[:3]) == 3
    s2.close()
    s3 = PageStore(device_factory(16 << 20, reopen=True), fast_config(writer=False))
    assert s3.partition is None and s3.lookup(keys) == 0 and s3.lookup(keys[3:]) == len(keys) - 3
    assert s3.contains(more) == [True] * 5
    assert s3.save(keys[0], b"x").status is PageStatus.ERROR  # read-only
    s3.close()


def test_restart_after_crash_without_close(device_factory) -> None:
    """The writer dies (no close, lease still fresh); its restart with the same writer id resumes at once."""
    keys = NS.chain_tokens(list(range(16 * 10)))
    dev = device_factory(8 << 20)
    s = PageStore(dev, fast_config(writer_id=b"engine-B-rank-00", lease_ttl_s=3600))
    assert s.save_batch(keys, [k * 100 for k in keys]).ok_count(10) == 10
    s.abandon()
    s2 = PageStore(dev, fast_config(writer_id=b"engine-B-rank-00", lease_ttl_s=3600))
    assert s2.partition == s.partition and s2.lookup(keys) == 10
    # the dead instance (same id, other incarnation) has lost its lease
    assert s.heartbeat() is False
    s2.close()


def test_format_version_and_reformat(device_factory) -> None:
    dev = device_factory(4 << 20)
    s = PageStore(dev, fast_config())
    k = NS.chain_tokens(list(range(16)))[0]
    assert s.save(k, b"abc" * 1000).ok
    s.close()
    g = PageStore.format(dev, partitions=2)  # a new UUID: old records never validate again
    s2 = PageStore(dev, fast_config(create=False))
    assert s2.geometry == g and s2.lookup([k]) == 0
    s2.close()
