"""Eviction order: a chain loses its tail before its head; pages read back outlive a cyclic scan (slru); pins."""

from __future__ import annotations

import pytest
from memdevice import MemDevice
from store_testutil import fast_config

from adp_connector.store import KeyNamespace, PageStatus, PageStore, StoreConfig
from adp_connector.store.core import Loc
from adp_connector.store.recency import REUSE_EPOCH_MIN, OwnPages

NS = KeyNamespace("evict", "bf16", "L", 4)
PAGE = 20_000  # every page the same size: one eviction per page saved once the card is full


def _chain(n: int, first_token: int) -> list[bytes]:
    return NS.chain_tokens(list(range(first_token, first_token + 4 * n)))


def _data(k: bytes) -> bytes:
    return (k * (PAGE // 32 + 1))[:PAGE]


def _save(s: PageStore, keys: list[bytes]) -> None:
    res = s.save_batch(keys, [_data(k) for k in keys]).wait(5)
    assert all(r.status in (PageStatus.OK, PageStatus.EXISTS) for r in res), res


def _load_prefix(s: PageStore, keys: list[bytes]) -> int:
    """Load ``keys`` in one batch; the number of leading pages that hit."""
    res = s.load_batch(keys, [bytearray(PAGE) for _ in keys]).wait(5)
    return next((i for i, r in enumerate(res) if not r.ok), len(keys))


def _full_store(policy: str) -> tuple[PageStore, list[bytes]]:
    """A store on a 1 MiB card filled with one-page batches until it evicts; the filler keys."""
    s = PageStore(MemDevice(1 << 20, 512), fast_config(partitions=1, eviction=policy))
    filler = _chain(200, 100_000)
    n = 0
    while s.stats.evictions == 0:
        _save(s, [filler[n]])
        n += 1
    return s, filler[n:]


def _evict_some_of(s: PageStore, chain: list[bytes], k: int, filler: list[bytes]) -> list[bool]:
    """Save filler pages one at a time until ``chain`` lost at least ``k`` pages; which of them remain."""
    it = iter(filler)
    while sum(s.contains(chain)) > len(chain) - k:
        _save(s, [next(it)])
    return s.contains(chain)


def _is_prefix(present: list[bool]) -> bool:
    n = sum(present)
    return present == [True] * n + [False] * (len(present) - n)


@pytest.mark.parametrize("policy", ["slru", "lru"])
def test_chain_loses_its_tail_first(policy: str) -> None:
    s, filler = _full_store(policy)
    chain = _chain(8, 0)
    _save(s, chain)
    present = _evict_some_of(s, chain, 3, filler)
    assert 0 < sum(present) <= 5 and _is_prefix(present), present
    s.close()


@pytest.mark.parametrize("policy", ["slru", "lru"])
def test_batch_of_stored_head_and_new_tail_keeps_the_head(policy: str) -> None:
    """A save batch whose head is stored already (EXISTS) and whose tail is new: the head still ends most recent,
    although its pages were touched before the tail was committed."""
    s, filler = _full_store(policy)
    chain = _chain(8, 0)
    _save(s, chain[:4])
    _save(s, chain)
    present = _evict_some_of(s, chain, 5, filler)
    assert 0 < sum(present) <= 3 and _is_prefix(present), present
    s.close()


def test_load_batch_leaves_the_head_most_recent() -> None:
    """Pages saved head first (the head oldest), then read back in one batch: the head ends most recent."""
    s, filler = _full_store("lru")
    chain = _chain(8, 0)
    for k in chain:
        _save(s, [k])
    assert _load_prefix(s, chain) == 8
    present = _evict_some_of(s, chain, 3, filler)
    assert 0 < sum(present) <= 5 and _is_prefix(present), present
    s.close()


def test_control_head_first_order_loses_the_head(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: with the former order (the batch's head touched first, so the oldest) the same eviction
    leaves the chain's useless tail. The prefix assertion above would fail on it."""
    monkeypatch.setattr(PageStore, "_order_tail_first",
                        lambda self, touched: self._own.touch(k for _i, k in sorted(touched)))
    s, filler = _full_store("lru")
    chain = _chain(8, 0)
    _save(s, chain)
    present = _evict_some_of(s, chain, 3, filler)
    assert not present[0] and present[-1] and not _is_prefix(present), present
    s.close()


def _cyclic_hit_rates(policy: str, sessions: int = 4, length: int = 15, grow: int = 3, rounds: int = 8,
                      admission: str = "always") -> list[float]:
    """Agents taking turns round-robin: each turn a session's history grows by ``grow`` pages up to ``length``;
    the turn loads it (hits: the leading pages found) and saves what it did not find (a full card may decline
    them under ``frequency`` admission). Per round, the share of the pages asked that hit."""
    s = PageStore(MemDevice(1 << 20, 512), fast_config(partitions=1, eviction=policy, admission=admission))
    chains = [_chain(length, 10_000 * (c + 1)) for c in range(sessions)]
    ok = {PageStatus.OK, PageStatus.EXISTS} | ({PageStatus.NOT_ADMITTED} if admission == "frequency" else set())
    rates = []
    for r in range(rounds):
        hit = asked = 0
        for chain in chains:
            history = chain[:grow * (r + 1)]
            got = _load_prefix(s, history)
            res = s.save_batch(history[got:], [_data(k) for k in history[got:]]).wait(5)
            assert {x.status for x in res} <= ok, res
            hit, asked = hit + got, asked + len(history)
        rates.append(hit / asked)
    capacity = s.info()["own_pages"]
    s.close()
    assert sessions * length > 1.5 * capacity, capacity  # the card holds ~60% of the full histories
    return rates


def test_whole_histories_larger_than_the_card_keep_a_stable_part_with_frequency_admission() -> None:
    """Each session asks for its whole history from the first round (agents whose histories exceed the card from
    their first turn): nothing is read back before it is evicted, so the order alone never protects anything;
    frequency admission keeps the sessions that fit, and they hit whole every round."""
    rates = _cyclic_hit_rates("slru", grow=15, rounds=6, admission="frequency")
    assert min(rates[1:]) >= 0.5, rates


@pytest.mark.parametrize("policy", ["slru", "lru"])
def test_control_whole_histories_thrash_when_every_page_is_admitted(policy: str) -> None:
    rates = _cyclic_hit_rates(policy, grow=15, rounds=6, admission="always")
    assert max(rates) == 0.0, rates  # each turn evicts the history asked for next


def test_whole_histories_over_twice_the_card_keep_a_stable_part() -> None:
    """Past twice the card, the first round has no reuse to go by and its pages outlive the floor; the second round
    measures the reuse of keys the card no longer holds, and from the third on the stable part hits every round."""
    rates = _cyclic_hit_rates("slru", sessions=8, grow=15, rounds=6, admission="frequency")
    assert min(rates[2:]) >= 0.25, rates


def test_control_reuse_of_keys_not_held_unmeasured_thrashes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: a clock that measures no reuse (as when only pages still held gave a distance) lets every page of a
    cycle over twice the card outlive the floor, so nothing is ever read back."""
    def clock_only(self: OwnPages, keys: list[bytes]) -> None:
        self.clock += len(keys)

    monkeypatch.setattr(OwnPages, "asked", clock_only)
    rates = _cyclic_hit_rates("slru", sessions=8, grow=15, rounds=6, admission="frequency")
    assert max(rates) == 0.0, rates


def test_cyclic_sessions_keep_hits_with_slru() -> None:
    rates = _cyclic_hit_rates("slru")
    assert min(rates[-3:]) >= 0.35, rates  # the protected prefixes of every session hit (0.45 when written)


def test_control_cyclic_sessions_thrash_with_lru() -> None:
    rates = _cyclic_hit_rates("lru")
    assert max(rates[1:3]) > 0.3 and rates[-3:] == [0.0, 0.0, 0.0], rates  # hits while it fits, none after


def _pages(n: int, policy: str = "slru", share: float = 0.8) -> OwnPages:
    own = OwnPages(policy, share)
    for i in range(n):
        own[bytes([i])] = Loc(0, i, i, 1, i)
    return own


def test_reuse_distance_widens_the_horizon_for_two_epochs() -> None:
    """The clock counts keys asked; a key asked again gives a reuse distance whether it is held or not; the horizon
    is twice the longest of the last one to two epochs, at least twice the pages held; a page untouched for longer
    than it has outlived it."""
    own = _pages(4)
    assert own.clock == 0 and own.horizon == 8
    gone = bytes(range(32))  # a key not held
    own.asked([gone] + [bytes([200 + i]) * 32 for i in range(49)])
    own.asked([gone])  # asked again after 50: a reuse distance of 50
    assert own.clock == 51 and own.horizon == 100 and not own.outlived(bytes([1]))
    own.asked([bytes([250]) * 32] * 50)
    assert own.outlived(bytes([1]))  # untouched for 101 pages asked
    own.touch([bytes([1])])
    assert not own.outlived(bytes([1]))  # its age starts again
    own.asked([bytes([251]) * 32] * (REUSE_EPOCH_MIN - own.clock))  # the first epoch ends: remembered one more
    assert own.horizon == 100
    own.asked([bytes([252]) * 32] * 2)  # the same key twice: a distance of 1
    own.asked([bytes([253]) * 32] * REUSE_EPOCH_MIN)  # a second epoch without a long reuse
    assert own.horizon == 8  # back to twice the pages held
    del own[bytes([2])]
    assert own.horizon == 6 and bytes([2]) not in own._stamp


def test_unprotected_pages_go_first_then_protected_ones() -> None:
    own = _pages(6, share=1.0)
    own.read_back([bytes([1]), bytes([0])])  # protected, page 0 most recent
    assert list(own) == [bytes([i]) for i in (2, 3, 4, 5, 1, 0)]
    assert own.victim(lambda loc: True) == bytes([2])
    for i in (2, 3, 4, 5):
        del own[bytes([i])]
    assert own.victim(lambda loc: True) == bytes([1])


@pytest.mark.parametrize("policy", ["slru", "lru"])
def test_pinned_pages_are_never_the_victim(policy: str) -> None:
    own = _pages(4, policy, share=1.0)
    own.read_back([bytes([0]), bytes([1])])
    pinned = {0, 2, 3}
    assert own.victim(lambda loc: loc.slot not in pinned) == bytes([1])
    assert own.victim(lambda loc: False) is None


def test_protected_share_is_capped_and_demoted_pages_follow_unread_ones() -> None:
    own = _pages(10, share=0.5)
    own.read_back([bytes([i]) for i in reversed(range(8))])  # pages 0..7 read back, page 0 most recent
    assert own.protected == 5
    assert [own.is_protected(bytes([i])) for i in range(10)] == [True] * 5 + [False] * 5
    # never read (8, 9) go first, then the demoted ones (7, 6, 5: least recent protected first)
    assert list(own)[:5] == [bytes([i]) for i in (8, 9, 7, 6, 5)]


def test_store_caps_protected_pages() -> None:
    s = PageStore(MemDevice(1 << 20, 512), fast_config(partitions=1, protected_share=0.5))
    chain = _chain(10, 0)
    _save(s, chain)
    assert _load_prefix(s, chain) == 10
    assert s._own.protected == 5 and all(s._own.is_protected(k) for k in chain[:5])
    s.close()


def test_reopened_store_starts_unprotected_in_commit_order() -> None:
    dev = MemDevice(1 << 20, 512)
    cfg = fast_config(partitions=1, writer_id=b"evict-writer-000")
    s = PageStore(dev, cfg)
    chain = _chain(6, 0)
    _save(s, chain)
    assert _load_prefix(s, chain) == 6 and s._own.protected > 0
    s.close()
    s2 = PageStore(dev, cfg)
    assert s2._own.protected == 0
    assert list(s2._own) == chain  # the index rebuild orders by sequence: commit (batch) order
    s2.close()


def test_eviction_options_are_validated() -> None:
    assert StoreConfig().eviction == "slru" and StoreConfig(eviction="lru").eviction == "lru"
    with pytest.raises(ValueError, match=r"^StoreConfig.eviction must be one of slru, lru, got 'fifo'$"):
        StoreConfig(eviction="fifo")
    with pytest.raises(ValueError, match=r"protected_share must be within 0\.\.1"):
        StoreConfig(protected_share=1.5)


@pytest.mark.parametrize(("notice", "policy"), [("read_back", "slru"), ("reading", "slru"), ("reading", "lru")])
@pytest.mark.parametrize("noted", [True, False])
def test_pages_another_helper_reads_are_evicted_last(notice: str, policy: str, noted: bool) -> None:
    """The notices: ``note_read_back`` (another helper served a load) protects the pages as a load hit here would;
    ``note_reading`` (a restore is about to read them) makes them the most recent, protecting nothing,
    under either policy. Under pressure the noted chain stays whole while a chain saved after it goes first.
    Control: not noted, the older chain goes first."""
    s, filler = _full_store(policy)
    try:
        a, b = _chain(4, 1), _chain(4, 50)
        _save(s, a)
        _save(s, b)
        if noted:
            note = s.note_read_back if notice == "read_back" else s.note_reading
            assert note([*a, b"x" * 32]) == 4  # a key it does not own is ignored
            assert (s.stats.read_back_elsewhere if notice == "read_back" else s.stats.reading_noted) == 4
            assert s._own.protected == (4 if notice == "read_back" else 0)
        it = iter(filler)
        while all(s.contains(a)) and all(s.contains(b)):
            _save(s, [next(it)])
        assert all(s.contains(a)) is noted and all(s.contains(b)) is not noted
    finally:
        s.close()


def test_take_evicted_names_each_evicted_page_once() -> None:
    """``take_evicted`` returns the own pages evicted since the last call: exactly those no longer stored, once.
    Control: a store that has not evicted returns nothing."""
    s = PageStore(MemDevice(1 << 20, 512), fast_config(partitions=1))
    try:
        first = _chain(4, 1)
        _save(s, first)
        assert s.take_evicted() == []  # control
        filler = _chain(200, 100_000)
        saved, it = list(first), iter(filler)
        while s.stats.evictions < 6:
            k = next(it)
            _save(s, [k])
            saved.append(k)
        taken = s.take_evicted()
        gone = {bytes(k) for k, present in zip(saved, s.contains(saved), strict=True) if not present}
        assert {bytes(k) for k in taken} == gone
        assert len(taken) == s.stats.evictions and s.take_evicted() == []
    finally:
        s.close()


def _key(i: int, tag: int = 0) -> bytes:
    """A 32-byte key whose last-asked slot is ``i`` and whose tag bytes are ``tag``."""
    return bytes(8) + i.to_bytes(4, "little") + tag.to_bytes(4, "little") + bytes(16)


def test_a_page_keeps_its_own_cycle_and_outlives_twice_it() -> None:
    """A key asked again gives its page a cycle (kept from before its save when it was not held); a key that only
    shares the slot gives none; a protected page untouched past twice its cycle and the own pages' count is the
    next victim, ahead of unprotected pages, well within the horizon."""
    own = OwnPages("slru", 1.0)
    a, b, c, stranger = _key(1), _key(2), _key(3), _key(1, tag=7)
    own.asked([c, *(_key(100 + i) for i in range(29)), c])  # c, never held, asked again after 30: horizon 60
    own.asked([b, *(_key(200 + i) for i in range(9)), b])  # b, not held, asked again after 10
    own[b] = Loc(0, 2, 2, 1, 2)
    assert own._cycle == {b: 10} and own.horizon == 60
    own[a] = Loc(0, 1, 1, 1, 1)
    own.asked([stranger])  # a's slot, another key: no cycle for either
    own.asked([a])
    assert a not in own._cycle
    own.read_back([a, b])  # both protected, touched now
    for i in range(4):
        own[_key(300 + i)] = Loc(0, 10 + i, 10 + i, 1, 10 + i)  # unprotected, newer
    assert own.victim(lambda loc: True) == _key(300)  # b is within twice its cycle
    own.asked([_key(400 + i) for i in range(20)])
    assert not own.outlived(b) and own.victim(lambda loc: True) == _key(300)
    own.asked([_key(500)])  # b untouched for 21 > 2 * 10 pages asked (and > 6 own pages)
    assert own.outlived(b) and own.victim(lambda loc: True) == b
    assert not own.outlived(a)  # no cycle of its own: only the horizon applies
    del own[b]
    assert b not in own._cycle


def test_control_a_page_without_a_cycle_is_not_the_next_victim_while_protected() -> None:
    own = OwnPages("slru", 1.0)
    b = _key(2)
    own[b] = Loc(0, 2, 2, 1, 2)
    own.read_back([b])
    own[_key(3)] = Loc(0, 3, 3, 1, 3)
    own.asked([_key(300 + i) for i in range(4)])  # untouched for more than the own pages' count, no cycle
    assert own.horizon == 4 and not own.outlived(b) and own.victim(lambda loc: True) == _key(3)
