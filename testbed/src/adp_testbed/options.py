"""argparse types of the `testbed` options: a bad value is one line from argparse (exit 2) at parse time."""

from __future__ import annotations

import argparse
import ipaddress
import math
from collections.abc import Callable
from typing import TypeVar

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


def seconds(text: str) -> float:
    """A finite, positive number of seconds."""
    try:
        v = float(text)
    except ValueError:
        raise _err(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise _err(f"must be a positive, finite number of seconds, got {text!r}")
    return v


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


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line (``prog: error: ... (see prog --help)``), exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")
