"""The codec's fast paths (what the host, the target and the probe put on the wire) against its reference.

PduPacker must produce exactly the bytes :func:`encode` produces; HeaderCheck must accept exactly the
headers :func:`check_common_header` + :func:`decode_header` accept, with the same results, and refuse
the others with the same FES/FEI. The queue state and IC negotiation shared by both ends live here too.
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adp_wire import (
    R2T,
    C2HData,
    CapsuleCmd,
    CapsuleResp,
    H2CData,
    HeaderCheck,
    ICReq,
    ICResp,
    NegotiationError,
    PduDecoder,
    PduError,
    PduPacker,
    QueueState,
    TermReq,
    accept_icreq,
    accept_icresp,
    decode_header,
    encode_bytes,
)
from adp_wire.constants import CATTR_DISABLE_SQ_FLOW_CONTROL, FatalErrorStatus, IoOpcode, PduType
from adp_wire.hotpath import CQE_FIELDS, DATA_FIELDS, payload_digest
from adp_wire.pdu import CommonHeader, check_common_header
from adp_wire.sqe import Cqe, keep_alive_cmd, rw_cmd
from adp_wire.status import Status

NEGOTIATED = [(h, d, pda) for h in (False, True) for d in (False, True) for pda in (0, 3)]


def joined(bufs: list) -> bytes:
    return b"".join(bytes(b) for b in bufs)


@pytest.mark.parametrize(("hd", "dd", "pda"), NEGOTIATED)
def test_packer_bytes_equal_the_reference_encoder(hd, dd, pda) -> None:
    p = PduPacker(hd, dd, pda)
    data = bytes(range(256)) * 17
    sqe = keep_alive_cmd()
    sqe.cid = 9
    assert joined(p.capsule(sqe.encode())) == encode_bytes(CapsuleCmd(sqe.encode()), hd, dd, pda)
    assert joined(p.capsule(sqe.encode(), data)) == encode_bytes(CapsuleCmd(sqe.encode(), data), hd, dd, pda)
    for opcode in (IoOpcode.READ, IoOpcode.WRITE):
        ref = rw_cmd(opcode, 1, (7 << 32) | 5, 2, 8192)
        ref.cid = 33
        assert joined(p.rw_capsule(opcode, 33, 1, (7 << 32) | 5, 2, 8192)) == encode_bytes(
            CapsuleCmd(ref.encode()), hd, dd, pda)
    ref = rw_cmd(IoOpcode.WRITE, 1, 5, 1, len(data), in_capsule=True)
    ref.cid = 4
    assert joined(p.rw_capsule(IoOpcode.WRITE, 4, 1, 5, 1, len(data), data)) == encode_bytes(
        CapsuleCmd(ref.encode(), data), hd, dd, pda)
    cqe = Cqe(cid=3, status=Status.named("LBA_OUT_OF_RANGE"), dw0=0xDEAD, dw1=7, sqhd=12, sqid=2)
    assert p.capsule_resp(3, cqe.status.word, 0xDEAD, 7, 12, 2) == encode_bytes(CapsuleResp(cqe.encode()), hd, dd,
                                                                                   pda)
    assert p.r2t(3, 4, 8192, 65536) == encode_bytes(R2T(3, 4, 8192, 65536), hd, dd, pda)
    for last in (False, True):
        assert joined(p.h2c_data(3, 4, 512, data, last)) == encode_bytes(H2CData(3, 4, 512, data, last), hd, dd, pda)
        for success in (False, True):
            assert joined(p.c2h_data(3, 512, data, last, success)) == encode_bytes(
                C2HData(3, 512, data, last, success), hd, dd, pda)


def test_packer_splices_scatter_lists_without_copying() -> None:
    p = PduPacker(True, True, 0)
    parts = [memoryview(b"a" * 100), memoryview(b"b" * 412)]
    bufs = p.h2c_data(1, 2, 0, parts, True)
    assert bufs[1] is parts[0] and bufs[2] is parts[1]
    assert joined(bufs) == encode_bytes(H2CData(1, 2, 0, b"a" * 100 + b"b" * 412, True), True, True)
    assert payload_digest(parts) == payload_digest(b"a" * 100 + b"b" * 412)
    assert payload_digest(parts) != payload_digest(b"b" * 412 + b"a" * 100)  # negative control: order matters


def reference(raw: bytes, to_host: bool, hd: bool, dd: bool, limit: int) -> tuple:
    """What the codec's general path says of a header received after the IC exchange."""
    ch = CommonHeader.parse(raw)
    if ch.type in (PduType.IC_REQ, PduType.IC_RESP):
        raise PduError(FatalErrorStatus.PDU_SEQUENCE_ERROR, "second IC PDU", 0, raw[:8])
    check_common_header(ch, raw[:8], to_host, hd, dd, limit)
    h = decode_header(raw, to_host, hd, dd, limit)
    return ch.type, h.header_span, h.data_offset, h.data_len, h.has_ddgst


def fast(raw: bytes, to_host: bool, hd: bool, dd: bool, limit: int) -> tuple:
    rx = HeaderCheck(to_host, hd, dd, max_plen=limit)
    t, span, pdo, dlen, has_dd = rx.common(raw)
    rx.complete(raw, t, span, dlen)
    return t, span, pdo, dlen, has_dd


def outcome(fn, *args) -> tuple:
    try:
        return ("ok", fn(*args))
    except PduError as e:
        return ("error", e.fes, e.fei)


def sample_headers(hd: bool, dd: bool, pda: int) -> list[tuple[bytes, bool]]:
    """(header bytes, received by the host) for every PDU type a queue carries after the IC exchange."""
    sqe = keep_alive_cmd().encode()
    pdus = [(CapsuleCmd(sqe), False), (CapsuleCmd(sqe, b"x" * 64), False), (H2CData(1, 2, 0, b"y" * 512, True), False),
            (TermReq(1, 2, b"z" * 10, from_host=True), False), (CapsuleResp(Cqe(cid=1).encode()), True),
            (C2HData(1, 0, b"w" * 512, True, True), True), (R2T(1, 2, 0, 4096), True), (TermReq(4, 0), True)]
    out = []
    for pdu, to_host in pdus:
        raw = encode_bytes(pdu, hd, dd, pda)
        ch = CommonHeader.parse(raw)
        span = ch.hlen + (4 if ch.flags & 1 else 0)
        out.append((raw[:span], to_host))
    return out


@pytest.mark.parametrize(("hd", "dd", "pda"), NEGOTIATED)
def test_header_check_accepts_what_the_codec_accepts(hd, dd, pda) -> None:
    for raw, to_host in sample_headers(hd, dd, pda):
        got = outcome(fast, raw, to_host, hd, dd, 1 << 20)
        assert got[0] == "ok", (raw[:8], got)
        assert got == outcome(reference, raw, to_host, hd, dd, 1 << 20)


# A mutation: (byte offset, value) sets a byte, (byte offset, delta) with the flag nudges one (the common
# header's fields and DATAL, where near-valid values find the edge cases).
MUTATION = st.one_of(
    st.tuples(st.integers(0, 27), st.integers(0, 255), st.just(False)),
    st.tuples(st.sampled_from([0, 1, 2, 3, 4, 5, 20, 21]), st.integers(-9, 9), st.just(True)),
)


@settings(max_examples=600, deadline=None)
@given(case=st.integers(0, 7), neg=st.sampled_from(NEGOTIATED), mutations=st.lists(MUTATION, min_size=1, max_size=3),
       tight=st.booleans())
def test_header_check_refuses_like_the_codec(case, neg, mutations, tight) -> None:
    hd, dd, pda = neg
    raw, to_host = sample_headers(hd, dd, pda)[case]
    limit = CommonHeader.parse(raw).plen if tight else 1 << 20  # tight: a larger PLEN exceeds the bound
    buf = bytearray(raw)
    for pos, value, nudge in mutations:
        if pos < len(buf):
            buf[pos] = (buf[pos] + value) & 0xFF if nudge else value
    ch = CommonHeader.parse(buf)
    if ch.hlen + (4 if ch.flags & 1 else 0) > len(buf):
        buf += bytes(ch.hlen + 4 - len(buf))  # a reader would have read this far
    assert outcome(fast, bytes(buf), to_host, hd, dd, limit) == outcome(reference, bytes(buf), to_host, hd, dd, limit)


def test_header_check_rejects_a_second_icreq_and_bad_digests() -> None:
    rx = HeaderCheck(receiver_is_host=False, hdgst=True)
    with pytest.raises(PduError) as e:
        rx.common(encode_bytes(ICReq()))
    assert e.value.fes == FatalErrorStatus.PDU_SEQUENCE_ERROR
    raw = bytearray(encode_bytes(CapsuleCmd(keep_alive_cmd().encode()), hdgst=True))
    t, span, _, dlen, _ = rx.common(raw)
    rx.complete(raw, t, span, dlen)  # intact: accepted
    raw[20] ^= 1
    with pytest.raises(PduError) as e:
        rx.complete(raw, t, span, dlen)
    assert e.value.fes == FatalErrorStatus.HEADER_DIGEST_ERROR


def test_field_structs_read_what_the_encoder_wrote() -> None:
    raw = encode_bytes(CapsuleResp(Cqe(cid=77, status=Status.named("INVALID_FIELD"), dw0=5, dw1=6, sqhd=9,
                                       sqid=3).encode()))
    assert CQE_FIELDS.unpack_from(raw, 0) == (5, 6, 9, 3, 77, Status.named("INVALID_FIELD").word)
    assert DATA_FIELDS.unpack_from(encode_bytes(H2CData(11, 12, 4096, b"q" * 8)), 0) == (11, 12, 4096, 8)
    assert DATA_FIELDS.unpack_from(encode_bytes(R2T(1, 2, 3, 4)), 0) == (1, 2, 3, 4)


def test_queue_state_sq_head_and_negotiation() -> None:
    s = QueueState.from_icreq(ICReq(hpda=1, hdgst=True), maxh2cdata=65536)
    assert (s.hdgst, s.ddgst, s.pda, s.maxh2cdata) == (True, False, 1, 65536)
    assert s.data_offset(24) == 32  # 24 + 4 rounded up to 8
    assert s.next_sqhd() == 0  # not connected: no SQ accounting
    s.connected(3, 0)
    assert [s.next_sqhd() for _ in range(4)] == [1, 2, 0, 1]
    s.connected(3, CATTR_DISABLE_SQ_FLOW_CONTROL)
    assert [s.next_sqhd() for _ in range(2)] == [0, 0]
    h = QueueState.from_icresp(ICResp(cpda=0, ddgst=True, maxh2cdata=8192))
    assert (h.hdgst, h.ddgst, h.pda, h.maxh2cdata) == (False, True, 0, 8192)


def test_ic_parameter_checks() -> None:
    raw = encode_bytes(ICReq())
    accept_icreq(ICReq(), raw)
    for req, fes, fei in ((ICReq(pfv=1), FatalErrorStatus.UNSUPPORTED_PARAMETER, 8),
                          (ICReq(hpda=32), FatalErrorStatus.INVALID_HEADER_FIELD, 10)):
        with pytest.raises(PduError) as e:
            accept_icreq(req, raw)
        assert (e.value.fes, e.value.fei) == (fes, fei)
    with pytest.raises(PduError) as e:
        accept_icreq(ICReq(ddgst=False), raw, require_data_digest=True)
    assert e.value.fei == 11
    accept_icresp(ICResp(maxh2cdata=4096), False, False)
    with pytest.raises(NegotiationError, match="unacceptable"):
        accept_icresp(ICResp(maxh2cdata=1024), False, False)
    with pytest.raises(NegotiationError, match="granted digests"):
        accept_icresp(ICResp(maxh2cdata=4096, hdgst=True), False, False)


def test_decoder_needed_reads_exactly_one_pdu() -> None:
    dec = PduDecoder(receiver_is_host=True)
    stream = encode_bytes(ICResp(maxh2cdata=4096)) + encode_bytes(R2T(1, 2, 0, 8))
    pos, seen = 0, []
    while len(seen) < 2:
        n = dec.needed
        assert n >= 1
        dec.feed(stream[pos:pos + n])
        pos += n
        if (pdu := dec.next_pdu()) is not None:
            seen.append(pdu)
            assert pos in (128, 152)  # never past the PDU
    assert isinstance(seen[0], ICResp) and isinstance(seen[1], R2T)


def test_decoder_first_pdu_is_the_receivers_ic_pdu() -> None:
    for receiver_is_host, wrong in ((False, encode_bytes(ICResp(maxh2cdata=4096))),
                                    (True, encode_bytes(ICReq())),
                                    (False, encode_bytes(TermReq(1))),  # a C2HTermReq sent to a controller
                                    (True, encode_bytes(TermReq(1, from_host=True)))):
        dec = PduDecoder(receiver_is_host)
        dec.feed(wrong)
        with pytest.raises(PduError) as e:
            dec.next_pdu()
        assert e.value.fes == FatalErrorStatus.PDU_SEQUENCE_ERROR
    dec = PduDecoder(receiver_is_host=False)
    dec.feed(encode_bytes(TermReq(1, from_host=True)))
    assert isinstance(dec.next_pdu(), TermReq)


def test_rw_capsule_fields_match_the_sqe_views() -> None:
    raw = joined(PduPacker().rw_capsule(IoOpcode.READ, 5, 1, (1 << 40) + 3, 65536, 65536 << 12))
    from adp_wire.sqe import Sqe

    sqe = Sqe.decode(raw, 8)
    assert (sqe.cid, sqe.slba, sqe.nlb, sqe.sgl_len) == (5, (1 << 40) + 3, 65536, 65536 << 12)
    assert struct.unpack_from("<B", raw, 8 + 39)[0] == 0x5A  # transport SGL data block


def test_small_log_and_identify_structures() -> None:
    from adp_wire.structs import decode_supported_logs, encode_independent_ns, encode_supported_logs

    page = encode_supported_logs([0x70, 0x02])
    assert len(page) == 1024 and decode_supported_logs(page) == [0x02, 0x70]
    assert page[0x70 * 4:0x70 * 4 + 4] == b"\1\0\0\0" and page[:4] == bytes(4)
    ns = encode_independent_ns(nmic=1, nstat=1)
    assert len(ns) == 4096 and (ns[1], ns[14]) == (1, 1) and ns.count(0) == 4094
