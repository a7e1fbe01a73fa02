"""Numeric constants of NVMe, NVMe over Fabrics and the NVMe/TCP transport.

Values restated from the NVMe Base / NVMe-oF / NVMe-TCP specifications as implemented by Linux
(include/linux/nvme.h, include/linux/nvme-tcp.h) and SPDK (include/spdk/nvmf_spec.h,
nvme_spec.h); see docs/wire-format.md for the source table.
"""

from __future__ import annotations

from enum import IntEnum, IntFlag

DISCOVERY_NQN = "nqn.2014-08.org.nvmexpress.discovery"
NVME_TCP_DEFAULT_PORT = 4420
NVME_TCP_DISCOVERY_PORT = 8009

SQE_SIZE = 64
CQE_SIZE = 16
IDENTIFY_SIZE = 4096
CONNECT_DATA_SIZE = 1024
NQN_FIELD_SIZE = 256
NQN_MAX_LEN = 223

# Dynamic controller model: a host asks for "any" controller id with 0xFFFF in Connect.
CNTLID_DYNAMIC = 0xFFFF


class PduType(IntEnum):
    """NVMe/TCP PDU types (common header byte 0)."""

    IC_REQ = 0x00
    IC_RESP = 0x01
    H2C_TERM_REQ = 0x02
    C2H_TERM_REQ = 0x03
    CAPSULE_CMD = 0x04
    CAPSULE_RESP = 0x05
    H2C_DATA = 0x06
    C2H_DATA = 0x07
    R2T = 0x09


class PduFlags(IntFlag):
    """Common header byte 1."""

    NONE = 0
    HDGSTF = 0x01
    DDGSTF = 0x02
    DATA_LAST = 0x04
    DATA_SUCCESS = 0x08


class FatalErrorStatus(IntEnum):
    """FES values carried by H2CTermReq / C2HTermReq."""

    INVALID_HEADER_FIELD = 0x01
    PDU_SEQUENCE_ERROR = 0x02
    HEADER_DIGEST_ERROR = 0x03
    DATA_TRANSFER_OUT_OF_RANGE = 0x04
    DATA_TRANSFER_LIMIT_EXCEEDED = 0x05
    UNSUPPORTED_PARAMETER = 0x06


class AdminOpcode(IntEnum):
    DELETE_IO_SQ = 0x00
    CREATE_IO_SQ = 0x01
    GET_LOG_PAGE = 0x02
    DELETE_IO_CQ = 0x04
    CREATE_IO_CQ = 0x05
    IDENTIFY = 0x06
    ABORT = 0x08
    SET_FEATURES = 0x09
    GET_FEATURES = 0x0A
    ASYNC_EVENT_REQUEST = 0x0C
    KEEP_ALIVE = 0x18
    FABRICS = 0x7F


class IoOpcode(IntEnum):
    FLUSH = 0x00
    WRITE = 0x01
    READ = 0x02
    COMPARE = 0x05
    WRITE_ZEROES = 0x08
    DATASET_MANAGEMENT = 0x09
    FABRICS = 0x7F


class FabricsType(IntEnum):
    """FCTYPE (SQE byte 4) of a Fabrics command (opcode 0x7F)."""

    PROPERTY_SET = 0x00
    CONNECT = 0x01
    PROPERTY_GET = 0x04
    AUTH_SEND = 0x05
    AUTH_RECEIVE = 0x06
    DISCONNECT = 0x08


class Property(IntEnum):
    """Controller property (register) offsets."""

    CAP = 0x00
    VS = 0x08
    CC = 0x14
    CSTS = 0x1C
    NSSR = 0x20
    CRTO = 0x68


class Cns(IntEnum):
    """Identify CNS values."""

    NAMESPACE = 0x00
    CONTROLLER = 0x01
    ACTIVE_NS_LIST = 0x02
    NS_DESCRIPTORS = 0x03
    CSI_NAMESPACE = 0x05
    CSI_CONTROLLER = 0x06
    CSI_INDEPENDENT_NAMESPACE = 0x08


class LogPage(IntEnum):
    SUPPORTED_LOGS = 0x00
    ERROR = 0x01
    SMART = 0x02
    FIRMWARE_SLOT = 0x03
    CHANGED_NS = 0x04
    COMMAND_EFFECTS = 0x05
    DISCOVERY = 0x70


class Feature(IntEnum):
    VOLATILE_WRITE_CACHE = 0x06
    NUMBER_OF_QUEUES = 0x07
    ASYNC_EVENT_CONFIG = 0x0B
    KEEP_ALIVE_TIMER = 0x0F


class SglId(IntEnum):
    """SGL descriptor identifier byte (type << 4 | subtype)."""

    DATA_BLOCK_OFFSET = 0x01  # in-capsule data, address = offset from ICDOFF
    TRANSPORT_DATA_BLOCK = 0x5A  # data moves in C2HData / R2T + H2CData


class NidType(IntEnum):
    """Namespace identification descriptor types (Identify CNS 3)."""

    EUI64 = 1
    NGUID = 2
    UUID = 3
    CSI = 4


# SQE byte 1 (FLAGS): PSDT = 01b (SGL for data, metadata in one buffer) is what fabrics hosts send.
SQE_FLAGS_SGL = 0x40

# Controller type (Identify Controller byte 111).
CNTRLTYPE_IO = 1
CNTRLTYPE_DISCOVERY = 2

# Discovery log entry values.
TRTYPE_TCP = 3
ADRFAM_IPV4 = 1
ADRFAM_IPV6 = 2
SUBTYPE_REFERRAL = 1
SUBTYPE_NVME = 2
SUBTYPE_CURRENT_DISCOVERY = 3

# CC / CSTS bits.
CC_EN = 0x1
CC_SHN_SHIFT = 14
CC_SHN_MASK = 0x3 << CC_SHN_SHIFT
CSTS_RDY = 0x1
CSTS_CFS = 0x2
CSTS_SHST_COMPLETE = 0x2 << 2

# Connect command CATTR bit 2: disable SQ flow control.
CATTR_DISABLE_SQ_FLOW_CONTROL = 0x4
