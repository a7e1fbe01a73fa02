"""The Admin command set: Identify, Get Log Page, Set/Get Features, AER, Keep Alive, Abort.

Behaviour mirrors Linux nvmet (drivers/nvme/target/admin-cmd.c, discovery.c) so differential tests
against the kernel target agree. The controller state these commands read and change is
:class:`~adp_emulator.target.controller.Controller`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from adp_wire.constants import CSTS_RDY, AdminOpcode, Cns, Feature, LogPage, NidType
from adp_wire.sqe import Sqe
from adp_wire.structs import (
    IdentifyNamespace,
    LbaFormat,
    encode_ns_descriptors,
    encode_ns_list,
    encode_supported_logs,
)

from ..controller import AERL, OAES_DISC_CHANGE, OAES_NS_ATTR
from .result import (
    DIR_IN,
    DIR_NONE,
    OK,
    SC_AER_LIMIT,
    SC_CMD_SEQ,
    SC_INVALID_FIELD,
    SC_INVALID_NS,
    SC_INVALID_OPCODE,
    SC_KA_INVALID,
    Parsed,
    Result,
    error,
    expect,
    no_op,
)

if TYPE_CHECKING:  # pragma: no cover
    from ..connection import Connection, ConnectionTarget


def parse(conn: Connection, sqe: Sqe) -> Parsed:
    ctrl = conn.ctrl
    assert ctrl is not None
    opc = sqe.opcode
    if not ctrl.discovery and not ctrl.csts & CSTS_RDY:  # nvmet_check_ctrl_status (not for discovery)
        return SC_CMD_SEQ, DIR_NONE, None, no_op
    if opc == AdminOpcode.IDENTIFY:
        return expect(sqe, 4096, DIR_IN, identify)
    if opc == AdminOpcode.GET_LOG_PAGE:
        numd = ((sqe.cdw10 >> 16) | ((sqe.cdw11 & 0xFFFF) << 16)) + 1
        if numd * 4 > conn.mdts:  # never build an unbounded buffer for a host
            return SC_INVALID_FIELD, DIR_IN, None, no_op
        return expect(sqe, numd * 4, DIR_IN, get_log)
    if opc == AdminOpcode.SET_FEATURES:
        return expect(sqe, 0, DIR_NONE, set_features)
    if opc == AdminOpcode.GET_FEATURES:
        n = 16 if sqe.cdw10 & 0xFF == 0x81 else 0
        return expect(sqe, n, DIR_IN if n else DIR_NONE, get_features)
    if opc == AdminOpcode.ASYNC_EVENT_REQUEST:
        return expect(sqe, 0, DIR_NONE, aer)
    if opc == AdminOpcode.KEEP_ALIVE:
        return expect(sqe, 0, DIR_NONE, keep_alive)
    if opc == AdminOpcode.ABORT and not ctrl.discovery:
        return expect(sqe, 0, DIR_NONE, abort)
    return SC_INVALID_OPCODE, DIR_NONE, None, no_op


def identify(conn: Connection, sqe: Sqe, data: memoryview | None) -> Result:
    ctrl = conn.ctrl
    assert ctrl is not None
    cns = sqe.cdw10 & 0xFF
    nsid = sqe.nsid
    t = conn.target
    if cns == Cns.CONTROLLER:
        return (0, 0, 0, ctrl.identify_controller())
    if ctrl.discovery:
        return error(SC_INVALID_FIELD)
    if cns == Cns.NAMESPACE:
        if nsid == 0xFFFFFFFF:
            return error(SC_INVALID_NS)
        return (0, 0, 0, identify_namespace(t, nsid) or bytes(4096))
    if cns == Cns.ACTIVE_NS_LIST:
        if nsid >= 0xFFFFFFFE:
            return error(SC_INVALID_NS)
        return (0, 0, 0, encode_ns_list([n for n in t.namespaces if n > nsid]))
    csi = sqe.cdw11 >> 24
    if cns in (Cns.CSI_NAMESPACE, Cns.CSI_CONTROLLER) and csi != 0:
        return error(SC_INVALID_FIELD)
    if cns == Cns.CSI_CONTROLLER:
        return (0, 0, 0, bytes(4096))
    if cns in (Cns.NS_DESCRIPTORS, Cns.CSI_NAMESPACE, Cns.CSI_INDEPENDENT_NAMESPACE):
        if nsid not in t.namespaces:
            return error(SC_INVALID_NS)
        if cns == Cns.NS_DESCRIPTORS:
            return (0, 0, 0, ns_descriptors(t, nsid))
        if cns == Cns.CSI_NAMESPACE:
            return (0, 0, 0, bytes(4096))
        buf = bytearray(4096)
        buf[1] = 1  # NMIC shared
        buf[14] = 1  # NSTAT: namespace ready
        return (0, 0, 0, bytes(buf))
    return error(SC_INVALID_FIELD)


def get_log(conn: Connection, sqe: Sqe, data: memoryview | None) -> Result:
    ctrl = conn.ctrl
    assert ctrl is not None
    lid = sqe.cdw10 & 0xFF
    length = sqe.sgl_len
    offset = sqe.cdw12 | (sqe.cdw13 << 32)
    if offset & 3:
        return error(SC_INVALID_FIELD)
    if ctrl.discovery:
        if lid != LogPage.DISCOVERY:
            return error(SC_INVALID_FIELD)
        page = ctrl.discovery_log(conn)
    elif lid == LogPage.SUPPORTED_LOGS:
        page = supported_logs(False)
    elif lid == LogPage.ERROR:
        page = ctrl.error_log()
    elif lid == LogPage.SMART:
        # Per-namespace SMART: an NSID that is neither 0, "all" nor active is Invalid Namespace (nvmet).
        if sqe.nsid not in (0, 0xFFFFFFFF) and sqe.nsid not in conn.target.namespaces:
            return error(SC_INVALID_NS)
        page = ctrl.smart_log()
    elif lid == LogPage.CHANGED_NS:
        page = ctrl.changed_ns_log(retain=bool(sqe.cdw10 & (1 << 15)))
    elif lid == LogPage.FIRMWARE_SLOT:
        page = bytes(512)
    else:
        return error(SC_INVALID_FIELD)
    return (0, 0, 0, slice_log(page, offset, length))


def set_features(conn: Connection, sqe: Sqe, data: memoryview | None) -> Result:
    ctrl = conn.ctrl
    assert ctrl is not None
    fid = sqe.cdw10 & 0xFF
    val = sqe.cdw11
    if fid == Feature.NUMBER_OF_QUEUES and not ctrl.discovery:
        if val & 0xFFFF == 0xFFFF or val >> 16 == 0xFFFF:
            return error(SC_INVALID_FIELD)
        n = ctrl.max_qid - 1
        return (0, n | (n << 16), 0, None)
    if fid == Feature.ASYNC_EVENT_CONFIG:
        mask = OAES_DISC_CHANGE if ctrl.discovery else OAES_NS_ATTR
        if val & ~mask:
            return error(SC_INVALID_FIELD)
        ctrl.aec = val
        return OK
    if fid == Feature.KEEP_ALIVE_TIMER:
        ctrl.kato_ms = -(-val // 1000) * 1000  # nvmet keeps whole seconds
        ctrl.touch()
        return OK
    return error(SC_INVALID_FIELD)


def get_features(conn: Connection, sqe: Sqe, data: memoryview | None) -> Result:
    ctrl = conn.ctrl
    assert ctrl is not None
    fid = sqe.cdw10 & 0xFF
    if fid == Feature.NUMBER_OF_QUEUES and not ctrl.discovery:
        n = ctrl.max_qid - 1
        return (0, n | (n << 16), 0, None)
    if fid == Feature.ASYNC_EVENT_CONFIG:
        return (0, ctrl.aec, 0, None)
    if fid == Feature.KEEP_ALIVE_TIMER:
        return (0, ctrl.kato_ms, 0, None)
    if fid == Feature.VOLATILE_WRITE_CACHE and not ctrl.discovery:
        return (0, 1, 0, None)
    if fid == 0x81 and not ctrl.discovery:  # host identifier: 128-bit only (EXHID)
        if not sqe.cdw11 & 1:
            return error(SC_INVALID_FIELD)
        return (0, 0, 0, ctrl.hostid.ljust(16, b"\0")[:16])
    return error(SC_INVALID_FIELD)


def aer(conn: Connection, sqe: Sqe, data: memoryview | None) -> Result | None:
    ctrl = conn.ctrl
    assert ctrl is not None
    with ctrl.lock:
        if ctrl.pending_events:
            return (0, ctrl.pending_events.popleft(), 0, None)
        if len(ctrl.aers) > AERL:
            return error(SC_AER_LIMIT)
        ctrl.aers.append((conn, sqe.cid))
    return None


def keep_alive(conn: Connection, sqe: Sqe, data: memoryview | None) -> Result:
    ctrl = conn.ctrl
    assert ctrl is not None
    if not ctrl.kato_ms:
        return error(SC_KA_INVALID)
    ctrl.touch()
    return OK


def abort(conn: Connection, sqe: Sqe, data: memoryview | None) -> Result:
    return (0, 1, 0, None)  # "command not aborted", like nvmet


# ------------------------------------------------------------------------------------------------------
# Identify Namespace and friends


def identify_namespace(target: ConnectionTarget, nsid: int) -> bytes | None:
    ns = target.namespaces.get(nsid)
    if ns is None:
        return None
    shift = ns.lba_shift
    idn = IdentifyNamespace(nsze=ns.nsze, ncap=ns.nsze, nuse=ns.nsze, nmic=1, nguid=ns.nguid,
                            dlfeat=0x01,  # deallocated blocks read as zeros
                            lbaf=[LbaFormat(0, shift, 0)])
    return idn.encode()


def ns_descriptors(target: ConnectionTarget, nsid: int) -> bytes | None:
    ns = target.namespaces.get(nsid)
    if ns is None:
        return None
    return encode_ns_descriptors([(NidType.UUID, ns.uuid), (NidType.NGUID, ns.nguid), (NidType.CSI, b"\0")])


# ------------------------------------------------------------------------------------------------------
# Get Log Page helpers


def slice_log(page: bytes, offset: int, length: int) -> bytes:
    """``length`` bytes of ``page`` from ``offset``, zero padded past its end."""
    part = page[offset:offset + length]
    return part + bytes(length - len(part))


def supported_logs(discovery: bool) -> bytes:
    return encode_supported_logs([LogPage.DISCOVERY] if discovery else [0x00, 0x01, 0x02, 0x03, 0x04])
