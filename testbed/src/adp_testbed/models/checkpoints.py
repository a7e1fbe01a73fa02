"""Random-weight tiny checkpoints of every model family the connector supports, for tests and demos.

Hand-written configs (hidden 256, 4 layers: an engine starts in seconds on a CPU), weights from ``transformers``
``from_config`` with ``initializer_range=0.05`` (dummy weights make outputs KV-independent), cached under
``${ADP_KV_CACHE:-~/.cache/adp-kv}/models/<family>``.

Self-contained (standard library, then torch/transformers/safetensors when a checkpoint is generated), so any
interpreter that has those can run it by path, without adp_testbed installed:
``python checkpoints.py FAMILY`` prints the checkpoint's directory.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
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

# DeepSeek-V3.2 (DSA): the MLA model plus a lightning indexer per layer. GPU-only (vLLM: "Sparse Attention is not
# supported on CPU"); its dims are the GPU MLA ones (MLA_GPU) and index_n_heads 64 (the DeepGEMM indexer vLLM 0.26
# bundles asserts 16/32/64 heads, seen on the H200 on 2026-11-29). index_topk stays below the verify prompts (1200
# tokens) so each query attends to the indexer's top-k selection, not to every token: outputs depend on the
# indexer's cache.
DSA = {"index_n_heads": 64, "index_head_dim": 128, "index_topk": 256}
# vLLM's weight names of one layer's indexer (model_executor/models/deepseek_v2.py: Indexer; wk and weights_proj
# are fused at load time) -> shape from (config): [rows, cols] or [cols] for the LayerNorm
_INDEXER_TENSORS = ("wq_b.weight", "wk.weight", "weights_proj.weight", "k_norm.weight", "k_norm.bias")


def _indexer_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, d, q = cfg["index_n_heads"], cfg["index_head_dim"], cfg["q_lora_rank"]
    return {"wq_b.weight": (h * d, q), "wk.weight": (d, cfg["hidden_size"]),
            "weights_proj.weight": (h, cfg["hidden_size"]), "k_norm.weight": (d,), "k_norm.bias": (d,)}


def _add_dsa_indexer(out: Path, seed: int = 0) -> None:
    """Turn a DeepSeek-V3 checkpoint into a DeepSeek-V3.2 one: a random-weight indexer per layer and the config
    keys vLLM reads (``index_topk`` makes it a V3.2 model; vLLM maps ``deepseek_v32`` to ``DeepseekV3Config``, so
    no transformers class of V3.2 is needed). Linear weights are N(0, initializer_range), the LayerNorm is ones /
    zeros, as ``from_config`` would give them."""
    import torch
    from safetensors.torch import load_file, save_file

    cfg = json.loads((out / "config.json").read_text())
    cfg.update(DSA, model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"])
    (shard,) = sorted(out.glob("*.safetensors"))
    w = load_file(str(shard))
    gen = torch.Generator().manual_seed(seed)
    std = float(cfg.get("initializer_range", 0.02))
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}.self_attn.indexer."
        for name, shape in _indexer_shapes(cfg).items():
            if name == "k_norm.weight":
                t = torch.ones(shape)
            elif name == "k_norm.bias":
                t = torch.zeros(shape)
            else:
                t = torch.randn(shape, generator=gen) * std
            w[pre + name] = t.to(torch.bfloat16)
    save_file(w, str(shard), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))


def check_dsa_checkpoint(path: Path, prompt_len: int | None = None) -> list[str]:
    """What keeps ``path`` from being a DSA checkpoint whose outputs depend on the indexer (empty: nothing).

    Checks the config (V3.2 architecture, indexer dims, ``index_topk`` below ``prompt_len``) and that every layer
    has every indexer tensor, of the shape vLLM's loader expects."""
    from safetensors import safe_open

    problems: list[str] = []
    cfg = json.loads((Path(path) / "config.json").read_text())
    if cfg.get("architectures") != ["DeepseekV32ForCausalLM"] or cfg.get("model_type") != "deepseek_v32":
        problems.append(f"not a DeepSeek-V3.2 config: {cfg.get('architectures')} / {cfg.get('model_type')}")
    for k, v in DSA.items():
        if k not in cfg:
            problems.append(f"config has no {k}")
        elif k != "index_topk" and cfg[k] != v:
            problems.append(f"config {k}={cfg[k]}, not {v}")
    if prompt_len is not None and cfg.get("index_topk", prompt_len) >= prompt_len:
        problems.append(f"index_topk {cfg.get('index_topk')} >= the prompt length {prompt_len}: every token is "
                        "selected, the indexer does not matter")
    if problems:
        return problems
    shapes = _indexer_shapes(cfg)
    found: dict[str, tuple[int, ...]] = {}
    for shard in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has keys(), not iteration)
                if ".self_attn.indexer." in name:
                    found[name] = tuple(f.get_slice(name).get_shape())
    for i in range(cfg["num_hidden_layers"]):
        for name, shape in shapes.items():
            full = f"model.layers.{i}.self_attn.indexer.{name}"
            if full not in found:
                problems.append(f"missing {full}")
            elif found[full] != shape:
                problems.append(f"{full} has shape {found[full]}, not {shape}")
    return problems


def cache_dir() -> Path:
    """Where generated models live: ``models/`` under the repository's one cache directory (adp_emulator.paths)."""
    from adp_emulator.paths import cache_dir as cache_root

    return cache_root() / "models"


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
# 64 / 64; found in the H200 runs, docs/benchmarks.md §4): the MLA families take them on a CUDA machine.
MLA_GPU = {"num_attention_heads": 16, "num_key_value_heads": 16, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
           "v_head_dim": 128, "kv_lora_rank": 512}

# FlashInfer's GDN prefill (vLLM 0.26's default on SM90, a CuTe-DSL kernel) takes only head dim 128: "DSL kernel
# only supports D=128, got 64" (H200, GPU run 18). Qwen3-Next's own linear-attention heads are 128 wide. One key and
# two value heads keep the state, and so the block vLLM sizes to hold it (144 tokens), under verify's 256 batched
# tokens (four value heads made it 272: "block_size (272) must be <= max_num_batched_tokens (256)").
GDN_GPU = {"linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 1,
           "linear_num_value_heads": 2}


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
    elif family == "dsa":  # DeepSeek-V3 (GPU MLA dims) + an indexer per layer (_add_dsa_indexer): GPU-only
        cfg_cls, model_cls, over = FAMILIES["mla"]
        over = dict(over, **MLA_GPU)
    else:
        cfg_cls, model_cls, over = FAMILIES[family]
    if family in ("mla", "mtp") and _on_gpu():
        over, name = dict(over, **MLA_GPU), name + "-gpu"
    if family == "gdn" and _on_gpu():
        over, name = dict(over, **GDN_GPU), name + "-gpu"
    out = cache_dir() / name
    if _complete(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # one writer per model: runs started together (validate.sh families with FAMILY_JOBS) wait for the first
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _complete(out):
            _generate(family, cfg_cls, model_cls, over, out)
    return out


def _complete(out: Path) -> bool:
    return (out / "config.json").exists() and any(out.glob("*.safetensors"))


def _generate(family: str, cfg_cls: str, model_cls: str, over: dict[str, Any], out: Path) -> None:
    """Write the random-weight checkpoint of ``family`` to ``out`` (through a temporary directory)."""
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
    if family == "dsa":
        _add_dsa_indexer(tmp)
    _unfuse_experts(tmp)
    if out.exists():  # an incomplete directory left by a run that was killed
        shutil.rmtree(out)
    tmp.rename(out)




if __name__ == "__main__":
    print(ensure_model(sys.argv[1]))
