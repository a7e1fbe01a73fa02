"""scripts/gpu/scatter_bench.py (the scatter alone, idle and under a GPU or Python load) runs end to end on a CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "gpu" / "scatter_bench.py"


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    src = str(Path(__file__).resolve().parents[2] / "src")  # before the caller's path (where torch may live)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p))
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=240,
                          env=env, cwd=tmp_path)


def test_scatter_bench_reports_every_point(tmp_path: Path) -> None:
    out = tmp_path / "scatter.json"
    r = _run(tmp_path, "--device", "cpu", "--gb", "0.14", "--blocks", "64", "--out", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["page_bytes"] == 2 << 20 and res["host_cores"] == os.cpu_count()
    pts = {(p["page_copy"], p["load"]): p for p in res["points"]}
    assert set(pts) == {(c, load) for c in ("per_layer", "fused") for load in ("idle", "gpu", "python")}
    assert all(p["gbps"] > 0 and p["bytes"] == 2 * 64 << 20 for p in pts.values())
    assert "load_share_kept" in pts[("fused", "python")] and "load_share_kept" not in pts[("fused", "idle")]
    assert pts[("fused", "idle")]["copy_path"] == "per_layer: the KV cache is not on a GPU"  # a CPU moves per layer
    assert not any(p["cut_short"] for p in pts.values())


def test_a_point_past_its_time_reports_what_it_moved(tmp_path: Path) -> None:
    out = tmp_path / "scatter.json"
    r = _run(tmp_path, "--device", "cpu", "--gb", "0.14", "--blocks", "64", "--max-seconds", "0", "--out", str(out))
    assert r.returncode == 0, r.stderr
    pts = json.loads(out.read_text())["points"]
    assert all(p["cut_short"] and p["bytes"] == 64 << 20 for p in pts)  # one slab of the two, then the time was up


def test_scatter_bench_without_a_gpu_says_so(tmp_path: Path) -> None:
    if __import__("torch").cuda.is_available():
        pytest.skip("this host has a GPU")
    r = _run(tmp_path, "--gb", "0.1")
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1] == (
        "scatter_bench: no CUDA device (--device cpu runs the smoke test)")


def test_python_load_points_once_per_switch_interval(tmp_path: Path) -> None:
    out = tmp_path / "scatter.json"
    r = _run(tmp_path, "--device", "cpu", "--gb", "0.07", "--blocks", "64", "--switch-intervals", "0.005,0.0005",
             "--out", str(out))
    assert r.returncode == 0, r.stderr
    pts = json.loads(out.read_text())["points"]
    python = sorted((p["page_copy"], p["switch_interval_s"]) for p in pts if p["load"] == "python")
    assert python == [("fused", 0.0005), ("fused", 0.005), ("per_layer", 0.0005), ("per_layer", 0.005)]
    assert {p["switch_interval_s"] for p in pts if p["load"] != "python"} == {0.005}  # Python's default


def test_a_bad_switch_interval_is_one_line(tmp_path: Path) -> None:
    r = _run(tmp_path, "--device", "cpu", "--switch-intervals", "0.001,-1")
    assert r.returncode == 2 and "--switch-intervals: positive seconds" in r.stderr.strip().splitlines()[-1]
