"""The NVMe/TCP ICReq/ICResp exchange used as the readiness check of a target (the kernel one in QEMU).

Every byte goes through the shared codec (:mod:`adp_wire`): the ICReq is encoded by it and the
answer is parsed by its :class:`~adp_wire.stream.PduDecoder`, which also checks that the first PDU a
host receives is an ICResp (or a C2HTermReq). Both IC PDUs are 128 bytes (NVMe/TCP transport spec,
include/linux/nvme-tcp.h).
"""

from __future__ import annotations

import socket
import time

from adp_wire.pdu import HLEN, ICReq, ICResp, PduError, TermReq, decode_header, encode_bytes
from adp_wire.stream import PduDecoder

ICREQ_LEN = HLEN[ICReq.type]
_IC_MAX_PLEN = 24 + 128  # an ICResp, or a C2HTermReq with its data


def build_icreq(hdgst: bool = False, ddgst: bool = False) -> bytes:
    """A 128-byte ICReq: PFV 0, HPDA 0, MAXR2T 0, digests as requested."""
    return encode_bytes(ICReq(hdgst=hdgst, ddgst=ddgst))


def _fields(resp: ICResp, flags: int, pdo: int) -> dict[str, int]:
    return {"pfv": resp.pfv, "cpda": resp.cpda, "hdgst": int(resp.hdgst), "ddgst": int(resp.ddgst),
            "maxh2cdata": resp.maxh2cdata, "flags": flags, "pdo": pdo}


def parse_icresp(data: bytes) -> dict[str, int]:
    """Decode an ICResp; ValueError if it is not one."""
    if len(data) != ICREQ_LEN:
        raise ValueError(f"ICResp must be {ICREQ_LEN} bytes, got {len(data)}")
    try:
        hdr = decode_header(data, receiver_is_host=True)
    except PduError as e:
        raise ValueError(f"not an ICResp: {e}") from None
    if not isinstance(hdr.pdu, ICResp):
        raise ValueError(f"not an ICResp: {type(hdr.pdu).__name__}")
    return _fields(hdr.pdu, hdr.ch.flags, hdr.ch.pdo)


def icreq_exchange(host: str, port: int, timeout: float = 5.0) -> dict[str, int]:
    """Connect, send an ICReq, read the ICResp and close. Raises OSError/ValueError."""
    dec = PduDecoder(receiver_is_host=True, max_plen=_IC_MAX_PLEN)
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.settimeout(timeout)
        s.sendall(build_icreq())
        got = 0
        while True:
            try:
                pdu = dec.next_pdu()
            except PduError as e:
                raise ValueError(f"not an ICResp: {e}") from None
            if pdu is not None:
                break
            chunk = s.recv(dec.needed)
            if not chunk:
                raise ConnectionError(f"connection closed after {got} of {ICREQ_LEN} ICResp bytes")
            got += len(chunk)
            dec.feed(chunk)
    if isinstance(pdu, TermReq):
        raise ValueError(f"not an ICResp: the target answered with C2HTermReq FES {pdu.fes:#x}")
    assert isinstance(pdu, ICResp)  # the decoder's sequence rule
    return _fields(pdu, 0, 0)  # the decoder accepted it: an ICResp's flags and PDO are 0


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
