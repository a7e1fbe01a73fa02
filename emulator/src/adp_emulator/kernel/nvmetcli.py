"""Fetch Debian's ``nvmetcli`` package (sid only; pure Python) so its restore code can be run.

Used by the tests to check that our configfs writer builds the same tree as ``nvmetcli restore``,
and usable on an nvmet host without nvmetcli installed.  Only the Debian package registry is
contacted, through ``apt-get`` with a private, temporary sources list and state directory.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

from adp_emulator.kernel.tools import KernelBackendError, cache_root, require_tools

SID_SOURCES = """Types: deb
URIs: http://deb.debian.org/debian
Suites: sid
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""
PACKAGE = "nvmetcli"


def fetch_nvmetcli(cache: Path | None = None, timeout: float = 120.0) -> Path:
    """Return a directory containing the ``nvmet`` Python package from Debian's nvmetcli (cached)."""
    dest = (cache or cache_root()) / "nvmetcli"
    pkg_dir = dest / "usr" / "lib" / "python3" / "dist-packages"
    if (pkg_dir / "nvmet" / "nvme.py").is_file():
        return pkg_dir
    tools = require_tools("apt-get", "dpkg-deb")
    with tempfile.TemporaryDirectory(prefix="adp-kv-sid-") as t:
        tmp = Path(t)
        for d in ("parts", "lists/partial", "cache/archives/partial", "dl"):
            (tmp / d).mkdir(parents=True)
        os.chmod(tmp / "dl", 0o777)
        (tmp / "parts" / "sid.sources").write_text(SID_SOURCES)
        opts = ["-o", "Dir::Etc::SourceList=/dev/null", "-o", f"Dir::Etc::SourceParts={tmp / 'parts'}",
                "-o", f"Dir::State::Lists={tmp / 'lists'}", "-o", f"Dir::Cache={tmp / 'cache'}",
                "-o", "Debug::NoLocking=1", "-q"]
        for args, cwd in ((["update"], tmp), (["download", PACKAGE], tmp / "dl")):
            r = subprocess.run([tools["apt-get"], *opts, *args], cwd=cwd, capture_output=True, text=True,
                               timeout=timeout, check=False)
            if r.returncode != 0:
                raise KernelBackendError(f"apt-get {' '.join(args)} (Debian sid) failed: {r.stderr.strip()[-800:]}")
        debs = sorted((tmp / "dl").glob("nvmetcli_*.deb"))
        if not debs:
            raise KernelBackendError("apt-get download nvmetcli produced no .deb")
        dest.mkdir(parents=True, exist_ok=True)
        subprocess.run([tools["dpkg-deb"], "-x", str(debs[-1]), str(dest)], check=True)
        (dest / "PACKAGE").write_text(debs[-1].name + "\n")
    if not (pkg_dir / "nvmet" / "nvme.py").is_file():
        raise KernelBackendError(f"{debs[-1].name} has no nvmet/nvme.py")
    return pkg_dir


def import_nvmet(pkg_dir: Path) -> ModuleType:
    """Import ``nvmet.nvme`` from ``pkg_dir`` (as returned by :func:`fetch_nvmetcli`)."""
    if str(pkg_dir) not in sys.path:
        sys.path.insert(0, str(pkg_dir))
    return importlib.import_module("nvmet.nvme")
