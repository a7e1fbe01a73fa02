"""The CPU workarounds of the test harness: which ones an engine process gets, and the AMX one's effect on torch."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from adp_testbed.models.cpu_workarounds import PATH, SELECT, cpu_has_amx

ROOT = Path(__file__).resolve().parents[2]


def test_amx_is_read_from_the_cpu_flags(tmp_path: Path) -> None:
    amx = tmp_path / "amx"
    amx.write_text("processor\t: 0\nflags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8\n\n")
    plain = tmp_path / "plain"
    plain.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f\n\n")  # control: no amx_tile flag
    assert cpu_has_amx(str(amx)) and not cpu_has_amx(str(plain))
    assert not cpu_has_amx(str(tmp_path / "missing"))


def _torch_python() -> str | None:
    cand = os.environ.get("ADP_KV_VLLM_PYTHON") or str(ROOT / ".venv-vllm/bin/python")
    return cand if Path(cand).exists() else None


@pytest.mark.parametrize("select", ["no-amx", None])
def test_no_amx_makes_torch_report_no_amx_tiles(select: str | None, tmp_path: Path) -> None:
    """With ``no-amx`` selected, an engine process's torch reports no AMX tiles (what vLLM picks its AMX kernels by);
    without it (the control) torch answers what the hardware says."""
    py = _torch_python()
    if py is None:
        pytest.skip("no interpreter with torch (.venv-vllm)")
    env = {k: v for k, v in os.environ.items() if k != SELECT}
    env["PYTHONPATH"] = PATH
    if select:
        env[SELECT] = select
    code = "import torch.cpu as c; print(c._is_amx_tile_supported(), c.get_capabilities().get('amx_tile', False))"
    r = subprocess.run([py, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    seen, hardware = r.stdout.split()
    assert seen == ("False" if select else hardware)
    assert ("CPU AMX kernels off" in r.stderr) == bool(select)


def test_an_unknown_workaround_stops_the_interpreter_with_one_line(tmp_path: Path) -> None:
    import sys

    env = {**os.environ, "PYTHONPATH": PATH, SELECT: "no-amx,no-amz"}
    r = subprocess.run([sys.executable, "-c", "print('ran')"], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=60)
    assert r.returncode == 2 and "ran" not in r.stdout
    assert r.stderr.strip() == ("ADP_KV_CPU_WORKAROUNDS: unknown workaround 'no-amz' (known: "
                                "mamba2-prefill-checkpoint, no-amx)")
