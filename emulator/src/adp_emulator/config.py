"""The one target configuration format for every backend: nvmetcli's JSON plus an ``"adp"`` section.

The non-``adp`` part is exactly what ``nvmetcli restore`` accepts (layout from linux-nvme/nvmetcli
``nvmet/nvme.py`` ``Root.restore`` / ``*.setup`` and its ``examples/tcp.json``)::

    {"hosts": [{"nqn": ...}],
     "ports": [{"portid": 1, "addr": {"adrfam", "traddr", "treq", "trsvcid", "trtype"},
                "param": {...}, "subsystems": [nqn, ...], "referrals": [], "ana_groups": [...]}],
     "subsystems": [{"nqn": ..., "attr": {"allow_any_host": "1", ...}, "allowed_hosts": [nqn, ...],
                     "namespaces": [{"nsid": 1, "enable": 1, "device": {"path", "nguid", "uuid"}}]}],
     "adp": {...userspace-only knobs, stripped before the JSON reaches nvmetcli or configfs...}}

Each JSON group maps to configfs files named ``<group>_<key>`` (e.g. ``attr_allow_any_host``,
``addr_trsvcid``, ``device_path``), see :mod:`adp_emulator.kernel.configfs`.
"""

from __future__ import annotations

import ipaddress
import json
import re
import uuid as uuid_mod
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

DEFAULT_NQN = "nqn.2026-11.io.awide:adp-kv"
DEFAULT_PORT = 4420
#: NVMF_NQN_SIZE in include/linux/nvme.h: 223 bytes excluding the terminating NUL.
NQN_MAX_BYTES = 223
#: nvmetcli Namespace.MAX_NSID (nvmet/nvme.py); the kernel accepts more, nvmetcli does not.
MAX_NSID = 8192

# Accepted configfs strings (drivers/nvme/target/configfs.c).
TRTYPES = ("tcp", "rdma", "fc", "loop", "pci")
ADRFAMS = ("ipv4", "ipv6", "ib", "fc", "loop", "pci")
TREQS = ("not specified", "required", "not required")

_UUID_RE = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")


def _fail(where: str, msg: str) -> ValueError:
    return ValueError(f"config: {where}: {msg}")


def _check_nqn(where: str, nqn: Any) -> str:
    if not isinstance(nqn, str) or not nqn:
        raise _fail(where, f"NQN must be a non-empty string, got {nqn!r}")
    if len(nqn.encode()) > NQN_MAX_BYTES:
        raise _fail(where, f"NQN is {len(nqn.encode())} bytes, at most {NQN_MAX_BYTES} allowed")
    if "/" in nqn or any(ord(c) < 0x20 for c in nqn):
        raise _fail(where, f"NQN {nqn!r} contains '/' or a control character (it becomes a directory name)")
    return nqn


def _as_int(where: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool):
        raise _fail(where, f"expected an integer, got {value!r}")
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
        value = int(value)
    if not isinstance(value, int):
        raise _fail(where, f"expected an integer, got {value!r}")
    if not lo <= value <= hi:
        raise _fail(where, f"{value} is out of range [{lo}, {hi}]")
    return value


def _as_bool(where: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("0", "1", "true", "false", "y", "n"):
        return value.strip().lower() in ("1", "true", "y")
    raise _fail(where, f"expected a boolean (true/false, 0/1, \"0\"/\"1\"), got {value!r}")


def _as_str_dict(where: str, value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise _fail(where, f"expected an object, got {type(value).__name__}")
    out: dict[str, str] = {}
    for k, v in value.items():
        if not isinstance(k, str) or not re.fullmatch(r"[A-Za-z0-9_]+", k):
            raise _fail(where, f"bad attribute name {k!r}")
        if isinstance(v, bool):
            v = int(v)
        if not isinstance(v, (str, int)):
            raise _fail(f"{where}.{k}", f"expected a string or integer, got {v!r}")
        out[k] = str(v)
    return out


def _as_list(where: str, value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise _fail(where, f"expected a list, got {type(value).__name__}")
    return value


def _check_keys(where: str, obj: Any, allowed: set[str], required: set[str] = frozenset()) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise _fail(where, f"expected an object, got {type(obj).__name__}")
    unknown = set(obj) - allowed
    if unknown:
        raise _fail(where, f"unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    missing = required - set(obj)
    if missing:
        raise _fail(where, f"missing required key(s) {sorted(missing)}")
    return obj


@dataclass
class Namespace:
    """One namespace of a subsystem (configfs ``subsystems/<nqn>/namespaces/<nsid>``)."""

    nsid: int
    path: str = ""
    enable: bool = True
    uuid: str | None = None
    nguid: str | None = None
    ana_grpid: int | None = None

    def validate(self, where: str = "namespace") -> None:
        """Raise ValueError if a field is invalid."""
        _as_int(f"{where}.nsid", self.nsid, 1, MAX_NSID)
        if not isinstance(self.path, str):
            raise _fail(f"{where}.device.path", f"expected a string, got {self.path!r}")
        for name in ("uuid", "nguid"):
            val = getattr(self, name)
            if val is not None and not _UUID_RE.match(val):
                raise _fail(f"{where}.device.{name}", f"{val!r} is not of the form 8-4-4-4-12 hex digits")
        if self.ana_grpid is not None:
            _as_int(f"{where}.ana_grpid", self.ana_grpid, 1, 1024)

    def to_json(self) -> dict[str, Any]:
        """nvmetcli JSON for this namespace."""
        device: dict[str, str] = {"path": self.path}
        if self.nguid is not None:
            device["nguid"] = self.nguid
        if self.uuid is not None:
            device["uuid"] = self.uuid
        d: dict[str, Any] = {"nsid": self.nsid, "enable": int(self.enable), "device": device}
        if self.ana_grpid is not None:
            d["ana_grpid"] = self.ana_grpid
        return d

    @classmethod
    def from_json(cls, d: Any, where: str = "namespace") -> Namespace:
        """Parse one nvmetcli namespace object."""
        _check_keys(where, d, {"nsid", "enable", "device", "ana_grpid", "ana", "resv"}, {"nsid"})
        device = _check_keys(f"{where}.device", d.get("device", {}), {"path", "nguid", "uuid"})
        for k, v in device.items():
            if not isinstance(v, str):
                raise _fail(f"{where}.device.{k}", f"expected a string, got {v!r}")
        ns = cls(
            nsid=_as_int(f"{where}.nsid", d["nsid"], 1, MAX_NSID),
            path=device.get("path", ""),
            enable=_as_bool(f"{where}.enable", d.get("enable", True)),
            uuid=device.get("uuid"),
            nguid=device.get("nguid"),
            ana_grpid=(_as_int(f"{where}.ana_grpid", d["ana_grpid"], 1, 1024) if "ana_grpid" in d else None),
        )
        ns.validate(where)
        return ns


@dataclass
class Subsystem:
    """An NVM subsystem; ``attrs`` holds the other ``attr_*`` files (serial, model, version, ...)."""

    nqn: str
    allow_any_host: bool = True
    allowed_hosts: list[str] = field(default_factory=list)
    namespaces: list[Namespace] = field(default_factory=list)
    attrs: dict[str, str] = field(default_factory=dict)

    def validate(self, where: str = "subsystem") -> None:
        """Raise ValueError if a field is invalid."""
        _check_nqn(f"{where}.nqn", self.nqn)
        if "allow_any_host" in self.attrs:
            raise _fail(f"{where}.attrs", "allow_any_host belongs in Subsystem.allow_any_host, not attrs")
        _as_str_dict(f"{where}.attr", self.attrs)
        for i, h in enumerate(self.allowed_hosts):
            _check_nqn(f"{where}.allowed_hosts[{i}]", h)
        seen: set[int] = set()
        for i, ns in enumerate(self.namespaces):
            ns.validate(f"{where}.namespaces[{i}]")
            if ns.nsid in seen:
                raise _fail(f"{where}.namespaces[{i}].nsid", f"duplicate nsid {ns.nsid}")
            seen.add(ns.nsid)

    def to_json(self) -> dict[str, Any]:
        """nvmetcli JSON for this subsystem."""
        attr = {"allow_any_host": "1" if self.allow_any_host else "0", **self.attrs}
        return {
            "nqn": self.nqn,
            "attr": attr,
            "allowed_hosts": list(self.allowed_hosts),
            "namespaces": [ns.to_json() for ns in self.namespaces],
        }

    @classmethod
    def from_json(cls, d: Any, where: str = "subsystem") -> Subsystem:
        """Parse one nvmetcli subsystem object."""
        _check_keys(where, d, {"nqn", "attr", "allowed_hosts", "namespaces"}, {"nqn"})
        attrs = _as_str_dict(f"{where}.attr", d.get("attr", {}))
        allow_any = _as_bool(f"{where}.attr.allow_any_host", attrs.pop("allow_any_host", "0"))
        hosts = _as_list(f"{where}.allowed_hosts", d.get("allowed_hosts", []))
        nss = _as_list(f"{where}.namespaces", d.get("namespaces", []))
        sub = cls(
            nqn=_check_nqn(f"{where}.nqn", d["nqn"]),
            allow_any_host=allow_any,
            allowed_hosts=[_check_nqn(f"{where}.allowed_hosts[{i}]", h) for i, h in enumerate(hosts)],
            namespaces=[Namespace.from_json(n, f"{where}.namespaces[{i}]") for i, n in enumerate(nss)],
            attrs=attrs,
        )
        sub.validate(where)
        return sub


@dataclass
class Port:
    """A transport port (configfs ``ports/<portid>``) and the subsystems exported through it."""

    portid: int
    trtype: str = "tcp"
    adrfam: str = "ipv4"
    traddr: str = "127.0.0.1"
    trsvcid: str = str(DEFAULT_PORT)
    treq: str = "not specified"
    params: dict[str, str] = field(default_factory=dict)
    subsystems: list[str] = field(default_factory=list)
    referrals: list[dict[str, Any]] = field(default_factory=list)
    ana_groups: list[dict[str, Any]] = field(default_factory=list)

    def validate(self, where: str = "port") -> None:
        """Raise ValueError if a field is invalid."""
        _as_int(f"{where}.portid", self.portid, 0, 0xFFFF)
        if self.trtype not in TRTYPES:
            raise _fail(f"{where}.addr.trtype", f"{self.trtype!r} not one of {list(TRTYPES)}")
        if self.adrfam not in ADRFAMS:
            raise _fail(f"{where}.addr.adrfam", f"{self.adrfam!r} not one of {list(ADRFAMS)}")
        if self.treq not in TREQS:
            raise _fail(f"{where}.addr.treq", f"{self.treq!r} not one of {list(TREQS)}")
        if self.trtype == "tcp":
            if not isinstance(self.trsvcid, str) or not self.trsvcid.isdigit():
                raise _fail(f"{where}.addr.trsvcid", f"TCP port must be a decimal string, got {self.trsvcid!r}")
            _as_int(f"{where}.addr.trsvcid", self.trsvcid, 1, 65535)
            fam = {"ipv4": ipaddress.IPv4Address, "ipv6": ipaddress.IPv6Address}.get(self.adrfam)
            if fam is None:
                raise _fail(f"{where}.addr.adrfam", f"tcp needs ipv4 or ipv6, got {self.adrfam!r}")
            try:
                fam(self.traddr)
            except ValueError:
                raise _fail(f"{where}.addr.traddr", f"{self.traddr!r} is not an {self.adrfam} address") from None
        _as_str_dict(f"{where}.param", self.params)
        for i, s in enumerate(self.subsystems):
            _check_nqn(f"{where}.subsystems[{i}]", s)
        for i, r in enumerate(self.referrals):
            _check_keys(f"{where}.referrals[{i}]", r, {"name", "addr", "enable", "portid"}, {"name"})
        for i, a in enumerate(self.ana_groups):
            _check_keys(f"{where}.ana_groups[{i}]", a, {"grpid", "ana"}, {"grpid"})

    def to_json(self) -> dict[str, Any]:
        """nvmetcli JSON for this port."""
        d: dict[str, Any] = {
            "portid": self.portid,
            "addr": {
                "adrfam": self.adrfam,
                "traddr": self.traddr,
                "treq": self.treq,
                "trsvcid": self.trsvcid,
                "trtype": self.trtype,
            },
            "param": dict(self.params),
            "subsystems": list(self.subsystems),
            "referrals": [json.loads(json.dumps(r)) for r in self.referrals],
        }
        if self.ana_groups:
            d["ana_groups"] = [json.loads(json.dumps(a)) for a in self.ana_groups]
        return d

    @classmethod
    def from_json(cls, d: Any, where: str = "port") -> Port:
        """Parse one nvmetcli port object."""
        _check_keys(where, d, {"portid", "addr", "param", "subsystems", "referrals", "ana_groups"}, {"portid"})
        addr = _check_keys(f"{where}.addr", d.get("addr", {}), {"adrfam", "traddr", "treq", "trsvcid", "trtype",
                                                                 "tsas"})
        for k, v in addr.items():
            if not isinstance(v, str):
                raise _fail(f"{where}.addr.{k}", f"expected a string, got {v!r}")
        if "tsas" in addr and addr["tsas"] not in ("none", ""):
            raise _fail(f"{where}.addr.tsas", f"TLS ({addr['tsas']!r}) is not supported by this project")
        port = cls(
            portid=_as_int(f"{where}.portid", d["portid"], 0, 0xFFFF),
            trtype=addr.get("trtype", "tcp"),
            adrfam=addr.get("adrfam", "ipv4"),
            traddr=addr.get("traddr", "127.0.0.1"),
            trsvcid=addr.get("trsvcid", str(DEFAULT_PORT)),
            treq=addr.get("treq", "not specified"),
            params=_as_str_dict(f"{where}.param", d.get("param", {})),
            subsystems=list(_as_list(f"{where}.subsystems", d.get("subsystems", []))),
            referrals=list(_as_list(f"{where}.referrals", d.get("referrals", []))),
            ana_groups=list(_as_list(f"{where}.ana_groups", d.get("ana_groups", []))),
        )
        port.validate(where)
        return port


Backing = Literal["ram", "file"]


@dataclass
class AdpSettings:
    """Userspace-target knobs nvmetcli JSON has no field for (top-level ``"adp"`` key).

    ``capacity_bytes`` sizes RAM namespaces and file namespaces whose file must be created.
    ``keep_alive_ms_default`` is the KATO the userspace target applies when a host's Connect
    carries KATO 0 (nvmet uses 120 s for discovery controllers, NVMET_DISC_KATO_MS).
    ``overcommit`` lets the userspace target map a namespace larger than its backing can still take (refused
    otherwise: target/backing.py).
    """

    capacity_bytes: int = 1 * GiB
    lba_size: int = 4096
    mdts_bytes: int = 128 * KiB
    max_io_queues: int = 8
    queue_depth: int = 128
    keep_alive_ms_default: int = 120_000
    backing: Backing = "ram"
    inline_data_size: int | None = None  # None: the MDTS (every single-command write goes in-capsule)
    io_workers: int = 0  # worker processes serving the I/O queues (0: the target process serves them)
    overcommit: bool = False

    def validate(self, where: str = "adp") -> None:
        """Raise ValueError naming the offending field."""
        for f in fields(self):
            val = getattr(self, f.name)
            if f.name == "inline_data_size" and val is None:
                continue
            if f.name == "overcommit":
                if not isinstance(val, bool):
                    raise _fail(f"{where}.{f.name}", f"expected true or false, got {val!r}")
                continue
            if f.name != "backing" and (isinstance(val, bool) or not isinstance(val, int)):
                raise _fail(f"{where}.{f.name}", f"expected an integer, got {val!r}")
        if self.lba_size not in (512, 4096):
            raise _fail(f"{where}.lba_size", f"must be 512 or 4096, got {self.lba_size}")
        if self.capacity_bytes <= 0 or self.capacity_bytes % self.lba_size:
            raise _fail(f"{where}.capacity_bytes",
                        f"must be a positive multiple of lba_size ({self.lba_size}), got {self.capacity_bytes}")
        m = self.mdts_bytes
        if m < 4096 or m & (m - 1) or m > 4096 << 15:
            raise _fail(f"{where}.mdts_bytes", f"must be a power of two in [4096, 128 MiB], got {m}")
        if not 1 <= self.max_io_queues <= 65535:
            raise _fail(f"{where}.max_io_queues", f"must be in [1, 65535], got {self.max_io_queues}")
        if not 2 <= self.queue_depth <= 65536:
            raise _fail(f"{where}.queue_depth", f"must be in [2, 65536], got {self.queue_depth}")
        if self.keep_alive_ms_default < 0:
            raise _fail(f"{where}.keep_alive_ms_default", f"must be >= 0, got {self.keep_alive_ms_default}")
        if self.backing not in ("ram", "file"):
            raise _fail(f"{where}.backing", f"must be 'ram' or 'file', got {self.backing!r}")
        if not 0 <= self.io_workers <= 256:
            raise _fail(f"{where}.io_workers", f"must be in [0, 256], got {self.io_workers}")
        if self.inline_data_size is not None and (self.inline_data_size < 0 or self.inline_data_size % 16):
            raise _fail(f"{where}.inline_data_size",
                        f"must be a non-negative multiple of 16, got {self.inline_data_size}")

    def to_json(self) -> dict[str, Any]:
        """The ``"adp"`` JSON object."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, d: Any, where: str = "adp") -> AdpSettings:
        """Parse the ``"adp"`` object; unknown keys are errors (typo protection)."""
        names = {f.name for f in fields(cls)}
        _check_keys(where, d, names)
        s = cls(**d)
        s.validate(where)
        return s


@dataclass
class NvmetConfig:
    """A whole target configuration: nvmetcli's JSON model plus :class:`AdpSettings`."""

    hosts: list[str] = field(default_factory=list)
    ports: list[Port] = field(default_factory=list)
    subsystems: list[Subsystem] = field(default_factory=list)
    adp: AdpSettings = field(default_factory=AdpSettings)

    def validate(self) -> None:
        """Check every field and every cross reference; raise ValueError with the JSON location."""
        for i, h in enumerate(self.hosts):
            _check_nqn(f"hosts[{i}].nqn", h)
        if len(set(self.hosts)) != len(self.hosts):
            raise _fail("hosts", "duplicate host NQN")
        nqns: set[str] = set()
        for i, s in enumerate(self.subsystems):
            s.validate(f"subsystems[{i}]")
            if s.nqn in nqns:
                raise _fail(f"subsystems[{i}].nqn", f"duplicate subsystem {s.nqn!r}")
            nqns.add(s.nqn)
            for j, h in enumerate(s.allowed_hosts):
                if h not in self.hosts:
                    raise _fail(f"subsystems[{i}].allowed_hosts[{j}]",
                                f"host {h!r} is not declared in the top-level \"hosts\" list")
        ids: set[int] = set()
        for i, p in enumerate(self.ports):
            p.validate(f"ports[{i}]")
            if p.portid in ids:
                raise _fail(f"ports[{i}].portid", f"duplicate portid {p.portid}")
            ids.add(p.portid)
            for j, s in enumerate(p.subsystems):
                if s not in nqns:
                    raise _fail(f"ports[{i}].subsystems[{j}]", f"subsystem {s!r} is not defined in \"subsystems\"")
        self.adp.validate()

    def to_json(self, include_adp: bool = True) -> dict[str, Any]:
        """Serialise; with ``include_adp=False`` the result is exactly nvmetcli-restore input."""
        d: dict[str, Any] = {
            "hosts": [{"nqn": h} for h in self.hosts],
            "ports": [p.to_json() for p in self.ports],
            "subsystems": [s.to_json() for s in self.subsystems],
        }
        if include_adp:
            d["adp"] = self.adp.to_json()
        return d

    def nvmetcli_json(self) -> dict[str, Any]:
        """The JSON handed to ``nvmetcli restore`` (the ``"adp"`` section stripped)."""
        return self.to_json(include_adp=False)

    @classmethod
    def from_json(cls, d: Any) -> NvmetConfig:
        """Parse and validate a config dict (nvmetcli JSON, optionally with ``"adp"``)."""
        _check_keys("top level", d, {"hosts", "ports", "subsystems", "adp"})
        hosts = []
        for i, h in enumerate(_as_list("hosts", d.get("hosts", []))):
            _check_keys(f"hosts[{i}]", h, {"nqn", "dhchap"}, {"nqn"})
            if h.get("dhchap"):
                raise _fail(f"hosts[{i}].dhchap", "DH-HMAC-CHAP is not supported by this project")
            hosts.append(_check_nqn(f"hosts[{i}].nqn", h["nqn"]))
        cfg = cls(
            hosts=hosts,
            ports=[Port.from_json(p, f"ports[{i}]") for i, p in enumerate(_as_list("ports", d.get("ports", [])))],
            subsystems=[Subsystem.from_json(s, f"subsystems[{i}]")
                        for i, s in enumerate(_as_list("subsystems", d.get("subsystems", [])))],
            adp=AdpSettings.from_json(d.get("adp", {})),
        )
        cfg.validate()
        return cfg

    def subsystem(self, nqn: str) -> Subsystem:
        """Look a subsystem up by NQN (KeyError if absent)."""
        for s in self.subsystems:
            if s.nqn == nqn:
                return s
        raise KeyError(nqn)


def load_config(path: str | Path) -> NvmetConfig:
    """Read and validate a config file; errors name the file and the offending key."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"config: cannot read {p}: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"config: {p} is not UTF-8 text (byte {e.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"config: {p}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from e
    except RecursionError:
        raise ValueError(f"config: {p}: JSON nested too deeply") from None
    try:
        return NvmetConfig.from_json(data)
    except RecursionError:
        raise ValueError(f"config: {p}: JSON nested too deeply") from None
    except (ValueError, TypeError) as e:
        raise ValueError(f"{e} (in {p})") from e


def save_config(cfg: NvmetConfig, path: str | Path, include_adp: bool = True) -> None:
    """Write ``cfg`` as pretty JSON (``include_adp=False`` gives a file for ``nvmetcli restore``)."""
    Path(path).write_text(json.dumps(cfg.to_json(include_adp), indent=2, sort_keys=True) + "\n", encoding="utf-8")


def default_config(port: int = DEFAULT_PORT, nqn: str = DEFAULT_NQN, traddr: str = "127.0.0.1",
                   backing_path: str | None = None) -> NvmetConfig:
    """The embedded default used by ``testbed up``: one port, one subsystem, namespace 1.

    With ``backing_path`` the namespace is file-backed (``adp.backing = "file"``), else RAM-backed.
    The namespace UUID/NGUID are derived from the NQN so they are stable across runs.
    """
    ns_uuid = str(uuid_mod.uuid5(uuid_mod.NAMESPACE_URL, nqn + "/ns1"))
    ns_nguid = str(uuid_mod.uuid5(uuid_mod.NAMESPACE_URL, nqn + "/ns1/nguid"))
    cfg = NvmetConfig(
        hosts=[],
        ports=[Port(portid=1, traddr=traddr, trsvcid=str(port), subsystems=[nqn])],
        subsystems=[Subsystem(
            nqn=nqn,
            allow_any_host=True,
            namespaces=[Namespace(nsid=1, path=backing_path or "", uuid=ns_uuid, nguid=ns_nguid)],
            attrs={"serial": "adpkv" + ns_uuid.replace("-", "")[:15], "model": "Awide ADP KV emulator"},
        )],
        adp=AdpSettings(backing="file" if backing_path else "ram"),
    )
    cfg.validate()
    return cfg
