"""Data structures carried in command data: Connect data, Identify, log pages.

Offsets are those of the NVMe Base / NVMe-oF specifications (cross-checked against libnvme's
``struct nvme_id_ctrl``/``nvme_id_ns`` and SPDK's static asserts; see docs/wire-format.md).
Every structure encodes to and decodes from its exact wire size.
"""

from __future__ import annotations

import struct
import uuid as uuidlib
from dataclasses import dataclass, field

from .constants import (
    ADRFAM_IPV4,
    CNTLID_DYNAMIC,
    CNTRLTYPE_IO,
    CONNECT_DATA_SIZE,
    IDENTIFY_SIZE,
    NQN_FIELD_SIZE,
    NQN_MAX_LEN,
    SUBTYPE_NVME,
    TRTYPE_TCP,
)


def _put_str(buf: bytearray, off: int, size: int, text: str, pad: bytes = b"\0") -> None:
    raw = text.encode("ascii")
    if len(raw) > size:
        raise ValueError(f"{text!r} longer than {size} bytes")
    buf[off : off + size] = raw + pad * (size - len(raw))


def _get_str(buf: bytes | memoryview, off: int, size: int) -> str:
    return bytes(buf[off : off + size]).split(b"\0", 1)[0].decode("ascii", "replace").rstrip(" ")


def check_nqn(nqn: str) -> str:
    """Validate an NQN's length and characters; returns it."""
    if not nqn or len(nqn.encode()) > NQN_MAX_LEN:
        raise ValueError(f"NQN must be 1..{NQN_MAX_LEN} bytes: {nqn!r}")
    if not nqn.isascii() or not nqn.isprintable():
        raise ValueError(f"NQN must be printable ASCII: {nqn!r}")
    return nqn


# ----------------------------------------------------------------------------------------------------
# Connect data (1024 bytes): 0 HOSTID(16), 16 CNTLID, 256 SUBNQN, 512 HOSTNQN


@dataclass(slots=True)
class ConnectData:
    hostid: bytes
    cntlid: int
    subnqn: str
    hostnqn: str

    def encode(self) -> bytes:
        buf = bytearray(CONNECT_DATA_SIZE)
        buf[0:16] = self.hostid.ljust(16, b"\0")[:16]
        struct.pack_into("<H", buf, 16, self.cntlid)
        _put_str(buf, 256, NQN_FIELD_SIZE, self.subnqn)
        _put_str(buf, 512, NQN_FIELD_SIZE, self.hostnqn)
        return bytes(buf)

    @classmethod
    def decode(cls, data: bytes | memoryview) -> ConnectData:
        if len(data) < CONNECT_DATA_SIZE:
            raise ValueError(f"Connect data is {len(data)} bytes, need {CONNECT_DATA_SIZE}")
        return cls(bytes(data[0:16]), struct.unpack_from("<H", data, 16)[0],
                   _get_str(data, 256, NQN_FIELD_SIZE), _get_str(data, 512, NQN_FIELD_SIZE))


def default_host_nqn(hostid: bytes | None = None) -> str:
    """An NQN of the UUID form the Linux host uses when none is configured."""
    u = uuidlib.UUID(bytes=hostid) if hostid else uuidlib.uuid4()
    return f"nqn.2014-08.org.nvmexpress:uuid:{u}"


# ----------------------------------------------------------------------------------------------------
# Identify Controller (CNS 1)

_IDCTRL_FIELDS: list[tuple[str, int, str]] = [
    # name, offset, struct format
    ("vid", 0, "H"), ("ssvid", 2, "H"), ("rab", 72, "B"), ("cmic", 76, "B"), ("mdts", 77, "B"),
    ("cntlid", 78, "H"), ("ver", 80, "I"), ("oaes", 92, "I"), ("ctratt", 96, "I"), ("cntrltype", 111, "B"),
    ("oacs", 256, "H"), ("acl", 258, "B"), ("aerl", 259, "B"), ("frmw", 260, "B"), ("lpa", 261, "B"),
    ("elpe", 262, "B"), ("npss", 263, "B"), ("kas", 320, "H"), ("sqes", 512, "B"), ("cqes", 513, "B"),
    ("maxcmd", 514, "H"), ("nn", 516, "I"), ("oncs", 520, "H"), ("fuses", 522, "H"), ("vwc", 525, "B"),
    ("awun", 526, "H"), ("awupf", 528, "H"), ("sgls", 536, "I"), ("mnan", 540, "I"),
    ("ioccsz", 1792, "I"), ("iorcsz", 1796, "I"), ("icdoff", 1800, "H"), ("fcatt", 1802, "B"),
    ("msdbd", 1803, "B"),
]


@dataclass(slots=True)
class IdentifyController:
    sn: str = ""
    mn: str = ""
    fr: str = ""
    subnqn: str = ""
    vid: int = 0
    ssvid: int = 0
    rab: int = 6
    cmic: int = 0
    mdts: int = 0
    cntlid: int = 0
    ver: int = 0x020100
    oaes: int = 0
    ctratt: int = 0
    cntrltype: int = CNTRLTYPE_IO
    oacs: int = 0
    acl: int = 3
    aerl: int = 3
    frmw: int = 0x3
    lpa: int = 0x7
    elpe: int = 127
    npss: int = 0
    kas: int = 10
    sqes: int = 0x66
    cqes: int = 0x44
    maxcmd: int = 128
    nn: int = 1
    oncs: int = 0
    fuses: int = 0
    vwc: int = 1
    awun: int = 0
    awupf: int = 0
    sgls: int = 0x00100001
    mnan: int = 0
    ioccsz: int = 4
    iorcsz: int = 1
    icdoff: int = 0
    fcatt: int = 0
    msdbd: int = 1

    def encode(self) -> bytes:
        buf = bytearray(IDENTIFY_SIZE)
        _put_str(buf, 4, 20, self.sn, b" ")
        _put_str(buf, 24, 40, self.mn, b" ")
        _put_str(buf, 64, 8, self.fr, b" ")
        _put_str(buf, 768, 256, self.subnqn)
        for name, off, fmt in _IDCTRL_FIELDS:
            struct.pack_into("<" + fmt, buf, off, getattr(self, name))
        return bytes(buf)

    @classmethod
    def decode(cls, data: bytes | memoryview) -> IdentifyController:
        if len(data) < IDENTIFY_SIZE:
            raise ValueError("Identify Controller data must be 4096 bytes")
        kw = {name: struct.unpack_from("<" + fmt, data, off)[0] for name, off, fmt in _IDCTRL_FIELDS}
        return cls(sn=_get_str(data, 4, 20), mn=_get_str(data, 24, 40), fr=_get_str(data, 64, 8),
                   subnqn=_get_str(data, 768, 256), **kw)

    @property
    def in_capsule_data_size(self) -> int:
        """Bytes of in-capsule data the I/O queues take (IOCCSZ counts 16-byte units incl. the SQE)."""
        return max(0, self.ioccsz * 16 - 64)


# ----------------------------------------------------------------------------------------------------
# Identify Namespace (CNS 0)


@dataclass(slots=True)
class LbaFormat:
    ms: int = 0
    lbads: int = 12
    rp: int = 0


@dataclass(slots=True)
class IdentifyNamespace:
    nsze: int = 0
    ncap: int = 0
    nuse: int = 0
    nsfeat: int = 0
    nlbaf: int = 0
    flbas: int = 0
    nmic: int = 0
    dlfeat: int = 0
    nawun: int = 0
    nawupf: int = 0
    nguid: bytes = bytes(16)
    eui64: bytes = bytes(8)
    lbaf: list[LbaFormat] = field(default_factory=lambda: [LbaFormat()])

    def encode(self) -> bytes:
        buf = bytearray(IDENTIFY_SIZE)
        struct.pack_into("<QQQBBB", buf, 0, self.nsze, self.ncap, self.nuse, self.nsfeat, self.nlbaf, self.flbas)
        buf[30] = self.nmic
        buf[33] = self.dlfeat
        struct.pack_into("<HH", buf, 34, self.nawun, self.nawupf)
        buf[104:120] = self.nguid
        buf[120:128] = self.eui64
        for i, f in enumerate(self.lbaf[:64]):
            struct.pack_into("<HBB", buf, 128 + 4 * i, f.ms, f.lbads, f.rp & 0x3)
        return bytes(buf)

    @classmethod
    def decode(cls, data: bytes | memoryview) -> IdentifyNamespace:
        if len(data) < IDENTIFY_SIZE:
            raise ValueError("Identify Namespace data must be 4096 bytes")
        nsze, ncap, nuse, nsfeat, nlbaf, flbas = struct.unpack_from("<QQQBBB", data, 0)
        nawun, nawupf = struct.unpack_from("<HH", data, 34)
        lbaf = [LbaFormat(*struct.unpack_from("<HBB", data, 128 + 4 * i)) for i in range(nlbaf + 1)]
        return cls(nsze, ncap, nuse, nsfeat, nlbaf, flbas, data[30], data[33], nawun, nawupf,
                   bytes(data[104:120]), bytes(data[120:128]), lbaf)

    @property
    def lba_size(self) -> int:
        idx = (self.flbas & 0xF) | ((self.flbas >> 1) & 0x30)
        return 1 << self.lbaf[idx].lbads


def encode_ns_list(nsids: list[int]) -> bytes:
    """Active namespace ID list (CNS 2): up to 1024 ascending u32, zero padded."""
    ids = sorted(nsids)[:1024]
    return struct.pack(f"<{len(ids)}I", *ids) + bytes(IDENTIFY_SIZE - 4 * len(ids))


def decode_ns_list(data: bytes | memoryview) -> list[int]:
    out = []
    for (nsid,) in struct.iter_unpack("<I", bytes(data[:IDENTIFY_SIZE])):
        if nsid == 0:
            break
        out.append(nsid)
    return out


def encode_independent_ns(nmic: int = 0, nstat: int = 0) -> bytes:
    """I/O command set independent Identify Namespace (CNS 8): NMIC (byte 1) and NSTAT (byte 14) set,
    everything else zero."""
    buf = bytearray(IDENTIFY_SIZE)
    buf[1] = nmic
    buf[14] = nstat
    return bytes(buf)


def encode_ns_descriptors(descs: list[tuple[int, bytes]]) -> bytes:
    """Namespace identification descriptor list (CNS 3) from (NIDT, NID) pairs."""
    buf = bytearray()
    for nidt, nid in descs:
        buf += struct.pack("<BBH", nidt, len(nid), 0) + nid
    if len(buf) > IDENTIFY_SIZE:
        raise ValueError("descriptor list too long")
    return bytes(buf) + bytes(IDENTIFY_SIZE - len(buf))


def decode_ns_descriptors(data: bytes | memoryview) -> list[tuple[int, bytes]]:
    out, off = [], 0
    data = bytes(data)
    while off + 4 <= len(data):
        nidt, nidl = data[off], data[off + 1]
        if nidt == 0:
            break
        out.append((nidt, data[off + 4 : off + 4 + nidl]))
        off += 4 + nidl
    return out


# ----------------------------------------------------------------------------------------------------
# Supported Log Pages (LID 0x00): 256 u32 entries, bit 0 (LSUPP) set for each supported LID

SUPPORTED_LOGS_SIZE = 1024


def encode_supported_logs(lids: list[int]) -> bytes:
    buf = bytearray(SUPPORTED_LOGS_SIZE)
    for lid in lids:
        struct.pack_into("<I", buf, (lid & 0xFF) * 4, 1)
    return bytes(buf)


def decode_supported_logs(data: bytes | memoryview) -> list[int]:
    return [i for i, (v,) in enumerate(struct.iter_unpack("<I", bytes(data[:SUPPORTED_LOGS_SIZE]))) if v & 1]


# ----------------------------------------------------------------------------------------------------
# Discovery log page (LID 0x70): 1024-byte header, then 1024-byte entries

DISC_HEADER = 1024
DISC_ENTRY = 1024


@dataclass(slots=True)
class DiscoveryEntry:
    subnqn: str
    traddr: str
    trsvcid: str
    trtype: int = TRTYPE_TCP
    adrfam: int = ADRFAM_IPV4
    subtype: int = SUBTYPE_NVME
    treq: int = 0
    portid: int = 1
    cntlid: int = CNTLID_DYNAMIC
    asqsz: int = 32
    eflags: int = 0
    sectype: int = 0

    def encode(self) -> bytes:
        buf = bytearray(DISC_ENTRY)
        struct.pack_into("<BBBBHHHH", buf, 0, self.trtype, self.adrfam, self.subtype, self.treq,
                         self.portid, self.cntlid, self.asqsz, self.eflags)
        _put_str(buf, 32, 32, self.trsvcid)
        _put_str(buf, 256, 256, self.subnqn)
        _put_str(buf, 512, 256, self.traddr)
        buf[768] = self.sectype
        return bytes(buf)

    @classmethod
    def decode(cls, data: bytes | memoryview) -> DiscoveryEntry:
        trtype, adrfam, subtype, treq, portid, cntlid, asqsz, eflags = struct.unpack_from("<BBBBHHHH", data, 0)
        return cls(_get_str(data, 256, 256), _get_str(data, 512, 256), _get_str(data, 32, 32), trtype, adrfam,
                   subtype, treq, portid, cntlid, asqsz, eflags, data[768])


def encode_discovery_log(genctr: int, entries: list[DiscoveryEntry]) -> bytes:
    hdr = bytearray(DISC_HEADER)
    struct.pack_into("<QQH", hdr, 0, genctr, len(entries), 0)
    return bytes(hdr) + b"".join(e.encode() for e in entries)


def decode_discovery_header(data: bytes | memoryview) -> tuple[int, int]:
    """(GENCTR, NUMREC)."""
    genctr, numrec = struct.unpack_from("<QQ", data, 0)
    return genctr, numrec


def decode_discovery_log(data: bytes | memoryview) -> tuple[int, list[DiscoveryEntry]]:
    genctr, numrec = decode_discovery_header(data)
    n = min(numrec, (len(data) - DISC_HEADER) // DISC_ENTRY)
    return genctr, [DiscoveryEntry.decode(memoryview(data)[DISC_HEADER + i * DISC_ENTRY :]) for i in range(n)]


# ----------------------------------------------------------------------------------------------------
# Error information log entry (64 bytes) and SMART / health log (512 bytes)


@dataclass(slots=True)
class ErrorLogEntry:
    error_count: int
    sqid: int
    cid: int
    status: int  # STATUS word (phase bit cleared)
    param_location: int = 0xFFFF
    lba: int = 0
    nsid: int = 0
    opcode: int = 0

    def encode(self) -> bytes:
        buf = bytearray(64)
        struct.pack_into("<QHHHHQI", buf, 0, self.error_count, self.sqid, self.cid, self.status,
                         self.param_location, self.lba, self.nsid)
        buf[29] = 3  # transport type TCP
        buf[31] = self.opcode
        return bytes(buf)

    @classmethod
    def decode(cls, data: bytes | memoryview) -> ErrorLogEntry:
        ec, sqid, cid, status, loc, lba, nsid = struct.unpack_from("<QHHHHQI", data, 0)
        return cls(ec, sqid, cid, status, loc, lba, nsid, data[31])


@dataclass(slots=True)
class SmartLog:
    critical_warning: int = 0
    temperature_k: int = 300
    available_spare: int = 100
    spare_threshold: int = 10
    percent_used: int = 0
    data_units_read: int = 0  # thousands of 512-byte units
    data_units_written: int = 0
    host_read_commands: int = 0
    host_write_commands: int = 0
    power_cycles: int = 0
    power_on_hours: int = 0
    unsafe_shutdowns: int = 0
    media_errors: int = 0
    error_log_entries: int = 0

    _U128 = (("data_units_read", 32), ("data_units_written", 48), ("host_read_commands", 64),
             ("host_write_commands", 80), ("power_cycles", 112), ("power_on_hours", 128),
             ("unsafe_shutdowns", 144), ("media_errors", 160), ("error_log_entries", 176))

    def encode(self) -> bytes:
        buf = bytearray(512)
        struct.pack_into("<BHBBB", buf, 0, self.critical_warning, self.temperature_k, self.available_spare,
                         self.spare_threshold, self.percent_used)
        for name, off in self._U128:
            buf[off : off + 16] = getattr(self, name).to_bytes(16, "little")
        return bytes(buf)

    @classmethod
    def decode(cls, data: bytes | memoryview) -> SmartLog:
        cw, temp, spare, thresh, used = struct.unpack_from("<BHBBB", data, 0)
        kw = {name: int.from_bytes(bytes(data[off : off + 16]), "little") for name, off in cls._U128}
        return cls(cw, temp, spare, thresh, used, **kw)
