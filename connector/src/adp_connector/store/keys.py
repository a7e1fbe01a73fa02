"""Content keys for KV pages: stable across processes and restarts (no PYTHONHASHSEED dependence).

A :class:`KeyNamespace` captures everything that changes the *bytes* of a page (model, dtype, cache-group layout,
block size, TP/PP rank and size, cache-group id, optional extras such as LoRA or quantisation mode). Its 32-byte
digest is used as the BLAKE2b *key* of every page-key derivation, so two namespaces can never produce the same page
key (short of breaking BLAKE2b). Page keys are 32-byte digests (:class:`PageKey`).

Two ways to derive page keys:

* :meth:`KeyNamespace.chain_tokens` -- chain raw token ids block by block:
  ``key_i = BLAKE2b(key=ns, "chain" || key_{i-1} || n_tokens || tokens_i)``.
* :meth:`KeyNamespace.key_for_block_hash` -- wrap an opaque block hash that already chains the prefix (e.g. vLLM's
  ``BlockHash`` bytes): ``key = BLAKE2b(key=ns, "bhash" || len || block_hash)``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

KEY_BYTES = 32
_NS_TAG = b"ADPKV-namespace-v1"
_PERSON_CHAIN = b"adpkv-chain-v1"
_PERSON_BHASH = b"adpkv-bhash-v1"
_ROOT = bytes(KEY_BYTES)


class PageKey(bytes):
    """A 32-byte page key (a ``bytes`` subclass: hashable, cheap, stored verbatim on the device)."""

    __slots__ = ()

    def __new__(cls, value: bytes | bytearray | memoryview) -> PageKey:
        b = bytes(value)
        if len(b) != KEY_BYTES:
            raise ValueError(f"a PageKey is {KEY_BYTES} bytes, got {len(b)}")
        return super().__new__(cls, b)

    def __repr__(self) -> str:
        return f"PageKey({self.hex()[:16]}...)"


def _digest_key(digest: bytes) -> PageKey:
    """A :class:`PageKey` of a digest known to be KEY_BYTES long (no copy, no check: derivations run per block)."""
    return bytes.__new__(PageKey, digest)


def _field(name: str, value: str | int) -> bytes:
    """Length-prefixed canonical encoding of one namespace field."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TypeError(f"namespace field {name!r} must be str or int, got {type(value).__name__}")
    kind = b"s" if isinstance(value, str) else b"i"
    raw = value.encode() if isinstance(value, str) else str(value).encode()
    nb = name.encode()
    return struct.pack("<I", len(nb)) + nb + kind + struct.pack("<Q", len(raw)) + raw


@dataclass(frozen=True)
class KeyNamespace:
    """Everything that determines the bytes of a page; pages of different namespaces never share keys.

    ``layout`` is a free-form descriptor of the cache-group layout (e.g. ``"LBHNC;heads=8;hd=128"``); ``extra``
    holds further ``(name, value)`` pairs (LoRA id, kv quant mode, DCP rank, cache salt...), order-insensitive.
    """

    model: str
    dtype: str
    layout: str
    block_size: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    group_id: int = 0
    extra: tuple[tuple[str, str | int], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if not (0 <= self.tp_rank < self.tp_size) or not (0 <= self.pp_rank < self.pp_size):
            raise ValueError("rank must be in [0, size)")
        if self.group_id < 0:
            raise ValueError("group_id must be >= 0")

    @cached_property
    def digest(self) -> bytes:
        """32-byte canonical digest of the namespace (independent of Python's hash seed)."""
        h = hashlib.blake2b(digest_size=KEY_BYTES)
        h.update(_NS_TAG)
        for name in ("model", "dtype", "layout", "block_size", "tp_rank", "tp_size", "pp_rank", "pp_size",
                     "group_id"):
            h.update(_field(name, getattr(self, name)))
        for name, value in sorted(self.extra, key=lambda kv: kv[0]):
            h.update(_field("extra." + name, value))
        return h.digest()

    def with_group(self, group_id: int) -> KeyNamespace:
        """The same namespace for another cache group."""
        return KeyNamespace(self.model, self.dtype, self.layout, self.block_size, self.tp_rank, self.tp_size,
                            self.pp_rank, self.pp_size, group_id, self.extra)

    def chain_tokens(self, token_ids: Sequence[int], parent: bytes | None = None) -> list[PageKey]:
        """Keys of every *full* block of ``token_ids`` (a trailing partial block gets no key).

        ``parent`` is the key of the block preceding ``token_ids[0]`` (None at the start of a sequence).
        """
        bs = self.block_size
        prev = _ROOT if parent is None else bytes(parent)
        if len(prev) != KEY_BYTES:
            raise ValueError("parent must be a 32-byte key")
        out: list[PageKey] = []
        for start in range(0, len(token_ids) - bs + 1, bs):
            block = token_ids[start:start + bs]
            prev = chain_step(self.digest, prev, block)
            out.append(PageKey(prev))
        return out

    @cached_property
    def _bhash_state(self) -> Any:
        """The keyed BLAKE2b state every block-hash key starts from (a copy costs less than keying it again)."""
        return hashlib.blake2b(digest_size=KEY_BYTES, key=self.digest, person=_PERSON_BHASH)

    def key_for_block_hash(self, block_hash: bytes) -> PageKey:
        """Key of a page identified by an opaque, already-chained block hash (e.g. vLLM's BlockHash)."""
        bh = bytes(block_hash)
        h = self._bhash_state.copy()
        h.update(struct.pack("<Q", len(bh)))
        h.update(bh)
        return _digest_key(h.digest())

    def keys_for_block_hashes(self, block_hashes: Iterable[bytes]) -> list[PageKey]:
        """:meth:`key_for_block_hash` over a sequence."""
        return [self.key_for_block_hash(b) for b in block_hashes]


def chain_step(ns_digest: bytes, parent: bytes, tokens: Sequence[int]) -> bytes:
    """One link of the token chain: ``BLAKE2b(key=ns_digest, person=chain, parent || n || tokens as u64 LE)``."""
    h = hashlib.blake2b(digest_size=KEY_BYTES, key=ns_digest, person=_PERSON_CHAIN)
    h.update(parent)
    h.update(struct.pack("<Q", len(tokens)))
    try:
        h.update(struct.pack(f"<{len(tokens)}Q", *tokens))
    except struct.error as exc:
        raise ValueError("token ids must be integers in [0, 2**64)") from exc
    return h.digest()
