"""The kernel-nvmet backend: host nvmet when the host kernel has it, else a QEMU guest running nvmet."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Literal

from adp_emulator.config import MiB, NvmetConfig
from adp_emulator.kernel import configfs
from adp_emulator.kernel.image import MARKER, GuestImage, build_guest_image
from adp_emulator.kernel.probe import wait_icresp
from adp_emulator.kernel.tools import KernelBackendError
from adp_emulator.kernel.vm import QemuVM, free_port, kill_pid, pid_alive

#: Default namespace size inside the guest (tmpfs file, guest RAM); capped so a 1 GiB
#: ``adp.capacity_bytes`` does not need a multi-GiB guest under TCG.
GUEST_CAPACITY_DEFAULT = 256 * MiB
GUEST_NS_DIR = "/run/adp"
STATE_FILE = "kernel-target.json"
READY = f"{MARKER} target-ready"

Mode = Literal["auto", "host", "vm"]


def host_nvmet_status() -> tuple[bool, str]:
    """Whether this host kernel can serve nvmet directly (root, configfs, nvmet loadable), and why not."""
    if os.geteuid() != 0:
        return False, "not root"
    if not Path("/sys/kernel/config").is_dir():
        return False, "configfs is not available (/sys/kernel/config missing)"
    if not Path(configfs.NVMET_ROOT).is_dir():
        modprobe = shutil.which("modprobe")
        if modprobe:
            for mod in ("nvmet", "nvmet-tcp"):
                subprocess.run([modprobe, mod], capture_output=True, check=False)
        if not Path(configfs.NVMET_ROOT).is_dir():
            return False, "nvmet module not loadable (no /sys/kernel/config/nvmet after modprobe nvmet)"
    return True, "host kernel has nvmet"


def guest_config(cfg: NvmetConfig) -> NvmetConfig:
    """``cfg`` as the guest applies it: every port listens on 0.0.0.0 and every namespace is a
    tmpfs file ``/run/adp/s<subsystem-index>-ns<nsid>.img`` (host paths mean nothing in the guest)."""
    g = copy.deepcopy(cfg)
    for p in g.ports:
        if p.trtype != "tcp":
            raise KernelBackendError(f"port {p.portid}: only trtype tcp can be forwarded out of the guest")
        p.traddr = "0.0.0.0" if p.adrfam == "ipv4" else "::"
    for i, s in enumerate(g.subsystems):
        for ns in s.namespaces:
            ns.path = f"{GUEST_NS_DIR}/s{i}-ns{ns.nsid}.img"
    return g


def guest_target_script(cfg: NvmetConfig, capacity_bytes: int) -> str:
    """The guest's ``/adp/run.sh``: load nvmet, create namespace files, write configfs, report, idle."""
    files = [ns.path for s in cfg.subsystems for ns in s.namespaces]
    lines = [
        "adp_load nvmet || { echo 'ADP-GUEST: target-failed modules'; return 1; }",
        f"mkdir -p {GUEST_NS_DIR}",
        *[f"truncate -s {capacity_bytes} {f}" for f in files],
        configfs.to_shell(configfs.plan(cfg, buffered_io=True)),
        "if adp_configfs; then",
        f"  echo '{READY}'",
        "else",
        "  echo 'ADP-GUEST: target-failed configfs'; dmesg | tail -n 20",
        "fi",
        "while :; do sleep 3600; done",
    ]
    return "\n".join(lines) + "\n"


class KernelTarget:
    """Run ``config`` on the Linux kernel NVMe target: host nvmet if available, else a QEMU guest.

    ``host_port``: host TCP port forwarded to the first port's trsvcid (VM mode). None = the
    config's trsvcid, 0 = pick a free one.  Other ports of the config get free host ports.
    State is kept in ``workdir/kernel-target.json`` so :meth:`from_workdir` can stop it later.
    """

    def __init__(self, config: NvmetConfig, workdir: Path, *, mode: Mode = "auto", host_port: int | None = None,
                 image: GuestImage | None = None, guest_capacity_bytes: int | None = None,
                 accel: str | None = None) -> None:
        config.validate()
        if not config.ports or not config.subsystems:
            raise ValueError("config: the kernel backend needs at least one port and one subsystem")
        self.config = config
        self.workdir = Path(workdir)
        self.mode = mode
        self.host_port = host_port
        self.image = image
        self.guest_capacity_bytes = guest_capacity_bytes or min(config.adp.capacity_bytes, GUEST_CAPACITY_DEFAULT)
        self.accel = accel
        self.vm: QemuVM | None = None
        self.info: dict[str, Any] = {}

    # -- state ---------------------------------------------------------------------------------
    @property
    def state_path(self) -> Path:
        """Where start() records what it did."""
        return self.workdir / STATE_FILE

    @classmethod
    def from_workdir(cls, workdir: Path) -> KernelTarget:
        """Re-attach to a target started by another process (for ``testbed down``/``status``)."""
        state = json.loads((Path(workdir) / STATE_FILE).read_text())
        t = cls(NvmetConfig.from_json(state["config"]), Path(workdir), mode=state["hosted"])
        t.info = state
        return t

    def _save(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.state_path.write_text(json.dumps({**self.info, "config": self.config.to_json()}, indent=2))

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> dict[str, Any]:
        """Bring the target up and wait until it answers an ICReq. Returns traddr, trsvcid, subnqn,
        hosted ("vm"/"host"), pid, plus details (accel, ports, timings)."""
        if self.is_running():
            return self.info
        mode = self.mode
        if mode == "auto":
            ok, _why = host_nvmet_status()
            mode = "host" if ok else "vm"
        t0 = time.monotonic()
        if mode == "host":
            self.info = self._start_host(timeout)
        else:
            self.info = self._start_vm(timeout)
        self.info["startup_s"] = round(time.monotonic() - t0, 2)
        self._save()
        return self.info

    def _start_vm(self, timeout: float) -> dict[str, Any]:
        t0 = time.monotonic()
        image = self.image or build_guest_image()
        self.image = image
        gcfg = guest_config(self.config)
        fwd: dict[int, int] = {}
        ports: dict[str, int] = {}
        for i, p in enumerate(self.config.ports):
            hp = self.host_port if i == 0 and self.host_port is not None else (int(p.trsvcid) if i == 0 else 0)
            hp = hp or free_port()
            fwd[hp] = int(p.trsvcid)
            ports[str(p.portid)] = hp
        mem = 384 + self.guest_capacity_bytes * len([n for s in gcfg.subsystems for n in s.namespaces]) // MiB
        self.vm = QemuVM(image, self.workdir, guest_target_script(gcfg, self.guest_capacity_bytes),
                         hostfwd=fwd, mem_mb=mem, accel=self.accel, restrict=True, name="nvmet")
        image_s = time.monotonic() - t0
        self.vm.start()
        try:
            self.vm.wait_for(rf"{MARKER} (target-ready|target-failed.*|run-exited.*)",
                             max(1.0, timeout - (time.monotonic() - t0)))
            if READY not in self.vm.console():
                raise KernelBackendError(f"guest failed to configure nvmet: {self.vm.console()[-3000:]}")
            ready_s = time.monotonic() - self.vm.started_at
            first = next(iter(fwd))
            icresp = wait_icresp("127.0.0.1", first, max(1.0, timeout - (time.monotonic() - t0)))
        except BaseException:
            self.vm.stop()
            raise
        p0 = self.config.ports[0]
        return {
            "traddr": "127.0.0.1", "trsvcid": str(first), "subnqn": p0.subsystems[0] if p0.subsystems else
            self.config.subsystems[0].nqn, "hosted": "vm", "pid": self.vm.pid, "accel": self.vm.accel,
            "ports": ports, "kernel_version": image.kernel_version, "icresp": icresp,
            "image_s": round(image_s, 2), "boot_to_marker_s": round(ready_s, 2),
            "boot_to_icresp_s": round(time.monotonic() - self.vm.started_at, 2),
            "guest_capacity_bytes": self.guest_capacity_bytes, "console": str(self.vm.console_path),
        }

    def _start_host(self, timeout: float) -> dict[str, Any]:
        """Apply the config to the host's nvmet (nvmetcli restore when configfs is empty, else our
        additive writer). RAM namespaces get a sparse file in ``workdir``."""
        ok, why = host_nvmet_status()
        if not ok:
            raise KernelBackendError(f"host nvmet unavailable: {why}")
        cfg = copy.deepcopy(self.config)
        created: list[str] = []
        for i, s in enumerate(cfg.subsystems):
            for ns in s.namespaces:
                if not ns.path:
                    ns.path = str(self.workdir / f"s{i}-ns{ns.nsid}.img")
                if not Path(ns.path).exists():
                    Path(ns.path).parent.mkdir(parents=True, exist_ok=True)
                    with open(ns.path, "wb") as f:
                        f.truncate(cfg.adp.capacity_bytes)
                    created.append(ns.path)
        root = Path(configfs.NVMET_ROOT)
        existing_hosts = set(os.listdir(root / "hosts")) if (root / "hosts").is_dir() else set()
        empty = not any((root / d).is_dir() and os.listdir(root / d) for d in ("subsystems", "ports"))
        nvmetcli = shutil.which("nvmetcli")
        tool = "writer"
        our_hosts = [h for h in cfg.hosts if h not in existing_hosts]
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            if nvmetcli and empty:
                cfg_file = self.workdir / "nvmetcli-restore.json"
                cfg_file.write_text(json.dumps(cfg.nvmetcli_json(), indent=2))
                r = subprocess.run([nvmetcli, "restore", str(cfg_file)], capture_output=True, text=True,
                                   check=False)
                if r.returncode != 0:
                    raise KernelBackendError(f"nvmetcli restore failed: {r.stderr.strip()}")
                tool = "nvmetcli"
            else:
                try:
                    configfs.apply(configfs.plan(cfg), root)
                except OSError as e:
                    raise KernelBackendError(f"configuring host nvmet failed: {e}") from e
            p0 = cfg.ports[0]
            icresp = wait_icresp(p0.traddr if p0.traddr not in ("0.0.0.0", "::") else "127.0.0.1",
                                 int(p0.trsvcid), timeout)
        except BaseException:
            configfs.remove(configfs.undo_plan(cfg, our_hosts), root)
            for f in created:
                Path(f).unlink(missing_ok=True)
            raise
        self.config = cfg
        return {"traddr": p0.traddr, "trsvcid": p0.trsvcid, "subnqn": p0.subsystems[0] if p0.subsystems else
                cfg.subsystems[0].nqn, "hosted": "host", "pid": None, "tool": tool, "icresp": icresp,
                "created_files": created, "created_hosts": our_hosts}

    def stop(self) -> None:
        """Undo start(): kill the guest, or remove exactly our objects from host configfs."""
        hosted = self.info.get("hosted")
        if hosted == "host":
            errors = configfs.remove(configfs.undo_plan(self.config, self.info.get("created_hosts", [])),
                                     configfs.NVMET_ROOT)
            for f in self.info.get("created_files", []):
                Path(f).unlink(missing_ok=True)
            if errors:
                raise KernelBackendError(f"host nvmet cleanup incomplete: {errors}")
        elif self.vm is not None:
            self.vm.stop()
        elif self.info.get("pid"):
            kill_pid(int(self.info["pid"]))
        self.info = {**self.info, "stopped": True}
        if self.state_path.exists():
            self.state_path.unlink()

    def is_running(self) -> bool:
        """True while the guest runs (VM) or our subsystem exists in configfs (host)."""
        if not self.info or self.info.get("stopped"):
            return False
        if self.info.get("hosted") == "host":
            return Path(configfs.NVMET_ROOT, "subsystems", self.config.subsystems[0].nqn).is_dir()
        if self.vm is not None:
            return self.vm.running()
        pid = self.info.get("pid")
        return bool(pid) and pid_alive(int(pid))

    def console(self) -> str:
        """The guest's serial console so far ("" in host mode)."""
        return self.vm.console() if self.vm else ""

    def __enter__(self) -> KernelTarget:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
