"""The own pages' index in eviction order: plain LRU, or a segmented LRU that protects pages read back (format.md §10).

``slru``: a page starts *unprotected* when it is written; a load hit makes it *protected*. Eviction takes the least
recently used unpinned unprotected page, and a protected one only when no unprotected page can go. Protected pages
are capped at a share of the own pages: over it, the least recent protected page is demoted to the most recent end
of the unprotected order. A cyclic reader (agents taking turns over more sessions than fit) then keeps the pages it
read back, instead of evicting exactly the ones it needs next. ``lru``: one recency order, a load hit only touches.

Each page also carries when it was last touched, on a clock of pages asked for (saves asked, pages read back), and
the longest reuse distance seen lately: how long a key went unasked before it was asked for again, whether the card
held it or not (a table of when each key was last asked, indexed by the key's own bytes, which are a hash already; a
collision can only lengthen the longest distance, which keeps more pages). A page also keeps its own longest reuse
distance (the table then checks four more of the key's bytes, so a collision gives no distance): a page asked again
after one agent round has a cycle of one round.
:meth:`OwnPages.outlived` tells a page no workload of late comes back to: untouched for longer than twice the longest
reuse seen lately and twice the own pages' count, or, for a page with a cycle of its own, for longer than twice that
cycle and the own pages' count. Frequency admission lets such a page go without weighing its count (admission.py),
and it is the next victim even while protected (:meth:`OwnPages.victim` looks at the least recent few): the pages
of a workload that ended (an earlier benchmark point's agents, read back every round, so their counts are high)
make room for the next one within its first round, instead of declining it until the counts halve.

The policy lives in memory only: a re-opened store indexes every page unprotected, oldest sequence first.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from itertools import chain

from .core import Loc, check_eviction

REUSE_EPOCH_MIN = 1024  # the reuse distance is remembered over two epochs of max(own pages, this) pages asked
LAST_ASKED_SLOTS = 1 << 18  # when each key was last asked, by the key's bytes 8..12 (0: never)
OUTLIVED_SCAN = 16  # the least recent protected pages looked at for one that outlived its cycle
GHOST_CYCLES_KEPT = 1 << 16  # keys not held whose reuse distance waits for their save


class OwnPages(MutableMapping[bytes, Loc]):
    """Key -> :class:`Loc` of the own pages; iterates from the next victim to the last one (coldest first).

    Two ordered classes, least recent first: ``_cold`` (unprotected; every page under ``lru``) and ``_hot``
    (protected). A key is in exactly one. Not thread-safe: the store calls it under its lock.
    """

    def __init__(self, policy: str = "slru", protected_share: float = 0.8) -> None:
        check_eviction(policy, protected_share)
        self.policy = policy
        self.protected_share = protected_share
        self._cold: OrderedDict[bytes, Loc] = OrderedDict()
        self._hot: OrderedDict[bytes, Loc] = OrderedDict()
        self.clock = 0  # pages asked for so far (:meth:`asked`)
        self._stamp: dict[bytes, int] = {}  # key -> the clock when it was last touched
        self._reuse = [0, 0]  # the longest reuse distance seen in the previous epoch and in this one
        self._epoch_end = REUSE_EPOCH_MIN
        self._last_asked = array("Q", bytes(8 * LAST_ASKED_SLOTS))  # the clock when a key was last asked (0: never)
        self._last_tag = array("I", bytes(4 * LAST_ASKED_SLOTS))  # that key's bytes 12..16
        self._cycle: dict[bytes, int] = {}  # own key -> the longest reuse distance seen for that key
        self._ghost_cycle: OrderedDict[bytes, int] = OrderedDict()  # keys not held, just asked again -> distance

    # ---------------------------------------------------------------- mapping

    def __getitem__(self, key: bytes) -> Loc:
        loc = self._cold.get(key)
        return loc if loc is not None else self._hot[key]

    def __setitem__(self, key: bytes, loc: Loc) -> None:
        """A (re)written page: unprotected and the most recent."""
        self._hot.pop(key, None)
        self._cold.pop(key, None)
        self._cold[key] = loc
        self._mark(key)
        cycle = self._ghost_cycle.pop(key, None)  # asked again before it was (re)written: its cycle is known
        if cycle is not None:
            self._cycle[key] = max(cycle, self._cycle.get(key, 0))

    def __delitem__(self, key: bytes) -> None:
        if self._cold.pop(key, None) is None:
            del self._hot[key]
        self._stamp.pop(key, None)
        self._cycle.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._cold or key in self._hot

    def __iter__(self) -> Iterator[bytes]:
        return chain(self._cold, self._hot)

    def __len__(self) -> int:
        return len(self._cold) + len(self._hot)

    def get(self, key: bytes, default: Loc | None = None) -> Loc | None:  # type: ignore[override]
        loc = self._cold.get(key)
        return loc if loc is not None else self._hot.get(key, default)

    def clear(self) -> None:
        self._cold.clear()
        self._hot.clear()
        self._stamp.clear()
        self._cycle.clear()
        self._ghost_cycle.clear()

    # ---------------------------------------------------------------- age

    def asked(self, keys: list[bytes]) -> None:
        """``keys`` asked for (saved or read back, stored or not): the clock advances by one per key, and a key asked
        before gives a reuse distance (the longest seen lately, and the key's own cycle)."""
        last, tags, mask = self._last_asked, self._last_tag, LAST_ASKED_SLOTS - 1
        longest = self._reuse[1]
        for k in keys:
            self.clock += 1
            i = int.from_bytes(k[8:12], "little") & mask
            tag = int.from_bytes(k[12:16], "little")
            if last[i]:
                d = self.clock - last[i]
                longest = max(longest, d)
                if tags[i] == tag:
                    self._note_cycle(k, d)
            last[i] = self.clock
            tags[i] = tag
        self._reuse[1] = longest
        while self.clock >= self._epoch_end:
            self._reuse = [self._reuse[1], 0]
            self._epoch_end += max(len(self), REUSE_EPOCH_MIN)

    def _note_cycle(self, key: bytes, d: int) -> None:
        """``key`` asked again ``d`` pages after its last ask: its cycle, kept with the page if held, else until it
        is written (the newest ``GHOST_CYCLES_KEPT`` keys not held)."""
        if key in self:
            self._cycle[key] = max(d, self._cycle.get(key, 0))
            return
        ghosts = self._ghost_cycle
        ghosts[key] = max(d, ghosts.pop(key, 0))
        while len(ghosts) > GHOST_CYCLES_KEPT:
            ghosts.popitem(last=False)

    def _mark(self, key: bytes) -> None:
        """``key`` touched now (its age starts again)."""
        self._stamp[key] = self.clock

    @property
    def horizon(self) -> int:
        """Pages asked for beyond which an untouched page counts as outlived: twice the longest reuse distance of the
        last one to two epochs, or twice the own pages' count if larger (a cyclic working set up to twice the card
        keeps its standing before any of it was read back)."""
        return 2 * max(len(self), *self._reuse)

    def outlived(self, key: bytes) -> bool:
        """Whether ``key`` (present) went untouched for longer than :attr:`horizon`, or, if it has a cycle of its own
        (it was asked for again at least once), for longer than twice that cycle and than the own pages' count."""
        age = self.clock - self._stamp.get(key, self.clock)
        if age > self.horizon:
            return True
        cycle = self._cycle.get(key)
        return cycle is not None and age > max(2 * cycle, len(self))

    # ---------------------------------------------------------------- recency

    @property
    def protected(self) -> int:
        """How many pages are protected."""
        return len(self._hot)

    def is_protected(self, key: bytes) -> bool:
        """Whether ``key`` is a protected page."""
        return key in self._hot

    def touch(self, keys: Iterable[bytes]) -> None:
        """Make ``keys`` (present ones) the most recent of their class, the last one most recent."""
        for k in keys:
            for order in (self._cold, self._hot):
                if k in order:
                    order.move_to_end(k)
                    self._mark(k)
                    break

    def read_back(self, keys: Iterable[bytes]) -> None:
        """Load hits on ``keys``: protected and most recent (``slru``), or touched (``lru``); the last one ends
        most recent."""
        if self.policy == "lru":
            self.touch(keys)
            return
        for k in keys:
            loc = self._cold.pop(k, None)
            if loc is not None:
                self._hot[k] = loc
                self._mark(k)
            elif k in self._hot:
                self._hot.move_to_end(k)
                self._mark(k)
        self._cap_protected()

    def _cap_protected(self) -> None:
        """Demote the least recent protected pages (to the most recent end of the unprotected order) while the
        protected ones exceed their share."""
        limit = self.protected_share * len(self)
        while self._hot and len(self._hot) > limit:
            k, loc = self._hot.popitem(last=False)
            self._cold[k] = loc

    def add_oldest(self, pages: Iterable[tuple[bytes, Loc]]) -> None:
        """Index ``pages`` (not present yet) as unprotected and older than every page present, in the given order."""
        older = OrderedDict(pages)
        for k in older:  # their age is unknown: counted from now
            self._stamp[k] = self.clock
        older.update(self._cold)
        self._cold = older

    def victim(self, evictable: Callable[[Loc], bool]) -> bytes | None:
        """The next page to evict: among the ``OUTLIVED_SCAN`` least recent ``evictable`` protected pages, the first
        that has :meth:`outlived` its reuse (a workload that ended); else the least recent ``evictable`` unprotected
        page, else protected one."""
        scanned = 0
        for k, loc in self._hot.items():
            if scanned == OUTLIVED_SCAN:
                break
            if evictable(loc):
                if self.outlived(k):
                    return k
                scanned += 1
        for order in (self._cold, self._hot):
            for k, loc in order.items():
                if evictable(loc):
                    return k
        return None
