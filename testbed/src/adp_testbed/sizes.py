"""Byte sizes on the command line: the repository's one grammar (:mod:`adp_emulator.sizes`) as argparse types."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from adp_emulator.sizes import format_size
from adp_emulator.sizes import parse_size as _parse

__all__ = ["format_size", "mdts_problem", "mdts_size", "parse_size", "positive_size", "size_at_least", "size_list"]


def parse_size(text: str | int) -> int:
    """``128K`` -> 131072 (see :mod:`adp_emulator.sizes`); raises ArgumentTypeError for argparse."""
    try:
        return _parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_size(text: str) -> int:
    """A size above 0 (a page, a buffer)."""
    n = parse_size(text)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive size, got {text!r}")
    return n


def size_at_least(lo: int) -> Callable[[str], int]:
    """A size of at least ``lo`` bytes."""

    def conv(text: str) -> int:
        n = parse_size(text)
        if n < lo:
            raise argparse.ArgumentTypeError(f"must be at least {format_size(lo)}, got {text!r}")
        return n

    conv.__name__ = f"size of at least {format_size(lo)}"
    return conv


def size_list(text: str) -> list[int]:
    """``64K,1M`` -> [65536, 1048576], each size positive."""
    return [positive_size(part) for part in text.split(",")]


def mdts_problem(m: int) -> str | None:
    """Why ``m`` cannot be an emulated controller's MDTS (a power of two from 4K to 128M), or None."""
    if m < 4096 or m & (m - 1) or m > 4096 << 15:
        return f"must be a power of two from 4K to 128M, got {m}"
    return None


def mdts_size(text: str) -> int:
    """An MDTS on the command line (``1M``), checked as :func:`mdts_problem` says."""
    m = parse_size(text)
    problem = mdts_problem(m)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return m
