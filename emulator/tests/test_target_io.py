"""Userspace target: NVM I/O commands, digests, concurrency, persistence, faults, counters."""

from __future__ import annotations

import os
import sys
import threading

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from target_client import RawQueue, open_admin, open_io, running_target, w

from adp_wire.constants import IoOpcode
from adp_wire.sqe import (
    Sqe,
    dsm_cmd,
    dsm_ranges,
    flush_cmd,
    rw_cmd,
    write_zeroes_cmd,
)

R, W = IoOpcode.READ, IoOpcode.WRITE


@pytest.fixture(scope="module", params=[0, 2], ids=["in-process", "io-workers"])
def tgt(request):
    """Every test here runs against both data planes: queues served in the target process, and
    queues handed to worker processes (same wire behaviour, same faults, same counters)."""
    with running_target(mdts_bytes=64 * 1024, maxh2cdata=16 * 1024, in_capsule_bytes=4096,
                        io_workers=request.param) as t:
        yield t


@pytest.fixture
def qs(tgt):
    a = open_admin(tgt.address)
    io = open_io(tgt.address, a.cntlid)
    yield a, io
    io.close()
    a.close()


def _pattern(n: int, seed: int) -> bytes:
    return bytes((i * 31 + seed) & 0xFF for i in range(n))


def test_in_capsule_write_and_read(qs) -> None:
    _, io = qs
    data = _pattern(4096, 1)
    assert io.cmd(rw_cmd(W, 1, 100, 1, 4096, in_capsule=True), data)[0].status.ok
    c, back = io.cmd(rw_cmd(R, 1, 100, 1, 4096))
    assert c.status.ok and back == data
    # In-capsule larger than IOCCSZ allows (but within the 8 KiB admin bound): SGL Offset Invalid,
    # the data is consumed and the stream stays in sync.
    sqe = rw_cmd(W, 1, 100, 2, 8192, in_capsule=True)
    assert io.cmd(sqe, bytes(8192))[0].status.word == w("SGL_OFFSET_INVALID")
    # In-capsule data on a read: Invalid Field.
    sqe = rw_cmd(R, 1, 0, 1, 4096, in_capsule=True)
    assert io.cmd(sqe, bytes(4096))[0].status.word == w("INVALID_FIELD")
    assert io.cmd(rw_cmd(R, 1, 100, 1, 4096))[1] == data


def test_r2t_write_multi_h2cdata(qs) -> None:
    _, io = qs
    data = _pattern(64 * 1024, 2)  # = MDTS; 4 R2Ts of MAXH2CDATA (16 KiB), sent as 4 KiB H2CData PDUs
    assert io.maxh2cdata == 16 * 1024
    c, _ = io.cmd(rw_cmd(W, 1, 1000, 16, len(data)), data, h2c_chunk=4096)
    assert c.status.ok
    assert io.cmd(rw_cmd(R, 1, 1000, 16, len(data)))[1] == data


def test_pipelined_writes_and_reads(qs) -> None:
    _, io = qs
    blobs = {i: _pattern(16384, i) for i in range(8)}
    cids = {io.submit(rw_cmd(W, 1, 2000 + 4 * i, 4, 16384), blobs[i]): i for i in range(8)}
    for cid in cids:
        assert io.wait(cid)[0].status.ok
    rc = {io.submit(rw_cmd(R, 1, 2000 + 4 * i, 4, 16384)): i for i in range(8)}
    for cid, i in rc.items():
        c, d = io.wait(cid)
        assert c.status.ok and d == blobs[i]


def test_io_errors(qs) -> None:
    _, io = qs
    nsze = (16 << 20) // 4096
    assert io.cmd(rw_cmd(R, 1, nsze - 1, 2, 8192))[0].status.word == w("LBA_OUT_OF_RANGE")
    assert io.cmd(rw_cmd(W, 1, nsze, 1, 4096))[0].status.word == w("LBA_OUT_OF_RANGE")
    assert io.cmd(rw_cmd(R, 1, 0, 32, 128 * 1024))[0].status.word == w("INVALID_FIELD")  # > MDTS
    assert io.cmd(rw_cmd(R, 1, 0, 2, 4096))[0].status.word == w("SGL_DATA_BLOCK_INVALID")
    assert io.cmd(rw_cmd(W, 1, 0, 1, 8192))[0].status.word == w("SGL_DATA_BLOCK_INVALID")
    assert io.cmd(rw_cmd(R, 2, 0, 1, 4096))[0].status.word == w("INVALID_NAMESPACE")
    assert io.cmd(Sqe(opcode=0x05, nsid=1, sgl_len=0))[0].status.word == w("INVALID_OPCODE")
    assert io.cmd(Sqe(opcode=0x99, nsid=1, sgl_len=0))[0].status.word == w("INVALID_OPCODE")
    sqe = rw_cmd(R, 1, 0, 1, 4096)
    sqe.sgl_id = 0x00  # Data Block with address: not for TCP
    assert io.cmd(sqe)[0].status.word == w("SGL_DESCRIPTOR_TYPE_INVALID")
    sqe = rw_cmd(R, 1, 0, 1, 4096)
    sqe.flags |= 0x01  # fused
    assert io.cmd(sqe)[0].status.word == w("INVALID_FIELD")
    # Fabrics commands other than Connect are invalid on I/O queues.
    assert io.cmd(Sqe(opcode=0x7F, nsid=0x04, sgl_len=0))[0].status.word == w("INVALID_OPCODE")


def test_flush_write_zeroes_dsm(qs) -> None:
    _, io = qs
    data = _pattern(4 * 4096, 3)
    assert io.cmd(rw_cmd(W, 1, 3000, 4, len(data)), data)[0].status.ok
    assert io.cmd(flush_cmd(1))[0].status.ok
    assert io.cmd(write_zeroes_cmd(1, 3001, 1))[0].status.ok
    back = io.cmd(rw_cmd(R, 1, 3000, 4, len(data)))[1]
    assert back[:4096] == data[:4096] and back[4096:8192] == bytes(4096) and back[8192:] == data[8192:]
    ranges = dsm_ranges([(3002, 1), (3003, 1)])
    assert io.cmd(dsm_cmd(1, 2), ranges)[0].status.ok
    assert io.cmd(rw_cmd(R, 1, 3000, 4, len(data)))[1][4096:] == bytes(3 * 4096)
    # DSM via R2T, and out-of-range ranges.
    assert io.cmd(dsm_cmd(1, 1, in_capsule=False), dsm_ranges([(3000, 1)]))[0].status.ok
    assert io.cmd(rw_cmd(R, 1, 3000, 1, 4096))[1] == bytes(4096)
    c = io.cmd(dsm_cmd(1, 1), dsm_ranges([(1 << 40, 1)]))[0]
    assert c.status.word == w("LBA_OUT_OF_RANGE")
    assert io.cmd(write_zeroes_cmd(1, 1 << 40, 1))[0].status.word == w("LBA_OUT_OF_RANGE")
    # Large write zeroes spanning whole pages.
    assert io.cmd(write_zeroes_cmd(1, 0, 4096))[0].status.ok


def test_commands_before_enable(tgt) -> None:
    a = open_admin(tgt.address, enable=False)
    io = open_io(tgt.address, a.cntlid)
    with a, io:
        assert io.cmd(rw_cmd(R, 1, 0, 1, 4096))[0].status.word == w("COMMAND_SEQUENCE_ERROR")
        assert io.cmd(flush_cmd(1))[0].status.word == w("COMMAND_SEQUENCE_ERROR")


@pytest.mark.parametrize("hd,dd", [(True, False), (False, True), (True, True)])
def test_digests(tgt, hd, dd) -> None:
    a = open_admin(tgt.address, hdgst=hd, ddgst=dd)
    io = open_io(tgt.address, a.cntlid, hdgst=hd, ddgst=dd)
    with a, io:
        assert (io.hd, io.dd) == (hd, dd)
        data = _pattern(20000 // 4096 * 4096, 5)
        n = len(data) // 4096
        assert io.cmd(rw_cmd(W, 1, 50, n, len(data)), data, h2c_chunk=8192)[0].status.ok  # R2T path
        assert io.cmd(rw_cmd(W, 1, 70, 1, 4096, in_capsule=True), data[:4096])[0].status.ok
        c, back = io.cmd(rw_cmd(R, 1, 50, n, len(data)))  # the codec verifies the target's digests
        assert c.status.ok and back == data
        assert io.cmd(rw_cmd(R, 1, 70, 1, 4096))[1] == data[:4096]


def test_bad_data_digest_fails_command_only(tgt) -> None:
    from adp_wire import CapsuleCmd, encode

    a = open_admin(tgt.address, ddgst=True)
    io = open_io(tgt.address, a.cntlid, ddgst=True)
    with a, io:
        sqe = rw_cmd(W, 1, 80, 1, 4096, in_capsule=True)
        sqe.cid = 77
        bufs = encode(CapsuleCmd(sqe.encode(), bytes(4096)), ddgst=True)
        bufs[-1] = bytes(b ^ 0xFF for b in bufs[-1])
        io.sock.sendmsg(bufs)
        c, _ = io.wait(77)
        assert c.status.word == w("TRANSIENT_TRANSPORT_ERROR")
        assert io.cmd(rw_cmd(R, 1, 80, 1, 4096))[0].status.ok


def test_sq_flow_control_disabled_uses_success_flag(tgt) -> None:
    a = open_admin(tgt.address)
    with a, RawQueue(tgt.address) as io:
        io.icreq()
        c = io.connect(1, 32, cntlid=a.cntlid, cattr=0x4)
        assert c.status.ok and c.sqhd == 0xFFFF
        data = _pattern(4096, 9)
        assert io.cmd(rw_cmd(W, 1, 90, 1, 4096), data)[0].status.ok
        c, back = io.cmd(rw_cmd(R, 1, 90, 1, 4096))  # completed by C2HData SUCCESS (see client)
        assert c.status.ok and back == data


def test_many_queues_concurrently(tgt) -> None:
    a = open_admin(tgt.address)
    queues = [open_io(tgt.address, a.cntlid, qid) for qid in range(1, 9)]
    errors: list[BaseException] = []

    def worker(i: int, q: RawQueue) -> None:
        try:
            for k in range(20):
                data = _pattern(8192, i * 100 + k)
                slba = 3100 + i * 64 + (k % 8) * 2
                assert q.cmd(rw_cmd(W, 1, slba, 2, 8192), data)[0].status.ok
                assert q.cmd(rw_cmd(R, 1, slba, 2, 8192))[1] == data
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    ths = [threading.Thread(target=worker, args=(i, q)) for i, q in enumerate(queues)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(30)
    assert not errors, errors
    qstats = [q for q in tgt.counters()["queues"] if q["cntlid"] == a.cntlid and q["qid"] > 0]
    assert len(qstats) == 8 and all(q["reads"] == 20 and q["writes"] == 20 for q in qstats)
    for q in queues:
        q.close()
    a.close()


def test_file_backing_persists(tmp_path) -> None:
    path = str(tmp_path / "ns1.img")
    data = _pattern(8192, 7)
    with running_target(backing_path=path, lba_size=512) as t:
        a = open_admin(t.address)
        io = open_io(t.address, a.cntlid)
        assert io.cmd(rw_cmd(W, 1, 33, 16, 8192), data)[0].status.ok
        io.close()
        a.close()
    assert os.path.getsize(path) == 16 << 20
    with running_target(backing_path=path, lba_size=512) as t:
        a = open_admin(t.address)
        io = open_io(t.address, a.cntlid)
        assert io.cmd(rw_cmd(R, 1, 33, 16, 8192))[1] == data
        io.close()
        a.close()
    with open(path, "rb") as f:
        f.seek(33 * 512)
        assert f.read(8192) == data


def test_fault_hooks(tgt, qs) -> None:
    a, io = qs
    f = tgt.faults
    try:
        f.fail_next_io(2, "NAMESPACE_NOT_READY")
        assert io.cmd(rw_cmd(R, 1, 0, 1, 4096))[0].status.word == w("NAMESPACE_NOT_READY")
        assert io.cmd(rw_cmd(W, 1, 0, 1, 4096, in_capsule=True), bytes(4096))[0].status.word == w(
            "NAMESPACE_NOT_READY")
        assert io.cmd(rw_cmd(R, 1, 0, 1, 4096))[0].status.ok
        f.set_device_full(True)
        assert io.cmd(rw_cmd(W, 1, 0, 1, 4096), bytes(4096))[0].status.word == w("CAPACITY_EXCEEDED")
        assert io.cmd(write_zeroes_cmd(1, 0, 1))[0].status.word == w("CAPACITY_EXCEEDED")
        assert io.cmd(rw_cmd(R, 1, 0, 1, 4096))[0].status.ok
        f.set_device_full(False)
        data = _pattern(4096, 11)
        assert io.cmd(rw_cmd(W, 1, 5, 1, 4096), data)[0].status.ok
        f.corrupt(5 * 4096 + 10, 2)
        back = io.cmd(rw_cmd(R, 1, 5, 1, 4096))[1]
        assert back[10] == data[10] ^ 0xFF and back[12:] == data[12:]
        f.corrupt_next_reads(1)
        back = io.cmd(rw_cmd(R, 1, 5, 1, 4096))[1]
        assert back[0] != data[0]
        import time

        f.set_delay(0.05)
        t0 = time.monotonic()
        io.cmd(flush_cmd(1))
        assert time.monotonic() - t0 >= 0.05
        f.set_delay(0)
        assert f.drop_connections() >= 2
        assert io.closed_by_peer(2) and a.closed_by_peer(2)
    finally:
        f.clear()


def test_counters_json(tgt, qs) -> None:
    import json

    _, io = qs
    before = tgt.counters()["namespaces"]["1"]
    io.cmd(rw_cmd(R, 1, 0, 1, 4096))
    io.cmd(rw_cmd(R, 1, 1 << 40, 1, 4096))
    snap = tgt.counters()
    json.dumps(snap)
    ns = snap["namespaces"]["1"]
    assert ns["bytes_read"] - before["bytes_read"] == 4096 and ns["errors"] - before["errors"] == 1
    assert sum(ns["latency_us_log2"].values()) == ns["commands"]
