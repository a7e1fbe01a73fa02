"""``testbed bench``: every finished point is kept in results.partial.json at once, until results.json replaces it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from adp_testbed.bench.common import Run, add_common_arguments


def _args(tmp_path: Path) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_common_arguments(p)
    return p.parse_args(["--model", "m", "--out", str(tmp_path), "--vllm-python", sys.executable, "--no-report",
                         "--arms", "baseline"])


def test_a_run_that_dies_keeps_the_points_it_finished(tmp_path: Path) -> None:
    run = Run("sweep", _args(tmp_path), {})
    partial = tmp_path / "results.partial.json"
    run.checkpoint("baseline", {"users": 1, "wall_s": 3.4})
    run.checkpoint("baseline", {"users": 16, "wall_s": 15.2})
    run.checkpoint("adp", {"users": 1, "wall_s": 3.5})  # any arm name: the checkpoint does not check it
    doc = json.loads(partial.read_text())
    assert doc["complete"] is False and doc["scenario"] == "sweep"
    assert [p["users"] for p in doc["points"]["baseline"]] == [1, 16] and doc["points"]["adp"][0]["wall_s"] == 3.5
    assert doc["environment"]["cpu_cores"] >= 1 and "gpu" in doc["environment"]
    assert not (tmp_path / "results.json").exists() and not (tmp_path / "results.partial.json.tmp").exists()
    run.finish({"baseline": {"available": True, "points": doc["points"]["baseline"]}})
    assert json.loads((tmp_path / "results.json").read_text())["arms"]["baseline"]["points"][1]["users"] == 16
    assert not partial.exists()  # the whole result replaces the partial one


def test_an_arm_that_fails_after_some_points_keeps_them_in_its_result(tmp_path: Path) -> None:
    run = Run("sweep", _args(tmp_path), {})

    def body(arm: str, _kv) -> dict:
        run.checkpoint(arm, {"users": 1, "wall_s": 3.4})
        raise RuntimeError("the engine died at the second point")

    arms = run.run_arms(body)
    assert arms["baseline"]["available"] is False and "engine died" in arms["baseline"]["reason"]
    assert arms["baseline"]["finished_points"] == [{"users": 1, "wall_s": 3.4}]
