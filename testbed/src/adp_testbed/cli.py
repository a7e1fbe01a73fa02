"""`testbed`: bring a local NVMe/TCP target up and down, show its status, run benchmarks and the demo.

    testbed up [--backend user|kernel] [--port 4420] [--mgmt-port 0] [--capacity 1G] [--config FILE] ...
    testbed status [--json [PATH]]
    testbed down
    testbed bench datapath [--preset quick|full] [--target ADDR:PORT --nqn NQN] [--json [PATH]]
    testbed bench restore-path [--helpers 1,2,4] [--target-workers 0,4] [--into gpu]
    testbed verify [--family dense] [--target ADDR:PORT --nqn NQN]
    testbed demo [--json [PATH]]

One vocabulary: `up` listens on --host/--port as --nqn (aliases --traddr/--trsvcid/--subnqn); every command
that uses a running target takes --target ADDR:PORT (or --traddr ADDR --trsvcid PORT) and --nqn (--subnqn):
the connector's traddr, trsvcid and subnqn. `--json` alone (or `--json -`) prints only the JSON document on
stdout (the text goes to stderr); `--json PATH` writes it to PATH.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from importlib import metadata
from pathlib import Path

from . import options as O
from . import state as S
from . import targets as T
from .sizes import mdts_problem, parse_size

DEFAULT_NQN = "nqn.2026-11.io.awide:adp-kv"
DEFAULT_HOST = "127.0.0.1"
PRESET_NOTE = "Options that show no default take the value of the --preset (presets.py; docs/bench-scenarios.md)."
DEFAULT_PORT = 4420
MGMT_TOKEN_FILE = "mgmt.token"  # in the state dir, mode 0600 (written by the emulator process)


class CliError(Exception):
    """A problem reported to the user as one line, exit status 2."""


# ----------------------------------------------------------------------------------------------------
# up / down / status


def _check_up_args(args: argparse.Namespace) -> None:
    """What argparse types cannot see alone, checked before anything starts."""
    if args.capacity <= 0 or args.capacity % args.lba_size:
        raise CliError(f"--capacity {args.capacity} is not a positive multiple of --lba-size {args.lba_size}")
    problem = mdts_problem(args.mdts)
    if problem:
        raise CliError(f"--mdts {problem}")
    if args.backing:
        b = Path(args.backing)
        if b.exists() and not b.is_file():
            raise CliError(f"--backing {b} is not a regular file")
        if str(b.resolve()).startswith(("/proc/", "/sys/", "/dev/")):
            raise CliError(f"--backing {b} is not a regular file on a disk")
    if args.allow_host and args.allow_any_host:
        raise CliError("--allow-host and --allow-any-host contradict each other; give one")
    if args.overcommit and args.backend != "user":
        raise CliError("--overcommit is for the userspace target (--backend user)")


def _listen_address(args: argparse.Namespace) -> tuple[str | None, int | None]:
    """--host/--port as given; without --config the defaults fill in, with it the file's own values stay."""
    if args.config:
        return args.host, args.port
    return args.host or DEFAULT_HOST, DEFAULT_PORT if args.port is None else args.port


def _spawn_userspace(args: argparse.Namespace, sdir: Path) -> S.TargetState:
    host, port = _listen_address(args)
    if host is not None and port is not None:  # port 0 too: is the address one of this machine's?
        problem = S.bind_problem(host, port)
        if problem:
            raise CliError(problem)
    cmd = T.userspace_command(
        host=host, port=port, config=args.config,
        nqn=None if args.config else args.nqn, capacity=None if args.config else args.capacity,
        lba_size=None if args.config else args.lba_size, mdts=None if args.config else args.mdts,
        backing=args.backing, allow_hosts=args.allow_host, allow_any_host=args.allow_any_host,
        mgmt_port=args.mgmt_port, mgmt_token_file=str(sdir / MGMT_TOKEN_FILE), io_workers=args.io_workers,
        overcommit=args.overcommit)
    try:
        got = T.launch_userspace(cmd, sdir / "target.log", timeout=args.timeout)
    except T.LaunchError as e:
        raise CliError(str(e)) from None
    return S.TargetState(backend="user", traddr=got.traddr, trsvcid=got.trsvcid, subnqn=got.subnqn,
                         pid=got.proc.pid, hosted="host", log=str(got.log), mgmt_url=got.mgmt_url,
                         extra={"mgmt_token_file": str(sdir / MGMT_TOKEN_FILE),
                                "identity": S.process_identity(got.proc.pid)})


def _spawn_kernel_mgmt(sdir: Path, workdir: Path, timeout: float, port: int = 0) -> dict:
    """The management API process of a kernel target (`adp_emulator mgmt`); {} if it does not start."""
    token_file = sdir / MGMT_TOKEN_FILE
    try:
        proc, url = T.launch_mgmt(T.mgmt_command(workdir, token_file, port), sdir / "mgmt.log", timeout=timeout)
    except T.LaunchError as e:
        print(f"note: no management API: {e}", file=sys.stderr)
        return {}
    return {"mgmt_url": url, "mgmt_pid": proc.pid, "mgmt_token_file": str(token_file),
            "mgmt_identity": S.process_identity(proc.pid)}


def _spawn_kernel(args: argparse.Namespace, sdir: Path) -> S.TargetState:
    """The Linux kernel target: nvmet on this kernel if it has it, else a QEMU guest (which outlives us)."""
    from adp_emulator.config import default_config, load_config
    from adp_emulator.kernel import KernelBackendError, KernelTarget

    if args.config:
        cfg = load_config(args.config)
        if args.port and cfg.ports:  # an explicit --port overrides the file's (host nvmet and VM alike)
            cfg.ports[0].trsvcid = str(args.port)
    else:
        cfg = default_config(port=args.port or DEFAULT_PORT, nqn=args.nqn)
        cfg.adp.capacity_bytes = args.capacity
    port = args.port if args.port is not None else int(cfg.ports[0].trsvcid) if cfg.ports else 0
    if port:
        problem = S.bind_problem("127.0.0.1", port)
        if problem:
            raise CliError(problem)
    workdir = sdir / "kernel"
    workdir.mkdir(parents=True, exist_ok=True)
    # host_port None: the config's own trsvcid (the file's, or --port's, or 4420); 0: any free port
    kt = KernelTarget(cfg, workdir, host_port=args.port)
    try:
        info = kt.start(timeout=max(args.timeout, 30.0))
    except KernelBackendError as e:
        raise CliError(str(e)) from None
    mgmt = _spawn_kernel_mgmt(sdir, workdir, args.timeout, args.mgmt_port)
    return S.TargetState(backend="kernel", traddr=info["traddr"], trsvcid=int(info["trsvcid"]),
                         subnqn=info["subnqn"], pid=int(info.get("pid") or 0), hosted=info.get("hosted", "vm"),
                         log=str(workdir), mgmt_url=mgmt.pop("mgmt_url", None),
                         extra={"workdir": str(workdir), "accel": info.get("accel"), **mgmt,
                                "identity": S.process_identity(int(info.get("pid") or 0)) if info.get("pid") else None})


def cmd_up(args: argparse.Namespace) -> int:
    """Start a target, holding the state dir's lock; the state is written (atomically) before success is
    reported, and a target whose state cannot be written is stopped again."""
    _check_up_args(args)
    sdir = S.state_dir(args.state_dir)
    with S.locked(sdir):
        return _up_locked(args, sdir)


def _up_locked(args: argparse.Namespace, sdir: Path) -> int:
    old = S.load(sdir)
    if old is not None:
        if S.pid_alive(old.pid):
            raise CliError(f"a {old.backend} target is already up at {old.traddr}:{old.trsvcid} (pid {old.pid}); "
                           f"run `testbed down` first")
        print(f"note: removed stale state of a target (pid {old.pid}) that is no longer running", file=sys.stderr)
        S.clear(sdir)
    st = _spawn_kernel(args, sdir) if args.backend == "kernel" else _spawn_userspace(args, sdir)
    try:
        S.save(sdir, st)
    except OSError as e:
        _stop_recorded(st)
        raise CliError(f"cannot write the state file in {sdir} ({e.strerror or e}); the target was stopped "
                       f"again") from None
    print(f"{st.backend} target up: {st.traddr}:{st.trsvcid} {st.subnqn} (pid {st.pid}, {st.hosted})")
    if st.mgmt_url:
        print(f"management API: {st.mgmt_url} (token in {st.extra.get('mgmt_token_file')})")
    return 0


#: Words one of which the command line of a process we started holds (state files without an identity).
_OUR_MARKERS = ("adp_emulator", "qemu-system")


def _stop_recorded(st: S.TargetState) -> None:
    """Stop the processes ``st`` names (best effort: used when ``up`` cannot record them)."""
    for pid in (int(st.extra.get("mgmt_pid") or 0), st.pid):
        if S.pid_alive(pid):
            S.stop_pid(pid)


def _check_ours(pid: int, recorded: dict | None, what: str) -> bool:
    """True if ``pid`` is still the process the state recorded; a note (and False) if not."""
    if not S.pid_alive(pid):
        return False
    ok, now = S.is_same_process(pid, recorded, _OUR_MARKERS)
    if not ok:
        print(f"note: pid {pid} is no longer our {what} (it runs `{now}`); not signalled", file=sys.stderr)
    return ok


def cmd_down(args: argparse.Namespace) -> int:
    sdir = S.state_dir(args.state_dir)
    with S.locked(sdir):
        return _down_locked(args, sdir)


def _down_locked(args: argparse.Namespace, sdir: Path) -> int:
    try:
        st = S.load(sdir)
    except S.StateError:
        if not args.force:
            raise
        S.clear(sdir)
        print("removed an unreadable state file")
        return 0
    if st is None:
        print("no target is up")
        return 0
    if st.backend == "kernel" and st.extra.get("workdir"):
        from adp_emulator.kernel import KernelTarget

        try:
            KernelTarget.from_workdir(Path(st.extra["workdir"])).stop()
        except Exception as e:  # fall back to killing the recorded process
            print(f"note: {e}", file=sys.stderr)
    mgmt_pid = int(st.extra.get("mgmt_pid") or 0)  # the kernel backend's API process
    if _check_ours(mgmt_pid, st.extra.get("mgmt_identity"), "management API") and not S.stop_pid(mgmt_pid):
        print(f"note: could not stop the management API (pid {mgmt_pid})", file=sys.stderr)
    if st.extra.get("mgmt_token_file"):
        Path(st.extra["mgmt_token_file"]).unlink(missing_ok=True)
    if _check_ours(st.pid, st.extra.get("identity"), "target") and not S.stop_pid(st.pid):
        raise CliError(f"could not stop pid {st.pid}")
    S.clear(sdir)
    print(f"{st.backend} target at {st.traddr}:{st.trsvcid} stopped")
    return 0


def status_dict(sdir: Path) -> dict:
    st = S.load(sdir)
    if st is None:
        return {"running": False, "backend": None, "traddr": None, "trsvcid": None, "subnqn": None,
                "mgmt_url": None, "hosted": None}
    d = st.to_json()
    d["running"] = S.pid_alive(st.pid)
    if not d["running"]:
        d["stale"] = True
    return d


def cmd_status(args: argparse.Namespace) -> int:
    d = status_dict(S.state_dir(args.state_dir))
    O.emit_json(args, d)
    if O.json_to_stdout(args):
        pass
    elif d["backend"] is None:
        print("no target is up")
    else:
        state = "running" if d["running"] else "NOT running (stale state; `testbed up` will replace it)"
        print(f"{d['backend']} target {state}\n  address  {d['traddr']}:{d['trsvcid']}\n  subnqn   {d['subnqn']}\n"
              f"  hosted   {d['hosted']}\n  pid      {d['pid']}\n  mgmt     {d['mgmt_url'] or '-'}\n"
              f"  log      {d.get('log') or '-'}")
    return 0 if d["running"] or d["backend"] is None else 1


# ----------------------------------------------------------------------------------------------------
# bench / demo


def cmd_bench_datapath(args: argparse.Namespace) -> int:
    from .bench import datapath

    return datapath.main(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from . import demo

    return demo.main(args)


# ----------------------------------------------------------------------------------------------------


def _target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["user", "kernel"], default="user",
                   help="user: our userspace NVMe/TCP target; kernel: Linux nvmet (in a QEMU VM if needed)")
    p.add_argument("--host", "--traddr", dest="host", type=O.host_address, default=None, metavar="ADDR",
                   help=f"listen address, the connector's traddr (userspace backend; default {DEFAULT_HOST}, "
                        "or the --config file's)")
    p.add_argument("--port", "--trsvcid", dest="port", type=O.port, default=None, metavar="PORT",
                   help=f"TCP port, the connector's trsvcid (0: any free port; default {DEFAULT_PORT}, or the "
                        "--config file's)")
    p.add_argument("--nqn", "--subnqn", dest="nqn", type=O.nqn, default=DEFAULT_NQN, metavar="NQN",
                   help="subsystem NQN, the connector's subnqn (ignored with --config)")
    p.add_argument("--mgmt-port", type=O.port, default=0, metavar="PORT",
                   help="port of the management API on 127.0.0.1 (0: any free port)")
    p.add_argument("--capacity", type=parse_size, default=parse_size("1G"), help="namespace size (default 1G)")
    p.add_argument("--lba-size", type=int, choices=[512, 4096], default=4096)
    p.add_argument("--mdts", type=parse_size, default=parse_size("128K"),
                   help="max data transfer size, a power of two from 4K to 128M (default 128K)")
    p.add_argument("--backing", type=O.path, help="file backing the namespace (persists across restarts); default RAM")
    p.add_argument("--overcommit", action="store_true",
                   help="userspace backend: serve a namespace larger than its backing can still take (sparse; "
                        "refused by default: writing past the room kills the target or, in RAM, stalls the host)")
    p.add_argument("--io-workers", type=O.int_in(0, 256), default=None, metavar="N",
                   help="userspace backend: serve I/O queues in N worker processes (default 0: one process)")
    p.add_argument("--config", type=O.path, metavar="FILE",
                   help="nvmetcli JSON configuration: its port, NQN, capacity, ... are used (--nqn/--capacity/"
                        "--lba-size/--mdts ignored); --host/--port, when given, override the file's")
    p.add_argument("--allow-host", action="append", type=O.nqn,
                   help="host NQN allowed to connect (repeatable; enforced on loopback too)")
    p.add_argument("--allow-any-host", action="store_true", help="allow any host NQN (default only on loopback)")
    p.add_argument("--timeout", type=O.seconds, default=20.0, help="seconds to wait for the target to be ready")


def build_parser() -> argparse.ArgumentParser:
    ap = O.OneLineParser(prog="testbed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", action="version", version=f"testbed {version()}")
    ap.add_argument("--state-dir", type=O.path, default=None,
                    help="where the target's state lives (default $ADP_KV_STATE_DIR or ~/.local/state/adp-kv)")
    sub = ap.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a local target in the background")
    _target_args(up)
    up.set_defaults(func=cmd_up)
    down = sub.add_parser("down", help="stop the local target")
    down.add_argument("--force", action="store_true", help="also remove an unreadable state file")
    down.set_defaults(func=cmd_down)
    st = sub.add_parser("status", help="show the local target")
    O.add_json_option(st, "the state")
    st.set_defaults(func=cmd_status)
    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="scenario", required=True)
    dp = bsub.add_parser("datapath", help="NVMe/TCP client read/write GB/s vs a plain loopback TCP stream",
                         description="NVMe/TCP client read/write GB/s vs a plain loopback TCP stream. " + PRESET_NOTE)
    from .bench.datapath import add_arguments

    add_arguments(dp)
    dp.set_defaults(func=cmd_bench_datapath)
    from .bench import store as store_bench

    sb = bsub.add_parser("store", help="page-store save/load GB/s vs the raw client on the same target")
    store_bench.add_arguments(sb)
    sb.set_defaults(func=store_bench.main)
    from .bench import restore as restore_path_bench

    rb = bsub.add_parser("restore-path", help="the connector's restore machinery without vLLM: helper processes "
                         "loading pages through staging slabs (and on into GPU memory), GB/s and CPU per process")
    restore_path_bench.add_arguments(rb)
    rb.set_defaults(func=restore_path_bench.main)
    from .bench import agents as agents_bench
    from .bench import restart as restart_bench
    from .bench import sweep as sweep_bench

    for name, mod, text in (
            ("restart", restart_bench, "vllm serve: prompts cold, engine restart, warm; TTFT baseline vs connector"),
            ("agents", agents_bench, "vllm serve: concurrent agents with growing histories; tokens/s per agent"),
            ("sweep", sweep_bench, "vllm serve: 1..N concurrent users; p50/p95 TTFT, throughput, failures")):
        sp = bsub.add_parser(name, help=text, description=f"{text}. {PRESET_NOTE}")
        mod.add_arguments(sp)
        sp.set_defaults(func=mod.main)
    from . import verify  # the vLLM acceptance harness

    vp = sub.add_parser("verify", help="cold -> engine restart -> warm on a tiny random-weight model; "
                                       "compares every restored page byte for byte")
    verify.add_arguments(vp)
    vp.set_defaults(func=verify.main)
    demo = sub.add_parser("demo", help="the restart A/B on a tiny CPU model (baseline vs ADP connector)")
    O.add_json_option(demo, "the results")
    demo.add_argument("--datapath", action="store_true",
                      help="the NVMe/TCP data path only (target, client, restart): no vLLM needed")
    demo.add_argument("--corrupt-card", action="store_true",
                      help="negative control: corrupt every stored page between the cold and warm phases; "
                           "the demo must then print RESULT: FAIL")
    O.add_target_options(demo, "ADDR:PORT of an existing target (a real card) for the connector arm, the "
                               "connector's traddr:trsvcid; default: a local emulator")
    demo.add_argument("--yes-destroy", action="store_true",
                      help="with --target: let the connector format a namespace that holds data but no page store")
    demo.add_argument("--vllm-python", metavar="PYTHON",
                      help="interpreter with vLLM (default: this one, else .venv-vllm)")
    demo.set_defaults(func=cmd_demo)
    return ap


def version() -> str:
    try:
        return metadata.version("adp-kv-testbed")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    """Exit statuses: :data:`adp_testbed.options.EXIT_CODES` (0 ok, 1 failed check, 2 usage, 3 crash, 130)."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command line, for a command that reruns itself
    try:
        O.resolve_target(args)
        if O.json_to_stdout(args):  # stdout holds the JSON document only; everything else goes to stderr
            args.json_stream = sys.stdout
            with contextlib.redirect_stdout(sys.stderr):
                return args.func(args)
        return args.func(args)
    except (CliError, S.StateError, T.TargetError) as e:
        print(f"testbed: {e}", file=sys.stderr)
        return O.EXIT_USAGE
    except O.UsageError as e:
        msg = str(e)
        print(msg if msg.startswith("testbed") else f"testbed: {msg}", file=sys.stderr)
        return O.EXIT_USAGE
    except KeyboardInterrupt:
        return O.EXIT_INTERRUPTED
    except BrokenPipeError:  # whoever read our output stopped reading (`testbed status | head -1`): not a crash
        with contextlib.suppress(OSError):  # and no second error when Python flushes stdout at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return O.EXIT_OK
    except SystemExit:
        raise
    except Exception:
        traceback.print_exc()
        print(f"testbed: crashed (exit status {O.EXIT_CRASH}); the traceback above is a bug, please report it",
              file=sys.stderr)
        return O.EXIT_CRASH


if __name__ == "__main__":
    sys.exit(main())
