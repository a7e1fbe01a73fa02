"""Userspace target: Fabrics Connect, properties, admin commands, keep-alive, AER, discovery."""

from __future__ import annotations

import os
import struct
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from target_client import (
    CC_ENABLE,
    HOSTNQN,
    SUBNQN,
    RawQueue,
    discovery_admin,
    open_admin,
    open_io,
    running_target,
    w,
)

from adp_wire.constants import DISCOVERY_NQN, Property
from adp_wire.sqe import (
    Sqe,
    abort_cmd,
    async_event_request_cmd,
    get_features_cmd,
    get_log_page_cmd,
    identify_cmd,
    keep_alive_cmd,
    property_get_cmd,
    property_set_cmd,
    set_features_cmd,
)
from adp_wire.structs import (
    ErrorLogEntry,
    IdentifyController,
    IdentifyNamespace,
    SmartLog,
    decode_discovery_log,
    decode_ns_descriptors,
    decode_ns_list,
)


@pytest.fixture(scope="module")
def tgt():
    with running_target(max_io_queues=4, queue_depth=64) as t:
        yield t


@pytest.fixture
def admin(tgt):
    q = open_admin(tgt.address)
    yield q
    q.close()


# ---------------------------------------------------------------------------------------------------
# Connect


def _raw(tgt) -> RawQueue:
    q = RawQueue(tgt.address)
    q.icreq()
    return q


def test_connect_errors(tgt) -> None:
    with _raw(tgt) as q:
        c = q.connect(0, 32, subnqn="nqn.2026-11.io.awide:nope")
        assert c.status.word == w("CONNECT_INVALID_PARAMETERS") and c.dw0 == (1 << 16) | 256
    with _raw(tgt) as q:
        c = q.connect(0, 32, cntlid=5)
        assert c.status.word == w("CONNECT_INVALID_PARAMETERS") and c.dw0 == (1 << 16) | 16
    with _raw(tgt) as q:
        c = q.connect(0, 1)  # SQSIZE 0 (0's based)
        assert c.status.word == w("CONNECT_INVALID_PARAMETERS") and c.dw0 == 44
    a = open_admin(tgt.address)
    with a:
        with _raw(tgt) as q:
            c = q.connect(1, 32, cntlid=a.cntlid + 100)
            assert c.status.word == w("CONNECT_INVALID_PARAMETERS") and c.dw0 == (1 << 16) | 16
        with _raw(tgt) as q:
            c = q.connect(1, 32, cntlid=a.cntlid, hostnqn=HOSTNQN + "x")  # host mismatch
            assert c.status.word == w("CONNECT_INVALID_PARAMETERS")
        with _raw(tgt) as q:
            c = q.connect(5, 32, cntlid=a.cntlid)  # qid > max_io_queues
            assert c.status.word == w("CONNECT_INVALID_PARAMETERS") and c.dw0 == 42
        with _raw(tgt) as q:
            assert q.connect(1, 65, cntlid=a.cntlid).status.word == w("CONNECT_INVALID_PARAMETERS")  # > MQES+1
            assert q.connect(1, 1, cntlid=a.cntlid).status.word == w("CONNECT_INVALID_PARAMETERS")
        io = open_io(tgt.address, a.cntlid, 1)
        with io, _raw(tgt) as q:
            assert q.connect(1, 32, cntlid=a.cntlid).status.word == w("COMMAND_SEQUENCE_ERROR")  # dup qid
            assert io.connect(2, 32, cntlid=a.cntlid).status.word == w("CONNECT_CONTROLLER_BUSY")
        c = a.connect(0, 32)  # second Connect on a connected queue
        assert c.status.word == w("CONNECT_CONTROLLER_BUSY")


def test_connect_bad_recfmt_and_sgl(tgt) -> None:
    from target_client import HOSTID

    from adp_wire.sqe import connect_cmd
    from adp_wire.structs import ConnectData

    with _raw(tgt) as q:
        sqe = connect_cmd(0, 32)
        sqe.cdw10 |= 1  # RECFMT 1
        c, _ = q.cmd(sqe, ConnectData(HOSTID, 0xFFFF, SUBNQN, HOSTNQN).encode())
        assert c.status.word == w("CONNECT_INCOMPATIBLE_FORMAT")
        sqe = connect_cmd(0, 32)
        sqe.sgl_len = 512
        c, _ = q.cmd(sqe, bytes(512))
        assert c.status.word == w("SGL_DATA_BLOCK_INVALID")
        # Anything but Connect before Connect: Invalid Opcode.
        c, _ = q.cmd(identify_cmd(1))
        assert c.status.word == w("INVALID_OPCODE")
        c, _ = q.cmd(property_get_cmd(Property.CAP, True))
        assert c.status.word == w("INVALID_OPCODE")


def test_allow_list() -> None:
    other = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-000000000001"
    with running_target(allow_any_host=False, allowed_hosts=[other]) as t:
        with RawQueue(t.address) as q:
            q.icreq()
            c = q.connect(0, 32)
            assert c.status.word == w("CONNECT_INVALID_HOST") and c.dw0 == (1 << 16) | 512
        with RawQueue(t.address) as q:
            q.icreq()
            assert q.connect(0, 32, hostnqn=other).status.ok
        # Discovery is always allowed, but lists the subsystem only to allowed hosts.
        d = discovery_admin(t.address)
        with d:
            _, page = d.cmd(get_log_page_cmd(0x70, 4096))
            assert decode_discovery_log(page)[1] == []
        d = discovery_admin(t.address, hostnqn=other)
        with d:
            _, page = d.cmd(get_log_page_cmd(0x70, 2048))
            assert [e.subnqn for e in decode_discovery_log(page)[1]] == [SUBNQN]


def test_allow_any_default_depends_on_listen_address() -> None:
    from adp_emulator.target import TargetSettings

    assert TargetSettings(host="127.0.0.1").allow_any
    assert TargetSettings(host="::1").allow_any
    assert not TargetSettings(host="0.0.0.0").allow_any
    assert not TargetSettings(host="192.0.2.1").allow_any
    assert TargetSettings(host="0.0.0.0", allow_any_host=True).allow_any


# ---------------------------------------------------------------------------------------------------
# Properties, enable, shutdown


def test_properties_enable_shutdown(tgt) -> None:
    q = RawQueue(tgt.address)
    with q:
        q.icreq()
        assert q.connect(0, 32).status.ok
        cap = q.prop_get(Property.CAP, True)
        assert cap & 0xFFFF == 63 and (cap >> 24) & 0xFF == 15 and cap >> 37 & 1
        assert q.prop_get(Property.VS) == 0x020100
        assert q.prop_get(Property.CSTS) == 0
        # Admin commands need CC.EN.
        c, _ = q.cmd(identify_cmd(1))
        assert c.status.word == w("COMMAND_SEQUENCE_ERROR")
        c, _ = q.cmd(property_get_cmd(Property.VS, True))  # 8-byte read of a 4-byte register
        assert c.status.word == w("INVALID_FIELD")
        c, _ = q.cmd(property_get_cmd(0x30))
        assert c.status.word == w("INVALID_FIELD")
        c, _ = q.cmd(property_set_cmd(Property.CSTS, 1))
        assert c.status.word == w("INVALID_FIELD")
        q.enable()
        assert q.prop_get(Property.CSTS) == 1
        assert q.prop_get(Property.CC) == CC_ENABLE
        assert q.cmd(identify_cmd(1))[0].status.ok
        q.enable(CC_ENABLE | (1 << 14))  # SHN normal
        assert q.prop_get(Property.CSTS) & 0xC == 0x8
        c, _ = q.cmd(identify_cmd(1))
        assert c.status.word == w("COMMAND_SEQUENCE_ERROR")


def test_enable_with_bad_cc_sets_cfs(tgt) -> None:
    q = open_admin(tgt.address, enable=False)
    with q:
        q.enable(1)  # IOSQES/IOCQES 0
        assert q.prop_get(Property.CSTS) & 0x3 == 0x2


# ---------------------------------------------------------------------------------------------------
# Identify


def test_identify(tgt, admin) -> None:
    c, d = admin.cmd(identify_cmd(1))
    idc = IdentifyController.decode(d)
    assert c.status.ok and idc.cntlid == admin.cntlid and idc.subnqn == SUBNQN
    assert idc.mdts == 5 and idc.kas == 10 and idc.sgls & 3 == 1 and idc.icdoff == 0
    assert idc.ioccsz == (64 + 128 * 1024) // 16 and idc.maxcmd == 64 and idc.sqes == 0x66 and idc.cqes == 0x44
    assert idc.oncs == 0x0C and idc.vwc == 1 and idc.cntrltype == 1 and idc.nn == 1
    c, d = admin.cmd(identify_cmd(0, nsid=1))
    idn = IdentifyNamespace.decode(d)
    assert idn.nsze == idn.ncap == (16 << 20) // 4096 and idn.lba_size == 4096
    c, d = admin.cmd(identify_cmd(0, nsid=7))  # inactive: zeros
    assert c.status.ok and d == bytes(4096)
    assert admin.cmd(identify_cmd(0, nsid=0xFFFFFFFF))[0].status.word == w("INVALID_NAMESPACE")
    c, d = admin.cmd(identify_cmd(2, nsid=0))
    assert decode_ns_list(d) == [1]
    c, d = admin.cmd(identify_cmd(2, nsid=1))
    assert decode_ns_list(d) == []
    c, d = admin.cmd(identify_cmd(3, nsid=1))
    assert {t for t, _ in decode_ns_descriptors(d)} == {2, 3, 4}
    assert admin.cmd(identify_cmd(3, nsid=2))[0].status.word == w("INVALID_NAMESPACE")
    c, d = admin.cmd(identify_cmd(8, nsid=1))
    assert c.status.ok and d[14] == 1
    assert admin.cmd(identify_cmd(6, csi=0))[0].status.ok
    assert admin.cmd(identify_cmd(6, csi=1))[0].status.word == w("INVALID_FIELD")
    assert admin.cmd(identify_cmd(0x42))[0].status.word == w("INVALID_FIELD")
    bad = identify_cmd(1)
    bad.sgl_len = 1024
    assert admin.cmd(bad)[0].status.word == w("SGL_DATA_BLOCK_INVALID")


def test_invalid_admin_opcode_and_flags(admin) -> None:
    assert admin.cmd(Sqe(opcode=0x01, sgl_len=0))[0].status.word == w("INVALID_OPCODE")  # Create I/O SQ
    assert admin.cmd(Sqe(opcode=0xC1, sgl_len=0))[0].status.word == w("INVALID_OPCODE")
    sqe = keep_alive_cmd()
    sqe.flags = 0x00  # PRP instead of SGL
    assert admin.cmd(sqe)[0].status.word == w("INVALID_FIELD")


# ---------------------------------------------------------------------------------------------------
# Log pages


def test_log_pages(admin) -> None:
    c, d = admin.cmd(get_log_page_cmd(0x02, 512))
    assert c.status.ok and SmartLog.decode(d).available_spare == 100
    c, d = admin.cmd(get_log_page_cmd(0x02, 8, offset=32))  # arbitrary dword window
    assert c.status.ok and len(d) == 8
    admin.cmd(identify_cmd(0x42))  # produce an error entry
    c, d = admin.cmd(get_log_page_cmd(0x01, 64 * 4))
    e = ErrorLogEntry.decode(d)
    assert e.error_count >= 1 and e.opcode == 0x06 and e.status == w("INVALID_FIELD") and e.sqid == 0
    c, d = admin.cmd(get_log_page_cmd(0x01, 4, offset=4096))  # beyond the ring: zeros
    assert c.status.ok and d == bytes(4)
    c, d = admin.cmd(get_log_page_cmd(0x00, 1024))
    assert struct.unpack_from("<I", d, 8)[0] == 1
    assert admin.cmd(get_log_page_cmd(0x70, 1024))[0].status.word == w("INVALID_FIELD")
    assert admin.cmd(get_log_page_cmd(0x42, 512))[0].status.word == w("INVALID_FIELD")
    bad = get_log_page_cmd(0x02, 512)
    bad.cdw12 = 2  # unaligned offset
    assert admin.cmd(bad)[0].status.word == w("INVALID_FIELD")
    huge = get_log_page_cmd(0x02, 1 << 30)  # larger than MDTS: refused, nothing allocated
    assert admin.cmd(huge)[0].status.word == w("INVALID_FIELD")
    bad = get_log_page_cmd(0x02, 512)
    bad.sgl_len = 256
    assert admin.cmd(bad)[0].status.word == w("SGL_DATA_BLOCK_INVALID")


def test_discovery_log_any_window(tgt) -> None:
    d = discovery_admin(tgt.address)
    with d:
        c, full = d.cmd(get_log_page_cmd(0x70, 2048))
        _genctr, entries = decode_discovery_log(full)
        assert c.status.ok and len(entries) == 1
        e = entries[0]
        assert (e.subnqn, e.traddr, e.trsvcid, e.trtype, e.subtype) == (
            SUBNQN, "127.0.0.1", str(tgt.address[1]), 3, 2)
        c, hdr = d.cmd(get_log_page_cmd(0x70, 20))  # libnvme reads 20 header bytes first
        assert hdr == full[:20]
        for off, ln in ((1024, 1024), (1024 + 256, 512), (1020, 8), (4096, 16)):
            c, part = d.cmd(get_log_page_cmd(0x70, ln, offset=off))
            assert c.status.ok and part == (full + bytes(8192))[off:off + ln]
        c, idd = d.cmd(identify_cmd(1))
        idc = IdentifyController.decode(idd)
        assert idc.cntrltype == 2 and idc.subnqn == DISCOVERY_NQN
        assert d.cmd(identify_cmd(0, nsid=1))[0].status.word == w("INVALID_FIELD")
        assert d.cmd(get_log_page_cmd(0x02, 512))[0].status.word == w("INVALID_FIELD")
        assert d.cmd(Sqe(opcode=0x08, sgl_len=0))[0].status.word == w("INVALID_OPCODE")  # no Abort
        assert d.cmd(set_features_cmd(0x0B, 1 << 31))[0].status.ok
        assert d.cmd(get_features_cmd(0x0F))[0].dw0 == 120_000  # KATO 0 -> 120 s
        # No I/O queues on a discovery controller.
        with RawQueue(tgt.address) as q:
            q.icreq()
            c = q.connect(1, 32, cntlid=d.cntlid, subnqn=DISCOVERY_NQN)
            assert c.status.word == w("CONNECT_INVALID_PARAMETERS")


# ---------------------------------------------------------------------------------------------------
# Features, keep-alive, AER, Abort


def test_features(admin) -> None:
    c, _ = admin.cmd(set_features_cmd(0x07, (7 << 16) | 7))
    assert c.status.ok and c.dw0 == (3 << 16) | 3  # max_io_queues 4, 0's based
    assert admin.cmd(get_features_cmd(0x07))[0].dw0 == (3 << 16) | 3
    assert admin.cmd(set_features_cmd(0x07, 0xFFFF))[0].status.word == w("INVALID_FIELD")
    assert admin.cmd(set_features_cmd(0x0B, 1 << 8))[0].status.ok
    assert admin.cmd(get_features_cmd(0x0B))[0].dw0 == 1 << 8
    assert admin.cmd(set_features_cmd(0x0B, 1))[0].status.word == w("INVALID_FIELD")
    assert admin.cmd(set_features_cmd(0x0F, 1500))[0].status.ok
    assert admin.cmd(get_features_cmd(0x0F))[0].dw0 == 2000  # whole seconds, like nvmet
    assert admin.cmd(get_features_cmd(0x06))[0].dw0 == 1
    assert admin.cmd(set_features_cmd(0x42, 0))[0].status.word == w("INVALID_FIELD")
    assert admin.cmd(get_features_cmd(0x42))[0].status.word == w("INVALID_FIELD")
    sqe = get_features_cmd(0x81)
    sqe.cdw11, sqe.sgl_len = 1, 16
    c, hostid = admin.cmd(sqe)
    assert c.status.ok and hostid == bytes(range(16))


def test_keep_alive_and_expiry(tgt) -> None:
    a = open_admin(tgt.address, kato_ms=1000)
    io = open_io(tgt.address, a.cntlid)
    with a, io:
        for _ in range(3):  # keep-alives keep it alive past KATO
            time.sleep(0.5)
            assert a.cmd(keep_alive_cmd())[0].status.ok
        t0 = time.monotonic()
        assert a.closed_by_peer(timeout=4) and io.closed_by_peer(timeout=2)
        assert 0.8 < time.monotonic() - t0 < 3.5
    # KATO 0 (set via Set Features) makes Keep Alive invalid.
    with running_target(keep_alive_default_ms=0) as t:
        q = open_admin(t.address)
        with q:
            assert q.cmd(keep_alive_cmd())[0].status.word == w("KEEP_ALIVE_TIMER_INVALID")


def test_aer_held_completed_and_failed(tgt) -> None:
    a = open_admin(tgt.address)
    with a:
        assert a.cmd(set_features_cmd(0x0B, 1 << 8))[0].status.ok
        cids = [a.submit(async_event_request_cmd(), cid=31 - i) for i in range(4)]
        c5 = a.cmd(async_event_request_cmd())[0]  # the fifth exceeds AERL
        assert c5.status.word == w("ASYNC_EVENT_REQUEST_LIMIT_EXCEEDED")
        # Held: other commands complete meanwhile.
        assert a.cmd(keep_alive_cmd())[0].status.ok
        c = a.cmd(abort_cmd(0, cids[0]))[0]
        assert c.status.ok and c.dw0 & 1  # not aborted
        tgt.notify_namespace_changed()
        c, _ = a.wait(cids[0])
        assert c.status.ok and c.dw0 == 0x00040002
        # Teardown (shutdown) fails the others with Internal Error.
        a.enable(CC_ENABLE | (1 << 14))
        for cid in cids[1:]:
            c, _ = a.wait(cid)
            assert c.status.word == w("INTERNAL_ERROR")
