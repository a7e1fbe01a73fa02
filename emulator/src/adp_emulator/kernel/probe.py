"""A hand-built NVMe/TCP ICReq/ICResp exchange used as the readiness check.

Layout (notes/nvme-tcp.md §1.1, §1.5; include/linux/nvme-tcp.h): common header = type (0x00 ICReq,
0x01 ICResp), flags, HLEN, PDO, PLEN (u32 LE); then PFV (u16), HPDA/CPDA (u8), DGST (u8), and for
ICReq MAXR2T / for ICResp MAXH2CDATA (u32); both PDUs are 128 bytes.
"""

from __future__ import annotations

import socket
import struct
import time

ICREQ_LEN = 128


def build_icreq(hdgst: bool = False, ddgst: bool = False) -> bytes:
    """A 128-byte ICReq: PFV 0, HPDA 0, MAXR2T 0, digests as requested."""
    hdr = struct.pack("<BBBBI", 0x00, 0, ICREQ_LEN, 0, ICREQ_LEN)
    body = struct.pack("<HBBI", 0, 0, (1 if hdgst else 0) | (2 if ddgst else 0), 0)
    return hdr + body + bytes(ICREQ_LEN - len(hdr) - len(body))


def parse_icresp(data: bytes) -> dict[str, int]:
    """Decode an ICResp; ValueError if it is not one."""
    if len(data) != ICREQ_LEN:
        raise ValueError(f"ICResp must be {ICREQ_LEN} bytes, got {len(data)}")
    ptype, flags, hlen, pdo, plen = struct.unpack_from("<BBBBI", data)
    if ptype != 0x01 or hlen != ICREQ_LEN or plen != ICREQ_LEN:
        raise ValueError(f"not an ICResp: type={ptype:#x} hlen={hlen} plen={plen}")
    pfv, cpda, dgst, maxh2c = struct.unpack_from("<HBBI", data, 8)
    return {"pfv": pfv, "cpda": cpda, "hdgst": dgst & 1, "ddgst": (dgst >> 1) & 1, "maxh2cdata": maxh2c,
            "flags": flags, "pdo": pdo}


def icreq_exchange(host: str, port: int, timeout: float = 5.0) -> dict[str, int]:
    """Connect, send an ICReq, read the 128-byte ICResp and close. Raises OSError/ValueError."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.settimeout(timeout)
        s.sendall(build_icreq())
        buf = b""
        while len(buf) < ICREQ_LEN:
            chunk = s.recv(ICREQ_LEN - len(buf))
            if not chunk:
                raise ConnectionError(f"connection closed after {len(buf)} of {ICREQ_LEN} ICResp bytes")
            buf += chunk
    return parse_icresp(buf)


def wait_icresp(host: str, port: int, timeout: float) -> dict[str, int]:
    """Retry :func:`icreq_exchange` until it succeeds (QEMU's hostfwd accepts before the guest listens)."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            return icreq_exchange(host, port, timeout=max(0.5, min(5.0, deadline - time.monotonic())))
        except (OSError, ValueError) as e:
            last = e
            time.sleep(0.2)
    raise TimeoutError(f"no ICResp from {host}:{port} within {timeout:.1f}s (last error: {last})")
