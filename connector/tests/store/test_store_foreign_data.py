"""Nothing destroys data on a card without an explicit flag: a namespace that holds data but no page store is
refused by the store (and so by the connector), formatted only with ``reformat`` (the connector's
``format_card``)."""

from __future__ import annotations

import pytest

from adp_connector.store import PageStore, StoreConfig
from adp_connector.store.format import ForeignDataError, holds_data

from .memdevice import MemDevice


def _device(nbytes: int = 64 << 20) -> MemDevice:
    return MemDevice(nbytes)


def _reader(dev: MemDevice):
    def read(offset: int, length: int) -> bytes:
        buf = bytearray(length)
        dev.read_into(offset, memoryview(buf))
        return bytes(buf)

    return read


def _peek(dev: MemDevice, offset: int, length: int) -> bytes:
    return _reader(dev)(offset, length)


def test_a_namespace_with_foreign_data_is_refused_and_left_as_it_was() -> None:
    dev = _device()
    marker = b"not a page store".ljust(4096, b"\x01")
    dev.write(0, marker)
    with pytest.raises(ForeignDataError, match=r"holds data but no page store.*format_card"):
        PageStore(dev, StoreConfig())
    assert _peek(dev, 0, 4096) == marker  # nothing written


def test_data_far_from_the_head_is_found_too() -> None:
    dev = _device()
    # a 4 MiB file in the middle of the namespace: the spread samples (one per 1/16 of it) land in it
    dev.write(40 << 20, b"\x07" * (4 << 20))
    assert holds_data(_reader(dev), dev.capacity_bytes)
    with pytest.raises(ForeignDataError):
        PageStore(dev, StoreConfig())


def test_reformat_formats_it_and_an_empty_namespace_needs_no_flag() -> None:
    dev = _device()
    dev.write(0, b"\x01" * 4096)
    with PageStore(dev, StoreConfig(reformat=True)) as st:
        assert st.save(b"k" * 32, b"v" * 4096).ok
    # the control: an all-zero namespace is formatted without any flag, and a store opens again without one
    empty = _device()
    assert not holds_data(_reader(empty), empty.capacity_bytes)
    PageStore(empty, StoreConfig()).close()
    with PageStore(dev, StoreConfig()) as st:
        assert st.lookup([b"k" * 32]) == 1
