"""THE layout layer: what each vLLM KV-cache group stores, which pages a hit needs, and how a page is built.

Everything family-specific lives here, so a new model family is configuration (a spec class name -> :class:`Rule`),
not new connector code. Pure Python: specs are classified by class name (no vLLM import), so the module loads in any
process and the unit tests can feed it real vLLM specs or stand-ins.

A *page* is the bytes of one cache block of one group: the persisted layers' block slices, back to back, in the
group's layer order. Families (facts from vLLM 0.32 ``v1/kv_cache_interface.py`` and the tensors it hands to
``register_kv_caches``: one ``[num_blocks, H, N, C]`` view per layer, C = K and V concatenated (MLA: H = 1, C =
latent + rope); under HMA the groups alias one pool; Mamba/GDN state as a raw int8 page view ``[B, 1, 1, bytes]``):

* full attention (``FullAttentionSpec``): every block of the prefix; a hit needs all of them.
* sliding window (``SlidingWindowSpec``) / chunked local: every block is saved (a later, longer hit needs the window
  before *its* boundary); a hit needs only the trailing ``ceil((window - 1) / block) + 1`` blocks.
* Mamba2 / GDN / short-conv (``MambaSpec``) in ``align`` mode: the state after ``(p+1)*block`` tokens sits in block
  ``p``; only the state at the hit boundary is needed (window of one block), saved from the exact blocks the
  scheduler offers (``KVConnectorBlockState.boundary_state_offloads``). Hits are multiples of the block.
  In ``all`` mode (vLLM 0.26's choice for Nemotron-H) every full block holds the state at its end and vLLM caches
  every one of them (``MambaManager.cache_blocks``): the group is a prefix of states (``STATE_ALL``), every block
  saved and every block of a hit that vLLM allocates restored (a block left unrestored would be hashed by vLLM
  after the load and served to a later local hit). vLLM 0.26 allocates only the hit's last block (the earlier
  ones are null: ``get_num_skipped_tokens`` is ``tokens - 1``), so there the restore is that one state.
  Mode ``none`` keeps one rolling state: not persisted (the whole hit is refused).
  vLLM 0.26's ``MambaSpec`` has no ``real_page_size_bytes``: the page is the states' bytes (shapes x dtypes),
  without the padding to the attention page.
* MLA (``MLAAttentionSpec``): one latent vector per token, identical on every TP rank: stored once (namespace
  without TP rank), written by rank 0 only. The DSA indexer (``cache_role=INDEXER``) is one more layer of the MLA
  group's page.
* Drafter layers (MTP/EAGLE heads) in a target group: stored in the page by default (``store_drafters``), so a
  restore gives the drafter the KV it would have computed and the acceptance rate holds. The drafter's KV at a
  block's last slot was computed from the *next* token, which the block's key does not cover, so such a hit ends
  where the following block's page is stored too (vLLM drops the last block of a local hit for the same reason).
  Not stored (``store_drafters=False``): a restore zero-fills them (acceptance dips, target tokens never change)
  and the pages are identical with speculation on or off. Groups made only of drafter layers are
  volatile: never persisted (vLLM's ``is_eagle_group`` says only that a group holds drafter layers).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from typing import Any


class GroupKind(str, Enum):
    """How a group is cached."""

    FULL = "full"          # prefix of blocks
    WINDOW = "window"      # trailing window of blocks (SWA, chunked local)
    STATE = "state"        # one recurrent state at the hit boundary (Mamba/GDN align)
    STATE_ALL = "state_all"  # a recurrent state per block, prefix of blocks (Mamba "all" mode)
    MLA = "mla"            # prefix of blocks, TP-replicated
    VOLATILE = "volatile"  # never persisted (drafter groups); never blocks a hit
    UNSUPPORTED = "unsupported"  # refuses every hit (e.g. Mamba without prefix caching)


class LayerRole(str, Enum):
    """What a layer contributes to its group's page."""

    KV = "kv"
    MLA = "mla"
    INDEXER = "indexer"
    STATE = "state"
    DRAFTER = "drafter"    # a speculative drafter's layer: in the page if stored, else zero-filled on restore


@dataclass(frozen=True)
class LayerLayout:
    """One layer of a group: its role and the bytes of one block that belong in the page."""

    name: str
    role: LayerRole
    page_bytes: int
    persisted: bool = True  # False: not in the page (a drafter layer not stored, zero-filled on restore)


@dataclass(frozen=True)
class GroupLayout:
    """What the connector stores for one KV-cache group."""

    group_id: int
    kind: GroupKind
    spec_name: str
    block_size: int
    layers: tuple[LayerLayout, ...]
    window_blocks: int = 0       # WINDOW/STATE: trailing blocks a hit needs
    tp_replicated: bool = False  # identical on every TP rank: store once

    @cached_property
    def persisted_layers(self) -> tuple[LayerLayout, ...]:
        return tuple(la for la in self.layers if la.persisted)

    @cached_property
    def zero_filled_layers(self) -> tuple[LayerLayout, ...]:
        """Layers left out of the page (drafter layers not stored): a restore zero-fills them."""
        return tuple(la for la in self.layers if not la.persisted)

    @cached_property
    def stores_drafter(self) -> bool:
        """Some drafter layer's KV is in the page: a hit must end where the next page is stored too."""
        return any(la.persisted and la.role is LayerRole.DRAFTER for la in self.layers)

    @cached_property
    def page_bytes(self) -> int:
        """Bytes of one page of this group."""
        return sum(la.page_bytes for la in self.persisted_layers)

    @cached_property
    def persists(self) -> bool:
        return self.kind not in (GroupKind.VOLATILE, GroupKind.UNSUPPORTED) and self.page_bytes > 0

    @cached_property
    def descriptor(self) -> str:
        """Canonical text of everything that shapes the page bytes (part of the key namespace)."""
        parts = [f"{self.kind.value}", f"spec={self.spec_name}", f"bs={self.block_size}"]
        parts += [f"{_canon_layer(la.name)}:{la.role.value}:{la.page_bytes}" for la in self.persisted_layers]
        return ";".join(parts)

    def needed_blocks(self, hit_blocks: int) -> range:
        """Block indices whose pages a hit of ``hit_blocks`` blocks (of this group) must restore."""
        if self.kind in PREFIX_KINDS:
            return range(0, hit_blocks)
        if self.kind in (GroupKind.WINDOW, GroupKind.STATE):
            return range(max(0, hit_blocks - self.window_blocks), hit_blocks)
        return range(0)


PREFIX_KINDS = (GroupKind.FULL, GroupKind.MLA, GroupKind.STATE_ALL)  # a hit needs every block of the prefix


def _canon_layer(name: str) -> str:
    return re.sub(r"\s+", "", name)


def _mro_names(spec: Any) -> list[str]:
    return [c.__name__ for c in type(spec).__mro__]


def _layer_specs(group: Any) -> list[tuple[str, Any]]:
    """(layer name, per-layer spec) of a ``KVCacheGroupSpec`` (sees through ``UniformTypeKVCacheSpecs``)."""
    spec = group.kv_cache_spec
    per_layer = getattr(spec, "kv_cache_specs", None)
    if isinstance(per_layer, dict):
        return [(n, per_layer.get(n, spec)) for n in group.layer_names]
    return [(n, spec) for n in group.layer_names]


def _real_page_bytes(spec: Any) -> int:
    v = getattr(spec, "real_page_size_bytes", None)
    if v is None and "MambaSpec" in _mro_names(spec):  # vLLM 0.26: the states without the page padding
        v = sum(math.prod(shape) * int(dtype.itemsize) for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True))
    if v is None:
        v = spec.page_size_bytes
    return int(v)


def layer_role(name: str, spec: Any, drafter_layers: Iterable[str] = ()) -> LayerRole:
    """Role of one layer from its spec class (by name) and whether it belongs to a drafter."""
    if name in set(drafter_layers):
        return LayerRole.DRAFTER
    names = _mro_names(spec)
    if "MambaSpec" in names:
        return LayerRole.STATE
    if "MLAAttentionSpec" in names or "SlidingWindowMLASpec" in names:
        role = getattr(spec, "cache_role", None)
        role_v = getattr(role, "value", role)
        # vLLM 0.26 has no cache_role: its DSA indexer cache is a plain MLAAttentionSpec named "...indexer.k_cache"
        indexer = str(role_v).lower() == "indexer" or (role is None and ".indexer." in name)
        return LayerRole.INDEXER if indexer else LayerRole.MLA
    return LayerRole.KV


def group_kind(spec: Any) -> tuple[GroupKind, int]:
    """(kind, trailing window in blocks) of a group spec."""
    inner = getattr(spec, "kv_cache_specs", None)
    probe = next(iter(inner.values())) if isinstance(inner, dict) and inner else spec
    names = _mro_names(probe)
    bs = int(spec.block_size)
    if "MambaSpec" in names:
        mode = getattr(probe, "mamba_cache_mode", "none")
        if mode == "align":
            return GroupKind.STATE, 1
        if mode == "all":
            return GroupKind.STATE_ALL, 0
        return GroupKind.UNSUPPORTED, 0
    if "SlidingWindowSpec" in names or "SlidingWindowMLASpec" in names:
        w = int(probe.sliding_window) + int(getattr(probe, "extra_retained_tokens", 0) or 0)
        return GroupKind.WINDOW, math.ceil(max(w - 1, 0) / bs) + 1
    if "ChunkedLocalAttentionSpec" in names:
        return GroupKind.WINDOW, math.ceil(int(probe.attention_chunk_size) / bs) + 1
    if any(n in names for n in ("CircularBufferSpec", "HiSparseHotSpec", "HiSparseResidentSpec",
                                "EncoderOnlyAttentionSpec", "CrossAttentionSpec")):
        return GroupKind.UNSUPPORTED, 0
    if not getattr(probe, "prefix_cacheable", True):
        return GroupKind.UNSUPPORTED, 0
    if "MLAAttentionSpec" in names:
        return GroupKind.MLA, 0
    if "AttentionSpec" in names:
        return GroupKind.FULL, 0
    return GroupKind.UNSUPPORTED, 0


def describe_group(group_id: int, group: Any, drafter_layers: Iterable[str] = (),
                   store_drafters: bool = True) -> GroupLayout:
    """The :class:`GroupLayout` of one ``KVCacheGroupSpec`` (``store_drafters``: drafter layers in the page)."""
    drafters = set(drafter_layers)
    spec = group.kv_cache_spec
    # ``is_eagle_group`` is not read: it flags the group that HOLDS the drafter's layers (vLLM 0.33 sets it when
    # any layer is_draft, 0.32 for the group of the last layer), which with MTP is the target's own group
    kind, window = group_kind(spec)
    if not getattr(group, "enable_kv_transfer", True):
        kind, window = GroupKind.UNSUPPORTED, 0
    specs = list(_layer_specs(group))
    roles = [layer_role(name, lspec, drafters) for name, lspec in specs]
    if roles and all(r is LayerRole.DRAFTER for r in roles):
        kind, window = GroupKind.VOLATILE, 0  # a group made only of drafter layers: never persisted
    layers = []
    for (name, lspec), role in zip(specs, roles, strict=True):
        persisted = role is not LayerRole.DRAFTER or (store_drafters and kind is not GroupKind.VOLATILE)
        layers.append(LayerLayout(name, role, _real_page_bytes(lspec), persisted))
    inner = getattr(spec, "kv_cache_specs", None)
    probe = next(iter(inner.values())) if isinstance(inner, dict) and inner else spec
    replicated = kind is GroupKind.MLA or bool(getattr(probe, "tp_replicated", False))
    if kind is not GroupKind.VOLATILE and layers and all(not la.persisted for la in layers):
        kind = GroupKind.VOLATILE
    return GroupLayout(group_id, kind, type(probe).__name__, int(spec.block_size), tuple(layers), window,
                       replicated)


def describe_groups(kv_cache_config: Any, drafter_layers: Iterable[str] = (),
                    store_drafters: bool = True) -> list[GroupLayout]:
    """Layouts of every group of a ``KVCacheConfig``, in group-id order."""
    d = set(drafter_layers)
    return [describe_group(i, g, d, store_drafters) for i, g in enumerate(kv_cache_config.kv_cache_groups)]


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def drafter_layer_names(layer_names: Iterable[str], num_target_layers: int | None, has_drafter: bool) -> set[str]:
    """Layers that belong to a speculative drafter (MTP/EAGLE heads) rather than the target model.

    vLLM names DeepSeek MTP layers ``model.layers.{num_hidden_layers + i}...`` and Qwen3-Next's ``mtp.layers.i...``;
    EAGLE heads live past the target's layer count too.
    """
    if not has_drafter:
        return set()
    out = set()
    for n in layer_names:
        if n.startswith("mtp.") or ".mtp." in n or n.startswith("draft"):
            out.add(n)
            continue
        m = _LAYER_INDEX.search(n)
        if m and num_target_layers is not None and int(m.group(1)) >= num_target_layers:
            out.add(n)
    return out


def hit_unit(layouts: Sequence[GroupLayout]) -> int:
    """Tokens a hit is a multiple of: the LCM of the block sizes of the groups that constrain hits."""
    unit = 1
    for g in layouts:
        if g.kind is not GroupKind.VOLATILE:
            unit = math.lcm(unit, g.block_size)
    return unit


def best_hit(layouts: Sequence[GroupLayout], present: dict[int, list[bool]], max_tokens: int) -> int:
    """Largest hit (tokens, a multiple of :func:`hit_unit`, <= ``max_tokens``) every group can serve.

    ``present[g][j]``: whether group ``g``'s page for its block ``j`` is stored. A group that cannot be cached
    (UNSUPPORTED) refuses every hit; VOLATILE groups never limit it. A group that stores drafter KV also needs the
    page of the block right after the hit (give ``present`` one block past ``max_tokens`` where one exists): its
    drafter KV at the hit's last slot was computed from that block's first token.
    """
    unit = hit_unit(layouts)
    if any(g.kind is GroupKind.UNSUPPORTED for g in layouts):
        return 0
    active = [g for g in layouts if g.persists]
    if not active:
        return 0
    n = max_tokens // unit * unit
    # Prefix groups cap the search at their leading run of pages.
    for g in active:
        if g.kind in PREFIX_KINDS:
            p = present.get(g.group_id, [])
            run = next((i for i, ok in enumerate(p) if not ok), len(p))
            n = min(n, run * g.block_size // unit * unit)
    while n > 0:
        ok = True
        for g in active:
            p = present.get(g.group_id, [])
            if g.stores_drafter and (n // g.block_size >= len(p) or not p[n // g.block_size]):
                ok = False
                break
            if g.kind in (GroupKind.WINDOW, GroupKind.STATE):
                need = g.needed_blocks(n // g.block_size)
                if need.stop > len(p) or not all(p[j] for j in need):
                    ok = False
                    break
        if ok:
            return n
        n -= unit
    return 0
