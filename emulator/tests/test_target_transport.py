"""Userspace target: malformed PDUs end only their own connection, with the right C2HTermReq."""

from __future__ import annotations

import os
import struct
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from target_client import RawQueue, open_admin, open_io, running_target

from adp_wire import CapsuleCmd, H2CData, ICReq, encode_bytes
from adp_wire.constants import FatalErrorStatus as F
from adp_wire.constants import IoOpcode
from adp_wire.sqe import keep_alive_cmd, rw_cmd


@pytest.fixture(scope="module")
def tgt():
    with running_target(require_data_digest=False) as t:
        yield t


@pytest.fixture(scope="module")
def bystander(tgt):
    """An association whose queues must keep working while other connections misbehave."""
    a = open_admin(tgt.address)
    io = open_io(tgt.address, a.cntlid)
    yield a, io
    io.close()
    a.close()


def _check_bystander(bystander) -> None:
    a, io = bystander
    assert a.cmd(keep_alive_cmd())[0].status.ok
    assert io.cmd(rw_cmd(IoOpcode.READ, 1, 0, 1, 4096))[0].status.ok


def _capsule(sqe_cid: int = 5) -> bytes:
    sqe = keep_alive_cmd()
    sqe.cid = sqe_cid
    return encode_bytes(CapsuleCmd(sqe.encode()))


def _after_ic(tgt, hd: bool = False) -> RawQueue:
    q = RawQueue(tgt.address)
    q.icreq(hdgst=hd)
    return q


CASES = {
    "bad type": (lambda b: bytes([0x05]) + b[1:], F.INVALID_HEADER_FIELD, 0),
    "unknown type 8": (lambda b: bytes([0x08]) + b[1:], F.INVALID_HEADER_FIELD, 0),
    "bad hlen": (lambda b: b[:2] + bytes([70]) + b[3:], F.INVALID_HEADER_FIELD, 2),
    "plen too short": (lambda b: b[:4] + struct.pack("<I", 40) + b[8:], F.INVALID_HEADER_FIELD, 4),
    "plen huge": (lambda b: b[:4] + struct.pack("<I", 1 << 28) + b[8:], F.DATA_TRANSFER_LIMIT_EXCEEDED, 4),
    "unknown flag": (lambda b: b[:1] + bytes([0x10]) + b[2:], F.INVALID_HEADER_FIELD, 1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_malformed_header(tgt, bystander, name) -> None:
    mutate, fes, fei = CASES[name]
    with _after_ic(tgt) as q:
        raw = _capsule()
        q.send_raw(mutate(raw))
        term = q.expect_term()
        assert (term.fes, term.fei) == (fes, fei)
        assert term.data[:8] == mutate(raw)[:8]
        assert q.closed_by_peer()
    _check_bystander(bystander)


def test_pdu_before_icreq_and_second_icreq(tgt, bystander) -> None:
    with RawQueue(tgt.address) as q:
        q.send_raw(_capsule())
        term = q.expect_term()
        assert term.fes == F.PDU_SEQUENCE_ERROR
    with _after_ic(tgt) as q:
        q.send_raw(encode_bytes(ICReq()))
        assert q.expect_term().fes == F.PDU_SEQUENCE_ERROR
    _check_bystander(bystander)


def test_icreq_parameters() -> None:
    with running_target(require_data_digest=True) as t:
        with RawQueue(t.address) as q:
            q.send_raw(encode_bytes(ICReq(ddgst=False)))
            term = q.expect_term()
            assert (term.fes, term.fei) == (F.UNSUPPORTED_PARAMETER, 11)
        with RawQueue(t.address) as q:
            assert q.icreq(ddgst=True).ddgst
        with RawQueue(t.address) as q:
            q.send_raw(encode_bytes(ICReq(pfv=1, ddgst=True)))
            assert q.expect_term().fes == F.UNSUPPORTED_PARAMETER
    with running_target() as t, RawQueue(t.address) as q:  # HPDA honoured: padded C2HData
        r = q.icreq(hpda=7)
        assert r.cpda == 0 and r.maxh2cdata == 128 * 1024


def test_header_digest_error(tgt, bystander) -> None:
    with _after_ic(tgt, hd=True) as q:
        sqe = keep_alive_cmd()
        raw = bytearray(encode_bytes(CapsuleCmd(sqe.encode()), hdgst=True))
        raw[72] ^= 0xFF
        q.send_raw(bytes(raw))
        term = q.expect_term()
        assert term.fes == F.HEADER_DIGEST_ERROR and term.fei == struct.unpack_from("<I", raw, 72)[0]
    with _after_ic(tgt, hd=True) as q:  # digest negotiated but HDGSTF missing
        q.send_raw(_capsule())
        assert q.expect_term().fes == F.INVALID_HEADER_FIELD
    _check_bystander(bystander)


def test_h2cdata_errors(tgt, bystander) -> None:
    # Each case on a fresh qid: a terminated queue's qid is released after its socket closes, so a
    # Connect for the same qid right after the TermReq can race that (Linux nvmet also answers
    # Command Sequence Error for a qid still installed).
    qids = iter(range(2, tgt.settings.max_io_queues + 1))
    a = open_admin(tgt.address)
    with a:
        # H2CData without an R2T.
        io = open_io(tgt.address, a.cntlid, next(qids))
        with io:
            io.send_pdu(H2CData(9, 0, 0, bytes(512), last=True))
            term = io.expect_term()
            assert (term.fes, term.fei) == (F.INVALID_HEADER_FIELD, 10)
        # Out of range: wrong DATAO, then data past the R2T.
        for datao, length, fei in ((512, 512, 12), (0, 8192, 16)):
            io = open_io(tgt.address, a.cntlid, next(qids))
            with io:
                cid = io.submit(rw_cmd(IoOpcode.WRITE, 1, 0, 1, 4096))
                r2t = io.recv_pdu()
                io.send_pdu(H2CData(cid, r2t.ttag, datao, bytes(length), last=True))
                term = io.expect_term()
                assert (term.fes, term.fei) == (F.DATA_TRANSFER_OUT_OF_RANGE, fei)
        # Wrong CCCID for a valid TTAG.
        io = open_io(tgt.address, a.cntlid, next(qids))
        with io:
            cid = io.submit(rw_cmd(IoOpcode.WRITE, 1, 0, 1, 4096))
            r2t = io.recv_pdu()
            io.send_pdu(H2CData(cid + 1, r2t.ttag, 0, bytes(4096), last=True))
            assert io.expect_term().fei == 8
        # In-capsule data beyond every limit: Data Transfer Limit Exceeded.
        io = open_io(tgt.address, a.cntlid, next(qids))
        with io:
            n = tgt.settings.in_capsule_bytes + 16384  # past the I/O queue's advertised in-capsule size
            io.submit(rw_cmd(IoOpcode.WRITE, 1, 0, n // 4096, n, in_capsule=True), bytes(n))
            assert io.expect_term().fes == F.DATA_TRANSFER_LIMIT_EXCEEDED
    _check_bystander(bystander)


def test_garbage_and_abrupt_close(tgt, bystander) -> None:
    for blob in (b"\xff" * 300, b"\x00\x00\x80", b""):
        with RawQueue(tgt.address) as q:
            q.send_raw(blob)
    with _after_ic(tgt) as q:
        q.send_raw(_capsule()[:30])  # half a header, then close
    _check_bystander(bystander)
    assert tgt.counters()["connections"] >= 2
