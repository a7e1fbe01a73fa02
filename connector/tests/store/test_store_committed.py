"""Only committed pages count: lookups, save results, skipped re-saves and concurrent saves of one key."""

from __future__ import annotations

import threading
import time

from memdevice import MemDevice
from store_testutil import fast_config

from adp_connector.store import KeyNamespace, PageStatus, PageStore

NS = KeyNamespace("committed", "bf16", "L", 8)


def _data(k: bytes, n: int = 20_000) -> bytes:
    return (k * (n // 32 + 1))[:n]


def test_lookup_counts_a_page_only_once_its_commit_record_is_durable() -> None:
    dev = MemDevice(8 << 20, 512)
    s = PageStore(dev, fast_config())
    keys = NS.chain_tokens(list(range(8 * 6)))
    dev.delay_s = 0.01  # the batch takes ~0.5 s
    h = s.save_batch(keys, [_data(k) for k in keys])
    seen = []
    while not h.done():
        seen.append((s.lookup(keys), sum(s.contains(keys))))
        time.sleep(0.01)
    dev.delay_s = 0
    assert seen and all(x == (0, 0) for x in seen)  # planned, written, not yet committed: not offered
    assert h.committed_keys(5) == keys
    assert s.lookup(keys) == len(keys)  # the control: the same lookup counts them once committed
    s.close()


def test_a_failed_save_is_never_reported_or_indexed_as_stored() -> None:
    dev = MemDevice(8 << 20, 512)
    s = PageStore(dev, fast_config())
    keys = NS.chain_tokens(list(range(8 * 4)))
    dev.fail_next(1, ("flush",))  # the data flush fails: nothing of the batch is committed
    res = s.save_batch(keys, [_data(k) for k in keys]).wait(5)
    assert not any(r.committed for r in res) and s.lookup(keys) == 0 and not any(s.contains(keys))
    res = s.save_batch(keys, [_data(k) for k in keys]).wait(5)  # control: the same save without the fault
    assert all(r.committed and r.status is PageStatus.OK for r in res) and s.lookup(keys) == 4
    s.close()


def test_a_key_committed_on_the_card_is_not_saved_again() -> None:
    dev = MemDevice(8 << 20, 512)
    a = PageStore(dev, fast_config())
    keys = NS.chain_tokens(list(range(8 * 4)))
    assert a.save_batch(keys, [_data(k) for k in keys]).ok_count(5) == 4
    b = PageStore(dev, fast_config())
    b.refresh()
    for s in (a, b):  # its own page, and another writer's
        writes = dev.commands["write"]
        res = s.save_batch(keys, [_data(k) for k in keys]).wait(5)
        assert [r.status for r in res] == [PageStatus.EXISTS] * 4 and all(r.committed for r in res)
        assert dev.commands["write"] == writes  # skipped without I/O
    new = NS.with_group(1).chain_tokens(list(range(8)))
    writes = dev.commands["write"]
    assert b.save(new[0], _data(new[0])).status is PageStatus.OK and dev.commands["write"] > writes  # control
    a.close()
    b.close()


def _concurrent_same_key(fail_first: bool) -> tuple[PageStatus, PageStatus]:
    dev = MemDevice(8 << 20, 512, workers=1)
    s = PageStore(dev, fast_config(io_threads=2))
    k = NS.chain_tokens(list(range(8)))[0]
    dev.delay_s = 0.02
    if fail_first:
        dev.fail_next(1, ("write",))  # the first batch's page write fails
    h1 = s.save_batch([k], [_data(k)])
    deadline = time.monotonic() + 5
    while k not in s._inflight and time.monotonic() < deadline:
        time.sleep(0.001)
    h2 = s.save_batch([k], [_data(k)])  # the same key while the first batch is saving it
    r1, r2 = h1.wait(5)[0], h2.wait(5)[0]
    dev.delay_s = 0
    s.close()
    return r1.status, r2.status


def test_a_concurrent_save_of_a_key_reports_the_first_saves_outcome() -> None:
    first, second = _concurrent_same_key(fail_first=True)
    assert first is PageStatus.ERROR and second is PageStatus.ERROR  # never "exists" for a save that failed
    first, second = _concurrent_same_key(fail_first=False)  # the control
    assert first is PageStatus.OK and second is PageStatus.EXISTS


def test_threads_saving_one_key_get_one_write() -> None:
    dev = MemDevice(8 << 20, 512)
    s = PageStore(dev, fast_config(io_threads=4))
    k = NS.chain_tokens(list(range(8)))[0]
    out: list[PageStatus] = []
    ts = [threading.Thread(target=lambda: out.append(s.save(k, _data(k), timeout=5).status)) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert sorted(out) == sorted([PageStatus.OK] + [PageStatus.EXISTS] * 3) and s.stats.pages_saved == 1
    s.close()
