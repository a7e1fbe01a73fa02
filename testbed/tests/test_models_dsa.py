"""The random-weight DeepSeek-V3.2 (DSA) checkpoint (issue 16 item 2): indexer weights vLLM loads, outputs that
depend on the indexer, and the verify checks that the pages compared hold the indexer's keys.

Builds the checkpoint on CPU (seconds); the engine run is GPU-only (``testbed verify --family dsa`` on the H200).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="checkpoints are generated with torch")
pytest.importorskip("transformers", reason="checkpoints are generated with transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from adp_testbed import models as vm  # noqa: E402
from adp_testbed import verify  # noqa: E402


@pytest.fixture(scope="module")
def dsa(tmp_path_factory: pytest.TempPathFactory) -> Path:
    mp = pytest.MonkeyPatch()
    mp.setenv("ADP_KV_CACHE", str(tmp_path_factory.mktemp("cache")))
    try:
        yield vm.ensure_model("dsa")
    finally:
        mp.undo()


def test_dsa_checkpoint_is_v32_with_an_indexer_per_layer(dsa: Path) -> None:
    cfg = json.loads((dsa / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV32ForCausalLM"] and cfg["model_type"] == "deepseek_v32"
    assert (cfg["index_n_heads"], cfg["index_head_dim"]) == (64, 128)
    # the GPU MLA dims (an MLA prefill backend exists for them on the H200)
    assert {k: cfg[k] for k in vm.MLA_GPU} == vm.MLA_GPU
    assert cfg["index_topk"] < 1200  # below verify's prompt length: attention follows the indexer's choice
    assert vm.check_dsa_checkpoint(dsa, prompt_len=1200) == []
    (shard,) = sorted(dsa.glob("*.safetensors"))
    w = safetensors_torch.load_file(str(shard))
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}.self_attn.indexer."
        assert w[pre + "wq_b.weight"].shape == (64 * 128, cfg["q_lora_rank"])
        assert w[pre + "wk.weight"].shape == (128, cfg["hidden_size"])
        assert w[pre + "weights_proj.weight"].shape == (64, cfg["hidden_size"])
        assert float(w[pre + "wq_b.weight"].float().std()) > 0.01  # random, not zeros: the scores vary
    assert not (w["model.layers.0.self_attn.indexer.wk.weight"] == w["model.layers.1.self_attn.indexer.wk.weight"]
                ).all()


def test_control_the_check_catches_a_missing_indexer_and_a_useless_topk(dsa: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((dsa / "config.json").read_text())
    (shard,) = sorted(dsa.glob("*.safetensors"))
    w = safetensors_torch.load_file(str(shard))
    del w["model.layers.2.self_attn.indexer.wk.weight"]
    safetensors_torch.save_file(w, str(bad / shard.name))
    (bad / "config.json").write_text(json.dumps(cfg))
    assert vm.check_dsa_checkpoint(bad) == ["missing model.layers.2.self_attn.indexer.wk.weight"]
    # every token selected: the indexer would not matter
    assert any("index_topk" in p for p in vm.check_dsa_checkpoint(dsa, prompt_len=cfg["index_topk"]))
    # the plain MLA model (DeepSeek-V3) is no DSA checkpoint
    (bad / "config.json").write_text(json.dumps(dict(cfg, architectures=["DeepseekV3ForCausalLM"],
                                                     model_type="deepseek_v3")))
    assert vm.check_dsa_checkpoint(bad)


def test_verify_requires_the_indexer_bytes_in_the_pages(dsa: Path, tmp_path: Path) -> None:
    log = tmp_path / "engine-1.log"
    # 4 layers x 64 tokens x (576 x 2 B latent + 132 B indexer key) in one group
    log.write_text("(Worker pid=1) INFO [connector.py:120] ADP KV connector (WORKER): 1 group(s): "
                   f"g0=mla/64/{4 * 64 * (1152 + 132)}B\n")
    groups = verify._connector_groups(log)
    assert groups == [{"group": 0, "kind": "mla", "block_size": 64, "page_bytes": 4 * 64 * 1284}]
    assert verify._dsa_pages_cover_indexer(str(dsa), groups)["indexer_in_pages"]
    # control: pages holding only the MLA latents
    log.write_text(f"ADP KV connector (WORKER): 1 group(s): g0=mla/64/{4 * 64 * 1152}B\n")
    assert not verify._dsa_pages_cover_indexer(str(dsa), verify._connector_groups(log))["indexer_in_pages"]


def test_dsa_is_refused_without_cuda_before_any_engine_starts(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device: verify runs DSA here")
    p = argparse.ArgumentParser()
    verify.add_arguments(p)
    assert verify.main(p.parse_args(["--family", "dsa"])) == 2
    assert "Sparse Attention is not supported on CPU" in capsys.readouterr().err
