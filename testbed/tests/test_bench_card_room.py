"""``testbed bench``: a local card that $TMPDIR cannot hold in full is refused before any arm runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from adp_emulator.target import backing as B
from adp_testbed import options as O
from adp_testbed.bench.common import Run, add_common_arguments


def _args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_common_arguments(p)
    return p.parse_args(["--model", "m", "--out", str(tmp_path / "out"), "--vllm-python", sys.executable, *extra])


def test_a_card_tmpdir_cannot_hold_is_refused_before_any_arm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR
    room = B.backing_room(str(tmp_path / "card.img")).room
    huge = str((room + (1 << 40)) // 4096 * 4096)
    with pytest.raises(O.UsageError, match=r"the adp arm's card: a .* namespace does not fit in .*--card-bytes"):
        Run("sweep", _args(tmp_path, "--card-bytes", huge), {})
    assert not (tmp_path / "out").exists()  # refused before anything was written
    # controls: arms without a card, an external target, and a card that fits all go ahead
    Run("sweep", _args(tmp_path, "--card-bytes", huge, "--arms", "baseline"), {})
    Run("sweep", _args(tmp_path, "--card-bytes", huge, "--target", "127.0.0.1:4420"), {})
    Run("sweep", _args(tmp_path, "--card-bytes", str(64 << 20)), {})
