"""Property-based test: random save/load/discard/evict/restart/fault sequences against a model of the store."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from memdevice import MemDevice
from store_testutil import fast_config

from adp_connector.store import KeyNamespace, PageStatus, PageStore

NS = KeyNamespace("prop", "bf16", "L", 2)
KEYS = NS.chain_tokens(list(range(2 * 24)))
W = b"prop-writer-0000"


def size_of(i: int) -> int:
    """Payload size of key ``i``: 0 B .. ~45 KB, LBA-aligned and not."""
    return [0, 1, 511, 512, 4096, 4097, 9000, 20_000, 33_000, 45_000][i % 10] + i // 10


def data_of(i: int) -> bytes:
    """Content of key ``i`` (content-addressed: a key always has the same bytes)."""
    n = size_of(i)
    return (KEYS[i] * (n // 32 + 1))[:n]


idx = st.integers(0, len(KEYS) - 1)


class EvictionOrder:
    """The model's own keys in eviction order (next victim first): unprotected, then protected (read back; ``slru``
    only, at most ``share`` of the keys), each least recent first."""

    def __init__(self, policy: str, share: float, order: list[int] | None = None) -> None:
        self.policy, self.share = policy, share
        self.cold: OrderedDict[int, None] = OrderedDict.fromkeys(order or [])
        self.hot: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, i: object) -> bool:
        return i in self.cold or i in self.hot

    def __iter__(self) -> Iterator[int]:
        return iter([*self.cold, *self.hot])

    def __len__(self) -> int:
        return len(self.cold) + len(self.hot)

    def pop(self, i: int, default: None = None) -> None:
        self.cold.pop(i, None)
        self.hot.pop(i, None)

    __delitem__ = pop

    def touch(self, i: int) -> None:
        (self.cold if i in self.cold else self.hot).move_to_end(i)

    def written(self, i: int) -> None:
        self.pop(i)
        self.cold[i] = None

    def read_back(self, i: int) -> None:
        if self.policy == "lru":
            self.touch(i)
            return
        self.pop(i)
        self.hot[i] = None

    def cap(self) -> None:
        while self.hot and len(self.hot) > self.share * len(self):
            self.cold[self.hot.popitem(last=False)[0]] = None


class StoreMachine(RuleBasedStateMachine):
    """Model: ``present`` (eviction order) must equal the store's own keys exactly; ``maybe`` holds keys whose
    eviction tombstone may not have reached the device (after an injected write fault). A batch's keys are ordered
    tail-first: its first key ends the most recent."""

    policy = "slru"

    def __init__(self) -> None:
        super().__init__()
        self.dev = MemDevice(160 << 10, 512, 8192, workers=1)  # deterministic command order
        self.cfg = fast_config(partitions=1, slots_per_partition=16, writer_id=W, inline_bytes=4096,
                               eviction=self.policy)
        self.store = PageStore(self.dev, self.cfg)
        self.present = EvictionOrder(self.policy, self.cfg.protected_share)
        self.seq: dict[int, int] = {}
        self.maybe: set[int] = set()
        self.counter = 0
        self.evictions = 0

    def _sync_evictions(self, touched: list[int], resaved: list[int]) -> None:
        """Keys gone from the store must be explained by evictions in eviction order, the keys this batch found
        stored (``touched``, in batch order) made the most recent of their class first, tail-first."""
        have = {KEYS.index(k) for k in self.store._own}
        for i in reversed(touched):
            self.present.touch(i)
        order = list(self.present)
        gone = [i for i in order if i not in have or i in resaved]
        ev = self.store.stats.evictions - self.evictions
        self.evictions = self.store.stats.evictions
        assert len(gone) == ev, (gone, ev)
        assert gone == order[:len(gone)], (gone, order)  # victims in eviction order
        for i in gone:
            del self.present[i]
        return None

    def _save(self, ids: list[int], fault: bool) -> None:
        if fault:
            self.dev.fail_next(1, ("write",))
        ids = list(dict.fromkeys(ids))
        before = set(self.present)
        res = self.store.save_batch([KEYS[i] for i in ids], [data_of(i) for i in ids]).wait(10)
        self.dev.fail_next(0)
        touched, resaved = [], []
        for i, r in zip(ids, res, strict=True):
            if r.status is PageStatus.EXISTS:
                assert i in before
                touched.append(i)
            elif r.ok and i in before:
                resaved.append(i)  # evicted by an earlier page of this batch, then saved again
            elif not r.ok:
                assert fault or r.status is PageStatus.NO_SPACE, r
        self._sync_evictions(touched, resaved)
        for i, r in zip(ids, res, strict=True):
            if r.ok:
                self.counter += 1
                self.seq[i] = self.counter
                self.maybe.discard(i)
        for i, r in reversed(list(zip(ids, res, strict=True))):  # tail-first: the batch's head ends most recent
            if r.status is PageStatus.EXISTS and i in self.present:  # (unless this batch evicted it)
                self.present.touch(i)
            elif r.ok:
                self.present.written(i)
        if fault:
            self.maybe |= set(before) - set(self.present)

    @rule(ids=st.lists(idx, min_size=1, max_size=6))
    def save(self, ids: list[int]) -> None:
        self._save(ids, False)

    @rule(ids=st.lists(idx, min_size=1, max_size=4))
    def save_with_write_fault(self, ids: list[int]) -> None:
        self._save(ids, True)

    @rule(ids=st.lists(idx, min_size=1, max_size=6, unique=True))
    def load(self, ids: list[int]) -> None:
        bufs = [bytearray(size_of(i) + 5) for i in ids]
        res = self.store.load_batch([KEYS[i] for i in ids], bufs).wait(10)
        for i, b, r in zip(ids, bufs, res, strict=True):
            if i in self.present:
                assert r.ok, r
                assert bytes(b[:size_of(i)]) == data_of(i)
            else:
                assert r.status is PageStatus.MISSING
        for i in reversed(ids):
            if i in self.present:
                self.present.read_back(i)
        self.present.cap()

    @rule(ids=st.lists(idx, min_size=1, max_size=3, unique=True))
    def discard(self, ids: list[int]) -> None:
        n = self.store.discard([KEYS[i] for i in ids])
        assert n == sum(i in self.present for i in ids)
        for i in ids:
            self.present.pop(i, None)

    @precondition(lambda self: any(size_of(i) >= 1024 for i in self.present))
    @rule(data=st.data())
    def corrupt_on_media(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from([i for i in self.present if size_of(i) >= 1024]))
        self.present.read_back(i)
        self.present.cap()
        loc = self.store._own[KEYS[i]]
        self.dev.write((loc.lba + 1) * 512, b"\xee" * 512)
        r = self.store.load(KEYS[i], bytearray(size_of(i)))
        assert r.status is PageStatus.VERIFY_FAILED
        del self.present[i]
        self.maybe.discard(i)

    @rule(clean=st.booleans())
    def restart(self, clean: bool) -> None:
        if clean:
            self.store.close()
        else:
            self.store.abandon()
        self.store = PageStore(self.dev, self.cfg)
        self.evictions = 0
        have = {KEYS.index(k) for k in self.store._own}
        assert set(self.present) <= have <= set(self.present) | self.maybe
        for i in have - set(self.present):  # resurrected (tombstone lost to a fault): intact or a miss
            out = bytearray(size_of(i))
            r = self.store.load(KEYS[i], out)
            assert r.status in (PageStatus.OK, PageStatus.VERIFY_FAILED)
            if r.ok:
                assert bytes(out) == data_of(i)
            self.counter += 1
        self.store.discard([KEYS[i] for i in have - set(self.present)])
        self.maybe.clear()
        # after a restart every page is unprotected, in commit order
        self.present = EvictionOrder(self.policy, self.cfg.protected_share,
                                     sorted(self.present, key=lambda i: self.seq[i]))

    @invariant()
    def index_matches_model(self) -> None:
        assert {KEYS.index(k) for k in self.store._own} == set(self.present)
        assert self.store.lookup([KEYS[i] for i in self.present]) == len(self.present)
        info = self.store.info()
        g = self.store.geometry
        used = sum(g.page_lbas(size_of(i)) for i in self.present)
        assert info["free_lbas"] == g.data_lbas - used

    def teardown(self) -> None:
        self.store.close()


class LruStoreMachine(StoreMachine):
    """The same model under ``eviction="lru"``."""

    policy = "lru"


StoreMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
LruStoreMachine.TestCase.settings = settings(max_examples=20, stateful_step_count=30, deadline=None,
                                             suppress_health_check=[HealthCheck.too_slow])
test_store_state_machine = StoreMachine.TestCase
test_store_state_machine_lru = LruStoreMachine.TestCase
