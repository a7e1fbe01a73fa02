"""Page keys: one :class:`~adp_connector.store.KeyNamespace` per KV-cache group, keys from vLLM's block hashes.

``key_for_block_hash(request.block_hashes[k])`` where ``k`` indexes the hash at the block's end boundary; the
namespace carries the model id, KV dtype, the group descriptor from :mod:`.layouts`, the block size, TP/PP ranks
(not for TP-replicated MLA), and vLLM's hash algorithm and NONE_HASH seed.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from ..store import KeyNamespace, PageKey
from .config import ADPConfig
from .layouts import GroupLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("vllm.adp_kv.connector")

KEY_MEMO_ENTRIES = 1 << 16  # per generation and group: 64k blocks (1M tokens at block 16) derived at least once


class KeyMemo:
    """Keys derived recently, by block hash, in two generations of at most ``size`` entries each (a lookup in the
    old one moves the entry to the new one; a full new generation replaces the old).

    Why: every agent turn is a new request whose prompt repeats the previous turn's blocks, and the scheduler names
    each block in its lookups, its saves and its read-aheads. GPU run 26's 8-agent point spent 0.8 s of the engine
    thread in key derivations (py-spy at 25 Hz: 20 of the scheduler hooks' 61 samples), most of them of blocks
    named before. Dict operations only: safe to share between threads under the interpreter lock (a lost race
    costs one derivation).
    """

    def __init__(self, size: int = KEY_MEMO_ENTRIES) -> None:
        if size <= 0:
            raise ValueError("size must be positive")
        self.size = size
        self._new: dict[bytes, PageKey] = {}
        self._old: dict[bytes, PageKey] = {}

    def get(self, block_hash: bytes) -> PageKey | None:
        key = self._new.get(block_hash)
        if key is None:
            key = self._old.get(block_hash)
            if key is not None:
                self.put(block_hash, key)
        return key

    def put(self, block_hash: bytes, key: PageKey) -> None:
        if len(self._new) >= self.size:
            self._old, self._new = self._new, {}
        self._new[block_hash] = key

    def __len__(self) -> int:  # entries held (a key moved forward is counted in both until the old one goes)
        return len(self._new) + len(self._old)


class PageNamer:
    """Keys of one connector instance (its TP/PP rank); ``block_size``: vLLM's hash block size."""

    def __init__(self, vllm_config: VllmConfig, cfg: ADPConfig, layouts: list[GroupLayout], *, hash_block_size: int,
                 tp_rank: int, tp_size: int, pp_rank: int, pp_size: int, legacy: bool) -> None:
        self.layouts = layouts
        self.hash_block_size = hash_block_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        mc = vllm_config.model_config
        self.model_id = cfg.model_id or f"{mc.model}@{getattr(mc, 'revision', None) or ''}"
        cc = vllm_config.cache_config
        algo = str(getattr(cc, "prefix_caching_hash_algo", "sha256"))
        try:
            from vllm.utils.hashing import get_hash_fn_by_name
            from vllm.v1.core.kv_cache_utils import resolve_none_hash_seed

            seed: Any = resolve_none_hash_seed(get_hash_fn_by_name(algo))
        except Exception:
            seed = os.environ.get("PYTHONHASHSEED", "")
        if algo.startswith("xxhash") and os.environ.get("PYTHONHASHSEED") is None:
            log.warning("ADP KV: prefix_caching_hash_algo=%s without PYTHONHASHSEED: block hashes change at every "
                        "restart, so pages written now will never be found again. Set PYTHONHASHSEED or use "
                        "sha256_cbor.", algo)
        kv_dtype = str(getattr(cc, "cache_dtype", "auto"))
        if kv_dtype == "auto":
            kv_dtype = str(mc.dtype)
        self.namespaces: dict[int, KeyNamespace] = {}
        self.memos: dict[int, KeyMemo] = {g.group_id: KeyMemo() for g in layouts}
        for g in layouts:
            rep = g.tp_replicated
            self.namespaces[g.group_id] = KeyNamespace(
                model=self.model_id, dtype=kv_dtype, layout=g.descriptor, block_size=g.block_size,
                tp_rank=0 if rep else tp_rank, tp_size=1 if rep else tp_size,
                pp_rank=pp_rank, pp_size=pp_size, group_id=0,
                extra=(("hash_algo", algo), ("none_hash_seed", str(seed)), ("user", cfg.namespace_extra),
                       ("hash_block_size", hash_block_size))
                + ((("vllm_kv_abi", "0.26"),) if legacy else ()))

    def key(self, group: GroupLayout, block_hashes: list, block_idx: int,
            hashes_out: dict[bytes, bytes] | None = None) -> PageKey | None:
        """Key of ``group``'s block ``block_idx`` (None when its end-boundary hash is not known yet).

        ``hashes_out``: the key goes to the workers; with TP > 1 its block hash is recorded there (see
        :meth:`rank_key`).
        """
        k = (block_idx + 1) * group.block_size // self.hash_block_size - 1
        if k >= len(block_hashes):
            return None
        h = bytes(block_hashes[k])
        key = self._derive(group.group_id, h)
        if hashes_out is not None and self.sends_hashes(group):
            hashes_out[bytes(key)] = h
        return key

    def sends_hashes(self, group: GroupLayout) -> bool:
        """Whether ``group``'s keys go to the workers with their block hashes (each TP rank derives its own key)."""
        return self.tp_size > 1 and not group.tp_replicated

    def rank_key(self, gid: int, key: bytes, block_hashes: dict[bytes, bytes]) -> bytes | None:
        """This worker's key for a page the scheduler named by rank 0's key (the same key when the group is
        identical on every rank, or at TP 1). None if the block hash did not come along."""
        g = self.layouts[gid]
        if self.tp_size == 1 or self.tp_rank == 0 or g.tp_replicated:
            return key
        h = block_hashes.get(key)
        return None if h is None else self._derive(gid, bytes(h))

    def _derive(self, gid: int, block_hash: bytes) -> PageKey:
        """Group ``gid``'s key of ``block_hash``, from the memo when derived recently."""
        memo = self.memos[gid]
        key = memo.get(block_hash)
        if key is None:
            key = self.namespaces[gid].key_for_block_hash(block_hash)
            memo.put(block_hash, key)
        return key
