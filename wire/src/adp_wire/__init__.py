"""Sans-IO NVMe/TCP codec: the one description of the wire format, used by the host client
(adp_connector.nvmeof.host), the userspace target (adp_emulator.target) and the kernel target's
readiness probe for every PDU they send or parse.

Bytes in, typed values out, and back; nothing here touches a socket. Modules:

* :mod:`.constants` - PDU types, flags, opcodes, CNS/LID/FID, property offsets.
* :mod:`.status` - completion status words with names.
* :mod:`.sqe` - 64-byte SQE / 16-byte CQE and command builders.
* :mod:`.pdu` - PDU values, :func:`encode` to buffers, strict :func:`decode_header`.
* :mod:`.stream` - :class:`PduDecoder`, an incremental bytes -> PDUs decoder.
* :mod:`.structs` - Connect data, Identify structures, discovery/error/SMART log pages.
* :mod:`.digest` - CRC-32C header/data digests.
* :mod:`.negotiate` - ICReq/ICResp checks and :class:`QueueState` (digests, alignment, SQ head).
* :mod:`.hotpath` - :class:`PduPacker` and :class:`HeaderCheck`: the per-command PDUs with precompiled
  structs, byte for byte what :func:`encode` / :func:`decode_header` produce and accept.
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
from .hotpath import HeaderCheck, PduPacker
from .negotiate import NegotiationError, QueueState, accept_icreq, accept_icresp
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
    "HeaderCheck",
    "ICReq",
    "ICResp",
    "IoOpcode",
    "LogPage",
    "NegotiationError",
    "Pdu",
    "PduDecoder",
    "PduError",
    "PduFlags",
    "PduHeader",
    "PduPacker",
    "PduType",
    "Property",
    "QueueState",
    "SglId",
    "Sqe",
    "Status",
    "TermReq",
    "accept_icreq",
    "accept_icresp",
    "check_data_digest",
    "decode_header",
    "encode",
    "encode_bytes",
]
