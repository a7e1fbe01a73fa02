"""Byte sizes written by people, the one grammar of every ADP KV option and config field.

A size is a number, optionally with a decimal fraction, then optionally a binary unit: ``K``, ``M``,
``G`` or ``T`` (powers of 1024, any case), which may be followed by ``iB`` or ``B``. Blanks around
are ignored. The result must be a whole number of bytes: ``4096``, ``128K``, ``1.5M`` (1572864),
``2MiB`` and ``1g`` are sizes; ``1.3``, ``0.1K``, ``-1``, ``12X`` and ``1e3`` are not.
"""

from __future__ import annotations

import re
from fractions import Fraction

_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(?:i?b)?\s*", re.IGNORECASE)
UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str | int) -> int:
    """Bytes in ``text`` (grammar above); an int is returned as is. Raises ValueError."""
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, int):
        return text
    m = _SIZE_RE.fullmatch(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 128K, 1.5M, 1G)")
    n = Fraction(m.group(1)) * UNITS[m.group(2).upper()]
    if n.denominator != 1:
        raise ValueError(f"not a whole number of bytes: {text!r}")
    return int(n)


def format_size(n: int) -> str:
    """The shortest exact spelling: 131072 -> ``128K``, 1000 -> ``1000``."""
    for unit in ("T", "G", "M", "K"):
        if n >= UNITS[unit] and n % UNITS[unit] == 0:
            return f"{n // UNITS[unit]}{unit}"
    return str(n)
