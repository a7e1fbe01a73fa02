"""Many writers on one namespace: partitions, leases, refresh, and safe reads of pages being evicted."""

from __future__ import annotations

import threading
import time

from memdevice import MemDevice
from store_testutil import fast_config

from adp_connector.store import KeyNamespace, PageStatus, PageStore

NS = KeyNamespace("m", "bf16", "L", 8)


def _data(k: bytes, n: int) -> bytes:
    return (k * (n // 32 + 1))[:n]


def test_two_writers_partitions_and_refresh(device_factory) -> None:
    dev = device_factory(8 << 20)
    a = PageStore(dev, fast_config(writer_label="engine-a"))
    b = PageStore(dev, fast_config(writer_label="engine-b"))
    assert a.partition is not None and b.partition is not None and a.partition != b.partition
    ka = NS.chain_tokens(list(range(8 * 20)))
    kb = NS.with_group(1).chain_tokens(list(range(8 * 20)))
    assert a.save_batch(ka, [_data(k, 7000) for k in ka]).ok_count(10) == 20
    assert b.save_batch(kb, [_data(k, 9000) for k in kb]).ok_count(10) == 20
    assert b.lookup(ka) == 0
    b.refresh()
    a.refresh()
    assert b.lookup(ka) == 20 and a.lookup(kb) == 20
    outs = [bytearray(7000) for _ in ka]
    assert b.load_batch(ka, outs).ok_count(10) == 20
    assert all(bytes(o) == _data(k, 7000) for o, k in zip(outs, ka, strict=True))
    assert b.save(ka[0], _data(ka[0], 7000)).status is PageStatus.EXISTS  # dedupe across writers
    # extents of the two partitions never overlap
    la = {range(x.lba, x.lba + a.geometry.page_lbas(x.length)) for x in a._own.values()}
    lb = {range(x.lba, x.lba + b.geometry.page_lbas(x.length)) for x in b._own.values()}
    assert max(r.stop for r in la) <= min(r.start for r in lb) or max(r.stop for r in lb) <= min(
        r.start for r in la)
    a.close()
    b.close()


def test_refresh_parses_a_slot_table_only_when_it_changed(device_factory, monkeypatch) -> None:
    """Re-parsing every other partition's table each second held the GIL on a busy engine (GPU profile): an
    unchanged table is skipped; a changed one (new pages, or pages gone) is picked up."""
    dev = device_factory(8 << 20)
    a = PageStore(dev, fast_config(writer_label="engine-a"))
    b = PageStore(dev, fast_config(writer_label="engine-b"))
    parsed: list[int] = []
    real = PageStore._valid_entries

    def counting(self: PageStore, p: int, img: bytearray):  # type: ignore[no-untyped-def]
        if self is b:
            parsed.append(p)
        return real(self, p, img)

    monkeypatch.setattr(PageStore, "_valid_entries", counting)
    ka = NS.chain_tokens(list(range(8 * 4)))
    assert a.save_batch(ka, [_data(k, 5000) for k in ka]).ok_count(10) == 4
    b.refresh()
    first = len(parsed)
    assert first >= 1 and b.lookup(ka) == 4
    b.refresh()
    b.refresh()
    assert len(parsed) == first and b.lookup(ka) == 4  # unchanged: not parsed again, still visible
    assert a.discard(ka[2:]) == 2
    b.refresh()
    assert len(parsed) > first and b.lookup(ka) == 2  # changed: parsed, the discarded pages are gone
    a.close()
    b.close()


def test_concurrent_claims_get_distinct_partitions() -> None:
    dev = MemDevice(8 << 20, 512, 128 << 10)
    PageStore.format(dev, partitions=4)
    stores: list[PageStore] = []
    mu = threading.Lock()
    barrier = threading.Barrier(6)

    def open_one() -> None:
        barrier.wait()
        s = PageStore(dev, fast_config(claim_settle_s=0.03))
        with mu:
            stores.append(s)

    ts = [threading.Thread(target=open_one) for _ in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    parts = [s.partition for s in stores if s.partition is not None]
    assert len(parts) == 4 and len(set(parts)) == 4
    assert sum(s.partition is None for s in stores) == 2
    for s in stores:
        s.close()


def test_reader_never_sees_wrong_bytes_while_writer_evicts() -> None:
    dev = MemDevice(2 << 20, 512, 16 << 10)
    w = PageStore(dev, fast_config(partitions=2, inline_bytes=4096))
    r = PageStore(dev, fast_config(partitions=2))
    keys = NS.chain_tokens(list(range(8 * 400)))
    sizes = {k: 3000 + (i * 977) % 40_000 for i, k in enumerate(keys)}
    stop = threading.Event()
    bad: list[bytes] = []
    ok = [0]

    def reader() -> None:
        while not stop.is_set():
            r.refresh()
            ks = [k for k in r.indexed_keys() if k in sizes][:40]
            outs = [bytearray(sizes[k]) for k in ks]
            for k, o, res in zip(ks, outs, r.load_batch(ks, outs).wait(10), strict=True):
                if res.ok:
                    ok[0] += 1
                    if bytes(o) != _data(k, sizes[k]):
                        bad.append(k)

    t = threading.Thread(target=reader)
    t.start()
    for i in range(0, len(keys), 10):
        batch = keys[i:i + 10]
        w.save_batch(batch, [_data(k, sizes[k]) for k in batch]).wait(10)
    stop.set()
    t.join()
    assert not bad
    assert w.stats.evictions > 100 and ok[0] > 0
    st = r.stats.snapshot()
    assert st["stale_reads"] + st["verify_failures"] + st["hits"] > 0
    w.close()
    r.close()


def test_lease_expiry_takeover_and_heartbeat() -> None:
    dev = MemDevice(4 << 20, 512)
    a = PageStore(dev, fast_config(partitions=1, lease_ttl_s=0.3))
    keys = NS.chain_tokens(list(range(8 * 5)))
    assert a.save_batch(keys, [_data(k, 5000) for k in keys]).ok_count(5) == 5
    b = PageStore(dev, fast_config(lease_ttl_s=0.3))
    assert b.partition is None and b.lookup(keys) == 5  # lease fresh: b is a reader
    b.close()
    time.sleep(0.35)  # a stalls past its TTL (no heartbeat thread)
    c = PageStore(dev, fast_config(lease_ttl_s=0.3))
    assert c.partition == 0 and c.lookup(keys) == 5  # took the partition over, pages included
    k2 = NS.with_group(3).chain_tokens(list(range(8)))
    r = a.save(k2[0], b"late")
    assert r.status is PageStatus.ERROR and a.stats.lease_lost == 1 and a.partition is None
    out = bytearray(5000)
    assert a.load(keys[0], out).ok  # still readable through the (now foreign) index
    # with a heartbeat thread the lease does not expire
    d = PageStore(MemDevice(4 << 20, 512), fast_config(partitions=1, lease_ttl_s=0.2, heartbeat_interval_s=0.03))
    time.sleep(0.5)
    assert d.partition == 0 and d.save(keys[0], b"x").ok and d.stats.lease_lost == 0
    for s in (a, c, d):
        s.close()


def _seen_by(store: PageStore, key: bytes, expect: int, deadline: float) -> bool:
    """Poll ``store.lookup([key])`` until it returns ``expect`` (True) or ``deadline`` passes (False)."""
    while store.lookup([key]) != expect and time.monotonic() < deadline:
        time.sleep(0.01)
    return store.lookup([key]) == expect


def test_background_refresh() -> None:
    dev = MemDevice(4 << 20, 512)
    a = PageStore(dev, fast_config())
    b = PageStore(dev, fast_config(refresh_interval_s=0.02))
    k = NS.chain_tokens(list(range(8)))[0]
    assert a.save(k, b"hello" * 100).ok
    deadline = time.monotonic() + 5
    assert _seen_by(b, k, 1, deadline)
    a.discard([k])
    assert _seen_by(b, k, 0, deadline)
    a.close()
    b.close()


def test_slow_background_refreshes_are_spaced_out(monkeypatch) -> None:
    """A refresh taking 50 ms of CPU with a 20 ms interval asked: the gap stretches so refreshing stays <= 2% of the
    time (it holds the interpreter lock an inference engine needs), and lookups still see new pages afterwards."""
    dev = MemDevice(4 << 20, 512)
    a = PageStore(dev, fast_config())
    b = PageStore(dev, fast_config(refresh_interval_s=0.02))
    real = PageStore.refresh
    calls: list[float] = []

    def slow_refresh(self: PageStore) -> None:
        calls.append(time.monotonic())
        t = time.thread_time()
        while time.thread_time() - t < 0.05:  # 50 ms of CPU (a parse), not of waiting
            pass
        real(self)

    monkeypatch.setattr(PageStore, "refresh", slow_refresh)
    k = NS.chain_tokens(list(range(8)))[0]
    assert a.save(k, b"hello" * 100).ok
    assert _seen_by(b, k, 1, time.monotonic() + 10)
    time.sleep(3.0)
    assert b.refresh_gap_s >= 0.05 / 0.02 * 0.9  # ~2.5 s between refreshes, not 20 ms
    recent = [t for t in calls if t > time.monotonic() - 3.0]
    assert len(recent) <= 2, len(recent)
    a.close()
    b.close()


def test_a_load_of_an_unindexed_key_refreshes_first() -> None:
    """Reader b has no background refresh; a page saved by a after b's last refresh still loads (b refreshes on
    the miss), a truly missing key stays MISSING, and misses do not refresh more often than the gap allows."""
    dev = MemDevice(4 << 20, 512)
    a = PageStore(dev, fast_config())
    b = PageStore(dev, fast_config(writer=False, miss_refresh_gap_s=60.0))
    keys = NS.chain_tokens(list(range(16)))[:2]
    assert a.save(keys[0], b"first" * 100).ok
    buf = bytearray(4096)
    r = b.load(keys[0], buf)
    assert r.ok and bytes(buf[:r.nbytes]) == b"first" * 100 and b.stats.miss_refreshes == 1
    assert a.save(keys[1], b"second" * 100).ok
    assert b.load(keys[1], buf).status is PageStatus.MISSING  # within the gap: no second refresh
    assert b.stats.miss_refreshes == 1
    c = PageStore(dev, fast_config(writer=False, miss_refresh_gap_s=-1))  # disabled
    assert c.load(NS.chain_tokens(list(range(24)))[2], buf).status is PageStatus.MISSING
    assert c.stats.miss_refreshes == 0
    for s in (a, b, c):
        s.close()
