"""Page naming: the scheduler's keys come from a memo of recent derivations, identical to deriving them afresh."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace
from typing import Any

import pytest

from adp_connector.store import KeyNamespace
from adp_connector.vllm.naming import KeyMemo, PageNamer

BS = 16


def _namer() -> PageNamer:
    vcfg = SimpleNamespace(model_config=SimpleNamespace(model="m", revision=None, dtype="bfloat16"),
                           cache_config=SimpleNamespace(prefix_caching_hash_algo="sha256_cbor", cache_dtype="auto"))
    layouts: Any = [SimpleNamespace(group_id=g, tp_replicated=False, descriptor=f"layout-{g}", block_size=BS)
                    for g in range(2)]
    return PageNamer(vcfg, SimpleNamespace(model_id="", namespace_extra="u"), layouts, hash_block_size=BS,
                     tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, legacy=False)


def _hashes(n: int, salt: bytes = b"") -> list[bytes]:
    return [hashlib.sha256(salt + i.to_bytes(4, "little")).digest() for i in range(n)]


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    derived: list[bytes] = []
    real = KeyNamespace.key_for_block_hash
    monkeypatch.setattr(KeyNamespace, "key_for_block_hash",
                        lambda self, h: derived.append(bytes(h)) or real(self, h))
    return derived


def test_a_block_named_again_by_a_later_request_is_not_derived_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A later turn's prompt repeats the earlier turn's blocks: their keys come from the memo, equal to a fresh
    derivation. Controls: the new blocks, and the same blocks in another group, are derived (to other keys)."""
    namer, fresh = _namer(), _namer()
    derived = _counting(monkeypatch)
    turn1 = _hashes(40)
    turn2 = turn1 + _hashes(8, b"new")  # the next request: the same history and a new turn
    g0, g1 = namer.layouts
    first = [namer.key(g0, turn1, j) for j in range(40)]
    assert len(derived) == 40  # control: the first naming derives every key
    derived.clear()
    again = [namer.key(g0, turn2, j) for j in range(48)]
    assert again[:40] == first and derived == turn2[40:]  # only the new turn's blocks
    monkeypatch.undo()
    assert again == [fresh.key(g0, turn2, j) for j in range(48)]
    other = [namer.key(g1, turn2, j) for j in range(48)]
    assert other == [fresh.key(g1, turn2, j) for j in range(48)]
    assert not set(other) & set(again)  # control: a memo shared by the groups would hand group 0's keys out


def test_the_memo_keeps_two_generations_at_most() -> None:
    """When the new generation is full it becomes the old one and the old one is dropped. A key read from the old
    generation moves to the new one."""
    memo = KeyMemo(size=2)

    def k(i: int) -> Any:
        return bytes([i]) * 32

    for i in range(6):
        memo.put(bytes([i]), k(i))
    assert len(memo) == 4  # {2, 3} old, {4, 5} new
    assert memo.get(b"\x00") is None and memo.get(b"\x01") is None  # dropped with their generation
    assert memo.get(b"\x05") == k(5) and memo.get(b"\x04") == k(4)
    assert memo.get(b"\x03") == k(3)  # from the old generation into a new one: {4, 5} old, {3} new
    assert memo.get(b"\x02") is None  # the generation it was in is gone
    assert memo.get(b"\x03") == k(3) and memo.get(b"\x04") == k(4) and len(memo) <= 4
    with pytest.raises(ValueError):
        KeyMemo(size=0)
