"""The repository's one size grammar (adp_emulator.sizes), used by the emulator and the testbed alike."""

from __future__ import annotations

import argparse

import pytest

from adp_emulator.sizes import format_size, parse_size
from adp_emulator.target import parse_size as target_parse_size


@pytest.mark.parametrize("text,want", [("4096", 4096), ("128K", 128 << 10), ("128k", 128 << 10), ("1G", 1 << 30),
                                       ("2MiB", 2 << 20), ("2mb", 2 << 20), (" 64 KiB ", 64 << 10),
                                       ("1.5M", 3 << 19), ("0.5K", 512), ("1T", 1 << 40), (7, 7)])
def test_sizes(text: str | int, want: int) -> None:
    assert parse_size(text) == want
    assert target_parse_size(text) == want  # the target's name is the same function


@pytest.mark.parametrize("text", ["", "12X", "1.3", "0.1K", "-1", "1e3", "K", "1.5.2M", "nan", "inf", True])
def test_not_sizes(text: object) -> None:
    with pytest.raises(ValueError):
        parse_size(text)  # type: ignore[arg-type]


def test_testbed_uses_the_same_grammar() -> None:
    from adp_testbed.sizes import parse_size as testbed_parse_size

    for text in ("1.5M", "128K", "2MiB"):
        assert testbed_parse_size(text) == parse_size(text)
    with pytest.raises(argparse.ArgumentTypeError):
        testbed_parse_size("1.3")  # accepted (as 1 byte) before: one grammar rejects it everywhere


def test_emulator_serve_accepts_what_the_testbed_accepts() -> None:
    from adp_emulator.__main__ import _build_parser

    args = _build_parser().parse_args(["serve", "--capacity", "1.5M", "--mdts", "128K"])
    assert args.capacity == 3 << 19 and args.mdts == 128 << 10


def test_format_size() -> None:
    assert [format_size(n) for n in (128 << 10, 1 << 30, 1000, 3 << 19)] == ["128K", "1G", "1000", "1536K"]
