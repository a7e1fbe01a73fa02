"""Frequency admission into a full card: a new page displaces a victim only if asked for more often."""

from __future__ import annotations

import pytest
from memdevice import MemDevice
from store_testutil import fast_config

from adp_connector.store import KeyNamespace, PageStatus, PageStore, admission
from adp_connector.store.admission import MAX_COUNT, FrequencySketch
from adp_connector.store.recency import OwnPages

NS = KeyNamespace("admit", "bf16", "L", 4)
PAGE = 20_000


def _chain(n: int, first_token: int) -> list[bytes]:
    return NS.chain_tokens(list(range(first_token, first_token + 4 * n)))


def _data(k: bytes) -> bytes:
    return (k * (PAGE // 32 + 1))[:PAGE]


def _save(s: PageStore, keys: list[bytes]) -> list[PageStatus]:
    return [r.status for r in s.save_batch(keys, [_data(k) for k in keys]).wait(5)]


def _load_prefix(s: PageStore, keys: list[bytes]) -> int:
    res = s.load_batch(keys, [bytearray(PAGE) for _ in keys]).wait(5)
    return next((i for i, r in enumerate(res) if not r.ok), len(keys))


def _full(admission: str) -> tuple[PageStore, list[bytes]]:
    """A 1 MiB card filled with pages each asked for once, up to and including the first page that did not fit
    (declined, or evicting under ``always``); the pages not asked for yet."""
    s = PageStore(MemDevice(1 << 20, 512), fast_config(partitions=1, admission=admission))
    keys = _chain(200, 0)
    for n, k in enumerate(keys):
        status = _save(s, [k])
        if s.stats.evictions or s.stats.not_admitted:
            assert status == [PageStatus.NOT_ADMITTED if admission == "frequency" else PageStatus.OK]
            return s, keys[n + 1:]
        assert status == [PageStatus.OK]
    raise AssertionError("the card never filled")


def test_sketch_counts_saturate_and_halve() -> None:
    sk = FrequencySketch(width=1 << 10, period=1000)
    a, b = bytes(range(32)), bytes(range(1, 33))
    sk.record([a] * 3)
    assert sk.estimate(a) == 3 and sk.estimate(b) == 0
    assert sk.admits(a, b) and not sk.admits(b, a)
    sk.record([b] * 3)
    assert not sk.admits(a, b) and not sk.admits(b, a)  # a tie keeps the victim
    sk.record([a] * 40)
    assert sk.estimate(a) == MAX_COUNT
    sk.record([bytes(32)] * (1000 - 46))  # the 1000th count halves every counter
    assert sk.halvings == 1 and sk.estimate(a) == MAX_COUNT // 2 and sk.estimate(b) == 1
    with pytest.raises(ValueError, match="power of two"):
        FrequencySketch(width=1000)


def test_a_page_asked_once_does_not_displace_one_asked_once_but_does_when_asked_again() -> None:
    s, rest = _full("frequency")
    before = s.info()["own_pages"]
    new = rest[0]
    assert _save(s, [new]) == [PageStatus.NOT_ADMITTED]
    assert s.stats.not_admitted >= 1 and s.stats.evictions == 0 and s.info()["own_pages"] == before
    assert not s.contains([new])[0] and s.stats.save_failed == 0  # declined, not failed
    assert _save(s, [new]) == [PageStatus.OK]  # asked for a second time: it beats a victim asked for once
    assert s.contains([new])[0] and s.stats.evictions >= 1
    s.close()


def test_control_always_admits_a_page_asked_once() -> None:
    s, rest = _full("always")
    assert s.stats.evictions >= 1 and s.stats.not_admitted == 0  # the page that filled it evicted at once
    assert _save(s, [rest[0]]) == [PageStatus.OK]
    s.close()


def test_pages_read_back_outrank_pages_asked_twice() -> None:
    s, rest = _full("frequency")
    stored = [k for k, present in zip(_chain(200, 0), s.contains(_chain(200, 0)), strict=True) if present]
    for _ in range(3):
        assert _load_prefix(s, stored) == len(stored)  # every stored page read back three times
    new = rest[0]
    assert _save(s, [new]) == [PageStatus.NOT_ADMITTED] and _save(s, [new]) == [PageStatus.NOT_ADMITTED]
    assert all(s.contains(stored))
    s.close()


def _shift(rounds: int = 80) -> tuple[int, int, int, int]:
    """A card full of pages read back until their counts saturate, then never asked for again, while a new set of
    30 pages is asked for every round (read back, what is missing saved). (halvings, new pages found at the end,
    old pages left, old pages at first)."""
    s, _rest = _full("frequency")
    old = [k for k, present in zip(_chain(200, 0), s.contains(_chain(200, 0)), strict=True) if present]
    for _ in range(MAX_COUNT):
        _load_prefix(s, old)
    new = _chain(30, 100_000)
    for _ in range(rounds):  # ~2,400 requests: the halving period is 1,024 on a card this small
        _save(s, new[_load_prefix(s, new):])
    assert s._freq is not None
    out = s._freq.halvings, _load_prefix(s, new), sum(s.contains(old)), len(old)
    s.close()
    return out


def _never_outlived(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages never count as outlived: admission by the counts alone (the halving's own effect)."""
    monkeypatch.setattr(OwnPages, "outlived", lambda self, key: False)


def test_pages_no_longer_asked_for_age_out(monkeypatch: pytest.MonkeyPatch) -> None:
    _never_outlived(monkeypatch)
    halvings, found, old_left, old_at_first = _shift()
    assert halvings >= 2 and found == 30 and old_left <= old_at_first - 30, (halvings, found, old_left)


def test_control_without_halving_saturated_pages_stay_forever(monkeypatch: pytest.MonkeyPatch) -> None:
    _never_outlived(monkeypatch)
    monkeypatch.setattr(admission, "_HALVE", bytes(range(256)))  # a halving that changes nothing
    halvings, found, old_left, old_at_first = _shift()
    assert halvings >= 2 and found == 0 and old_left == old_at_first, (halvings, found, old_left)


def test_pages_untouched_past_the_horizon_go_whatever_their_count() -> None:
    """Saturated counts do not hold a card once their pages stopped being asked for: past twice the card (and the
    reuse seen) in pages asked, they go to a new set asked for every round, before any halving (GPU run 22: a card
    full of earlier agents' pages declined 4,776 of the next agents' pages)."""
    halvings, found, old_left, old_at_first = _shift(rounds=8)
    assert halvings == 0 and found == 30 and old_left <= old_at_first - 30, (halvings, found, old_left)


def test_control_before_any_halving_saturated_pages_hold_the_card(monkeypatch: pytest.MonkeyPatch) -> None:
    _never_outlived(monkeypatch)
    halvings, found, old_left, old_at_first = _shift(rounds=8)
    assert halvings == 0 and found == 0 and old_left == old_at_first, (halvings, found, old_left)


def test_a_page_asked_once_displaces_one_untouched_for_two_cards_of_asks() -> None:
    """Counts decide while the victim is within the horizon; once it has outlived it, the next new page displaces it
    at its first ask (counted in ``evictions_outlived``), while a page asked for meanwhile stays."""
    s, rest = _full("frequency")
    stored = [k for k, present in zip(_chain(200, 0), s.contains(_chain(200, 0)), strict=True) if present]
    assert s._own.horizon == 2 * len(stored)  # nothing reused yet: twice the card
    keep = stored[:1]  # the next victim, asked for again below
    declined = 0
    for new in rest:
        _load_prefix(s, keep)  # reused: stays within the horizon (its first reuse, ~one card, widens it)
        status = _save(s, [new])
        if status == [PageStatus.OK]:
            break
        assert status == [PageStatus.NOT_ADMITTED] and s.stats.evictions_outlived == 0
        declined += 1
    assert s._own.horizon == 2 * (len(stored) + 1)  # keep's reuse distance: the card's pages and the page declined
    # stored[1] was a card old already: it outlived the horizon after about one more card of asks (two per round)
    assert declined == (s._own.horizon - len(stored)) // 2, declined
    assert s.stats.evictions_outlived == 1 and not s.contains([stored[1]])[0] and s.contains(keep)[0]
    s.close()


def _workload_shift() -> tuple[list[float], int]:
    """Two sessions of 8 pages take four rounds (read back every round, so their counts are high), then four new
    sessions of 8 pages take four rounds: the card (36 pages) holds the new sessions alone, not both workloads.
    The new sessions' share of pages hit per round, and how many of their saves the card declined."""
    s = PageStore(MemDevice(1 << 20, 512), fast_config(partitions=1, admission="frequency"))

    def rounds(chains: list[list[bytes]], n: int) -> list[float]:
        rates = []
        for _ in range(n):
            hit = asked = 0
            for chain in chains:
                got = _load_prefix(s, chain)
                _save(s, chain[got:])
                hit, asked = hit + got, asked + len(chain)
            rates.append(hit / asked)
        return rates

    old = [_chain(8, 10_000 * (c + 1)) for c in range(2)]
    new = [_chain(8, 500_000 + 10_000 * (c + 1)) for c in range(4)]
    assert rounds(old, 4) == [0.0, 1.0, 1.0, 1.0]
    declined = s.stats.not_admitted
    rates = rounds(new, 4)
    assert s.info()["own_pages"] < 48 <= s.info()["own_pages"] + 16  # room for the new sessions, not for both
    out = rates, s.stats.not_admitted - declined
    s.close()
    return out


def test_a_finished_workload_makes_room_for_the_next_within_its_first_round() -> None:
    """Pages read back every round of their own cycle, then untouched for twice that cycle and a card of asks, are
    the next victims whatever their counts, before the horizon of twice the card lets them go. (GPU runs 25 and 26
    declined ~5,000 pages of the 8-agent point behind the 1- and 4-agent points' pages; those were never read from
    the card, the GPU's own cache served them, so they have no cycle and this does not apply to them.)"""
    rates, declined = _workload_shift()
    assert declined < 8 and rates[1] >= 0.85 and rates[2:] == [1.0, 1.0], (rates, declined)


def test_control_without_a_cycle_per_page_the_finished_workload_holds_the_card(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(OwnPages, "_note_cycle", lambda self, key, d: None)
    rates, declined = _workload_shift()
    assert declined >= 16 and max(rates[1:3]) < 0.7, (rates, declined)
