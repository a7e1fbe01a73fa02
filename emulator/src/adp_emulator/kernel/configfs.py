"""Turn an :class:`NvmetConfig` into the nvmet configfs tree (our equivalent of ``nvmetcli restore``).

The order of operations follows nvmetcli 0.9 ``Root.restore`` (linux-nvme/nvmetcli nvmet/nvme.py):
hosts; then per subsystem: namespaces (``device_*`` attrs, ``ana_grpid``, ``enable``), allowed-host
symlinks, ``attr_*``; then per port: ``addr_*``/``param_*``, subsystem symlinks (which enable the port),
ANA groups, referrals.  One addition nvmetcli cannot express in JSON: ``buffered_io`` is written
before ``enable`` when asked (needed for files on tmpfs, which has no O_DIRECT; drivers/nvme/target/
io-cmd-file.c).  The same plan is executed either directly (host nvmet, tests on a fake tree) or as a
busybox ``sh`` script inside the QEMU guest.
"""

from __future__ import annotations

import contextlib
import os
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from adp_emulator.config import NvmetConfig

NVMET_ROOT = "/sys/kernel/config/nvmet"


@dataclass(frozen=True)
class Op:
    """One configfs operation; ``path`` (and a symlink's ``value``) are relative to the nvmet root."""

    kind: Literal["mkdir", "write", "symlink"]
    path: str
    value: str = ""


def plan(cfg: NvmetConfig, buffered_io: bool | None = None) -> list[Op]:
    """The configfs operations that create ``cfg`` (``adp`` settings are ignored).

    ``buffered_io``: None leaves the kernel default (what nvmetcli does); True/False writes
    ``namespaces/<nsid>/buffered_io`` before ``enable``.
    """
    ops: list[Op] = []
    for h in cfg.hosts:
        ops.append(Op("mkdir", f"hosts/{h}"))
    for s in cfg.subsystems:
        sp = f"subsystems/{s.nqn}"
        ops.append(Op("mkdir", sp))
        for ns in s.namespaces:
            np_ = f"{sp}/namespaces/{ns.nsid}"
            ops.append(Op("mkdir", np_))
            for key, val in ns.to_json()["device"].items():
                ops.append(Op("write", f"{np_}/device_{key}", val))
            if ns.ana_grpid is not None:
                ops.append(Op("write", f"{np_}/ana_grpid", str(ns.ana_grpid)))
            if buffered_io is not None:
                ops.append(Op("write", f"{np_}/buffered_io", "1" if buffered_io else "0"))
            ops.append(Op("write", f"{np_}/enable", "1" if ns.enable else "0"))
        for h in s.allowed_hosts:
            ops.append(Op("symlink", f"{sp}/allowed_hosts/{h}", f"hosts/{h}"))
        for key, val in s.to_json()["attr"].items():
            ops.append(Op("write", f"{sp}/attr_{key}", val))
    for p in cfg.ports:
        pp = f"ports/{p.portid}"
        ops.append(Op("mkdir", pp))
        pj = p.to_json()
        for key, val in pj["addr"].items():
            ops.append(Op("write", f"{pp}/addr_{key}", val))
        for key, val in pj["param"].items():
            ops.append(Op("write", f"{pp}/param_{key}", val))
        for nqn in p.subsystems:
            ops.append(Op("symlink", f"{pp}/subsystems/{nqn}", f"subsystems/{nqn}"))
        for a in p.ana_groups:
            ap = f"{pp}/ana_groups/{int(a['grpid'])}"
            ops.append(Op("mkdir", ap))
            for key, val in a.get("ana", {}).items():
                ops.append(Op("write", f"{ap}/ana_{key}", str(val)))
        for r in p.referrals:
            rp = f"{pp}/referrals/{r['name']}"
            ops.append(Op("mkdir", rp))
            for key, val in r.get("addr", {}).items():
                ops.append(Op("write", f"{rp}/addr_{key}", str(val)))
            if "enable" in r:
                ops.append(Op("write", f"{rp}/enable", str(int(r["enable"]))))
    return ops


def undo_plan(cfg: NvmetConfig, hosts: Iterable[str] | None = None) -> list[Op]:
    """Operations removing exactly the objects of ``cfg`` (reverse order); kinds are rmdir/unlink.

    Returned as ``Op`` with kind ``mkdir`` meaning *rmdir* and ``symlink`` meaning *unlink*; use
    :func:`remove`.  ``hosts`` limits which host entries are removed (default: all of ``cfg.hosts``).
    """
    ops: list[Op] = []
    for p in cfg.ports:
        pp = f"ports/{p.portid}"
        ops += [Op("symlink", f"{pp}/subsystems/{n}") for n in p.subsystems]
        ops += [Op("mkdir", f"{pp}/referrals/{r['name']}") for r in p.referrals]
        ops += [Op("mkdir", f"{pp}/ana_groups/{int(a['grpid'])}") for a in p.ana_groups if int(a["grpid"]) != 1]
        ops.append(Op("mkdir", pp))
    for s in cfg.subsystems:
        sp = f"subsystems/{s.nqn}"
        ops += [Op("symlink", f"{sp}/allowed_hosts/{h}") for h in s.allowed_hosts]
        ops += [Op("mkdir", f"{sp}/namespaces/{ns.nsid}") for ns in s.namespaces]
        ops.append(Op("mkdir", sp))
    ops += [Op("mkdir", f"hosts/{h}") for h in (cfg.hosts if hosts is None else hosts)]
    return ops


def apply(ops: Iterable[Op], root: str | Path = NVMET_ROOT) -> None:
    """Execute ``ops`` against a (real or fake) configfs tree rooted at ``root``.

    Directories that already exist are accepted (nvmetcli's mode 'any'); ``mkdir`` creates missing
    parents only on a fake tree (on configfs the kernel creates the default groups itself).
    """
    root = Path(root)
    for op in ops:
        target = root / op.path
        try:
            if op.kind == "mkdir":
                if not target.is_dir():
                    if not target.parent.is_dir():
                        target.parent.mkdir(parents=True)
                    os.mkdir(target)
            elif op.kind == "write":
                with open(target, "w", encoding="utf-8") as f:
                    f.write(op.value)
            elif op.kind == "symlink":
                if not target.parent.is_dir():
                    target.parent.mkdir(parents=True)
                os.symlink(root / op.value, target)
        except OSError as e:
            raise OSError(e.errno, f"configfs {op.kind} {target} ({op.value!r}): {e.strerror}") from e


def remove(ops: Iterable[Op], root: str | Path = NVMET_ROOT) -> list[str]:
    """Execute an :func:`undo_plan`; missing entries are skipped. Returns error strings (best effort)."""
    root = Path(root)
    errors: list[str] = []
    for op in ops:
        target = root / op.path
        try:
            if op.kind == "symlink":
                if target.is_symlink():
                    target.unlink()
            elif target.is_dir():
                if op.path.count("/") >= 2 and op.path.split("/")[-2] == "namespaces":
                    with contextlib.suppress(OSError), open(target / "enable", "w") as f:
                        f.write("0")
                os.rmdir(target)
        except OSError as e:
            errors.append(f"{op.path}: {e.strerror}")
    return errors


def to_shell(ops: Iterable[Op], root: str = NVMET_ROOT) -> str:
    """A POSIX/busybox ``sh`` fragment performing ``ops``; on failure prints
    ``ADP-GUEST: configfs-error <op> <path>`` and returns 1 from the ``adp_configfs`` function."""
    lines = [
        "adp_configfs() {",
        f"  R={shlex.quote(root)}",
        '  _e() { echo "ADP-GUEST: configfs-error $1 $2"; return 1; }',
        '  _mk() { [ -d "$R/$1" ] || mkdir -p "$R/$1" || _e mkdir "$1"; }',
        "  _w() { printf '%s' \"$2\" > \"$R/$1\" || _e write \"$1\"; }",
        '  _ln() { _d="$R/$1"; mkdir -p "${_d%/*}" && ln -s "$R/$2" "$R/$1" || _e symlink "$1"; }',
    ]
    fn = {"mkdir": "_mk", "write": "_w", "symlink": "_ln"}
    for op in ops:
        args = [shlex.quote(op.path)] + ([shlex.quote(op.value)] if op.kind != "mkdir" else [])
        lines.append(f"  {fn[op.kind]} {' '.join(args)} || return 1")
    lines += ["  return 0", "}"]
    return "\n".join(lines) + "\n"
