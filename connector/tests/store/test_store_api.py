"""The typed Store protocol: PageStore, StoreProcess and StoreGroup all provide it (names and call shapes)."""

from __future__ import annotations

import inspect

import pytest

from adp_connector.store import PageStore
from adp_connector.store.api import Store
from adp_connector.store.process import StoreGroup, StoreProcess


def _satisfies(cls: type) -> list[str]:
    """Protocol methods ``cls`` lacks or cannot be called as the protocol calls them (empty: it satisfies it)."""
    problems = []
    for name, proto in inspect.getmembers(Store, inspect.isfunction):
        if name.startswith("_"):
            continue
        impl = getattr(cls, name, None)
        if impl is None:
            problems.append(f"{name}: missing")
            continue
        want = [p for p in inspect.signature(proto).parameters.values() if p.name != "self"]
        sig = inspect.signature(impl)
        try:  # the protocol's own call shape (positional arguments, then its defaults by name) binds
            sig.bind(None, *[object() for p in want if p.default is inspect.Parameter.empty],
                     **{p.name: p.default for p in want if p.default is not inspect.Parameter.empty})
        except TypeError as exc:
            problems.append(f"{name}: {exc}")
    return problems


@pytest.mark.parametrize("cls", [PageStore, StoreProcess, StoreGroup])
def test_every_store_satisfies_the_protocol(cls: type) -> None:
    assert _satisfies(cls) == []


def test_a_store_without_discard_or_with_another_call_shape_does_not() -> None:
    class NoDiscard:
        def contains(self, keys): ...
        def save_batch(self, keys, buffers): ...
        def load_batch(self, keys, buffers): ...
        def close(self, release=True): ...
        def note_reading(self, keys): ...
        def take_evicted(self): ...

    class OneArgLoad(NoDiscard):
        def discard(self, keys): ...
        def load_batch(self, keys): ...  # type: ignore[override]

    assert _satisfies(NoDiscard) == ["discard: missing"]
    assert [p.split(":")[0] for p in _satisfies(OneArgLoad)] == ["load_batch"]
    assert not isinstance(NoDiscard(), Store) and isinstance(OneArgLoad(), Store)
