"""Where a benchmark ran: GPU model and count, host cores and memory, the kernel (recorded in every results JSON)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import time
from typing import Any


def mem_total_bytes() -> int | None:
    """The host's RAM (MemTotal), None where /proc/meminfo cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def gpus() -> list[str]:
    """The GPU models ``nvidia-smi`` lists (empty on a machine without NVIDIA GPUs)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=name,memory.total", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def host_info() -> dict[str, Any]:
    """GPU models and count, CPU model, usable cores, memory, kernel, UTC date: the ``environment`` of a results JSON.

    The kernel matters for every figure that crosses loopback TCP: a lent GPU host has run both a Linux kernel
    (Firecracker, 6.x) and gVisor's (which reports 4.4.0), whose network stacks differ."""
    g = gpus()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    names = [x.split(",")[0].strip() for x in g]
    summary = (f"{len(names)} x {names[0]}" if len(set(names)) == 1 else ", ".join(names)) if names else None
    return {"host": platform.node(), "machine": platform.machine(), "python": platform.python_version(),
            "gpus": g, "gpu_count": len(g), "gpu": summary, "cpu_model": _cpu_model(), "cpu_cores": usable,
            "mem_total_bytes": mem_total_bytes(), "kernel": platform.release(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
