"""LandedDigest: a loaded page's checksum is taken by the thread whose read completes the page (bytes in cache), or
by the batch's finish step, exactly once, and equals the one-shot checksum; corrupt pages are still refused."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future

import pytest
from store_testutil import fast_config

from adp_connector.store import PageStatus, PageStore
from adp_connector.store.core import LandedDigest
from adp_connector.store.format import page_checksum
from adp_connector.store.keys import KeyNamespace

NS = KeyNamespace("landed-digest", "bf16", "t", 16)


class _Count:
    def __init__(self, value: bytes = b"d" * 16) -> None:
        self.calls: list[str] = []
        self.value = value

    def __call__(self) -> bytes:
        self.calls.append(threading.current_thread().name)
        return self.value


def test_the_thread_landing_the_last_part_computes_it_once() -> None:
    futs: list[Future[None]] = [Future(), Future()]
    c = _Count()
    d = LandedDigest(futs, c)
    futs[0].set_result(None)
    assert c.calls == []  # a part is still in flight
    t = threading.Thread(target=futs[1].set_result, args=(None,), name="reader")
    t.start()
    t.join()
    assert c.calls == ["reader"] and d.result() == c.value and c.calls == ["reader"]


def test_the_finish_step_computes_it_when_it_comes_first_and_the_late_callback_skips() -> None:
    fut: Future[None] = Future()
    c = _Count()
    d = LandedDigest([fut], c)
    assert d.result() == c.value and c.calls == [threading.current_thread().name]
    fut.set_result(None)  # the landing callback runs after the waiter woke: nothing computed twice
    assert len(c.calls) == 1


def test_a_failed_read_is_not_hashed_on_landing() -> None:
    futs: list[Future[None]] = [Future(), Future()]
    c = _Count()
    d = LandedDigest(futs, c)
    futs[0].set_exception(OSError("gone"))
    futs[1].set_result(None)
    assert c.calls == []
    assert d.result() == c.value and len(c.calls) == 1  # (the store reports the error before it asks)


def test_a_raising_landing_computation_is_redone_by_the_finish_step() -> None:
    fut: Future[None] = Future()
    calls = []

    def compute() -> bytes:
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("first call fails")
        return b"x" * 16

    d = LandedDigest([fut], compute)
    fut.set_result(None)  # concurrent.futures logs the callback's exception
    assert d.result() == b"x" * 16 and len(calls) == 2


@pytest.mark.parametrize("corrupt", [False, True])
def test_large_pages_over_nvme_tcp_verify_with_the_landed_digest(device_factory, corrupt: bool) -> None:
    """Multi-command pages (MDTS 128 KiB, 1 MiB pages) over the real client: each digest is taken on landing and
    equals the one-shot checksum of the stored bytes; a byte flipped on the media is VERIFY_FAILED (the control
    run, uncorrupted, loads every page)."""
    dev = device_factory(32 << 20)
    s = PageStore(dev, fast_config(avg_page_bytes=1 << 20))
    keys = NS.chain_tokens(list(range(16 * 4)))
    data = {k: os.urandom((1 << 20) + 1000) for k in keys}  # a body of whole LBAs and a tail
    assert s.save_batch(keys, [data[k] for k in keys]).ok_count(30) == 4
    if corrupt:
        loc = s._own[keys[2]]
        dev.write((loc.lba + 100) * dev.lba_size, b"\xff" * dev.lba_size)
    seen: list[LandedDigest] = []
    orig = PageStore._submit_page_read

    def spy(self: PageStore, op) -> None:  # type: ignore[no-untyped-def]
        orig(self, op)
        seen.append(op.digest)

    PageStore._submit_page_read = spy  # type: ignore[method-assign]
    try:
        outs = [bytearray(len(data[k])) for k in keys]
        res = s.load_batch(keys, outs).wait(30)
    finally:
        PageStore._submit_page_read = orig  # type: ignore[method-assign]
    assert len(seen) == 4 and all(d is not None for d in seen)
    for i, (k, r) in enumerate(zip(keys, res, strict=True)):
        if corrupt and i == 2:
            assert r.status is PageStatus.VERIFY_FAILED and "checksum" in r.detail
            continue
        assert r.ok and bytes(outs[i]) == data[k]
        loc = s._own[k]
        assert seen[i].value == page_checksum(k, loc.seq, len(data[k]), data[k])
    assert s.stats.verify_failures == (1 if corrupt else 0)
    s.close()
