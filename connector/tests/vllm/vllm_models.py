"""Tiny random-weight models for the vLLM connector tests, and a one-shot engine runner.

Models: hand-written configs (the CPU matrix note §8 dims), weights from ``transformers`` ``from_config`` with
``initializer_range=0.05`` (dummy weights make outputs KV-independent), cached under
``${ADP_KV_CACHE:-~/.cache/adp-kv}/models/<family>``.

Runner: ``python vllm_models.py SPEC.json OUT.json`` starts ONE engine in this process, runs the prompts (a second
pass follows ``reset_prefix_cache()``, or with ``reset_between`` false is a local prefix-cache hit pass: the
reference a restored run must reproduce token for token), writes outputs and metrics to OUT.json and exits,
killing its engine children. Tests run it as a subprocess so an "engine restart" is a real process restart.
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
from pathlib import Path
from typing import Any

_BASE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 32000, "max_position_embeddings": 65536, "tie_word_embeddings": False,
         "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.05}

# family -> (transformers config class, model class, config overrides)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "dense": ("LlamaConfig", "LlamaForCausalLM", {"num_hidden_layers": 4, "rms_norm_eps": 1e-5,
                                                  "rope_theta": 10000.0}),
    "dense16": ("LlamaConfig", "LlamaForCausalLM", {"num_hidden_layers": 16, "rms_norm_eps": 1e-5,
                                                    "rope_theta": 10000.0}),
    "swa": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "num_hidden_layers": 4, "head_dim": 64, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 64,
        "sliding_window": 256,
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "pad_token_id": 0,
        "bos_token_id": 2, "eos_token_id": 1}),
    "mistral_swa": ("MistralConfig", "MistralForCausalLM", {"num_hidden_layers": 4, "head_dim": 64,
                                                           "sliding_window": 256, "rms_norm_eps": 1e-5}),
    "mla": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        "num_hidden_layers": 4, "num_key_value_heads": 4, "moe_intermediate_size": 128, "q_lora_rank": 128,
        "kv_lora_rank": 512, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 64,
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 4,
        "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 0,
        "rope_interleave": True, "bos_token_id": 0, "eos_token_id": 1}),
    # GDN hybrid: 3 linear-attention (GDN) + 1 full-attention layer. vLLM needs >= 1 MoE layer (layer 3); HF's
    # fused expert tensors are split per expert for vLLM's loader (_unfuse_experts).
    "gdn": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {
        "num_hidden_layers": 4, "head_dim": 64, "rms_norm_eps": 1e-6,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "partial_rotary_factor": 0.25, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 64,
        "linear_value_head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 128,
        "decoder_sparse_step": 1, "mlp_only_layers": [0, 1, 2], "norm_topk_prob": True,
        "num_nextn_predict_layers": 0, "hidden_act": "silu"}),
    # Mamba2 hybrid "M*M-": mamba, attention, mamba, mlp (needs cpu_workarounds/ on the engine's PYTHONPATH)
    "mamba": ("NemotronHConfig", "NemotronHForCausalLM", {
        "hybrid_override_pattern": "M*M-", "num_hidden_layers": 4, "head_dim": 64, "layer_norm_epsilon": 1e-5,
        "mlp_hidden_act": "relu2", "mamba_num_heads": 8, "mamba_head_dim": 64, "n_groups": 2, "ssm_state_size": 64,
        "conv_kernel": 4, "expand": 2, "chunk_size": 128, "use_conv_bias": True, "mamba_hidden_act": "silu",
        "mamba_proj_bias": False, "use_bias": False, "mlp_bias": False, "attention_bias": False,
        "residual_in_fp32": False, "rescale_prenorm_residual": True, "pad_token_id": 0,
        "num_nextn_predict_layers": 0}),
}

CPU_WORKAROUNDS = str(Path(__file__).parent / "cpu_workarounds")


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


def cache_dir() -> Path:
    return Path(os.environ.get("ADP_KV_CACHE", str(Path.home() / ".cache" / "adp-kv"))) / "models"


def _add_mtp_head(out: Path, hidden: int) -> None:
    """Turn a 2-layer DeepSeek-V3 checkpoint into a 1-layer model plus one MTP head that drafts by itself.

    The MTP head (vLLM ``deepseek_mtp`` weight names, ``model.layers.1.*``) is a copy of the target's layer:
    ``eh_proj`` passes the next token's embedding and drops the target's hidden state, the block is layer 0's
    weights, ``shared_head`` is the final norm and LM head. Embedding rows are scaled to RMS 1 so the head's
    ``enorm`` leaves them as they are. At position i the head then computes what the target computes at i+1
    (from its own KV cache, which holds the sequence shifted by one token; RoPE is relative): with random
    weights, drafts are mostly accepted, and only while the drafter's KV of the prefix is right (the attention
    output is scaled up to dominate the layer), so the acceptance rate shows whether a restore kept it.
    """
    import torch
    from safetensors.torch import load_file, save_file

    (shard,) = sorted(out.glob("*.safetensors"))
    w = load_file(str(shard))
    emb = w["model.embed_tokens.weight"].float()
    w["model.embed_tokens.weight"] = (emb / emb.pow(2).mean(-1, keepdim=True).sqrt()).to(torch.bfloat16)
    src, dst = "model.layers.0.", "model.layers.1."
    # attention dominates the layer's output, so a draft depends on the drafter's KV of the prefix
    w[src + "self_attn.o_proj.weight"] = (w[src + "self_attn.o_proj.weight"].float() * 8).to(torch.bfloat16)
    for n in [n for n in w if n.startswith(src)]:
        w[dst + n[len(src):]] = w[n].clone()
    for n in ("enorm", "hnorm"):
        w[dst + n + ".weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    w[dst + "eh_proj.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1).to(torch.bfloat16)
    w[dst + "shared_head.norm.weight"] = w["model.norm.weight"].clone()
    w[dst + "shared_head.head.weight"] = w["lm_head.weight"].clone()
    save_file(w, str(shard), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(num_hidden_layers=1, num_nextn_predict_layers=1)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))


def _unfuse_experts(out: Path) -> None:
    """Split transformers-5 fused MoE tensors (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
    [E, H, I]) into the per-expert ``experts.{e}.{gate,up,down}_proj.weight`` names vLLM's loaders read."""
    from safetensors.torch import load_file, save_file

    (shard,) = sorted(out.glob("*.safetensors"))
    w = load_file(str(shard))
    for name in [n for n in w if n.endswith("experts.gate_up_proj")]:
        base = name[: -len("gate_up_proj")]
        gu, down = w.pop(name), w.pop(base + "down_proj")
        inter = gu.shape[1] // 2
        for e in range(gu.shape[0]):
            w[f"{base}{e}.gate_proj.weight"] = gu[e, :inter].contiguous()
            w[f"{base}{e}.up_proj.weight"] = gu[e, inter:].contiguous()
            w[f"{base}{e}.down_proj.weight"] = down[e].contiguous()
    save_file(w, str(shard), metadata={"format": "pt"})


# vLLM's GPU MLA backends need DeepSeek's own head dims (an MLA prefill backend exists for qk_nope 128 / v 128, not
# 64 / 64; ../shared/gpu/README.md, "Model families on the H200"): the MLA families take them on a CUDA machine.
MLA_GPU = {"num_attention_heads": 16, "num_key_value_heads": 16, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
           "v_head_dim": 128, "kv_lora_rank": 512}


def _on_gpu() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def ensure_model(family: str) -> Path:
    """Directory of the random-weight checkpoint of ``family`` (generated once, then reused)."""
    name = family
    if family == "mtp":  # DeepSeek-V3, 1 layer + a self-drafting MTP head: generated as 2 layers (_add_mtp_head)
        cfg_cls, model_cls, over = FAMILIES["mla"]
        over, name = dict(over, num_hidden_layers=2, first_k_dense_replace=2), "mtp-selfdraft"
    else:
        cfg_cls, model_cls, over = FAMILIES[family]
    if family in ("mla", "mtp") and _on_gpu():
        over, name = dict(over, **MLA_GPU), name + "-gpu"
    out = cache_dir() / name
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    import torch
    import transformers

    kw = dict(_BASE)
    kw.update(over)
    cfg = getattr(transformers, cfg_cls)(**kw)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).to(torch.bfloat16)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    if family == "mtp":
        _add_mtp_head(tmp, cfg.hidden_size)
    _unfuse_experts(tmp)
    tmp.rename(out)
    return out


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    """``n`` independent random token-id prompts."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 30000) for _ in range(length)] for _ in range(n)]


def _metric(metrics: list[Any], name: str) -> float:
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
    llm = LLM(**kw)
    t_start = time.monotonic() - t0
    if spec.get("ready_marker"):  # tells a watching test that the engine is up (and gives it time to act)
        Path(spec["ready_marker"]).write_text("ready")
        time.sleep(spec.get("pause_after_ready", 0.0))
    try:
        block_size = int(llm.llm_engine.vllm_config.cache_config.block_size)
    except Exception:
        block_size = 0
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
            "seconds": dt,
            "ext_queries": _metric(m, "vllm:external_prefix_cache_queries"),
            "ext_hits": _metric(m, "vllm:external_prefix_cache_hits"),
            "local_hits": _metric(m, "vllm:prefix_cache_hits"),
            "adp": {x.name: float(getattr(x, "value", 0) or 0) for x in m if x.name.startswith("vllm:adp_kv")},
            # speculative decoding, cumulative over the engine's life (vllm:spec_decode_num_*)
            "spec": {k: _metric(m, f"vllm:spec_decode_num_{k}") for k in ("drafts", "draft_tokens", "accepted_tokens")},
        })
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    return {"start_seconds": t_start, "block_size": block_size, "passes": passes}


def run_subprocess(spec: dict[str, Any], workdir: Path, timeout: float = 400) -> dict[str, Any]:
    """Run :func:`run_engine` in a fresh interpreter (a real engine restart); kill its whole group on exit."""
    workdir.mkdir(parents=True, exist_ok=True)
    n = len(list(workdir.glob("spec-*.json")))
    sp, op, lp = workdir / f"spec-{n}.json", workdir / f"out-{n}.json", workdir / f"engine-{n}.log"
    sp.write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONHASHSEED="0", VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "INFO"))
    env.update(spec.get("env", {}))
    with open(lp, "w") as log:
        proc = subprocess.Popen([sys.executable, __file__, str(sp), str(op)], stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if rc != 0 or not op.exists():
        lines = lp.read_text(errors="replace").splitlines()
        causes = [ln for ln in lines if _ROOT_CAUSE.search(ln)][:3]  # the engine's own errors, wherever they are
        tail = "\n".join(lines[-40:])
        raise RuntimeError(f"engine run failed (rc={rc}); root cause: {' | '.join(causes) or 'unknown'}; "
                           f"log {lp}:\n{tail}")
    return json.loads(op.read_text())


_ROOT_CAUSE = re.compile(r"(NotImplementedError|Check failed|cannot serve this model safely|ValueError: |"
                         r"AssertionError|ImportError: |ModuleNotFoundError: )")


def adp_connector(port: int, **extra: Any) -> dict[str, Any]:
    """A ``kv_transfer_config`` for ADPConnector on 127.0.0.1:``port`` (short name via the plugin)."""
    cfg = {"traddr": "127.0.0.1", "trsvcid": port, "connect_timeout_s": 5.0, "retry_interval_s": 1.0}
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
