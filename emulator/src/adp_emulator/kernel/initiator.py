"""Run the Linux kernel NVMe/TCP *initiator* in a guest against a target listening on the host.

The guest reaches the host's loopback as 10.0.2.2 (QEMU user networking; nothing leaves the
machine).  It connects by writing an option string to ``/dev/nvme-fabrics`` (the interface nvme-cli
uses, drivers/nvme/host/fabrics.c), writes a pattern with ``dd``, drops caches, reads it back,
compares, disconnects (``delete_controller``) and powers off.  Console markers report each step.
"""

from __future__ import annotations

import random
import re
import shlex
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from adp_emulator.kernel.image import MARKER, GuestImage, build_guest_image
from adp_emulator.kernel.tools import KernelBackendError
from adp_emulator.kernel.vm import QemuVM

HOST_FROM_GUEST = "10.0.2.2"
PATTERN_FILE = "adp/pattern.bin"

_PRELUDE = r"""
adp_fail() { echo "ADP-GUEST: result fail $*"; dmesg | grep -i nvme | tail -n 15; return 1; }
adp_connect() {
  adp_load nvme-tcp || { adp_fail modules; return 1; }
  i=0; while [ ! -c /dev/nvme-fabrics ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
  echo "ADP-GUEST: connecting $ADP_TRADDR:$ADP_TRSVCID $ADP_SUBNQN"
  opts="transport=tcp,traddr=$ADP_TRADDR,trsvcid=$ADP_TRSVCID,nqn=$ADP_SUBNQN,hostnqn=$ADP_HOSTNQN"
  [ -n "$ADP_CONNECT_EXTRA" ] && opts="$opts,$ADP_CONNECT_EXTRA"
  echo "$opts" > /dev/nvme-fabrics || { adp_fail connect; return 1; }
  i=0; while [ ! -b /dev/nvme0n1 ] && [ $i -lt 200 ]; do sleep 0.1; i=$((i+1)); done
  [ -b /dev/nvme0n1 ] || { adp_fail no-namespace; return 1; }
  echo "ADP-GUEST: connected size=$(blockdev --getsize64 /dev/nvme0n1) lbs=$(blockdev --getss /dev/nvme0n1)"
}
adp_disconnect() { for c in /sys/class/nvme/nvme*/delete_controller; do [ -e "$c" ] && echo 1 > "$c"; done; }
"""

_DEFAULT_BODY = r"""
adp_connect || return 1
if [ "$ADP_WRITE" = 1 ]; then
  dd if=/adp/pattern.bin of=/dev/nvme0n1 bs=$ADP_BS seek=$((ADP_OFFSET / ADP_BS)) conv=fsync 2>/tmp/dd.err \
    || { cat /tmp/dd.err; adp_fail write; return 1; }
  echo "ADP-GUEST: wrote $ADP_NBYTES bytes at $ADP_OFFSET"
fi
blockdev --flushbufs /dev/nvme0n1; echo 3 > /proc/sys/vm/drop_caches
dd if=/dev/nvme0n1 of=/tmp/readback.bin bs=$ADP_BS skip=$((ADP_OFFSET / ADP_BS)) count=$((ADP_NBYTES / ADP_BS)) \
  2>/tmp/dd.err || { cat /tmp/dd.err; adp_fail read; return 1; }
echo "ADP-GUEST: readback-sha256 $(sha256sum /tmp/readback.bin | cut -d' ' -f1)"
if cmp -s /adp/pattern.bin /tmp/readback.bin; then r=ok; else r="fail mismatch"; fi
adp_disconnect
echo "ADP-GUEST: result $r"
"""


@dataclass
class GuestResult:
    """Outcome of one guest-initiator run."""

    ok: bool
    console: str
    markers: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    pattern: bytes = b""
    offset: int = 0
    readback_sha256: str | None = None
    accel: str | None = None

    @property
    def failure(self) -> str | None:
        """The ``result fail ...`` reason, if any."""
        for m in self.markers:
            if m.startswith("result fail"):
                return m[len("result fail"):].strip()
        return None


def make_pattern(nbytes: int, seed: int = 0) -> bytes:
    """Deterministic, position-dependent bytes (each 512-byte block starts with its index and seed)."""
    rnd = random.Random(seed)
    out = bytearray(rnd.randbytes(nbytes))
    for off in range(0, nbytes, 512):
        tag = f"ADPKV seed={seed} block={off // 512}\n".encode()
        out[off:off + len(tag)] = tag[: max(0, min(len(tag), nbytes - off))]
    return bytes(out)


def default_hostnqn(tag: str = "adp-kv-guest") -> str:
    """A stable UUID host NQN (nvme-cli's ``nqn.2014-08.org.nvmexpress:uuid:<uuid>`` form)."""
    return f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, tag)}"


def run_guest_initiator(traddr_port: int, subnqn: str, script: str | None = None, timeout: float = 120.0, *,
                        hostnqn: str | None = None, nbytes: int = 1 << 20, offset: int = 0, seed: int = 0,
                        write: bool = True, traddr: str = HOST_FROM_GUEST, connect_extra: str = "",
                        image: GuestImage | None = None, workdir: Path | None = None,
                        accel: str | None = None) -> GuestResult:
    """Boot a guest whose kernel initiator connects to ``traddr:traddr_port`` (default: the host's
    127.0.0.1), writes ``make_pattern(nbytes, seed)`` at byte ``offset`` of /dev/nvme0n1 (unless
    ``write`` is False), reads it back and compares.  ``script`` replaces that default body (it may
    use ``adp_connect``/``adp_disconnect``/``adp_fail`` and the ``ADP_*`` variables, and must print
    ``ADP-GUEST: result ok``).  ``connect_extra`` is appended to the fabrics option string
    (e.g. ``nr_io_queues=1,hdr_digest``).  Never raises for a guest-side failure: see ``ok``."""
    if nbytes <= 0 or nbytes % 512 or offset < 0 or offset % 512:
        raise ValueError(f"nbytes ({nbytes}) and offset ({offset}) must be non-negative multiples of 512")
    if not 1 <= traddr_port <= 65535:
        raise ValueError(f"traddr_port {traddr_port} out of range")
    hostnqn = hostnqn or default_hostnqn()
    for name, v in (("subnqn", subnqn), ("hostnqn", hostnqn), ("connect_extra", connect_extra)):
        if re.search(r"[\s,'\"\\$`]", v.replace(",", "") if name == "connect_extra" else v):
            raise ValueError(f"{name} {v!r} contains characters not allowed in a fabrics option string")
    bs = 4096 if nbytes % 4096 == 0 and offset % 4096 == 0 else 512
    pattern = make_pattern(nbytes, seed)
    env = {"ADP_TRADDR": traddr, "ADP_TRSVCID": str(traddr_port), "ADP_SUBNQN": subnqn, "ADP_HOSTNQN": hostnqn,
           "ADP_NBYTES": str(nbytes), "ADP_OFFSET": str(offset), "ADP_BS": str(bs), "ADP_WRITE": "1" if write else "0",
           "ADP_CONNECT_EXTRA": connect_extra}
    run = "".join(f"{k}={shlex.quote(v)}\n" for k, v in env.items()) + _PRELUDE + (script or _DEFAULT_BODY)
    image = image or build_guest_image()
    t0 = time.monotonic()
    tmp = None
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="adp-kv-initiator-")
        workdir = Path(tmp.name)
    vm = QemuVM(image, workdir, run, files={PATTERN_FILE: pattern}, mem_mb=256 + 3 * nbytes // (1 << 20),
                accel=accel, restrict=False, name="initiator")
    try:
        vm.start()
        try:
            vm.wait_for(rf"{MARKER} (result .*|run-exited.*)\n", timeout)
        except (TimeoutError, KernelBackendError):
            pass
        vm.wait_exit(5.0)
        console = vm.console()
    finally:
        vm.stop(grace=1.0)
        if tmp is not None:
            tmp.cleanup()
    markers = [m.strip() for m in re.findall(rf"{MARKER} (.*)", console)]
    sha = next((m.split()[1] for m in markers if m.startswith("readback-sha256 ")), None)
    return GuestResult(ok="result ok" in markers, console=console, markers=markers,
                       duration_s=round(time.monotonic() - t0, 2), pattern=pattern, offset=offset,
                       readback_sha256=sha, accel=vm.accel)
