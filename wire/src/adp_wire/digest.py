"""CRC-32C (Castagnoli) digests as NVMe/TCP uses them (header and data digests).

The ``crc32c`` package (hardware-accelerated, maintained on PyPI) computes the standard reflected
CRC-32C with init and final XOR 0xFFFFFFFF; NVMe/TCP stores that value little-endian.
Check value: crc32c(b"123456789") == 0xE3069283.
"""

from __future__ import annotations

import struct

from crc32c import crc32c as _crc32c

_U32 = struct.Struct("<I")


def crc32c(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC-32C of ``data``; pass a previous result as ``value`` to continue over several buffers."""
    return _crc32c(data, value)


def digest_bytes(data: bytes | bytearray | memoryview) -> bytes:
    """The 4-byte little-endian digest field for ``data``."""
    return _U32.pack(_crc32c(data))


def read_digest(data: bytes | bytearray | memoryview, offset: int = 0) -> int:
    return _U32.unpack_from(data, offset)[0]
