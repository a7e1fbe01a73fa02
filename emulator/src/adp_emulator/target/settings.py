"""Configuration of the userspace NVMe/TCP target."""

from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from adp_wire.constants import DISCOVERY_NQN
from adp_wire.structs import check_nqn

from ..sizes import parse_size

__all__ = ["ADMIN_IN_CAPSULE", "DEFAULT_SUBNQN", "MAX_IN_CAPSULE", "TargetSettings", "parse_size",
           "settings_from_config"]

if TYPE_CHECKING:  # pragma: no cover
    from adp_emulator.config import NvmetConfig

DEFAULT_SUBNQN = "nqn.2026-11.io.awide:adp-kv"
#: In-capsule limit for the admin queue and for Fabrics commands on any queue: the Linux host
#: uses a fixed 8192 bytes there whatever IOCCSZ says (drivers/nvme/host/tcp.c, notes §1.5).
ADMIN_IN_CAPSULE = 8192
#: Largest in-capsule data size offered (IOCCSZ); a larger MDTS sends the rest of a write by R2T.
MAX_IN_CAPSULE = 16 << 20


def check_nqn_format(nqn: str) -> str:
    """An NQN as the spec writes them: ``nqn.`` first, printable ASCII without blanks, at most 223 bytes."""
    check_nqn(nqn)
    if not nqn.startswith("nqn.") or any(c.isspace() for c in nqn):
        raise ValueError(f"not an NQN (nqn.<yyyy-mm>.<reverse domain>:<name>, no blanks): {nqn!r}")
    return nqn


def _fail(name: str, msg: str) -> ValueError:
    return ValueError(f"TargetSettings.{name}: {msg}")


def _int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(name, f"expected an integer, got {value!r}")
    if not lo <= value <= hi:
        raise _fail(name, f"{value} outside [{lo}, {hi}]")
    return value


def _ascii(name: str, value: Any, size: int) -> None:
    if not isinstance(value, str) or not value.isascii() or not value.isprintable() or len(value) > size:
        raise _fail(name, f"must be printable ASCII of at most {size} characters, got {value!r}")


@dataclass
class TargetSettings:
    """Everything the userspace target can be told; :meth:`validate` names the bad field."""

    host: str = "127.0.0.1"
    port: int = 4420  # 0 = pick a free port
    subnqn: str = DEFAULT_SUBNQN
    capacity_bytes: int = 1 << 30
    lba_size: int = 4096
    mdts_bytes: int = 128 * 1024
    max_io_queues: int = 8
    queue_depth: int = 128
    backing_path: str | None = None  # None = RAM
    # A namespace larger than its backing can still take (free space; RAM for a memfd or tmpfs) is refused at start
    # (target/backing.py); True maps it sparse anyway, and writes past the room fail (SIGBUS) or stall the host.
    backing_overcommit: bool = False
    allowed_hosts: list[str] = field(default_factory=list)
    allow_any_host: bool | None = None  # None = any host only on loopback and without allowed_hosts
    # Writes up to this size travel in the command capsule and skip the R2T round trip (nvmet: 16 KiB).
    # None = the MDTS (at most MAX_IN_CAPSULE), so every single-command write up to 16 MiB does.
    in_capsule_bytes: int | None = None
    maxh2cdata: int = 128 * 1024
    require_data_digest: bool = False
    serial: str = ""  # "" = derived from subnqn
    model: str = "ADP KV Emulator"
    firmware: str = "0.1.0"
    keep_alive_default_ms: int = 120_000  # KATO applied when Connect carries 0 (0 = none)
    # Worker processes serving the I/O queues (0 = every queue in the target process); see target/workers.py.
    io_workers: int = 0
    # Reads leave through os.sendfile from the namespace's pages (the kernel references them: no copy in this
    # process); False sends a copy of the mapping's bytes with sendmsg. Data digests and read faults always copy.
    splice_reads: bool = True
    # Open TCP connections served at once; one more is closed as soon as it is accepted.
    max_connections: int = 1024
    # Seconds a new connection has to send ICReq and its Fabrics Connect, else it is closed (0 = no limit).
    handshake_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.in_capsule_bytes is None and isinstance(self.mdts_bytes, int):
            self.in_capsule_bytes = min(self.mdts_bytes, MAX_IN_CAPSULE)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            raise _fail("host", f"must be an IPv4/IPv6 address literal, got {self.host!r}") from None
        _int("port", self.port, 0, 65535)
        try:
            check_nqn_format(self.subnqn)
        except (ValueError, AttributeError) as e:
            raise _fail("subnqn", str(e)) from None
        if self.subnqn == DISCOVERY_NQN:
            raise _fail("subnqn", "must not be the discovery NQN")
        _int("lba_size", self.lba_size, 512, 4096)
        if self.lba_size not in (512, 4096):
            raise _fail("lba_size", f"must be 512 or 4096, got {self.lba_size}")
        _int("capacity_bytes", self.capacity_bytes, self.lba_size, 1 << 48)
        if self.capacity_bytes % self.lba_size:
            raise _fail("capacity_bytes", f"must be a multiple of lba_size {self.lba_size}")
        m = _int("mdts_bytes", self.mdts_bytes, 4096, 4096 << 15)
        if m & (m - 1):
            raise _fail("mdts_bytes", f"must be 4096 * 2^n, got {m}")
        _int("max_io_queues", self.max_io_queues, 1, 65534)
        _int("queue_depth", self.queue_depth, 2, 65536)
        if self.backing_path is not None and (not isinstance(self.backing_path, str) or not self.backing_path):
            raise _fail("backing_path", f"must be None or a non-empty path, got {self.backing_path!r}")
        if not isinstance(self.allowed_hosts, list):
            raise _fail("allowed_hosts", "must be a list of host NQNs")
        for h in self.allowed_hosts:
            try:
                check_nqn_format(h)
            except (ValueError, AttributeError) as e:
                raise _fail("allowed_hosts", str(e)) from None
        if self.allow_any_host not in (None, True, False):
            raise _fail("allow_any_host", f"must be None, True or False, got {self.allow_any_host!r}")
        _int("in_capsule_bytes", self.in_capsule_bytes, 0, MAX_IN_CAPSULE)
        if self.in_capsule_bytes % 16:
            raise _fail("in_capsule_bytes", "must be a multiple of 16 (IOCCSZ units)")
        _int("maxh2cdata", self.maxh2cdata, 4096, 16 << 20)
        if self.maxh2cdata % 4:
            raise _fail("maxh2cdata", "must be a multiple of 4")
        if not isinstance(self.require_data_digest, bool):
            raise _fail("require_data_digest", "must be a bool")
        _ascii("serial", self.serial, 20)
        _ascii("model", self.model, 40)
        _ascii("firmware", self.firmware, 8)
        _int("keep_alive_default_ms", self.keep_alive_default_ms, 0, 0xFFFFFFFF)
        _int("io_workers", self.io_workers, 0, 256)
        if not isinstance(self.splice_reads, bool):
            raise _fail("splice_reads", f"must be a bool, got {self.splice_reads!r}")
        if not isinstance(self.backing_overcommit, bool):
            raise _fail("backing_overcommit", f"must be a bool, got {self.backing_overcommit!r}")
        _int("max_connections", self.max_connections, 1, 1 << 20)
        t = self.handshake_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 3600:
            raise _fail("handshake_timeout_s", f"must be a number of seconds in [0, 3600], got {t!r}")

    # Derived values.
    @property
    def allow_any(self) -> bool:
        """The effective allow-any switch. None means: any host only on a loopback listen address and
        only when no ``allowed_hosts`` are given (an explicit list is always enforced)."""
        if self.allow_any_host is None:
            return not self.allowed_hosts and ipaddress.ip_address(self.host).is_loopback
        return self.allow_any_host

    @property
    def serial_number(self) -> str:
        return self.serial or "adpkv" + hashlib.sha1(self.subnqn.encode()).hexdigest()[:15]

    @property
    def mdts_field(self) -> int:
        """Identify Controller MDTS: log2(mdts_bytes / 4096) (minimum page size 4 KiB)."""
        return (self.mdts_bytes // 4096).bit_length() - 1


def settings_from_config(cfg: NvmetConfig, port_index: int = 0, **overrides: Any) -> TargetSettings:
    """Map an nvmetcli-JSON :class:`~adp_emulator.config.NvmetConfig` onto :class:`TargetSettings`.

    Uses the port ``port_index`` and its first linked subsystem (or the first subsystem); the
    namespace 1 path is the backing file when ``adp.backing == "file"``.
    """
    if not cfg.ports:
        raise ValueError("config: no ports")
    port = cfg.ports[port_index]
    if port.trtype != "tcp":
        raise ValueError(f"config: port {port.portid} trtype {port.trtype!r}, only tcp is served")
    nqn = port.subsystems[0] if port.subsystems else (cfg.subsystems[0].nqn if cfg.subsystems else DEFAULT_SUBNQN)
    sub = next((s for s in cfg.subsystems if s.nqn == nqn), None)
    adp = cfg.adp
    backing: str | None = None
    if adp.backing == "file" and sub is not None:
        paths = [ns.path for ns in sub.namespaces if ns.path]
        if not paths:
            raise ValueError("config: adp.backing is 'file' but the subsystem has no namespace device path")
        backing = paths[0]
    kw: dict[str, Any] = {
        "host": port.traddr,
        "port": int(port.trsvcid),
        "subnqn": nqn,
        "capacity_bytes": adp.capacity_bytes,
        "lba_size": adp.lba_size,
        "mdts_bytes": adp.mdts_bytes,
        "max_io_queues": adp.max_io_queues,
        "queue_depth": adp.queue_depth,
        "backing_path": backing,
        "backing_overcommit": adp.overcommit,
        "allowed_hosts": list(sub.allowed_hosts) if sub else [],
        "allow_any_host": sub.allow_any_host if sub else None,
        "in_capsule_bytes": adp.inline_data_size,
        "keep_alive_default_ms": adp.keep_alive_ms_default,
        "io_workers": adp.io_workers,
    }
    if sub is not None:
        if sub.attrs.get("serial"):
            kw["serial"] = sub.attrs["serial"][:20]
        if sub.attrs.get("model"):
            kw["model"] = sub.attrs["model"][:40]
    kw.update(overrides)
    return TargetSettings(**kw)
