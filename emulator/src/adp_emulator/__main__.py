"""``python -m adp_emulator serve ...``: run the userspace NVMe/TCP target in the foreground.

``serve --mgmt-port N`` also serves the management API (docs/management-api.md) from the same process
(off unless given; ``testbed up`` passes ``--mgmt-port 0``). ``mgmt --kernel-workdir DIR`` serves it
for a kernel target started into DIR.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from adp_emulator.mgmt import ApiServer

TOKEN_ENV = "ADP_KV_MGMT_TOKEN"

#: TargetSettings field -> the ``serve`` option that sets it (error messages name options, not fields).
FIELD_OPTIONS = {"host": "--host", "port": "--port", "subnqn": "--nqn", "capacity_bytes": "--capacity",
                 "lba_size": "--lba-size", "mdts_bytes": "--mdts", "max_io_queues": "--queues",
                 "queue_depth": "--queue-depth", "backing_path": "--backing", "allowed_hosts": "--allow-host",
                 "io_workers": "--io-workers", "splice_reads": "--copy-reads", "max_connections": "--max-connections",
                 "handshake_timeout_s": "--handshake-timeout", "backing_overcommit": "--overcommit"}


def _size(text: str) -> int:
    from adp_emulator.sizes import parse_size

    try:
        n = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return n


def _port(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"{n} is not a TCP port (0-65535)")
    return n


def _user_message(e: ValueError) -> str:
    """A settings error in the words of the command line (``TargetSettings.mdts_bytes`` -> ``--mdts``)."""
    import re

    def opt(m: re.Match[str]) -> str:
        return FIELD_OPTIONS.get(m.group(1), m.group(1).replace("_", "-"))

    return re.sub(r"TargetSettings\.(\w+)", opt, str(e))


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="adp-emulator", description="ADP KV emulator (userspace NVMe/TCP target)")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the target until SIGINT/SIGTERM")
    s.add_argument("--config", help="nvmetcli JSON (+ 'adp' section); other options override it")
    s.add_argument("--host", "--traddr", dest="host", help="listen address, the hosts' traddr (default 127.0.0.1)")
    s.add_argument("--port", "--trsvcid", dest="port", type=_port,
                   help="TCP port, the hosts' trsvcid (default 4420, 0 = any free port)")
    s.add_argument("--nqn", "--subnqn", dest="nqn", help="subsystem NQN, the hosts' subnqn")
    s.add_argument("--capacity", type=_size, help="namespace size, e.g. 1G or 1.5M (binary units)")
    s.add_argument("--lba-size", type=int, choices=(512, 4096))
    s.add_argument("--mdts", type=_size, help="max data transfer size, 4K to 128M, a power of two, e.g. 128K")
    s.add_argument("--queues", type=int, help="max I/O queues")
    s.add_argument("--queue-depth", type=int)
    s.add_argument("--backing", help="backing file (default: RAM)")
    s.add_argument("--overcommit", action="store_true", default=None,
                   help="serve a namespace larger than its backing can still take (sparse; refused by default: "
                        "writing past the room kills the target or, in RAM, stalls the host)")
    s.add_argument("--allow-host", action="append", default=None, metavar="NQN", help="allowed host NQN (repeat)")
    s.add_argument("--allow-any-host", action="store_true", default=None)
    s.add_argument("--require-data-digest", action="store_true", default=None)
    s.add_argument("--io-workers", type=int, metavar="N",
                   help="serve I/O queues in N worker processes (default 0: all in this process)")
    s.add_argument("--copy-reads", action="store_true", default=None,
                   help="send read data as a copy of the namespace's bytes (default: spliced from its pages "
                        "with sendfile, no copy in the target)")
    s.add_argument("--max-connections", type=int, metavar="N",
                   help="open TCP connections served at once; more are closed at accept (default 1024)")
    s.add_argument("--handshake-timeout", type=float, metavar="S",
                   help="seconds a new connection has for ICReq and Connect before it is closed "
                        "(default 10, 0 = no limit)")
    _add_mgmt_args(s, port_default=None)
    s.add_argument("-v", "--verbose", action="store_true")
    m = sub.add_parser("mgmt", help="serve the management API for a kernel target (testbed up --backend kernel)")
    m.add_argument("--kernel-workdir", required=True, help="the KernelTarget workdir (holds kernel-target.json)")
    _add_mgmt_args(m, port_default=0)
    m.add_argument("-v", "--verbose", action="store_true")
    return p


def _add_mgmt_args(p: argparse.ArgumentParser, port_default: int | None) -> None:
    g = p.add_argument_group("management API")
    g.add_argument("--mgmt-port", type=_port, default=port_default,
                   help="serve the management API on this port (0 = any free port)"
                   + ("; default: off" if port_default is None else f"; default {port_default}"))
    g.add_argument("--mgmt-host", default="127.0.0.1", help="management API address (default 127.0.0.1)")
    g.add_argument("--mgmt-token", default=None,
                   help=f"bearer token for mutating requests (default ${TOKEN_ENV}, else generated)")
    g.add_argument("--mgmt-token-file", default=None,
                   help="write the token here, mode 0600 (default for a generated token: "
                        "<state dir>/mgmt-<port>.token)")
    g.add_argument("--mgmt-allow-remote", action="store_true",
                   help="allow a non-loopback --mgmt-host (needs --mgmt-token or $" + TOKEN_ENV + "; "
                        "then reads need the token too)")


class _Mgmt:
    """The management API server of this process and the token file it wrote (removed at exit)."""

    def __init__(self, server: ApiServer, token_file: str | None) -> None:
        self.server = server
        self.token_file = token_file

    def stop(self) -> None:
        self.server.stop()
        if self.token_file:
            try:
                os.unlink(self.token_file)
            except OSError:
                pass


def _check_mgmt_args(args: argparse.Namespace) -> str | None:
    """The explicit token (flag or env), if any; ValueError for an unsafe combination of options."""
    from adp_emulator.mgmt import is_loopback

    explicit = args.mgmt_token or os.environ.get(TOKEN_ENV) or None
    if args.mgmt_port is not None and not 0 <= args.mgmt_port <= 65535:
        raise ValueError(f"--mgmt-port {args.mgmt_port} is out of range [0, 65535]")
    if not is_loopback(args.mgmt_host):
        if not args.mgmt_allow_remote:
            raise ValueError(f"--mgmt-host {args.mgmt_host} is not a loopback address; "
                             f"pass --mgmt-allow-remote (and a token) to expose the management API")
        if not explicit or len(explicit) < 16:
            raise ValueError(f"a non-loopback management API needs a token of at least 16 characters "
                             f"(--mgmt-token or ${TOKEN_ENV})")
    return explicit


def _start_mgmt(args: argparse.Namespace, backend: Any) -> _Mgmt:
    """Start the API in a background thread; raises ValueError (bad options) or OSError (bind)."""
    from adp_emulator.mgmt import ApiServer, create_app, is_loopback, write_token_file

    explicit = _check_mgmt_args(args)
    app = create_app(backend, explicit, protect_reads=not is_loopback(args.mgmt_host))
    server = ApiServer(app, args.mgmt_host, args.mgmt_port)
    token_file = args.mgmt_token_file
    if token_file is None and not explicit:
        from adp_emulator.paths import state_dir

        token_file = str(state_dir() / f"mgmt-{server.port}.token")
    try:
        if token_file:
            write_token_file(token_file, app.state.token)
        server.start()
    except BaseException:
        server.stop()
        raise
    if token_file:
        print(f"adp-emulator: management token in {token_file}", file=sys.stderr, flush=True)
    return _Mgmt(server, token_file if not explicit else None)


def _install_signals() -> threading.Event:
    """An event set by SIGTERM/SIGINT (installed before the READY/MGMT lines are printed)."""
    done = threading.Event()

    def _on_signal(signum: int, frame: object) -> None:
        done.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    return done


def _main_mgmt(args: argparse.Namespace) -> int:
    from adp_emulator.mgmt import KernelBackend

    done = _install_signals()
    try:
        mgmt = _start_mgmt(args, KernelBackend(args.kernel_workdir))
    except ValueError as e:
        print(f"adp-emulator: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"adp-emulator: cannot serve the management API on {args.mgmt_host}:{args.mgmt_port}: {e}",
              file=sys.stderr)
        return 1
    print(f"ADP-EMULATOR MGMT {mgmt.server.url}", flush=True)
    try:
        while not done.wait(0.5):
            pass
    finally:
        mgmt.stop()
    return 0


def _settings(args: argparse.Namespace) -> Any:
    from adp_emulator.target import TargetSettings, parse_size, settings_from_config

    kw: dict[str, Any] = {}
    for opt, key, conv in (("host", "host", str), ("port", "port", int), ("nqn", "subnqn", str),
                           ("capacity", "capacity_bytes", parse_size), ("lba_size", "lba_size", int),
                           ("mdts", "mdts_bytes", parse_size), ("queues", "max_io_queues", int),
                           ("max_connections", "max_connections", int),
                           ("handshake_timeout", "handshake_timeout_s", float),
                           ("queue_depth", "queue_depth", int), ("backing", "backing_path", str),
                           ("allow_host", "allowed_hosts", list), ("allow_any_host", "allow_any_host", bool),
                           ("require_data_digest", "require_data_digest", bool), ("io_workers", "io_workers", int),
                           ("overcommit", "backing_overcommit", bool)):
        val = getattr(args, opt)
        if val is not None:
            kw[key] = conv(val)
    if getattr(args, "copy_reads", None):
        kw["splice_reads"] = False
    if args.config:
        from adp_emulator.config import load_config

        return settings_from_config(load_config(args.config), **kw)
    return TargetSettings(**kw)


#: The parser of ``python -m adp_emulator`` (docs tests parse the documented command lines with it).
build_parser = _build_parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.cmd == "mgmt":
        return _main_mgmt(args)
    from adp_emulator.target import UserspaceTarget
    from adp_emulator.target.server import BackingError, BackingTooSmall

    try:
        settings = _settings(args)
        if args.mgmt_port is not None:
            _check_mgmt_args(args)
    except ValueError as e:
        print(f"adp-emulator: {_user_message(e)}", file=sys.stderr)
        return 2
    target = UserspaceTarget(settings)
    try:
        target.start()
    except BackingError as e:
        opt = "--backing: " if settings.backing_path else "--capacity: " if isinstance(e, BackingTooSmall) else ""
        print(f"adp-emulator: {opt}{e}", file=sys.stderr)
        return 2
    except OSError as e:
        hint = " (not an address of this machine)" if e.errno == errno.EADDRNOTAVAIL else \
            " (another process listens there)" if e.errno == errno.EADDRINUSE else ""
        print(f"adp-emulator: cannot listen on {settings.host}:{settings.port}: {e.strerror or e}{hint}",
              file=sys.stderr)
        return 1
    done = _install_signals()
    mgmt: _Mgmt | None = None
    if args.mgmt_port is not None:
        from adp_emulator.mgmt import UserspaceBackend

        try:
            mgmt = _start_mgmt(args, UserspaceBackend(target))
        except (ValueError, OSError) as e:
            target.stop()
            what = "" if isinstance(e, ValueError) else f"cannot serve the management API on " \
                f"{args.mgmt_host}:{args.mgmt_port}: "
            print(f"adp-emulator: {what}{e}", file=sys.stderr)
            return 2 if isinstance(e, ValueError) else 1
        print(f"ADP-EMULATOR MGMT {mgmt.server.url}", flush=True)
    host, port = target.address
    print(f"ADP-EMULATOR READY {host} {port} {settings.subnqn}", flush=True)
    try:
        while not done.wait(0.5):
            pass
    finally:
        if mgmt is not None:
            mgmt.stop()
        target.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
