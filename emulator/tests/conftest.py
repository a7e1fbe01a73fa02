"""Shared fixtures for the emulator tests."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def require_qemu() -> str:
    """qemu-system-x86_64's path; skip without it, except under CI where a missing QEMU fails."""
    path = shutil.which("qemu-system-x86_64")
    if path is None:
        msg = ("qemu-system-x86_64 not found; install with scripts/install-kernel-deps.sh "
               "(apt-get install -y --no-install-recommends qemu-system-x86 kmod)")
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(msg)
        pytest.skip(msg)
    return path


@pytest.fixture(scope="session")
def guest_image(require_qemu: str):
    """The cached guest image (built on first use: one apt-get download, ~5 s)."""
    from adp_emulator.kernel.image import build_guest_image

    return build_guest_image()


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A scratch directory for one test."""
    return tmp_path
