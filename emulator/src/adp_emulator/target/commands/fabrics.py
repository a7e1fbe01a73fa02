"""The Fabrics command set (opcode 0x7F): Connect, Property Get and Property Set.

Behaviour mirrors Linux nvmet (drivers/nvme/target/fabrics-cmd.c) so differential tests against the
kernel target agree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from adp_wire.constants import CNTLID_DYNAMIC, CONNECT_DATA_SIZE, DISCOVERY_NQN, FabricsType, Property
from adp_wire.sqe import Sqe, connect_fields
from adp_wire.structs import ConnectData

from ..controller import VS_VALUE
from .result import (
    DIR_NONE,
    DIR_OUT,
    OK,
    SC_CMD_SEQ,
    SC_CONNECT_BUSY,
    SC_CONNECT_FORMAT,
    SC_CONNECT_INVALID_HOST,
    SC_CONNECT_INVALID_PARAM,
    SC_INVALID_FIELD,
    SC_INVALID_OPCODE,
    Parsed,
    Result,
    error,
    expect,
    no_op,
)

if TYPE_CHECKING:  # pragma: no cover
    from ..connection import Connection

# Connect Invalid Parameters DW0: IPO = byte offset, bit 16 IATTR = offset is into the data (nvmet.h).
IATTR_DATA = 1 << 16
CONNECT_OFF_CNTLID, CONNECT_OFF_SUBNQN, CONNECT_OFF_HOSTNQN = 16, 256, 512
SQE_OFF_RECFMT, SQE_OFF_QID, SQE_OFF_SQSIZE = 40, 42, 44
DISC_KATO_MS = 120_000  # NVMET_DISC_KATO_MS


def parse(conn: Connection, sqe: Sqe) -> Parsed:
    fct = sqe.fctype
    if fct == FabricsType.CONNECT:
        return expect(sqe, CONNECT_DATA_SIZE, DIR_OUT, connect)
    if conn.qid != 0:  # Property Get/Set only on a connected admin queue; nothing else implemented
        return SC_INVALID_OPCODE, DIR_NONE, None, no_op
    if fct == FabricsType.PROPERTY_GET:
        return expect(sqe, 0, DIR_NONE, prop_get)
    if fct == FabricsType.PROPERTY_SET:
        return expect(sqe, 0, DIR_NONE, prop_set)
    return SC_INVALID_OPCODE, DIR_NONE, None, no_op


def connect(conn: Connection, sqe: Sqe, data: memoryview | None) -> Result | None:
    """Fabrics Connect: a new association on the admin queue, or an I/O queue joining one."""
    if conn.qid >= 0:
        return error(SC_CONNECT_BUSY)
    recfmt, qid, sqsize, cattr, kato = connect_fields(sqe)
    if recfmt != 0:
        return error(SC_CONNECT_FORMAT)
    cd = ConnectData.decode(data)
    t = conn.target
    s = conn.settings
    raw_sqsize = sqsize - 1
    if cd.subnqn not in (s.subnqn, DISCOVERY_NQN):
        return error(SC_CONNECT_INVALID_PARAM, IATTR_DATA | CONNECT_OFF_SUBNQN)
    discovery = cd.subnqn == DISCOVERY_NQN
    if qid == 0:
        if cd.cntlid != CNTLID_DYNAMIC:
            return error(SC_CONNECT_INVALID_PARAM, IATTR_DATA | CONNECT_OFF_CNTLID)
        if not discovery and not t.host_allowed(cd.hostnqn):
            return error(SC_CONNECT_INVALID_HOST, IATTR_DATA | CONNECT_OFF_HOSTNQN)
        if raw_sqsize == 0:
            return error(SC_CONNECT_INVALID_PARAM, SQE_OFF_SQSIZE)
        if kato == 0:
            kato = DISC_KATO_MS if discovery else s.keep_alive_default_ms
        ctrl = t.create_controller(cd.hostnqn, cd.hostid, discovery, -(-kato // 1000) * 1000)
        if ctrl is None:
            return error(SC_CONNECT_BUSY)
        ctrl.queues[0] = conn
    else:
        ctrl = t.find_controller(cd.cntlid, discovery, cd.hostnqn)
        if ctrl is None:
            return error(SC_CONNECT_INVALID_PARAM, IATTR_DATA | CONNECT_OFF_CNTLID)
        if qid > ctrl.max_qid:
            return error(SC_CONNECT_INVALID_PARAM, SQE_OFF_QID)
        if raw_sqsize == 0 or raw_sqsize > s.queue_depth - 1:
            return error(SC_CONNECT_INVALID_PARAM, SQE_OFF_SQSIZE)
        with ctrl.lock:
            if qid in ctrl.queues or ctrl.dead:
                return error(SC_CMD_SEQ)
            ctrl.queues[qid] = conn
        conn.handoff = not discovery and t.serves_io_elsewhere()
    conn.ctrl = ctrl
    conn.qid = qid
    conn.state.connected(sqsize, cattr)
    ctrl.touch()
    if not conn.state.sqflow:
        conn.send_response(sqe.cid, 0, ctrl.cntlid, 0, sqhd=0xFFFF)  # no SQ head to report
        return None
    return (0, ctrl.cntlid, 0, None)


def prop_get(conn: Connection, sqe: Sqe, data: memoryview | None) -> Result:
    ctrl = conn.ctrl
    assert ctrl is not None
    off = sqe.cdw11
    if sqe.cdw10 & 0x7 == 1:
        if off == Property.CAP:
            cap = ctrl.cap()
            return (0, cap & 0xFFFFFFFF, cap >> 32, None)
        return error(SC_INVALID_FIELD)
    if sqe.cdw10 & 0x7 != 0:
        return error(SC_INVALID_FIELD)
    val = {Property.VS: VS_VALUE, Property.CC: ctrl.cc, Property.CSTS: ctrl.csts,
           Property.CRTO: 0x000F000F}.get(off)
    if val is None:
        return error(SC_INVALID_FIELD)
    return (0, val, 0, None)


def prop_set(conn: Connection, sqe: Sqe, data: memoryview | None) -> Result:
    ctrl = conn.ctrl
    assert ctrl is not None
    if sqe.cdw10 & 0x7 != 0 or sqe.cdw11 != Property.CC:
        return error(SC_INVALID_FIELD)
    ctrl.set_cc(sqe.cdw12)
    conn.target.controller_changed(ctrl)
    return OK
