"""NVMe completion status: the 16-bit STATUS word of a CQE, with names.

STATUS word layout: bit 0 phase (always 0 on fabrics), bits 8:1 SC, 11:9 SCT, 13:12 CRD,
bit 14 M (more info in the error log), bit 15 DNR (do not retry).
"""

from __future__ import annotations

from dataclasses import dataclass

# Status code types.
SCT_GENERIC = 0
SCT_COMMAND_SPECIFIC = 1
SCT_MEDIA = 2
SCT_PATH = 3
SCT_VENDOR = 7

_NAMES: dict[tuple[int, int], str] = {
    (0, 0x00): "SUCCESS",
    (0, 0x01): "INVALID_OPCODE",
    (0, 0x02): "INVALID_FIELD",
    (0, 0x03): "COMMAND_ID_CONFLICT",
    (0, 0x04): "DATA_TRANSFER_ERROR",
    (0, 0x05): "POWER_LOSS_ABORT",
    (0, 0x06): "INTERNAL_ERROR",
    (0, 0x07): "ABORT_REQUESTED",
    (0, 0x08): "SQ_DELETED_ABORT",
    (0, 0x0B): "INVALID_NAMESPACE",
    (0, 0x0C): "COMMAND_SEQUENCE_ERROR",
    (0, 0x0D): "INVALID_SGL_SEGMENT_DESCRIPTOR",
    (0, 0x0E): "INVALID_NUMBER_OF_SGL_DESCRIPTORS",
    (0, 0x0F): "SGL_DATA_BLOCK_INVALID",
    (0, 0x11): "SGL_DESCRIPTOR_TYPE_INVALID",
    (0, 0x16): "SGL_OFFSET_INVALID",
    (0, 0x1A): "KEEP_ALIVE_TIMER_INVALID",
    (0, 0x22): "TRANSIENT_TRANSPORT_ERROR",
    (0, 0x2C): "INVALID_IO_COMMAND_SET",
    (0, 0x80): "LBA_OUT_OF_RANGE",
    (0, 0x81): "CAPACITY_EXCEEDED",
    (0, 0x82): "NAMESPACE_NOT_READY",
    (1, 0x02): "INVALID_QUEUE_SIZE",
    (1, 0x05): "ASYNC_EVENT_REQUEST_LIMIT_EXCEEDED",
    (1, 0x09): "INVALID_LOG_PAGE",
    (1, 0x0D): "FEATURE_NOT_SAVEABLE",
    (1, 0x80): "CONNECT_INCOMPATIBLE_FORMAT",
    (1, 0x81): "CONNECT_CONTROLLER_BUSY",
    (1, 0x82): "CONNECT_INVALID_PARAMETERS",
    (1, 0x83): "CONNECT_RESTART_DISCOVERY",
    (1, 0x84): "CONNECT_INVALID_HOST",
    (1, 0x91): "AUTHENTICATION_REQUIRED",
    (2, 0x81): "UNRECOVERED_READ_ERROR",
    (2, 0x85): "COMPARE_FAILURE",
}
_CODES: dict[str, tuple[int, int]] = {name: code for code, name in _NAMES.items()}


@dataclass(frozen=True, slots=True)
class Status:
    """A decoded completion status."""

    sct: int = 0
    sc: int = 0
    dnr: bool = False
    more: bool = False
    crd: int = 0

    @classmethod
    def named(cls, name: str, dnr: bool | None = None) -> Status:
        """Status by name, e.g. ``Status.named("LBA_OUT_OF_RANGE")``; DNR defaults to set for errors."""
        sct, sc = _CODES[name]
        if dnr is None:
            dnr = name not in ("SUCCESS", "DATA_TRANSFER_ERROR", "NAMESPACE_NOT_READY",
                               "KEEP_ALIVE_TIMER_INVALID", "TRANSIENT_TRANSPORT_ERROR",
                               "COMPARE_FAILURE")
        return cls(sct, sc, dnr)

    @classmethod
    def from_word(cls, word: int) -> Status:
        return cls(
            sct=(word >> 9) & 0x7,
            sc=(word >> 1) & 0xFF,
            dnr=bool(word & 0x8000),
            more=bool(word & 0x4000),
            crd=(word >> 12) & 0x3,
        )

    @property
    def word(self) -> int:
        return (self.sc << 1) | (self.sct << 9) | (self.crd << 12) | (self.more << 14) | (self.dnr << 15)

    @property
    def ok(self) -> bool:
        return self.sct == 0 and self.sc == 0

    @property
    def name(self) -> str:
        return _NAMES.get((self.sct, self.sc), f"SCT{self.sct:#x}_SC{self.sc:#04x}")

    def __str__(self) -> str:
        return f"{self.name} (sct={self.sct:#x} sc={self.sc:#04x}{' dnr' if self.dnr else ''})"


SUCCESS = Status()


def status_names() -> list[str]:
    """All status names this module knows."""
    return sorted(_CODES)
