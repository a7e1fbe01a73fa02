"""Round trips, lookups, keys, formats and stats of the page store."""

from __future__ import annotations

import os

import pytest
from memdevice import MemDevice
from store_testutil import fast_config

from adp_connector.device import BlockDevice
from adp_connector.store import KeyNamespace, PageKey, PageStatus, PageStore
from adp_connector.store.alloc import ExtentAllocator
from adp_connector.store.format import compute_geometry, pack_superblock, unpack_superblock

NS = KeyNamespace("meta-llama/Llama-3.1-8B", "bfloat16", "LBHNC;h=8;d=128", 16, tp_rank=0, tp_size=2)


def payload(key: bytes, n: int) -> bytes:
    """Deterministic bytes for a key."""
    seed = int.from_bytes(key[:8], "little")
    return (seed.to_bytes(8, "little") * (n // 8 + 1))[:n] if n else b""


def test_memdevice_is_a_blockdevice() -> None:
    assert isinstance(MemDevice(1 << 20), BlockDevice)


@pytest.mark.parametrize("lba", [512, 4096])
def test_round_trip_sizes(device_factory, lba: int) -> None:
    dev = device_factory(8 << 20, lba_size=lba)
    store = PageStore(dev, fast_config(inline_bytes=8 << 10))
    sizes = [0, 1, 511, 512, 513, 4095, 4096, 4097, 8192, 8193, 65536 + 7, 300_000]
    keys = NS.chain_tokens(list(range(16 * len(sizes))))
    bufs = [os.urandom(n) for n in sizes]
    res = store.save_batch(keys, bufs).wait(10)
    assert [r.status for r in res] == [PageStatus.OK] * len(sizes)
    assert store.lookup(keys) == len(keys)
    outs = [bytearray(n + 3) for n in sizes]
    res = store.load_batch(keys, outs).wait(10)
    assert all(r.ok for r in res), res
    for n, b, o in zip(sizes, bufs, outs, strict=True):
        assert bytes(o[:n]) == b
    st = store.stats.snapshot()
    assert st["pages_saved"] == st["pages_loaded"] == len(sizes)
    assert st["bytes_saved"] == sum(sizes) and st["save_gbps"] > 0
    store.close()


def test_lookup_prefix_and_exists(device_factory) -> None:
    store = PageStore(device_factory(), fast_config())
    keys = NS.chain_tokens(list(range(160)))
    assert store.save_batch(keys[:6], [b"x" * 100] * 6).ok_count(5) == 6
    assert store.lookup(keys) == 6
    assert store.lookup(keys[1:]) == 5
    assert store.contains([keys[7], keys[0]]) == [False, True]
    assert store.save(keys[0], b"x" * 100).status is PageStatus.EXISTS
    buf = bytearray(100)
    assert store.load(keys[8], buf).status is PageStatus.MISSING
    assert store.load(keys[0], bytearray(10)).status is PageStatus.ERROR  # buffer too small
    assert store.load(keys[0], b"\0" * 100).status is PageStatus.ERROR  # read-only buffer
    st = store.stats.snapshot()
    assert st["misses"] == 3 and st["lookup_hits"] == 6 + 5 + 1
    store.close()


def test_async_handle_and_callback(device_factory) -> None:
    dev = device_factory()
    store = PageStore(dev, fast_config())
    dev.delay_s = 0.01
    keys = NS.chain_tokens(list(range(64)))
    seen = []
    h = store.save_batch(keys, [payload(k, 5000) for k in keys])
    h.add_done_callback(lambda hh: seen.append(hh.kind))
    assert not h.done()
    with pytest.raises(TimeoutError):
        h.wait(0.001)
    assert h.ok_count(10) == 4 and seen == ["save"]
    outs = [bytearray(5000) for _ in keys]
    assert store.load_batch(keys, outs).ok_count(10) == 4
    assert [bytes(o) for o in outs] == [payload(k, 5000) for k in keys]
    store.close()


def test_keys_stable_and_namespaced() -> None:
    toks = list(range(1000, 1064))
    a = NS.chain_tokens(toks)
    assert len(a) == 4 and a == NS.chain_tokens(toks)
    # Known-answer: independent of PYTHONHASHSEED and process (recomputed in a subprocess elsewhere).
    assert NS.chain_tokens(toks[:16], parent=a[0])[0] != a[1]
    assert NS.chain_tokens(toks[16:32], parent=a[0])[0] == a[1]
    others = [KeyNamespace("other", "bfloat16", NS.layout, 16, 0, 2),
              KeyNamespace(NS.model, "float16", NS.layout, 16, 0, 2),
              KeyNamespace(NS.model, NS.dtype, "LBNHC", 16, 0, 2),
              KeyNamespace(NS.model, NS.dtype, NS.layout, 32, 0, 2),
              KeyNamespace(NS.model, NS.dtype, NS.layout, 16, 1, 2),
              KeyNamespace(NS.model, NS.dtype, NS.layout, 16, 0, 2, pp_rank=1, pp_size=2),
              NS.with_group(1),
              KeyNamespace(NS.model, NS.dtype, NS.layout, 16, 0, 2, extra=(("lora", "x"),))]
    digests = {NS.digest} | {o.digest for o in others}
    assert len(digests) == len(others) + 1
    for o in others:
        assert set(o.chain_tokens(toks[:32])).isdisjoint(a)
        assert o.key_for_block_hash(b"h") != NS.key_for_block_hash(b"h")
    assert NS.key_for_block_hash(b"h") == NS.keys_for_block_hashes([b"h"])[0]
    assert len(NS.chain_tokens(list(range(15)))) == 0
    big = NS.chain_tokens([2**40, 300_000] * 8)  # token ids above 16/32 bits
    assert len(big) == 1


def test_key_stable_across_processes() -> None:
    import subprocess
    import sys
    code = ("from adp_connector.store import KeyNamespace as K;"
            "print(K('m','bf16','L',4,extra=(('b',1),('a','x'))).chain_tokens([1,2,3,4])[0].hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": s}).stdout for s in ("1", "2")}
    assert len(outs) == 1


def test_geometry_has_no_small_ceilings() -> None:
    cap = 64 << 40  # 64 TiB
    g = compute_geometry(cap, 4096, 64, None, 1 << 20, b"u" * 16, 1)
    assert g.segments_offset + g.segments * g.segment_stride <= cap
    assert 1000 <= g.segments <= 1024 and g.writers == 64
    assert unpack_superblock(pack_superblock(g)) == g
    assert g.data_start_lba(g.segments - 1) > 2**32  # LBAs beyond 32 bits are representable
    assert g.page_lbas(3 << 30) == 1 + (3 << 30) // 4096  # multi-GiB page


def test_allocator() -> None:
    a = ExtentAllocator(10, 110, used=[(20, 10), (50, 5)])
    assert a.free_lbas == 100 - 15
    assert a.alloc(40) == 55
    assert a.alloc(10) == 10
    a.free(10, 10)
    a.free(20, 10)
    assert a.extents()[0] == (10, 40)
    with pytest.raises(ValueError):
        a.free(15, 2)
    assert a.alloc(1000) is None


def test_refuses_foreign_geometry() -> None:
    from adp_connector.store import FormatError
    with pytest.raises(FormatError):
        PageStore(MemDevice(2 << 20, 512), fast_config(create=False))  # empty device, no formatting allowed
    dev = MemDevice(4 << 20, 512)
    PageStore(dev, fast_config()).close()
    small = MemDevice(2 << 20, 512)
    small.backing.buf[:] = dev.image()[: 2 << 20]
    with pytest.raises(FormatError):
        PageStore(small, fast_config(create=False))  # store larger than the namespace
    other_lba = MemDevice(4 << 20, 4096)
    other_lba.backing.buf[:] = dev.image()
    with pytest.raises(FormatError):
        PageStore(other_lba, fast_config(create=False))


def test_page_keys_stay_what_the_card_holds() -> None:
    """Keys name pages on the card across versions: a derivation that changes orphans every stored page. Pinned
    vectors (computed before the keyed state was reused across derivations), and docs/format.md's formulas written
    out with hashlib. Control: a key derived under another person string differs from the pinned one."""
    import hashlib
    import struct

    ns = KeyNamespace("m", "bfloat16", "LBHNC", 16, extra=(("hash_algo", "sha256_cbor"),))
    assert ns.digest.hex() == "b2eb1552322eb290e28f072b2b5bb08501e886774d71a484e4ffcd731429dad4"
    bh = bytes(range(32))
    pinned = "dfe475455c016edd313659edd039bef76afc7f1b4657a60eb52261b331dc21a9"
    for _ in range(2):  # the reused state is copied, never advanced
        assert ns.key_for_block_hash(bh).hex() == pinned
    by_formula = hashlib.blake2b(struct.pack("<Q", 32) + bh, digest_size=32, key=ns.digest, person=b"adpkv-bhash-v1")
    assert by_formula.hexdigest() == pinned
    other = hashlib.blake2b(struct.pack("<Q", 32) + bh, digest_size=32, key=ns.digest, person=b"adpkv-chain-v1")
    assert other.hexdigest() != pinned
    key = ns.key_for_block_hash(bh)
    assert isinstance(key, PageKey) and len(key) == 32
    assert ns.chain_tokens(list(range(16)))[0].hex() == (
        "e5ae8df298d4f9cb78796068017f3a22b7eb1eef9187fdee65cf98d708720c57")
