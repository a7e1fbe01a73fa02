"""A one-shot vLLM engine runner for the connector tests and ``testbed verify`` (the checkpoints: checkpoints.py).

``python -m adp_testbed.models.engine SPEC.json OUT.json`` starts ONE engine in this process, runs the prompts (a second
pass follows ``reset_prefix_cache()``, or with ``reset_between`` false is a local prefix-cache hit pass: the
reference a restored run must reproduce token for token), writes outputs and metrics to OUT.json and exits,
killing its engine children. Tests run it as a subprocess (:func:`run_subprocess`) so an "engine restart" is a real
process restart.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any


def vllm_version() -> tuple[int, int]:
    """(major, minor) of the installed vLLM ((99, 0) for a development build)."""
    import vllm

    try:
        return tuple(int(x) for x in vllm.__version__.split(".")[:2])  # type: ignore[return-value]
    except ValueError:
        return (99, 0)


def connector_totals(audit_dir: Path) -> dict[str, float]:
    """The connector's running totals of one engine run (scheduler + workers), written beside its audit log."""
    tot: dict[str, float] = {}
    for f in Path(audit_dir).glob("stats-*.json"):
        for k, v in json.loads(f.read_text()).items():
            tot[k] = tot.get(k, 0) + v
    return tot


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    """``n`` independent random token-id prompts."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 30000) for _ in range(length)] for _ in range(n)]


def metric_total(metrics: list[Any], name: str) -> float:
    """Sum of the values of every metric called ``name`` in ``LLM.get_metrics()``'s list (0 when absent)."""
    tot = 0.0
    for m in metrics:
        if m.name == name:
            tot += float(getattr(m, "value", 0) or 0)
    return tot


def _kill_children() -> None:
    try:
        import psutil

        for c in psutil.Process().children(recursive=True):
            try:
                c.kill()
            except Exception:
                pass
    except Exception:
        pass


def run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """Start one engine, run ``spec['prompts']`` (``passes`` times) or one list per pass (``pass_prompts``);
    return outputs, metrics and timings."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.monotonic()
    kw: dict[str, Any] = dict(model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                              kv_cache_memory_bytes=spec.get("kv_bytes", 256 << 20),
                              max_model_len=spec.get("max_model_len", 4096), enable_prefix_caching=True,
                              prefix_caching_hash_algo="sha256_cbor", disable_log_stats=False, seed=0)
    kw.update(spec.get("llm_kwargs", {}))
    if spec.get("connector") is not None:
        kw["kv_transfer_config"] = spec["connector"]
    in_process = _in_process(spec, kw)
    if in_process:
        engine_core_in_process(kw)
    llm = LLM(**kw)
    t_start = time.monotonic() - t0
    if spec.get("ready_marker"):  # tells a watching test that the engine is up (and gives it time to act)
        Path(spec["ready_marker"]).write_text("ready")
        time.sleep(spec.get("pause_after_ready", 0.0))
    try:
        block_size = int(llm.llm_engine.vllm_config.cache_config.block_size)
    except Exception:
        block_size = 0
    try:  # the most prompt tokens one step prefills (vLLM 0.26/0.32 Scheduler: its budget, capped by the threshold)
        sc = llm.llm_engine.vllm_config.scheduler_config
        chunk = int(getattr(sc, "max_num_scheduled_tokens", None) or sc.max_num_batched_tokens)
        threshold = int(getattr(sc, "long_prefill_token_threshold", 0) or 0)
        prefill_chunk = min(chunk, threshold) if threshold > 0 else chunk
    except Exception:
        prefill_chunk = 0
    sp = SamplingParams(max_tokens=spec.get("max_tokens", 16), temperature=0, detokenize=False, ignore_eos=True,
                        logprobs=spec.get("logprobs"))
    # each pass runs spec['prompts'], or its own list from spec['pass_prompts']
    pass_prompts = spec.get("pass_prompts") or [spec["prompts"]] * spec.get("passes", 1)
    passes = []
    for i, prompts_i in enumerate(pass_prompts):
        ps = [TokensPrompt(prompt_token_ids=p) for p in prompts_i]
        if i and spec.get("reset_between", True):
            llm.reset_prefix_cache()
        if i and spec.get("pause_before_pass2"):
            time.sleep(spec["pause_before_pass2"])
        if spec.get("marker"):  # tells a watching test that pass i is about to start
            Path(spec["marker"]).write_text(str(i))
        t = time.monotonic()
        outs = llm.generate(ps, sp, use_tqdm=False)
        dt = time.monotonic() - t
        time.sleep(spec.get("settle_s", 1.5))  # let async saves land before reading metrics / shutting down
        m = llm.get_metrics()
        passes.append({
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "num_cached": [o.num_cached_tokens for o in outs],
            # with spec["logprobs"]: the log-probability of each generated token (a finer oracle than the tokens)
            "logprobs": [[float(step[t].logprob) for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs,
                                                                   strict=False)]
                         for o in outs] if spec.get("logprobs") is not None else None,
            "seconds": dt,
            "ext_queries": metric_total(m, "vllm:external_prefix_cache_queries"),
            "ext_hits": metric_total(m, "vllm:external_prefix_cache_hits"),
            "local_hits": metric_total(m, "vllm:prefix_cache_hits"),
            "adp": {x.name: float(getattr(x, "value", 0) or 0) for x in m if x.name.startswith("vllm:adp_kv")},
            # speculative decoding, cumulative over the engine's life (vllm:spec_decode_num_*)
            "spec": {k: metric_total(m, f"vllm:spec_decode_num_{k}")
                     for k in ("drafts", "draft_tokens", "accepted_tokens")},
        })
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    return {"start_seconds": t_start, "block_size": block_size, "prefill_chunk_tokens": prefill_chunk,
            "in_process": in_process, "passes": passes}


def run_process_group(argv: Sequence[str], log: IO[str], env: dict[str, str], timeout: float,
                      started: Callable[[subprocess.Popen[bytes]], None] | None = None) -> int | None:
    """Run ``argv`` in a new session with its output in ``log``; kill its whole process group when it exits or
    after ``timeout`` seconds. ``started`` sees the process first (e.g. to attach a profiler). Returns the exit
    status, None on a timeout."""
    proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    if started is not None:
        started(proc)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def engine_core_in_process(llm_kwargs: dict[str, Any]) -> None:
    """Make the next ``LLM(**llm_kwargs)`` run its engine core and its one worker in this process (vLLM's in-process
    client, executor "uni"). On a CPU each of the two processes vLLM would start imports vLLM again (~25 s of a ~32 s
    start on the 2-core dev VM). The scheduler and worker halves of the connector then share a process, as they do
    on a GPU at TP=1 (uni executor inside the engine core); `vllm serve` (the bench scenarios) keeps vLLM's own
    processes."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    llm_kwargs.setdefault("distributed_executor_backend", "uni")


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _in_process(spec: dict[str, Any], kw: dict[str, Any], cuda_available: Callable[[], bool] = _cuda_available) -> bool:
    """Whether to run the engine core in this process: ``spec['in_process']`` (True / False), or by default ("auto")
    on a host without a CUDA GPU at one rank."""
    want = spec.get("in_process", "auto")
    if want not in (True, False, "auto"):
        raise ValueError(f"engine spec: in_process must be true, false or \"auto\", got {want!r}")
    if want != "auto":
        return bool(want)
    if int(kw.get("tensor_parallel_size", 1)) != 1 or int(kw.get("pipeline_parallel_size", 1)) != 1:
        return False
    return not cuda_available()


def run_subprocess(spec: dict[str, Any], workdir: Path, timeout: float = 400) -> dict[str, Any]:
    """Run :func:`run_engine` in a fresh interpreter (a real engine restart); kill its whole group on exit."""
    workdir.mkdir(parents=True, exist_ok=True)
    n = len(list(workdir.glob("spec-*.json")))
    sp, op, lp = workdir / f"spec-{n}.json", workdir / f"out-{n}.json", workdir / f"engine-{n}.log"
    sp.write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONHASHSEED="0", VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "INFO"))
    env.update(spec.get("env", {}))
    with open(lp, "w") as log:
        rc = run_process_group([sys.executable, "-m", "adp_testbed.models.engine", str(sp), str(op)], log, env, timeout)
    if rc != 0 or not op.exists():
        lines = lp.read_text(errors="replace").splitlines()
        causes = [ln for ln in lines if _ROOT_CAUSE.search(ln)][:3]  # the engine's own errors, wherever they are
        tail = "\n".join(lines[-40:])
        raise RuntimeError(f"engine run failed (rc={rc}); root cause: {' | '.join(causes) or 'unknown'}; "
                           f"log {lp}:\n{tail}")
    return json.loads(op.read_text())


_ROOT_CAUSE = re.compile(r"(NotImplementedError|Check failed|cannot serve this model safely|ValueError: |"
                         r"AssertionError|ImportError: |ModuleNotFoundError: |AttributeError: module 'triton')")


def adp_connector(port: int, **extra: Any) -> dict[str, Any]:
    """A ``kv_transfer_config`` for ADPConnector on 127.0.0.1:``port`` (short name via the plugin)."""
    # restore_policy always: these runs (tests, verify) check what a restore delivers, so every hit is restored;
    # the choice auto makes is tested on its own (connector/tests/pipeline/test_restore_policy.py)
    cfg = {"traddr": "127.0.0.1", "trsvcid": port, "connect_timeout_s": 5.0, "retry_interval_s": 1.0,
           "restore_policy": "always"}
    cfg.update(extra)
    return {"kv_connector": "ADPConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": cfg}


if __name__ == "__main__":
    spec_path, out_path = sys.argv[1], sys.argv[2]
    try:
        result = run_engine(json.loads(Path(spec_path).read_text()))
        Path(out_path).write_text(json.dumps(result))
    finally:
        _kill_children()
    os._exit(0)
