"""Unit and property tests of the sans-IO NVMe/TCP codec (no sockets)."""

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
    DataDigestError,
    FatalErrorStatus,
    H2CData,
    ICReq,
    ICResp,
    IoOpcode,
    PduDecoder,
    PduError,
    PduType,
    Status,
    TermReq,
    decode_header,
    encode,
    encode_bytes,
)
from adp_wire import sqe as S
from adp_wire import structs as T
from adp_wire.digest import crc32c
from adp_wire.sqe import Cqe, Sqe
from adp_wire.status import status_names

u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
payload = st.binary(min_size=1, max_size=4096)


def roundtrip(pdu, to_host: bool, hdgst=False, ddgst=False, pda=0, chunk=None):
    raw = encode_bytes(pdu, hdgst, ddgst, pda)
    dec = PduDecoder(receiver_is_host=to_host)
    dec._ic_seen = not isinstance(pdu, (ICReq, ICResp))
    dec.set_digests(hdgst, ddgst)
    if chunk:
        out = None
        for i in range(0, len(raw), chunk):
            assert out is None, "PDU returned before all bytes were fed"
            dec.feed(raw[i : i + chunk])
            out = dec.next_pdu()
    else:
        dec.feed(raw)
        out = dec.next_pdu()
    assert dec.buffered == 0
    return raw, out


def test_crc32c_check_value():
    assert crc32c(b"123456789") == 0xE3069283


def test_icreq_reference_bytes():
    # Reference bytes of a Linux host ICReq without digests (nvme-tcp brief §1.5).
    assert encode_bytes(ICReq()) == bytes.fromhex("0000800080000000") + bytes(120)
    raw = encode_bytes(ICResp(maxh2cdata=0x400000))
    assert raw[:16] == bytes.fromhex("01008000800000000000000000004000")


@given(hpda=st.integers(0, 31), h=st.booleans(), d=st.booleans(), maxr2t=u32)
def test_icreq_roundtrip(hpda, h, d, maxr2t):
    pdu = ICReq(0, hpda, h, d, maxr2t)
    raw, out = roundtrip(pdu, to_host=False)
    assert len(raw) == 128 and out == pdu


@given(cpda=st.integers(0, 31), h=st.booleans(), d=st.booleans(), maxdata=u32)
def test_icresp_roundtrip(cpda, h, d, maxdata):
    pdu = ICResp(0, cpda, h, d, maxdata)
    assert roundtrip(pdu, to_host=True)[1] == pdu


@settings(max_examples=200)
@given(data=st.binary(max_size=9000), h=st.booleans(), d=st.booleans(), pda=st.integers(0, 7),
       chunk=st.sampled_from([None, 1, 7, 100]), cid=u16)
def test_capsule_cmd_roundtrip(data, h, d, pda, chunk, cid):
    sqe = S.rw_cmd(IoOpcode.WRITE, 1, 5, 1, len(data), in_capsule=True)
    sqe.cid = cid
    raw, out = roundtrip(CapsuleCmd(sqe.encode(), data), False, h, d, pda, chunk)
    assert isinstance(out, CapsuleCmd)
    assert Sqe.decode(out.sqe) == sqe
    assert bytes(out.data) == data
    hlen = 72 + (4 if h else 0)
    if data:
        pdo = raw[3]
        assert pdo >= hlen and (pda == 0 or pdo % ((pda + 1) * 4) == 0)
        assert len(raw) == pdo + len(data) + (4 if d else 0)
    else:
        assert len(raw) == hlen and raw[3] == 0


@given(data=payload, h=st.booleans(), d=st.booleans(), cid=u16, ttag=u16, off=u32, last=st.booleans())
def test_h2c_data_roundtrip(data, h, d, cid, ttag, off, last):
    _, out = roundtrip(H2CData(cid, ttag, off, data, last), False, h, d)
    assert (out.cccid, out.ttag, out.datao, bytes(out.data), out.last, out.datal) == (cid, ttag, off, data, last,
                                                                                         len(data))


@given(data=payload, h=st.booleans(), d=st.booleans(), cid=u16, off=u32, last=st.booleans(), ok=st.booleans())
def test_c2h_data_roundtrip(data, h, d, cid, off, last, ok):
    _, out = roundtrip(C2HData(cid, off, data, last, ok), True, h, d)
    assert (out.cccid, out.datao, bytes(out.data), out.last, out.success) == (cid, off, data, last, ok)


@given(h=st.booleans(), cid=u16, ttag=u16, off=u32, length=st.integers(1, 0xFFFFFFFF))
def test_r2t_and_capsule_resp_roundtrip(h, cid, ttag, off, length):
    assert roundtrip(R2T(cid, ttag, off, length), True, h, True)[1] == R2T(cid, ttag, off, length)
    cqe = Cqe(cid=cid, status=Status.named("LBA_OUT_OF_RANGE"), dw0=off, sqhd=ttag, sqid=3)
    raw, out = roundtrip(CapsuleResp(cqe.encode()), True, h, True)
    assert len(raw) == 24 + (4 if h else 0)
    assert Cqe.decode(out.cqe) == cqe


@given(fes=st.sampled_from(list(FatalErrorStatus)), fei=u32, data=st.binary(max_size=200))
def test_term_req_roundtrip(fes, fei, data):
    for from_host in (True, False):
        raw, out = roundtrip(TermReq(fes, fei, data, from_host), to_host=not from_host, hdgst=True, ddgst=True)
        assert out.fes == fes and out.fei == fei and out.data == data[:128]
        assert raw[1] == 0  # never digested
        assert out.type == (PduType.H2C_TERM_REQ if from_host else PduType.C2H_TERM_REQ)


def test_encode_returns_payload_without_copy():
    data = memoryview(bytearray(65536))
    bufs = encode(C2HData(1, 0, data, True), hdgst=True, ddgst=True)
    assert bufs[1] is data  # payload handed to sendmsg as is
    assert len(bufs) == 3 and len(bufs[0]) == 28


@given(sqe_fields=st.tuples(st.integers(0, 255), u16, u32, st.integers(0, 2**64 - 1), u32, u32, u32, u32, u32,
                            u32))
def test_sqe_roundtrip(sqe_fields):
    opc, cid, nsid, mptr, c10, c11, c12, c13, c14, c15 = sqe_fields
    sqe = Sqe(opcode=opc, cid=cid, nsid=nsid, mptr=mptr, cdw10=c10, cdw11=c11, cdw12=c12, cdw13=c13, cdw14=c14,
              cdw15=c15)
    raw = sqe.encode()
    assert len(raw) == 64 and Sqe.decode(raw) == sqe
    buf = bytearray(80)
    sqe.encode_into(buf, 8)
    assert bytes(buf[8:72]) == raw


def test_sqe_field_offsets():
    sqe = S.rw_cmd(IoOpcode.READ, nsid=7, slba=0x1_0000_0002, nlb=65536, length=1 << 28)
    sqe.cid = 0x1234
    raw = sqe.encode()
    assert raw[0] == 0x02 and raw[1] == 0x40 and raw[2:4] == b"\x34\x12"
    assert struct.unpack_from("<I", raw, 4)[0] == 7
    assert struct.unpack_from("<Q", raw, 40)[0] == 0x1_0000_0002
    assert struct.unpack_from("<I", raw, 48)[0] & 0xFFFF == 0xFFFF  # NLB is 0's based
    assert struct.unpack_from("<I", raw, 32)[0] == 1 << 28  # SGL length
    assert raw[39] == 0x5A
    assert sqe.nlb == 65536 and sqe.slba == 0x1_0000_0002
    with pytest.raises(ValueError):
        S.rw_cmd(IoOpcode.READ, 1, 0, 65537, 0)


def test_connect_and_property_layout():
    sqe = S.connect_cmd(qid=3, sqsize=128, kato_ms=5000, cattr=4)
    raw = sqe.encode()
    assert raw[0] == 0x7F and raw[4] == 0x01  # FCTYPE Connect
    assert struct.unpack_from("<HHHBxI", raw, 40) == (0, 3, 127, 4, 5000)
    assert raw[39] == 0x01 and struct.unpack_from("<I", raw, 32)[0] == 1024
    assert S.connect_fields(Sqe.decode(raw)) == (0, 3, 128, 4, 5000)
    ps = S.property_set_cmd(0x14, 0x460061).encode()
    assert ps[4] == 0x00 and ps[40] == 0 and struct.unpack_from("<IQ", ps, 44) == (0x14, 0x460061)
    pg = S.property_get_cmd(0, size8=True).encode()
    assert pg[4] == 0x04 and pg[40] == 1


def test_log_page_and_features_layout():
    sqe = S.get_log_page_cmd(0x70, length=(1 << 18) + 4, offset=1 << 33)
    numd = (1 << 18) // 4
    assert sqe.cdw10 == 0x70 | ((numd & 0xFFFF) << 16) and sqe.cdw11 == numd >> 16
    assert sqe.cdw12 == 0 and sqe.cdw13 == 2
    with pytest.raises(ValueError):
        S.get_log_page_cmd(1, 6)
    assert S.set_features_cmd(7, (3 << 16) | 3).cdw11 == 0x30003


def test_dsm_ranges():
    ranges = [(0, 8), (1 << 40, 0xFFFFFFFF)]
    raw = S.dsm_ranges(ranges)
    assert len(raw) == 32 and S.decode_dsm_ranges(raw) == ranges
    assert S.dsm_cmd(1, 2).cdw10 == 1 and S.dsm_cmd(1, 2).cdw11 == 4


@given(word=u16)
def test_status_word_roundtrip(word):
    word &= ~1  # phase bit is not part of the status
    assert Status.from_word(word).word == word


def test_status_names():
    st_ = Status.named("LBA_OUT_OF_RANGE")
    assert (st_.sct, st_.sc, st_.dnr, st_.word) == (0, 0x80, True, 0x8100)
    assert Status.named("INVALID_OPCODE").word == 0x8002
    assert Status.named("CONNECT_INVALID_HOST").word == 0x8308
    assert Status.named("SUCCESS").ok and Status().name == "SUCCESS"
    assert "LBA_OUT_OF_RANGE" in str(st_)
    assert Status(7, 0x42).name == "SCT0x7_SC0x42"
    assert len(status_names()) > 20


# ---------------------------------------------------------------------------------------------------
# Malformed input: every violation maps to a fatal error status the target reports in C2HTermReq.


def _hdr(t, flags=0, hlen=24, pdo=0, plen=24, rest=b""):
    return struct.pack("<BBBBI", t, flags, hlen, pdo, plen) + rest.ljust(hlen - 8, b"\0")


@pytest.mark.parametrize(
    ("raw", "to_host", "fes"),
    [
        (_hdr(0x08), False, FatalErrorStatus.INVALID_HEADER_FIELD),  # unused type
        (_hdr(PduType.C2H_DATA, plen=30), False, FatalErrorStatus.INVALID_HEADER_FIELD),  # wrong direction
        (_hdr(PduType.CAPSULE_CMD, hlen=24, plen=24), False, FatalErrorStatus.INVALID_HEADER_FIELD),  # HLEN
        (_hdr(PduType.CAPSULE_CMD, flags=0x01, hlen=72, plen=76), False, FatalErrorStatus.INVALID_HEADER_FIELD),
        (_hdr(PduType.CAPSULE_CMD, flags=0x10, hlen=72, plen=72), False, FatalErrorStatus.INVALID_HEADER_FIELD),
        (_hdr(PduType.H2C_DATA, hlen=24, plen=24), False, FatalErrorStatus.INVALID_HEADER_FIELD),  # no data
        (_hdr(PduType.H2C_DATA, hlen=24, pdo=20, plen=40), False, FatalErrorStatus.INVALID_HEADER_FIELD),
        (_hdr(PduType.H2C_DATA, hlen=24, pdo=24, plen=24 + (1 << 31)), False,
         FatalErrorStatus.DATA_TRANSFER_LIMIT_EXCEEDED),
        (_hdr(PduType.CAPSULE_RESP, hlen=24, pdo=24, plen=40), True, FatalErrorStatus.INVALID_HEADER_FIELD),
        (_hdr(PduType.IC_RESP, hlen=128, plen=129), True, FatalErrorStatus.INVALID_HEADER_FIELD),
    ],
)
def test_malformed_headers(raw, to_host, fes):
    dec = PduDecoder(receiver_is_host=to_host)
    dec._ic_seen = raw[0] not in (PduType.IC_REQ, PduType.IC_RESP)
    dec.feed(raw + bytes(64))
    with pytest.raises(PduError) as e:
        dec.next_pdu()
    assert e.value.fes == fes
    assert e.value.header  # offending header is kept for the TermReq


def test_h2c_datal_must_match_plen():
    raw = bytearray(encode_bytes(H2CData(1, 1, 0, b"x" * 16, True)))
    struct.pack_into("<I", raw, 16, 15)
    with pytest.raises(PduError) as e:
        decode_header(raw[:24], receiver_is_host=False)
    assert e.value.fes == FatalErrorStatus.INVALID_HEADER_FIELD and e.value.fei == 16


def test_sequence_errors():
    dec = PduDecoder(receiver_is_host=False)
    sqe = Sqe(opcode=0x18)
    dec.feed(encode_bytes(CapsuleCmd(sqe.encode())))
    with pytest.raises(PduError) as e:
        dec.next_pdu()
    assert e.value.fes == FatalErrorStatus.PDU_SEQUENCE_ERROR
    dec = PduDecoder(receiver_is_host=False)
    dec.feed(encode_bytes(ICReq()) * 2)
    assert isinstance(dec.next_pdu(), ICReq)
    with pytest.raises(PduError) as e:
        dec.next_pdu()
    assert e.value.fes == FatalErrorStatus.PDU_SEQUENCE_ERROR


def test_header_digest_error():
    raw = bytearray(encode_bytes(R2T(1, 2, 0, 4096), hdgst=True))
    raw[12] ^= 0xFF
    dec = PduDecoder(receiver_is_host=True)
    dec._ic_seen = True
    dec.set_digests(True, False)
    dec.feed(raw)
    with pytest.raises(PduError) as e:
        dec.next_pdu()
    assert e.value.fes == FatalErrorStatus.HEADER_DIGEST_ERROR


def test_data_digest_error_keeps_stream_usable():
    good = encode_bytes(C2HData(9, 0, b"abcd" * 8, True), True, True)
    bad = bytearray(good)
    bad[-5] ^= 1  # last data byte
    dec = PduDecoder(receiver_is_host=True)
    dec._ic_seen = True
    dec.set_digests(True, True)
    dec.feed(bytes(bad) + good)
    with pytest.raises(DataDigestError) as e:
        dec.next_pdu()
    assert e.value.cccid == 9
    assert bytes(dec.next_pdu().data) == b"abcd" * 8


def test_missing_digest_flags_rejected_once_negotiated():
    raw = encode_bytes(C2HData(1, 0, b"z" * 8, True))  # no digests
    dec = PduDecoder(receiver_is_host=True)
    dec._ic_seen = True
    dec.set_digests(True, False)
    dec.feed(raw)
    with pytest.raises(PduError):
        dec.next_pdu()


@settings(max_examples=300)
@given(st.binary(min_size=8, max_size=300))
def test_decoder_never_crashes_on_garbage(data):
    for to_host in (False, True):
        dec = PduDecoder(receiver_is_host=to_host, max_plen=1 << 16)
        dec.feed(data)
        try:
            while dec.next_pdu() is not None:
                pass
        except (PduError, DataDigestError):
            pass


# ---------------------------------------------------------------------------------------------------
# Structures


def test_identify_controller_offsets():
    ic = T.IdentifyController(sn="SN1", mn="ADP", fr="1.0", subnqn="nqn.2026-11.io.awide:x", cntlid=0x1234,
                              mdts=5, kas=10, ioccsz=516, maxcmd=128, nn=1, oncs=0xC, sgls=0x100001)
    raw = ic.encode()
    assert len(raw) == 4096
    assert raw[4:24] == b"SN1".ljust(20) and raw[24:64] == b"ADP".ljust(40)
    assert raw[77] == 5 and struct.unpack_from("<H", raw, 78)[0] == 0x1234
    assert struct.unpack_from("<H", raw, 320)[0] == 10 and raw[512] == 0x66 and raw[513] == 0x44
    assert struct.unpack_from("<I", raw, 536)[0] == 0x100001
    assert struct.unpack_from("<I", raw, 1792)[0] == 516
    assert raw[768:790] == b"nqn.2026-11.io.awide:x"
    assert T.IdentifyController.decode(raw) == ic
    assert ic.in_capsule_data_size == 516 * 16 - 64


def test_identify_namespace_and_lists():
    ns = T.IdentifyNamespace(nsze=1 << 40, ncap=1 << 40, nuse=3, nlbaf=1, flbas=1,
                             lbaf=[T.LbaFormat(0, 9), T.LbaFormat(0, 12)], nguid=bytes(range(16)))
    raw = ns.encode()
    assert struct.unpack_from("<Q", raw, 0)[0] == 1 << 40 and raw[26] == 1 and raw[128 + 4 + 2] == 12
    back = T.IdentifyNamespace.decode(raw)
    assert back == ns and back.lba_size == 4096
    assert T.decode_ns_list(T.encode_ns_list([3, 1, 2])) == [1, 2, 3]
    descs = [(3, bytes(16)), (4, b"\0")]
    assert T.decode_ns_descriptors(T.encode_ns_descriptors(descs)) == descs


def test_connect_data_and_discovery_log():
    cd = T.ConnectData(bytes(range(16)), 0xFFFF, "nqn.sub", "nqn.host")
    raw = cd.encode()
    assert len(raw) == 1024 and raw[256:263] == b"nqn.sub" and raw[512:520] == b"nqn.host"
    assert T.ConnectData.decode(raw) == cd
    entries = [T.DiscoveryEntry("nqn.a", "127.0.0.1", "4420"), T.DiscoveryEntry("nqn.b", "::1", "4421", adrfam=2)]
    log = T.encode_discovery_log(7, entries)
    assert len(log) == 3 * 1024 and log[1024] == 3 and log[1024 + 32 : 1024 + 36] == b"4420"
    assert T.decode_discovery_log(log) == (7, entries)
    with pytest.raises(ValueError):
        T.check_nqn("x" * 224)


def test_error_and_smart_logs():
    e = T.ErrorLogEntry(5, 1, 9, 0x8100, 0xFFFF, 1 << 33, 1, 0x02)
    assert len(e.encode()) == 64 and T.ErrorLogEntry.decode(e.encode()) == e
    s = T.SmartLog(data_units_read=1 << 70, host_write_commands=12)
    assert len(s.encode()) == 512 and T.SmartLog.decode(s.encode()) == s
