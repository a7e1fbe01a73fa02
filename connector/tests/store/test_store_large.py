"""A 200k-token chain: 782 attention pages plus multi-MiB state pages, MDTS 64 KiB, sparse file target."""

from __future__ import annotations

import os

from memdevice import FileBacking, MemDevice
from store_testutil import fast_config

from adp_connector.store import KeyNamespace, PageStore


def test_200k_token_chain_multi_mib_pages(tmp_path) -> None:
    bs = 256
    tokens = [(i * 2654435761) % 151_000 for i in range(782 * bs)]  # 200,192 tokens
    attn = KeyNamespace("hybrid-200k", "bfloat16", "BLHNC", bs, group_id=0)
    mamba = attn.with_group(1)
    ka = attn.chain_tokens(tokens)
    km = mamba.chain_tokens(tokens)
    assert len(ka) == len(km) == 782
    cap = 1 << 30  # sparse: only what is written takes space
    dev = MemDevice(cap, 4096, 64 << 10, backing=FileBacking(tmp_path / "ns.img", cap))
    cfg = fast_config(partitions=2, avg_page_bytes=64 << 10, window_bytes=16 << 20)
    s = PageStore(dev, cfg)
    attn_page = 40_000  # odd size: exercises the LBA tail
    pages = {k: os.urandom(64) * (attn_page // 64) + b"t" * (attn_page % 64) for k in ka}
    # Mamba "align" mode keeps one state per boundary; store every 100th plus the last, 3 MiB + change each
    state = {km[i]: os.urandom(3 * (1 << 20) + 12_345) for i in [*range(0, 782, 100), 781]}
    pages.update(state)
    res = s.save_batch(list(pages), list(pages.values())).wait(120)
    assert all(r.ok for r in res)
    assert dev.max_command_bytes <= 64 << 10
    assert s.lookup(ka) == 782
    s.close()
    dev.close()
    dev2 = MemDevice(cap, 4096, 64 << 10, backing=FileBacking(tmp_path / "ns.img", cap))
    s2 = PageStore(dev2, fast_config(writer=False))
    assert s2.lookup(ka) == 782 and all(s2.contains(list(state)))
    outs = [bytearray(len(v)) for v in pages.values()]
    assert s2.load_batch(list(pages), outs).ok_count(120) == len(pages)
    assert all(bytes(o) == v for o, v in zip(outs, pages.values(), strict=True))
    assert dev2.max_command_bytes <= 64 << 10
    s2.close()
    dev2.close()


def test_terabyte_namespace_beyond_32bit_lbas() -> None:
    from memdevice import SparseBacking
    cap = 8 << 40  # 8 TiB, 512-byte LBAs: 2**34 LBAs
    dev = MemDevice(cap, 512, 128 << 10, backing=SparseBacking(cap))
    cfg = fast_config(partitions=2, avg_page_bytes=1 << 30, segment_bytes=3 << 40)
    first = PageStore(dev, cfg)  # takes segment 0; the second writer claims segment 1, 3 TiB into the card
    s = PageStore(dev, cfg)
    assert s.geometry.segments == 2 and s.info()["segments"] == 1 and s.geometry.data_start_lba(1) > 2**32
    ns = KeyNamespace("m", "bf16", "L", 16)
    k = ns.chain_tokens(list(range(16)))[0]
    data = os.urandom(5 << 20)
    assert s.save(k, data).ok
    assert s._own[k].lba > 2**32
    out = bytearray(len(data))
    assert s.load(k, out).ok and bytes(out) == data
    s.close()
    first.close()
