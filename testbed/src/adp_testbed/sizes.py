"""Human-readable byte sizes: ``parse_size("128K") == 131072``."""

from __future__ import annotations

import argparse
import re

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str | int) -> int:
    """Parse ``4096``, ``128K``, ``1G``, ``1.5M`` or ``64KiB`` into bytes; raises ArgumentTypeError."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(?:I?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4096, 128K, 1G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_size(n: int) -> str:
    for unit in ("T", "G", "M", "K"):
        if n >= _UNITS[unit] and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}"
    return str(n)
