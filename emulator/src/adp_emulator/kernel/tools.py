"""Errors and host-tool checks for the kernel backend."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

#: Debian package providing each host tool we call.
TOOL_PACKAGES: dict[str, str] = {
    "qemu-system-x86_64": "qemu-system-x86",
    "apt-get": "apt",
    "apt-cache": "apt",
    "dpkg-deb": "dpkg",
    "depmod": "kmod",
}


class KernelBackendError(RuntimeError):
    """The kernel backend cannot do what was asked; the message says why and what to do."""


class MissingDependencyError(KernelBackendError):
    """A host tool or package is missing; the message contains the command that installs it."""


def install_hint(packages: list[str]) -> str:
    """The shell command that installs ``packages`` (what scripts/install-kernel-deps.sh runs)."""
    pkgs = " ".join(sorted(set(packages)))
    sudo = "" if os.geteuid() == 0 else "sudo "
    return f"{sudo}apt-get update && {sudo}apt-get install -y --no-install-recommends {pkgs}"


def require_tools(*tools: str) -> dict[str, str]:
    """Return {tool: absolute path}; raise MissingDependencyError naming the apt-get command otherwise."""
    found: dict[str, str] = {}
    missing: list[str] = []
    for t in tools:
        p = shutil.which(t) or next((str(Path(d, t)) for d in ("/usr/sbin", "/sbin") if Path(d, t).exists()), None)
        if p is None:
            missing.append(t)
        else:
            found[t] = p
    if missing:
        pkgs = [TOOL_PACKAGES.get(t, t) for t in missing]
        raise MissingDependencyError(
            f"kernel backend needs {', '.join(missing)} (Debian package(s) {', '.join(sorted(set(pkgs)))}); "
            f"install with: {install_hint(pkgs)}   (or run scripts/install-kernel-deps.sh)")
    return found


def cache_root() -> Path:
    """``${ADP_KV_CACHE:-~/.cache/adp-kv}`` (:func:`adp_emulator.paths.cache_dir`)."""
    from adp_emulator.paths import cache_dir

    return cache_dir()
