"""argparse types of the `testbed` options: a bad value is one line from argparse (exit 2) at parse time."""

from __future__ import annotations

import argparse
import copy
import ipaddress
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from adp_emulator.target.settings import check_nqn_format

T = TypeVar("T")


def _err(msg: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(msg)


def port(text: str) -> int:
    """A TCP port, 0 (any free port) to 65535."""
    try:
        n = int(text)
    except ValueError:
        raise _err(f"not a port number: {text!r}") from None
    if not 0 <= n <= 65535:
        raise _err(f"{n} is not a TCP port (0-65535)")
    return n


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """An integer in [lo, hi]."""

    def conv(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise _err(f"not an integer: {text!r}") from None
        if not lo <= n <= hi:
            raise _err(f"{n} is outside [{lo}, {hi}]")
        return n

    conv.__name__ = f"integer in [{lo}, {hi}]"
    return conv


def _finite(text: str, what: str, zero_ok: bool) -> float:
    """``text`` as a finite number above 0 (or at least 0 with ``zero_ok``); ``what`` names it in the error."""
    try:
        v = float(text)
    except ValueError:
        raise _err(f"not a {what}: {text!r}") from None
    if not math.isfinite(v) or v < 0 or (v == 0 and not zero_ok):
        raise _err(f"must be a {'finite ' + what + ' >= 0' if zero_ok else 'positive, finite ' + what}, "
                   f"got {text!r}")
    return v


def seconds(text: str) -> float:
    """A finite, positive number of seconds."""
    return _finite(text, "number of seconds", False)


def positive_number(text: str) -> float:
    """A finite number above 0."""
    return _finite(text, "number", False)


def non_negative_number(text: str) -> float:
    """A finite number, 0 or above."""
    return _finite(text, "number", True)


def list_of(item: Callable[[str], T], what: str) -> Callable[[str], list[T]]:
    """A comma-separated, non-empty list of ``item``."""

    def conv(text: str) -> list[T]:
        parts = [p.strip() for p in text.split(",")]
        if not text.strip() or any(not p for p in parts):
            raise _err(f"expected a comma-separated list of {what}, got {text!r}")
        return [item(p) for p in parts]

    conv.__name__ = f"list of {what}"
    return conv


def choice_list(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    """A comma-separated list, each one of ``choices``."""

    def one(text: str) -> str:
        if text not in choices:
            raise _err(f"{text!r} is not one of {', '.join(choices)}")
        return text

    return list_of(one, "/".join(choices))


def host_address(text: str) -> str:
    """An IPv4 or IPv6 address literal (the target listens on it)."""
    try:
        ipaddress.ip_address(text)
    except ValueError:
        raise _err(f"not an IP address: {text!r}") from None
    return text


def target_address(text: str) -> str:
    """``ADDR:PORT`` (``[v6]:PORT`` for IPv6) of an existing target, checked; returned as ``ADDR:PORT``
    (callers split at the last colon)."""
    addr, sep, p = text.rpartition(":")
    if not sep or not addr:
        raise _err(f"expected ADDR:PORT (e.g. 192.0.2.10:4420), got {text!r}")
    addr = addr[1:-1] if addr.startswith("[") and addr.endswith("]") else addr
    try:
        ipaddress.ip_address(addr)
    except ValueError:
        if not addr.replace("-", "").replace(".", "").isalnum():
            raise _err(f"not an address: {addr!r}") from None
    n = port(p)
    if n == 0:
        raise _err("port 0 is not a target's port")
    return f"{addr}:{n}"


def nqn(text: str) -> str:
    """An NVMe Qualified Name (``nqn.`` ..., no blanks)."""
    try:
        return check_nqn_format(text)
    except ValueError as e:
        raise _err(str(e)) from None


def path(text: str) -> str:
    """A file-system path (non-empty, no NUL byte)."""
    if not text.strip() or "\0" in text:
        raise _err(f"not a usable path: {text!r}")
    return text


class UsageError(SystemExit):
    """A bad option or combination of options found after parsing: one line, exit status 2 under `testbed`
    (a SystemExit, so that a caller outside `testbed` stops too)."""


#: Exit statuses of every `testbed` command (the README and each ``--help`` epilog list them).
EXIT_CODES = """exit status:
  0    success (the acceptance held, the target is up/down, ...)
  1    an acceptance or a correctness check failed (RESULT: FAIL; `status`: the target is not running)
  2    usage: a bad option, value or combination, or a target that cannot be used (one line on stderr)
  3    crash: an unexpected error inside testbed (a traceback on stderr; please report it)
  130  interrupted (Ctrl-C)"""

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_CRASH, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


class DefaultsFormatter(argparse.RawDescriptionHelpFormatter):
    """Help that shows each option's default (when it has a meaningful one) and keeps the epilog's layout."""

    @staticmethod
    def _default_note(action: argparse.Action) -> str | None:
        text, d = action.help or "", action.default
        if ("%(default)" in text or "default" in text.lower() or d is None or d is False or d == []
                or d is argparse.SUPPRESS or not action.option_strings or action.nargs == 0):
            return None
        shown = ",".join(map(str, d)) if isinstance(d, list) else d
        return f"(default: {shown})".replace("%", "%%")

    def _get_help_string(self, action: argparse.Action) -> str:
        note = self._default_note(action)
        text = action.help or ""
        return f"{text} {note}".strip() if note else text

    def _format_action(self, action: argparse.Action) -> str:
        note = self._default_note(action)
        if not (action.help or "").strip() and note:  # an option without help text: its default alone
            action = copy.copy(action)
            action.help = note
        return super()._format_action(action)


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line (``prog: error: ... (see prog --help)``), exit 2; its
    help shows defaults and ends with the exit statuses."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        kw.setdefault("formatter_class", DefaultsFormatter)
        kw.setdefault("epilog", EXIT_CODES)
        super().__init__(*a, **kw)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


# ----------------------------------------------------------------------------------------------------
# The shared vocabulary: an existing target, and JSON output.

TARGET_HELP = ("ADDR:PORT of an existing target (a real card), the connector's traddr:trsvcid; "
               "skips the local emulator")


def add_target_options(p: argparse.ArgumentParser, target_help: str = TARGET_HELP) -> None:
    """``--target ADDR:PORT`` (or ``--traddr ADDR --trsvcid PORT``) and ``--nqn`` (``--subnqn``): the
    connector's ``traddr``/``trsvcid``/``subnqn``, under the same names on every command that uses a target
    that is already running. :func:`resolve_target` combines them after parsing."""
    g = p.add_argument_group("existing target (the connector's traddr / trsvcid / subnqn)")
    g.add_argument("--target", type=target_address, metavar="ADDR:PORT", help=target_help)
    g.add_argument("--traddr", type=target_host, metavar="ADDR", help="the address part of --target alone "
                   "(with --trsvcid)")
    g.add_argument("--trsvcid", type=port, metavar="PORT", help="the port part of --target alone (with --traddr)")
    g.add_argument("--nqn", "--subnqn", dest="nqn", type=nqn, metavar="NQN",
                   help="subsystem NQN of the target (default: ask its discovery controller)")


def target_host(text: str) -> str:
    """A target's address alone (IP literal or host name)."""
    return target_address(f"{text}:1").rpartition(":")[0]


def resolve_target(args: argparse.Namespace) -> None:
    """Fill ``args.target`` from ``--traddr``/``--trsvcid`` (or those from ``--target``); UsageError on a
    conflict. A no-op for commands without target options."""
    if not hasattr(args, "target") or not hasattr(args, "traddr"):
        return
    if args.target and (args.traddr or args.trsvcid):
        raise UsageError("give --target ADDR:PORT or --traddr/--trsvcid, not both")
    if args.traddr or args.trsvcid:
        if not args.trsvcid:
            raise UsageError("--traddr needs --trsvcid (or give --target ADDR:PORT)")
        host = args.traddr or "127.0.0.1"
        args.target = f"[{host}]:{args.trsvcid}" if ":" in host else f"{host}:{args.trsvcid}"
    if args.target:
        host, _, p = args.target.rpartition(":")
        args.traddr, args.trsvcid = host.strip("[]"), int(p)


def add_json_option(p: argparse.ArgumentParser, what: str = "the results") -> None:
    """``--json [PATH]``, the same on every command: write the JSON document to PATH; with no PATH or ``-``,
    to stdout, which then holds nothing else (the human-readable output goes to stderr)."""
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH", type=path,
                   help=f"write {what} as JSON to PATH; with no PATH (or -) to stdout, which then holds only "
                        "the JSON (the text goes to stderr)")


def json_to_stdout(args: argparse.Namespace) -> bool:
    return getattr(args, "json", None) == "-"


def emit_json(args: argparse.Namespace, doc: Any) -> None:
    """Write ``doc`` where ``--json`` says (nothing without ``--json``)."""
    where = getattr(args, "json", None)
    if where is None:
        return
    text = json.dumps(doc, indent=2) + "\n"
    if where == "-":
        out = getattr(args, "json_stream", None) or sys.stdout
        out.write(text)
        out.flush()
    else:
        Path(where).write_text(text)
