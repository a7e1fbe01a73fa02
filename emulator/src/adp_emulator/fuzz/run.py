"""The long fuzz run of the userspace target (``scripts/fuzz-target``), with the random or the atheris engine.

Every input is one loopback connection; a witness association, a fresh connection, the thread count and RSS are
checked every ``--check-every`` inputs. However the run ends (``--inputs`` done, ``--seconds`` out, the harness
itself failing), it prints one summary line and writes the final JSON. Exit status: 0 only when no input crashed
the target, hung or drew bad output and every check passed; 1 otherwise; 2 for a usage error (an engine that is
not installed).

atheris (coverage-guided, libFuzzer) calls back once per input and never returns: the run ends itself from that
callback (``os._exit``, since libFuzzer's exit runs no ``atexit`` hook). Nothing here imports the target or the
codec before atheris has instrumented them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

INSTALL_ATHERIS = ("atheris is not installed: 'pip install -r requirements-dev.txt' (Linux x86_64 wheels, "
                   "Python 3.10-3.13) or 'pip install atheris' (elsewhere it builds from source and needs clang "
                   "with libFuzzer; see docs/reliability.md)")
FAILURE_KINDS = ("crashes", "hangs", "bad_output")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fuzz-target", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", type=int, default=100_000, help="inputs to run (default 100000)")
    ap.add_argument("--seconds", type=float, default=3600, help="stop after this long anyway (default 3600)")
    ap.add_argument("--engine", choices=("auto", "atheris", "random"), default="auto",
                    help="auto: atheris when installed, else random (default auto)")
    ap.add_argument("--seed", type=int, default=20261101)
    ap.add_argument("--check-every", type=int, default=250, help="witness/threads/RSS check interval (default 250)")
    ap.add_argument("--deadline", type=float, default=10.0,
                    help="seconds an input may take before it is a hang (default 10)")
    ap.add_argument("--json", default="fuzz-target.json", help="where to write the figures")
    ap.add_argument("--crash-dir", default="fuzz-crashes", help="failing inputs are saved here")
    return ap


def _atheris_available() -> bool:
    try:
        import atheris  # noqa: F401
    except ImportError:
        return False
    return True


def _import_harness(instrument: bool) -> Any:
    """The fuzz harness; under atheris, the target and the codec are instrumented first."""
    if instrument:
        import atheris

        with atheris.instrument_imports(include=["adp_emulator.target", "adp_wire"]):
            import adp_emulator.target  # noqa: F401
            import adp_wire  # noqa: F401
    from . import generator, harness

    return generator, harness


class FuzzRun:
    """Counters of one run, its failures (inputs saved to ``crash_dir``) and its summary."""

    def __init__(self, args: argparse.Namespace, engine: str) -> None:
        self.args = args
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.seconds
        self.failures: list[str] = []
        self.stopped_by = ""
        self.st: dict[str, Any] = {"engine": engine, "inputs": 0, "crashes": 0, "hangs": 0, "bad_output": 0,
                                   "checks": 0, "target_errors": 0, "stages": {}, "max_threads": 0,
                                   "seed": args.seed, "final": False}
        self.max_rss = lambda: 0

    @property
    def failed(self) -> bool:
        return any(self.st[k] for k in FAILURE_KINDS)

    def fail(self, kind: str, msg: str, data: bytes | None) -> None:
        self.st[kind] += 1
        self.failures.append(f"{kind}: {msg}")
        d = Path(self.args.crash_dir)
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{kind}-{self.st['inputs']}.bin").write_bytes(data or b"")

    def done(self) -> bool:
        """The run is over: every input ran, or the time is up (``stopped_by`` says which)."""
        if self.st["inputs"] >= self.args.inputs:
            self.stopped_by = "inputs"
        elif time.monotonic() >= self.deadline:
            self.stopped_by = "seconds"
        return bool(self.stopped_by)

    def report(self, final: bool = False) -> None:
        el = time.monotonic() - self.t0
        st = self.st
        st.update(seconds=round(el, 1), inputs_per_s=round(st["inputs"] / el, 1) if el else 0.0,
                  max_rss_mib=round(self.max_rss() / 2**20, 1), failures=self.failures[:20], final=final)
        if final:
            st.update(stopped_by=self.stopped_by or "error", ok=not self.failed)
        Path(self.args.json).write_text(json.dumps(st, indent=2))
        if final:
            print(f"fuzz-target: {'OK' if st['ok'] else 'FAIL'} engine={st['engine']} inputs={st['inputs']} "
                  f"inputs/s={st['inputs_per_s']} crashes={st['crashes']} hangs={st['hangs']} "
                  f"bad_output={st['bad_output']} checks={st['checks']} max_rss={st['max_rss_mib']} MiB "
                  f"seconds={st['seconds']} stopped_by={st['stopped_by']} json={self.args.json}", flush=True)

    def finish(self) -> int:
        """Write the final summary; the exit status."""
        if not self.st["final"]:
            self.report(final=True)
        return 1 if self.failed else 0


def main(argv: list[str] | None = None) -> int:
    """``scripts/fuzz-target``; see the module docstring for the exit status."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if not args.deadline > 0 or not args.seconds > 0 or args.inputs < 0 or args.check_every < 1:
        ap.error("--deadline and --seconds must be > 0, --inputs >= 0, --check-every >= 1")
    engine = args.engine
    if engine == "auto":
        engine = "atheris" if _atheris_available() else "random"
    elif engine == "atheris" and not _atheris_available():
        print(f"fuzz-target: {INSTALL_ATHERIS}", file=sys.stderr)
        return 2
    gen, har = _import_harness(engine == "atheris")
    run = FuzzRun(args, engine)
    run.max_rss = har.max_rss_bytes
    try:
        h = har.FuzzHarness()
    except Exception as exc:
        run.fail("crashes", f"the harness could not start: {type(exc).__name__}: {exc}", None)
        return run.finish()

    def periodic() -> None:
        try:
            c = h.check()
            run.st["checks"] += 1
            run.st["max_threads"] = max(run.st["max_threads"], c["threads"])
        except Exception as e:  # an invariant broke (AssertionError), or the target stopped answering
            run.fail("crashes", f"invariant after {run.st['inputs']} inputs: {type(e).__name__}: {e}", None)
            h.errors.records.clear()
        if run.st["inputs"] % (args.check_every * 4) == 0:
            run.report()

    def one(src: Any) -> None:
        inp = gen.gen_input(src, h.witness)
        try:
            out = har.run_input(h.addr, inp, args.deadline)
        except OSError as e:  # the target refused or reset the connection before any byte: it is not serving
            run.st["inputs"] += 1
            run.fail("crashes", f"{inp.stage} {inp.kinds}: {type(e).__name__}: {e}", b"".join(inp.chunks))
            return
        run.st["inputs"] += 1
        run.st["stages"][inp.stage] = run.st["stages"].get(inp.stage, 0) + 1
        if out.hung:
            run.fail("hangs", f"{inp.stage} {inp.kinds}", b"".join(inp.chunks))
        if out.bad_output:
            run.fail("bad_output", out.bad_output, b"".join(inp.chunks))
        if h.errors.records:
            run.st["target_errors"] += len(h.errors.records)
            run.fail("crashes", f"target internal error: {h.errors.records[0]}", b"".join(inp.chunks))
            h.errors.records.clear()
        if run.st["inputs"] % args.check_every == 0:
            periodic()

    def close() -> None:
        try:
            h.close()
        except Exception as exc:
            run.failures.append(f"closing the harness: {type(exc).__name__}: {exc}")

    if engine == "atheris":
        import atheris

        def end_run() -> None:  # libFuzzer runs no atexit hook: the summary is written here, then the process ends
            periodic()
            close()
            code = run.finish()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

        def test_one_input(data: bytes) -> None:
            try:
                one(gen.ProviderSrc(atheris.FuzzedDataProvider(data)))
            except Exception as exc:  # a fault of the harness itself is a failed run, never a silent one
                run.fail("crashes", f"harness error: {type(exc).__name__}: {exc}", data)
                end_run()
            if run.done():
                end_run()

        # no -runs: the callback above ends the run after --inputs inputs or --seconds
        atheris.Setup([sys.argv[0], "-max_len=4096", "-len_control=0", f"-seed={args.seed}", "-rss_limit_mb=4096",
                       f"-max_total_time={int(args.seconds) + 120}", "-print_final_stats=1"], test_one_input)
        atheris.Fuzz()
        return run.finish()  # libFuzzer stopped on its own (-max_total_time): still a summary
    src = gen.RandomSrc(random.Random(args.seed))
    try:
        while not run.done():
            one(src)
        periodic()
    except KeyboardInterrupt:
        run.stopped_by = "interrupted"
    except Exception as exc:
        run.fail("crashes", f"harness error: {type(exc).__name__}: {exc}", None)
    finally:
        close()
    code = run.finish()
    return 130 if run.stopped_by == "interrupted" and not code else code
