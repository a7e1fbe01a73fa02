"""Format v2: one writer uses the whole card, writers share it through segments, v1 cards are refused."""

from __future__ import annotations

import struct
import time

import crc32c
import pytest
from memdevice import MemDevice
from store_testutil import fast_config

from adp_connector.store import KeyNamespace, PageStatus, PageStore
from adp_connector.store.format import SLOT_ENTRY_BYTES, FormatVersionError

NS = KeyNamespace("v2", "bf16", "L", 8)
PAGE = 15_000
SEG = 256 << 10


def _data(k: bytes, n: int = PAGE) -> bytes:
    return (k * (n // 32 + 1))[:n]


def _fill_until_eviction(s: PageStore, keys: list[bytes], batch: int = 8) -> float:
    """Save ``keys`` in batches until the first eviction; returns the card's fill fraction just before it."""
    fill = 0.0
    for i in range(0, len(keys), batch):
        info = s.info()
        fill = info["used_lbas"] / info["data_lbas"]
        ks = keys[i:i + batch]
        assert s.save_batch(ks, [_data(k) for k in ks]).ok_count(10) == len(ks)
        if s.stats.evictions:
            return fill
    raise AssertionError("the card never filled")


def test_one_writer_fills_the_whole_card_before_evicting(device_factory) -> None:
    dev = device_factory(8 << 20)
    s = PageStore(dev, fast_config(segment_bytes=SEG))
    g = s.geometry
    assert g.segments >= 16 and g.writers == 4
    keys = NS.chain_tokens(list(range(8 * 1200)))
    fill = _fill_until_eviction(s, keys)
    assert fill >= 0.9, fill
    assert s.info()["segments"] == g.segments  # every segment of the card, not 1/4 of it
    s.close()


def test_negative_control_a_writer_boxed_in_by_another_evicts_early() -> None:
    """The fill assertion can fail: with a second live writer holding half of the card, the first evicts at
    about half of it (no handover: heartbeats are off)."""
    dev = MemDevice(8 << 20, 512)
    g = PageStore.format(dev, partitions=4, avg_page_bytes=16 << 10, segment_bytes=SEG)
    other = PageStore(dev, fast_config(claim_segments=g.segments // 2))
    s = PageStore(dev, fast_config())
    fill = _fill_until_eviction(s, NS.chain_tokens(list(range(8 * 1200))))
    assert fill < 0.6, fill
    s.close()
    other.close()


def test_two_writers_share_a_card_and_each_restarts(device_factory) -> None:
    """A closes and reopens, B crashes (abandon) and reopens; no committed page of either is lost."""
    dev = device_factory(16 << 20)
    wa, wb = b"engine-A-rank-00", b"engine-B-rank-00"
    cfg = {"segment_bytes": 512 << 10}
    a = PageStore(dev, fast_config(writer_id=wa, **cfg))
    b = PageStore(dev, fast_config(writer_id=wb, **cfg))
    ka = NS.chain_tokens(list(range(8 * 60)))
    kb = NS.with_group(1).chain_tokens(list(range(8 * 60)))
    committed: dict[bytes, bytes] = {}
    for i in range(0, 30, 5):
        for s, ks in ((a, ka[i:i + 5]), (b, kb[i:i + 5])):
            res = s.save_batch(ks, [_data(k, PAGE + 7 * j) for j, k in enumerate(ks)]).wait(10)
            committed.update((r.key, _data(r.key, PAGE + 7 * j)) for j, r in enumerate(res) if r.ok)
    assert len(committed) == 60
    a.close()
    b.abandon()  # crash: lease still held, nothing released
    dev = device_factory(16 << 20, reopen=True)
    a = PageStore(dev, fast_config(writer_id=wa, **cfg))
    b = PageStore(dev, fast_config(writer_id=wb, **cfg))
    assert a.partition != b.partition and a.info()["segments"] > 0 and b.info()["segments"] > 0
    assert a.lookup(ka[:30]) == 30 and b.lookup(kb[:30]) == 30  # each got its own pages back
    for s, ks in ((a, ka[30:60]), (b, kb[30:60])):
        res = s.save_batch(ks, [_data(k, PAGE + 7 * j) for j, k in enumerate(ks)]).wait(10)
        committed.update((r.key, _data(r.key, PAGE + 7 * j)) for j, r in enumerate(res) if r.ok)
    assert len(committed) == 120 and a.stats.evictions == b.stats.evictions == 0
    a.close()
    b.close()
    r = PageStore(device_factory(16 << 20, reopen=True), fast_config(writer=False))
    keys = list(committed)
    outs = [bytearray(len(v)) for v in committed.values()]
    res = r.load_batch(keys, outs).wait(20)
    assert all(x.ok for x in res)
    assert all(bytes(o) == v for o, v in zip(outs, committed.values(), strict=True))
    r.close()


def test_negative_control_a_corrupted_commit_record_is_not_served() -> None:
    dev = MemDevice(8 << 20, 512)
    s = PageStore(dev, fast_config(writer_id=b"w" * 16, segment_bytes=SEG))
    keys = NS.chain_tokens(list(range(8 * 4)))
    assert s.save_batch(keys, [_data(k) for k in keys]).ok_count(5) == 4
    loc = s._own[keys[1]]
    s.close()
    off = s.geometry.segment_base(loc.segment) + loc.slot * SLOT_ENTRY_BYTES + 40  # the entry's LBA field
    dev.write(off - off % 512, _patched(dev.image()[off - off % 512:off - off % 512 + 512], off % 512))
    s2 = PageStore(dev, fast_config(writer_id=b"w" * 16))
    assert s2.contains(keys) == [True, False, True, True]
    assert s2.load(keys[1], bytearray(PAGE)).status is PageStatus.MISSING
    out = bytearray(PAGE)
    assert s2.load(keys[2], out).ok and bytes(out) == _data(keys[2])
    s2.close()


def _patched(block: bytes, at: int) -> bytes:
    b = bytearray(block)
    b[at] ^= 0x01
    return bytes(b)


def test_a_torn_page_never_verifies_and_the_control_without_verification_returns_it() -> None:
    dev = MemDevice(8 << 20, 512)
    w = PageStore(dev, fast_config(segment_bytes=SEG))
    k = NS.chain_tokens(list(range(8)))[0]
    assert w.save(k, _data(k, 60_000)).ok
    loc = w._own[k]
    dev.write((loc.lba + 50) * 512, b"\0" * (20 * 512))  # the tail of the payload torn away
    r = PageStore(dev, fast_config(writer=False))
    out = bytearray(60_000)
    assert r.load(k, out).status is PageStatus.VERIFY_FAILED
    control = PageStore(dev, fast_config(writer=False, verify=False))
    assert control.load(k, out).ok and bytes(out) != _data(k, 60_000)
    for s in (w, r, control):
        s.close()


def test_an_expired_writers_segments_are_adopted_and_its_cold_pages_evicted_first() -> None:
    dev = MemDevice(4 << 20, 512)
    a = PageStore(dev, fast_config(partitions=2, segment_bytes=SEG, lease_ttl_s=0.3, claim_settle_s=0.05))
    keys = NS.chain_tokens(list(range(8 * 600)))
    old = keys[:300]  # 15 segments hold 240 such pages
    for i in range(0, len(old), 8):
        a.save_batch(old[i:i + 8], [_data(k) for k in old[i:i + 8]]).wait(10)
    assert a.info()["segments"] == a.geometry.segments and a.stats.evictions > 0
    survivors = [k for k in old if a.contains([k])[0]]
    a.abandon()
    time.sleep(0.35)  # a's lease expires
    b = PageStore(dev, fast_config(partitions=2, lease_ttl_s=30))
    # no free segment: b took one of the expired writer's at open, with its pages (adopted, not erased)
    assert b.partition == 1 and b.info()["segments"] >= 1 and b.info()["own_pages"] > 0
    assert all(b.contains(survivors))  # own (adopted) or foreign pages, none lost
    new = keys[300:360]
    assert b.save_batch(new, [_data(k) for k in new]).ok_count(10) == len(new)
    assert b.stats.segments_claimed > 1
    # a's pages in the adopted segments became b's (coldest): evicted before b's own new pages
    assert all(b.contains(new)) and not all(b.contains(survivors))
    b.close()


def test_live_owner_hands_cold_segments_over_to_a_writer_that_asks() -> None:
    dev = MemDevice(4 << 20, 512)
    hb = {"heartbeat_interval_s": 0.02, "lease_ttl_s": 5.0}
    a = PageStore(dev, fast_config(partitions=2, segment_bytes=SEG, **hb))
    keys = NS.chain_tokens(list(range(8 * 600)))
    for i in range(0, 240, 8):
        assert a.save_batch(keys[i:i + 8], [_data(k) for k in keys[i:i + 8]]).ok_count(10) == 8
    g = a.geometry
    assert a.info()["segments"] == g.segments
    b = PageStore(dev, fast_config(partitions=2, **hb))
    kb = NS.with_group(2).chain_tokens(list(range(8 * 8)))
    deadline = time.monotonic() + 10
    while True:
        res = b.save_batch(kb, [_data(k) for k in kb]).wait(10)
        if all(r.ok for r in res) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert all(r.ok for r in res), [r.status for r in res]
    assert a.stats.segments_handed_over > 0 and b.info()["segments"] > 0
    assert a.info()["segments"] >= g.segments // 2  # a keeps its fair share
    # pages of the handed-over segments: b may have overwritten them; a never returns wrong bytes
    outs = [bytearray(PAGE) for _ in keys[:240]]
    for k, o, r in zip(keys[:240], outs, a.load_batch(keys[:240], outs).wait(20), strict=True):
        assert r.status in (PageStatus.OK, PageStatus.MISSING, PageStatus.VERIFY_FAILED)
        if r.ok:
            assert bytes(o) == _data(k)
    a.close()
    b.close()


def test_negative_control_without_heartbeats_nothing_is_handed_over() -> None:
    dev = MemDevice(4 << 20, 512)
    a = PageStore(dev, fast_config(partitions=2, segment_bytes=SEG))
    keys = NS.chain_tokens(list(range(8 * 600)))
    for i in range(0, 240, 8):
        a.save_batch(keys[i:i + 8], [_data(k) for k in keys[i:i + 8]]).wait(10)
    b = PageStore(dev, fast_config(partitions=2))
    kb = NS.with_group(2).chain_tokens(list(range(8 * 8)))
    res = b.save_batch(kb, [_data(k) for k in kb]).wait(10)
    assert all(r.status is PageStatus.NO_SPACE for r in res) and a.stats.segments_handed_over == 0
    a.close()
    b.close()


def _v1_superblock(lba: int, capacity: int) -> bytes:
    """A format 1.0 superblock as v1 wrote it (docs/format.md of v1: magic, major 1, minor 0, ...)."""
    body = struct.pack("<8sIIIIQ16sQIIQQQQQQQII", b"ADPKVPS1", 1, 0, lba, lba, capacity, b"u" * 16, 1, 16, 64,
                       4096, lba, 8192, capacity // 16, 64, 4096, capacity // 16 - 4096, 1, 0).ljust(252, b"\0")
    return body + struct.pack("<I", crc32c.crc32c(body))


def test_a_v1_card_is_refused_and_only_reformatted_with_the_flag() -> None:
    dev = MemDevice(4 << 20, 512)
    dev.write(0, _v1_superblock(512, 4 << 20).ljust(4096, b"\0"))
    dev.write(1 << 20, b"v1 page bytes".ljust(512, b"\0"))
    before = dev.image()
    with pytest.raises(FormatVersionError, match=r"format version 1.*reformat=True"):
        PageStore(dev, fast_config())  # create=True does not format over another version's store
    assert dev.image() == before  # nothing destroyed
    s = PageStore(dev, fast_config(reformat=True))
    assert s.geometry.segments >= 1 and s.save(NS.chain_tokens(list(range(8)))[0], b"x").ok
    s.close()
    # control: a v2 card opens without the flag
    PageStore(dev, fast_config()).close()


@pytest.mark.parametrize("settle", [0.002, 0.25], ids=["too-short", "control-default"])
def test_a_settle_time_too_short_for_the_device_is_named(settle: float, caplog: pytest.LogCaptureFixture) -> None:
    """A claim (of a writer slot or of segments) retries every attempt slower than half its settle time. On a device
    that slow every attempt is, so nothing is claimed and every save fails: the log names the cause and the fix. The
    control (the store's default settle) claims and saves."""
    dev = MemDevice(8 << 20, delay_s=0.002)  # each command 2 ms: a claim's table reads alone exceed 1 ms
    s = PageStore(dev, fast_config(segment_bytes=SEG, claim_settle_s=settle))
    keys = NS.chain_tokens(list(range(8 * 4)))
    with caplog.at_level("WARNING", logger="adp_connector.store.store"):
        got = [r.status for r in s.save_batch(keys, [_data(k) for k in keys]).wait(30)]
    named = "claim_settle_s" in caplog.text
    if settle < 0.01:
        assert PageStatus.OK not in got and named
    else:
        assert got == [PageStatus.OK] * len(keys) and not named
    s.close()
