"""``testbed bench``: the adp arm's local card is fitted to $TMPDIR before any arm runs: a ``--card-bytes`` that
does not fit is refused, the preset's size that does not fit becomes the largest that does (and says so)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from adp_emulator.target import TargetSettings, UserspaceTarget
from adp_emulator.target import backing as B
from adp_testbed import options as O
from adp_testbed.bench import common as C
from adp_testbed.bench.common import Run, add_common_arguments


def _args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_common_arguments(p)
    return p.parse_args(["--model", "m", "--out", str(tmp_path / "out"), "--vllm-python", sys.executable, *extra])


@pytest.fixture
def tmpdir_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """TMPDIR is the test's directory; returns the room there."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR
    return B.backing_room(str(tmp_path / "card.img")).room


def test_a_card_bytes_tmpdir_cannot_hold_is_refused_before_any_arm(tmp_path: Path, tmpdir_here: int) -> None:
    huge = str((tmpdir_here + (1 << 40)) // 4096 * 4096)
    with pytest.raises(O.UsageError, match=r"the adp arm's card: a .* namespace does not fit in .*--card-bytes"):
        Run("sweep", _args(tmp_path, "--card-bytes", huge), {})
    assert not (tmp_path / "out").exists()  # refused before anything was written
    # controls: arms without a card, an external target, and a card that fits all go ahead
    Run("sweep", _args(tmp_path, "--card-bytes", huge, "--arms", "baseline"), {})
    with UserspaceTarget(TargetSettings(port=0, capacity_bytes=64 << 20)) as card:  # an empty namespace to check
        Run("sweep", _args(tmp_path, "--card-bytes", huge, "--target", f"127.0.0.1:{card.address[1]}"), {})
    run = Run("sweep", _args(tmp_path, "--card-bytes", str(64 << 20)), {})
    assert run.card_bytes == 64 << 20 and run.card_note is None


def test_a_preset_card_that_does_not_fit_becomes_the_largest_that_does(tmp_path: Path, tmpdir_here: int,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    if B.backing_room(str(tmp_path / "card.img")).in_ram:
        pytest.skip("the test's directory is in RAM")
    if tmpdir_here < 2 << 30:
        pytest.skip("under 2 GiB free here")
    preset = dict(C.scenario_preset("cpu-smoke", "sweep")[2])
    preset["target_capacity_bytes"] = (tmpdir_here + (1 << 40)) // 4096 * 4096
    real = C.scenario_preset
    monkeypatch.setattr(C, "scenario_preset", lambda p, s: (*real(p, s)[:2], preset))
    run = Run("sweep", _args(tmp_path), {})
    assert run.card_bytes <= tmpdir_here and run.card_bytes % (1 << 30) == 0 and run.card_bytes >= 1 << 30
    assert run.card_note is not None and "--card-bytes chooses" in run.card_note
    # control: the preset's own size where it fits is kept, with no note
    monkeypatch.setattr(C, "scenario_preset", real)
    run = Run("sweep", _args(tmp_path), {})
    assert run.card_bytes == real("cpu-smoke", "sweep")[2]["target_capacity_bytes"] and run.card_note is None
