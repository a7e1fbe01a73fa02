"""Build (once) and cache the guest image: a Debian kernel plus a busybox initramfs with nvmet modules.

Everything comes from the distribution's package registry through ``apt-get download``: the
``linux-image-<version>`` package that ``linux-image-amd64`` currently depends on, and
``busybox-static``.  Packages are unpacked with ``dpkg-deb -x`` (no install), ``depmod -b`` writes the
modules.dep the package lacks, and only the modules we need (with their dependencies, in load order)
go into ``base.cpio.gz``.  Result: ``${ADP_KV_CACHE:-~/.cache/adp-kv}/guest/<kernel-version>/``
holding ``vmlinuz``, ``base.cpio.gz`` and ``manifest.json``.  Per-run content (config script,
pattern files) is appended as a second small cpio (see :func:`run_cpio`), the base is never rebuilt.
"""

from __future__ import annotations

import fcntl
import json
import lzma
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from adp_emulator.kernel.cpio import CpioWriter, gzip_cpio
from adp_emulator.kernel.tools import KernelBackendError, MissingDependencyError, cache_root, require_tools

#: Bump when the layout of base.cpio.gz or /init changes, so stale caches are rebuilt.
IMAGE_FORMAT = 3
META_PACKAGE = "linux-image-amd64"
#: Tried in order; Ubuntu's meta package (untested here) splits modules into linux-modules[-extra]-<ver>.
META_PACKAGES = (META_PACKAGE, "linux-image-generic")
BUSYBOX_PACKAGE = "busybox-static"

#: Module groups, loaded by name from the guest scripts (``adp_load <group>``).  Names as in
#: modules.dep with '-' and '_' equivalent; dependencies are added automatically.
MODULE_GROUPS: dict[str, list[str]] = {
    "base": ["virtio_pci", "virtio_net", "configfs", "crc32c_generic"],
    "nvmet": ["nvmet", "nvmet_tcp"],
    "nvme-tcp": ["nvme_core", "nvme_fabrics", "nvme_tcp"],
}

MARKER = "ADP-GUEST:"

_INIT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mkdir -p /proc /sys /dev /tmp /run
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t tmpfs -o mode=1777 tmpfs /tmp
mount -t tmpfs -o mode=755 tmpfs /run
exec </dev/console >/dev/console 2>&1
adp_load() {
  while read -r m; do
    [ -n "$m" ] || continue
    insmod "/lib/modules/$m" 2>/tmp/insmod.err || grep -q "File exists" /tmp/insmod.err || {
      echo "ADP-GUEST: insmod-failed $m: $(cat /tmp/insmod.err)"; return 1; }
  done < "/etc/adp/modules-$1.list"
}
adp_load base || echo "ADP-GUEST: base-modules-failed"
mount -t configfs configfs /sys/kernel/config 2>/dev/null
ip link set lo up
ip link set eth0 up && ip addr add 10.0.2.15/24 dev eth0 && ip route add default via 10.0.2.2 \
  || echo "ADP-GUEST: network-failed"
echo "ADP-GUEST: booted $(uname -r)"
if [ -f /adp/run.sh ]; then
  . /adp/run.sh
  echo "ADP-GUEST: run-exited rc=$?"
else
  echo "ADP-GUEST: no-run-script"
fi
sync
poweroff -f
echo o > /proc/sysrq-trigger
"""


@dataclass(frozen=True)
class GuestImage:
    """A built guest image in the cache."""

    kernel_version: str
    directory: Path
    kernel: Path
    initrd: Path
    package: str
    build_seconds: float

    @classmethod
    def load(cls, directory: Path) -> GuestImage | None:
        """The image in ``directory`` if complete and of the current format, else None."""
        try:
            m = json.loads((directory / "manifest.json").read_text())
        except (OSError, ValueError):
            return None
        if m.get("format") != IMAGE_FORMAT:
            return None
        img = cls(m["kernel_version"], directory, directory / "vmlinuz", directory / "base.cpio.gz",
                  m["package"], float(m.get("build_seconds", 0.0)))
        return img if img.kernel.is_file() and img.initrd.is_file() else None


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    try:
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600, check=False)
    except FileNotFoundError as e:
        raise MissingDependencyError(f"{cmd[0]} not found") from e
    if r.returncode != 0:
        raise KernelBackendError(f"{' '.join(cmd)} failed (exit {r.returncode}): {r.stderr.strip()[-2000:]}")
    return r.stdout


def resolve_kernel_package() -> str:
    """``linux-image-<ver>`` that ``linux-image-amd64`` depends on (``ADP_KV_KERNEL_PACKAGE`` overrides)."""
    env = os.environ.get("ADP_KV_KERNEL_PACKAGE")
    if env:
        return env
    require_tools("apt-cache")
    for meta in META_PACKAGES:
        out = subprocess.run(["apt-cache", "depends", meta], capture_output=True, text=True, check=False).stdout
        m = re.search(r"Depends:\s*(linux-image-(?:unsigned-)?\d\S*)", out)
        if m:
            return m.group(1).replace("linux-image-unsigned-", "linux-image-")
    raise MissingDependencyError(
        f"apt-cache knows none of {', '.join(META_PACKAGES)} (no package lists?); run: apt-get update "
        f"(needs a Debian/Ubuntu sources list), or set ADP_KV_KERNEL_PACKAGE=linux-image-<version>")


def kernel_version_of(package: str) -> str:
    """``linux-image-6.1.0-57-amd64`` -> ``6.1.0-57-amd64``."""
    if not package.startswith("linux-image-"):
        raise ValueError(f"not a kernel image package: {package!r}")
    return package[len("linux-image-"):]


def _norm(name: str) -> str:
    return name.replace("-", "_")


def _module_order(root: Path, kver: str, wanted: list[str]) -> tuple[list[str], list[str]]:
    """(module paths relative to lib/modules/<kver> in load order, built-in names) for ``wanted``."""
    mdir = root / "lib" / "modules" / kver
    deps: dict[str, list[str]] = {}
    by_name: dict[str, str] = {}
    for line in (mdir / "modules.dep").read_text().splitlines():
        if ":" not in line:
            continue
        mod, rest = line.split(":", 1)
        deps[mod] = rest.split()
        base = Path(mod).name
        by_name[_norm(re.sub(r"\.ko(\.\w+)?$", "", base))] = mod
    builtin = {_norm(re.sub(r"\.ko$", "", Path(x).name))
               for x in (mdir / "modules.builtin").read_text().split()}
    order: list[str] = []
    skipped: list[str] = []

    def visit(mod: str) -> None:
        if mod in order:
            return
        for d in reversed(deps.get(mod, [])):  # modules.dep lists deps so that the last loads first
            visit(d)
        order.append(mod)

    for name in wanted:
        n = _norm(name)
        if n in by_name:
            visit(by_name[n])
        elif n in builtin:
            skipped.append(n)
        else:
            raise KernelBackendError(f"kernel {kver} has no module {name!r} (neither loadable nor built in)")
    return order, skipped


def _module_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    if path.suffix == ".xz":
        return lzma.decompress(data)
    if path.suffix == ".gz":
        import gzip
        return gzip.decompress(data)
    if path.suffix == ".zst":
        zstd = require_tools("zstd")["zstd"]
        return subprocess.run([zstd, "-dc", str(path)], capture_output=True, check=True).stdout
    return data


def _extra_module_packages(kver: str) -> list[str]:
    """Ubuntu ships modules in separate packages; return those that exist for ``kver``."""
    out: list[str] = []
    for name in (f"linux-modules-{kver}", f"linux-modules-extra-{kver}"):
        r = subprocess.run(["apt-cache", "show", "--no-all-versions", name], capture_output=True, check=False)
        if r.returncode == 0 and r.stdout.strip():
            out.append(name)
    return out


def build_guest_image(cache: Path | None = None, package: str | None = None, force: bool = False) -> GuestImage:
    """Return the cached guest image, building it first if absent (a few seconds + one download)."""
    package = package or resolve_kernel_package()
    kver = kernel_version_of(package)
    dest = (cache or cache_root()) / "guest" / kver
    if not force:
        img = GuestImage.load(dest)
        if img is not None:
            return img
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time; the others then find the result
        img = None if force else GuestImage.load(dest)
        return img or _build(dest, package, kver)


def _build(dest: Path, package: str, kver: str) -> GuestImage:
    tools = require_tools("apt-get", "dpkg-deb", "depmod")
    t0 = time.monotonic()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="adp-kv-img-", dir=dest.parent) as tmp_s:
        tmp = Path(tmp_s)
        dl = tmp / "deb"
        dl.mkdir()
        os.chmod(tmp, 0o755)
        os.chmod(dl, 0o777)  # lets apt's sandbox user write there when we run as root
        try:
            _run([tools["apt-get"], "download", "-q", package, *_extra_module_packages(kver), BUSYBOX_PACKAGE],
                 cwd=dl)
        except KernelBackendError as e:
            raise MissingDependencyError(
                f"could not download {package} / {BUSYBOX_PACKAGE} with apt-get download "
                f"(try: apt-get update; or set ADP_KV_KERNEL_PACKAGE): {e}") from e
        root = tmp / "root"
        for deb in sorted(dl.glob("*.deb")):
            _run([tools["dpkg-deb"], "-x", str(deb), str(root)])
        vmlinuz = root / "boot" / f"vmlinuz-{kver}"
        busybox = root / "bin" / "busybox"
        if not vmlinuz.is_file() or not busybox.is_file():
            raise KernelBackendError(f"unpacked packages lack {vmlinuz.name} or bin/busybox")
        _run([tools["depmod"], "-b", str(root), kver])
        w = CpioWriter()
        for d in ("bin", "dev", "proc", "sys", "tmp", "run", "etc/adp", "adp", f"lib/modules/{kver}"):
            w.add_dir(d)
        w.add_file("bin/busybox", busybox.read_bytes(), 0o755)
        w.add_file("init", _INIT.encode(), 0o755)
        mdir = root / "lib" / "modules" / kver
        added: set[str] = set()
        manifest_groups: dict[str, list[str]] = {}
        for group, names in MODULE_GROUPS.items():
            order, _builtin = _module_order(root, kver, names)
            rels: list[str] = []
            for mod in order:
                rel = re.sub(r"\.(xz|zst|gz)$", "", mod)
                if rel not in added:
                    w.add_file(f"lib/modules/{kver}/{rel}", _module_bytes(mdir / mod))
                    added.add(rel)
                rels.append(f"{kver}/{rel}")
            manifest_groups[group] = rels
            w.add_file(f"etc/adp/modules-{group}.list", ("\n".join(rels) + "\n").encode())
        staging = tmp / "out"
        staging.mkdir()
        (staging / "base.cpio.gz").write_bytes(gzip_cpio(w))
        shutil.copyfile(vmlinuz, staging / "vmlinuz")
        secs = time.monotonic() - t0
        (staging / "manifest.json").write_text(json.dumps({
            "format": IMAGE_FORMAT, "kernel_version": kver, "package": package,
            "debs": sorted(p.name for p in dl.glob("*.deb")), "modules": manifest_groups,
            "build_seconds": round(secs, 2), "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }, indent=2))
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(staging, dest)
    img = GuestImage.load(dest)
    if img is None:
        raise KernelBackendError(f"image build in {dest} did not produce a complete image")
    return img


def run_cpio(files: dict[str, bytes], run_script: str) -> bytes:
    """The small per-run archive appended to ``base.cpio.gz``: ``/adp/run.sh`` plus extra files."""
    w = CpioWriter()
    w.add_dir("adp")
    for name, data in files.items():
        w.add_file(name, data)
    w.add_file("adp/run.sh", run_script.encode(), 0o755)
    return gzip_cpio(w, level=1)
