"""64-byte submission queue entries, 16-byte completion queue entries and command builders.

SQE layout (bytes): 0 OPC, 1 FLAGS, 2-3 CID, 4-7 NSID (byte 4 = FCTYPE for Fabrics commands),
8-15 CDW2-3, 16-23 MPTR, 24-39 DPTR (SGL: 24 address u64, 32 length u32, 39 identifier),
40-63 CDW10-CDW15. CQE: 0 DW0, 4 DW1, 8 SQHD, 10 SQID, 12 CID, 14 STATUS.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .constants import (
    SQE_FLAGS_SGL,
    AdminOpcode,
    FabricsType,
    IoOpcode,
    SglId,
)
from .status import SUCCESS, Status

_SQE = struct.Struct("<BBHIIIQQI3xBIIIIII")
_CQE = struct.Struct("<IIHHHH")
assert _SQE.size == 64 and _CQE.size == 16


@dataclass(slots=True)
class Sqe:
    """A submission queue entry. ``fctype`` aliases the low byte of ``nsid`` for Fabrics commands."""

    opcode: int
    cid: int = 0
    nsid: int = 0
    flags: int = SQE_FLAGS_SGL
    cdw2: int = 0
    cdw3: int = 0
    mptr: int = 0
    sgl_addr: int = 0
    sgl_len: int = 0
    sgl_id: int = SglId.TRANSPORT_DATA_BLOCK
    cdw10: int = 0
    cdw11: int = 0
    cdw12: int = 0
    cdw13: int = 0
    cdw14: int = 0
    cdw15: int = 0

    def encode(self) -> bytes:
        return _SQE.pack(
            self.opcode, self.flags, self.cid, self.nsid, self.cdw2, self.cdw3, self.mptr,
            self.sgl_addr, self.sgl_len, self.sgl_id,
            self.cdw10, self.cdw11, self.cdw12, self.cdw13, self.cdw14, self.cdw15,
        )

    def encode_into(self, buf: bytearray | memoryview, offset: int = 0) -> None:
        _SQE.pack_into(
            buf, offset, self.opcode, self.flags, self.cid, self.nsid, self.cdw2, self.cdw3, self.mptr,
            self.sgl_addr, self.sgl_len, self.sgl_id,
            self.cdw10, self.cdw11, self.cdw12, self.cdw13, self.cdw14, self.cdw15,
        )

    @classmethod
    def decode(cls, data: bytes | memoryview, offset: int = 0) -> Sqe:
        f = _SQE.unpack_from(data, offset)
        return cls(
            opcode=f[0], flags=f[1], cid=f[2], nsid=f[3], cdw2=f[4], cdw3=f[5], mptr=f[6],
            sgl_addr=f[7], sgl_len=f[8], sgl_id=f[9],
            cdw10=f[10], cdw11=f[11], cdw12=f[12], cdw13=f[13], cdw14=f[14], cdw15=f[15],
        )

    # Views of fields shared by several commands.
    @property
    def fctype(self) -> int:
        return self.nsid & 0xFF

    @property
    def slba(self) -> int:
        return self.cdw10 | (self.cdw11 << 32)

    @property
    def nlb(self) -> int:
        """Number of logical blocks (CDW12 bits 15:0 are 0's based; this is the real count)."""
        return (self.cdw12 & 0xFFFF) + 1


@dataclass(slots=True)
class Cqe:
    """A completion queue entry."""

    cid: int
    status: Status = SUCCESS
    dw0: int = 0
    dw1: int = 0
    sqhd: int = 0
    sqid: int = 0

    def encode(self) -> bytes:
        return _CQE.pack(self.dw0, self.dw1, self.sqhd, self.sqid, self.cid, self.status.word)

    @classmethod
    def decode(cls, data: bytes | memoryview, offset: int = 0) -> Cqe:
        dw0, dw1, sqhd, sqid, cid, word = _CQE.unpack_from(data, offset)
        return cls(cid=cid, status=Status.from_word(word), dw0=dw0, dw1=dw1, sqhd=sqhd, sqid=sqid)


# ----------------------------------------------------------------------------------------------------
# Builders. CIDs are assigned by the queue that sends the command; builders leave cid = 0.


def _fabrics(fctype: int, **kw: int) -> Sqe:
    return Sqe(opcode=AdminOpcode.FABRICS, nsid=fctype, **kw)


def connect_cmd(qid: int, sqsize: int, kato_ms: int = 0, cattr: int = 0) -> Sqe:
    """Fabrics Connect; ``sqsize`` is the real queue size (encoded 0's based). 1024 bytes in-capsule."""
    if not 1 <= sqsize <= 0x10000:
        raise ValueError(f"queue size {sqsize} outside 1..65536")
    return _fabrics(
        FabricsType.CONNECT,
        sgl_id=SglId.DATA_BLOCK_OFFSET, sgl_len=1024,
        cdw10=(qid & 0xFFFF) << 16,  # RECFMT 0 | QID
        cdw11=((sqsize - 1) & 0xFFFF) | ((cattr & 0xFF) << 16),
        cdw12=kato_ms & 0xFFFFFFFF,
    )


def connect_fields(sqe: Sqe) -> tuple[int, int, int, int, int]:
    """(recfmt, qid, sqsize (real, not 0's based), cattr, kato_ms) of a Connect SQE."""
    return (sqe.cdw10 & 0xFFFF, sqe.cdw10 >> 16, (sqe.cdw11 & 0xFFFF) + 1, (sqe.cdw11 >> 16) & 0xFF,
            sqe.cdw12)


def property_get_cmd(offset: int, size8: bool = False) -> Sqe:
    return _fabrics(FabricsType.PROPERTY_GET, sgl_len=0, cdw10=1 if size8 else 0, cdw11=offset)


def property_set_cmd(offset: int, value: int, size8: bool = False) -> Sqe:
    return _fabrics(
        FabricsType.PROPERTY_SET, sgl_len=0, cdw10=1 if size8 else 0, cdw11=offset,
        cdw12=value & 0xFFFFFFFF, cdw13=(value >> 32) & 0xFFFFFFFF,
    )


def identify_cmd(cns: int, nsid: int = 0, cntid: int = 0, csi: int = 0) -> Sqe:
    return Sqe(opcode=AdminOpcode.IDENTIFY, nsid=nsid, sgl_len=4096,
               cdw10=(cns & 0xFF) | ((cntid & 0xFFFF) << 16), cdw11=(csi & 0xFF) << 24)


def get_log_page_cmd(lid: int, length: int, offset: int = 0, nsid: int = 0, rae: bool = False) -> Sqe:
    """Get Log Page of ``length`` bytes (a multiple of 4) starting at byte ``offset``."""
    if length <= 0 or length % 4 or offset % 4:
        raise ValueError("log page length and offset must be positive dword multiples")
    numd = length // 4 - 1
    return Sqe(opcode=AdminOpcode.GET_LOG_PAGE, nsid=nsid, sgl_len=length,
               cdw10=(lid & 0xFF) | (rae << 15) | ((numd & 0xFFFF) << 16),
               cdw11=(numd >> 16) & 0xFFFF, cdw12=offset & 0xFFFFFFFF, cdw13=offset >> 32)


def set_features_cmd(fid: int, value: int, save: bool = False) -> Sqe:
    return Sqe(opcode=AdminOpcode.SET_FEATURES, sgl_len=0, cdw10=(fid & 0xFF) | (save << 31), cdw11=value)


def get_features_cmd(fid: int, sel: int = 0) -> Sqe:
    return Sqe(opcode=AdminOpcode.GET_FEATURES, sgl_len=0, cdw10=(fid & 0xFF) | ((sel & 0x7) << 8))


def keep_alive_cmd() -> Sqe:
    return Sqe(opcode=AdminOpcode.KEEP_ALIVE, sgl_len=0)


def async_event_request_cmd() -> Sqe:
    return Sqe(opcode=AdminOpcode.ASYNC_EVENT_REQUEST, sgl_len=0)


def abort_cmd(sqid: int, cid: int) -> Sqe:
    return Sqe(opcode=AdminOpcode.ABORT, sgl_len=0, cdw10=(sqid & 0xFFFF) | ((cid & 0xFFFF) << 16))


def rw_cmd(opcode: int, nsid: int, slba: int, nlb: int, length: int, in_capsule: bool = False,
           fua: bool = False) -> Sqe:
    """Read or Write of ``nlb`` blocks (real count, 1..65536) carrying ``length`` bytes."""
    if not 1 <= nlb <= 0x10000:
        raise ValueError(f"NLB {nlb} outside 1..65536")
    return Sqe(
        opcode=opcode, nsid=nsid, sgl_len=length,
        sgl_id=SglId.DATA_BLOCK_OFFSET if in_capsule else SglId.TRANSPORT_DATA_BLOCK,
        cdw10=slba & 0xFFFFFFFF, cdw11=slba >> 32, cdw12=(nlb - 1) | (fua << 30),
    )


def flush_cmd(nsid: int) -> Sqe:
    return Sqe(opcode=IoOpcode.FLUSH, nsid=nsid, sgl_len=0)


def write_zeroes_cmd(nsid: int, slba: int, nlb: int, deallocate: bool = False) -> Sqe:
    if not 1 <= nlb <= 0x10000:
        raise ValueError(f"NLB {nlb} outside 1..65536")
    return Sqe(opcode=IoOpcode.WRITE_ZEROES, nsid=nsid, sgl_len=0,
               cdw10=slba & 0xFFFFFFFF, cdw11=slba >> 32, cdw12=(nlb - 1) | (deallocate << 25))


DSM_RANGE = struct.Struct("<IIQ")  # context attributes, NLB (not 0's based), SLBA
DSM_ATTR_DEALLOCATE = 0x4


def dsm_cmd(nsid: int, nranges: int, deallocate: bool = True, in_capsule: bool = True) -> Sqe:
    """Dataset Management carrying ``nranges`` 16-byte ranges (built with :func:`dsm_ranges`)."""
    if not 1 <= nranges <= 256:
        raise ValueError("1..256 DSM ranges")
    return Sqe(opcode=IoOpcode.DATASET_MANAGEMENT, nsid=nsid, sgl_len=16 * nranges,
               sgl_id=SglId.DATA_BLOCK_OFFSET if in_capsule else SglId.TRANSPORT_DATA_BLOCK,
               cdw10=nranges - 1, cdw11=DSM_ATTR_DEALLOCATE if deallocate else 0)


def dsm_ranges(ranges: list[tuple[int, int]]) -> bytes:
    """Encode (slba, nlb) pairs as DSM range descriptors."""
    return b"".join(DSM_RANGE.pack(0, nlb, slba) for slba, nlb in ranges)


def decode_dsm_ranges(data: bytes | memoryview) -> list[tuple[int, int]]:
    return [(slba, nlb) for _, nlb, slba in DSM_RANGE.iter_unpack(bytes(data))]
