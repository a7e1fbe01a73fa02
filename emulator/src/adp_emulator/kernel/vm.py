"""Launch the guest image under QEMU (KVM when a probe shows it works, else TCG) and watch its console."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

from adp_emulator.kernel.image import MARKER, GuestImage, run_cpio
from adp_emulator.kernel.tools import KernelBackendError, cache_root, require_tools

QEMU = "qemu-system-x86_64"
#: ``quiet`` keeps the serial console (slow under TCG) almost silent; scripts print ADP-GUEST markers.
KERNEL_CMDLINE = "console=ttyS0 panic=-1 quiet"
KVM_PROBE_TIMEOUT = 8.0


def free_port() -> int:
    """An unused TCP port on 127.0.0.1 (racy by nature; QEMU fails loudly if it is taken meanwhile)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class QemuVM:
    """One QEMU process booting ``image`` with ``run_script`` as ``/adp/run.sh``.

    ``hostfwd`` maps host ports (bound on 127.0.0.1 only) to guest TCP ports.  ``restrict`` isolates
    the guest from the host and the outside (hostfwd still works); an initiator guest needs it off to
    reach the host's loopback as 10.0.2.2 (QEMU user networking; nothing leaves the machine).
    """

    def __init__(self, image: GuestImage, workdir: Path, run_script: str, files: dict[str, bytes] | None = None,
                 hostfwd: dict[int, int] | None = None, mem_mb: int = 768, accel: str | None = None,
                 restrict: bool = True, name: str = "guest") -> None:
        self.image = image
        self.workdir = Path(workdir)
        self.run_script = run_script
        self.files = files or {}
        self.hostfwd = hostfwd or {}
        self.mem_mb = mem_mb
        self.accel = accel
        self.restrict = restrict
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None
        self.console_path = self.workdir / f"{name}-console.log"
        self.started_at = 0.0

    def command(self, accel: str) -> list[str]:
        """The QEMU command line (initrd = cached base + per-run cpio, concatenated)."""
        net = "user,id=n0" + (",restrict=on" if self.restrict else "")
        for hp, gp in self.hostfwd.items():
            net += f",hostfwd=tcp:127.0.0.1:{hp}-:{gp}"
        cmd = [QEMU, "-accel", accel, "-m", str(self.mem_mb), "-smp", "1", "-nodefaults", "-no-user-config",
               "-display", "none", "-no-reboot", "-kernel", str(self.image.kernel),
               "-initrd", str(self.workdir / f"{self.name}-initrd.gz"), "-append", KERNEL_CMDLINE,
               "-chardev", f"file,id=con,path={self.console_path}", "-serial", "chardev:con",
               "-netdev", net, "-device", "virtio-net-pci,netdev=n0"]
        if accel == "kvm":
            cmd[3:3] = ["-cpu", "host"]
        return cmd

    def start(self) -> None:
        """Write the initrd and spawn QEMU (returns immediately)."""
        qemu = require_tools(QEMU)[QEMU]
        self.workdir.mkdir(parents=True, exist_ok=True)
        accel = self.accel or choose_accel(self.image)
        self.accel = accel
        initrd = self.workdir / f"{self.name}-initrd.gz"
        initrd.write_bytes(self.image.initrd.read_bytes() + run_cpio(self.files, self.run_script))
        self.console_path.write_bytes(b"")
        cmd = self.command(accel)
        cmd[0] = qemu
        log = open(self.workdir / f"{self.name}-qemu.log", "wb")  # noqa: SIM115 - handed to the child
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()

    @property
    def pid(self) -> int | None:
        """QEMU's pid (None before start)."""
        return self.proc.pid if self.proc else None

    def console(self) -> str:
        """Everything the guest printed on its serial console so far."""
        try:
            return self.console_path.read_text(errors="replace")
        except OSError:
            return ""

    def qemu_log(self) -> str:
        """QEMU's own stdout/stderr."""
        try:
            return (self.workdir / f"{self.name}-qemu.log").read_text(errors="replace")
        except OSError:
            return ""

    def running(self) -> bool:
        """True while the QEMU process is alive."""
        return self.proc is not None and self.proc.poll() is None

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        """Wait until ``pattern`` (regex) appears on the console; error if QEMU dies or time runs out."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            m = rx.search(self.console())
            if m:
                return m
            if not self.running():
                raise KernelBackendError(
                    f"QEMU exited (rc={self.proc.returncode if self.proc else None}) before {pattern!r}; "
                    f"qemu: {self.qemu_log()[-1500:]!r}; console tail: {self.console()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {pattern!r} on the guest console within {timeout:.0f}s "
                                   f"(accel={self.accel}); console tail: {self.console()[-3000:]}")
            time.sleep(0.05)

    def wait_exit(self, timeout: float) -> int | None:
        """Wait for QEMU to exit (guest poweroff); returns its exit code, None on timeout."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace: float = 3.0) -> None:
        """Terminate QEMU (SIGTERM, then SIGKILL after ``grace`` seconds)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def kill_pid(pid: int, grace: float = 3.0) -> None:
    """Stop a QEMU we started in another process (pid from the state file), only if it is QEMU."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return
    if b"qemu-system" not in cmdline:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if pid_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _kvm_usable_device() -> bool:
    return os.path.exists("/dev/kvm") and os.access("/dev/kvm", os.R_OK | os.W_OK)


def probe_kvm(image: GuestImage, timeout: float = KVM_PROBE_TIMEOUT) -> bool:
    """Boot the image under KVM with a script that only prints a marker; True if it arrives in time.

    Needed because /dev/kvm can exist while nested guests hang (seen on our dev machines).
    """
    if not _kvm_usable_device():
        return False
    import tempfile
    with tempfile.TemporaryDirectory(prefix="adp-kv-kvmprobe-") as d:
        vm = QemuVM(image, Path(d), f'echo "{MARKER} probe-ok"\n', accel="kvm", mem_mb=256, name="probe")
        vm.start()
        try:
            vm.wait_for(re.escape(f"{MARKER} probe-ok"), timeout)
            return True
        except (TimeoutError, KernelBackendError):
            return False
        finally:
            vm.stop(grace=1.0)


def choose_accel(image: GuestImage) -> str:
    """``ADP_KV_ACCEL`` (kvm|tcg) if set, else the cached result of :func:`probe_kvm` ("kvm"/"tcg")."""
    env = os.environ.get("ADP_KV_ACCEL", "").strip().lower()
    if env in ("kvm", "tcg"):
        return env
    if env:
        raise KernelBackendError(f"ADP_KV_ACCEL must be 'kvm' or 'tcg', got {env!r}")
    if not _kvm_usable_device():
        return "tcg"
    stamp = cache_root() / "kvm-probe.json"
    key = f"{os.uname().release}|{image.kernel_version}"
    try:
        cached = json.loads(stamp.read_text())
        if cached.get("key") == key:
            return "kvm" if cached["kvm"] else "tcg"
    except (OSError, ValueError, KeyError):
        pass
    ok = probe_kvm(image)
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps({"key": key, "kvm": ok, "probed_at": time.time()}))
    return "kvm" if ok else "tcg"
