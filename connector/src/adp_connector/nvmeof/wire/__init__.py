"""Sans-IO NVMe/TCP codec shared by the target (emulator) and the host client.

Bytes in, typed values out, and back; nothing here touches a socket. Modules:

* :mod:`.constants` - PDU types, flags, opcodes, CNS/LID/FID, property offsets.
* :mod:`.status` - completion status words with names.
* :mod:`.sqe` - 64-byte SQE / 16-byte CQE and command builders.
* :mod:`.pdu` - PDU values, :func:`encode` to buffers, strict :func:`decode_header`.
* :mod:`.stream` - :class:`PduDecoder`, an incremental bytes -> PDUs decoder.
* :mod:`.structs` - Connect data, Identify structures, discovery/error/SMART log pages.
* :mod:`.digest` - CRC-32C header/data digests.
"""

from .constants import (
    DISCOVERY_NQN,
    AdminOpcode,
    Cns,
    FabricsType,
    FatalErrorStatus,
    Feature,
    IoOpcode,
    LogPage,
    PduFlags,
    PduType,
    Property,
    SglId,
)
from .pdu import (
    R2T,
    C2HData,
    CapsuleCmd,
    CapsuleResp,
    DataDigestError,
    H2CData,
    ICReq,
    ICResp,
    Pdu,
    PduError,
    PduHeader,
    TermReq,
    check_data_digest,
    decode_header,
    encode,
    encode_bytes,
)
from .sqe import Cqe, Sqe
from .status import Status
from .stream import PduDecoder

__all__ = [
    "DISCOVERY_NQN",
    "R2T",
    "AdminOpcode",
    "C2HData",
    "CapsuleCmd",
    "CapsuleResp",
    "Cns",
    "Cqe",
    "DataDigestError",
    "FabricsType",
    "FatalErrorStatus",
    "Feature",
    "H2CData",
    "ICReq",
    "ICResp",
    "IoOpcode",
    "LogPage",
    "Pdu",
    "PduDecoder",
    "PduError",
    "PduFlags",
    "PduHeader",
    "PduType",
    "Property",
    "SglId",
    "Sqe",
    "Status",
    "TermReq",
    "check_data_digest",
    "decode_header",
    "encode",
    "encode_bytes",
]
