"""The NVM command set on I/O queues: Read, Write, Flush, Write Zeroes, Dataset Management.

Read and Write move their data in the connection (C2HData from, and R2T/H2CData or in-capsule data
straight into, the namespace mapping); :func:`parse` checks them and names that mapping.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from adp_wire.constants import CSTS_RDY, IoOpcode
from adp_wire.sqe import DSM_ATTR_DEALLOCATE, Sqe, decode_dsm_ranges

from .result import (
    DIR_IN,
    DIR_NONE,
    DIR_OUT,
    OK,
    SC_CAP_EXCEEDED,
    SC_CMD_SEQ,
    SC_INVALID_FIELD,
    SC_INVALID_NS,
    SC_INVALID_OPCODE,
    SC_LBA_RANGE,
    SC_SGL_INVALID_DATA,
    Parsed,
    Result,
    error,
    expect,
    no_op,
)

if TYPE_CHECKING:  # pragma: no cover
    from ..connection import Connection

_READ, _WRITE = int(IoOpcode.READ), int(IoOpcode.WRITE)


def parse(conn: Connection, sqe: Sqe) -> Parsed:
    ctrl = conn.ctrl
    assert ctrl is not None
    if not ctrl.csts & CSTS_RDY:
        return SC_CMD_SEQ, DIR_NONE, None, no_op
    ns = conn.ns
    if ns is None or sqe.nsid != ns.nsid:
        return SC_INVALID_NS, DIR_NONE, None, no_op
    opc = sqe.opcode
    if opc in (_READ, _WRITE):
        nlb = sqe.nlb
        length = nlb << ns.lba_shift
        direction = DIR_IN if opc == _READ else DIR_OUT
        if sqe.sgl_len != length:
            return SC_SGL_INVALID_DATA, direction, None, no_op
        if length > conn.mdts:
            return SC_INVALID_FIELD, direction, None, no_op
        slba = sqe.slba
        if slba + nlb > ns.nsze:
            return SC_LBA_RANGE, direction, None, no_op
        if opc == _WRITE and conn.faults.device_full:
            return SC_CAP_EXCEEDED, direction, None, no_op
        off = slba << ns.lba_shift
        return 0, direction, ns.view[off:off + length], write_done
    if opc == IoOpcode.FLUSH:
        return expect(sqe, 0, DIR_NONE, flush)
    if opc == IoOpcode.WRITE_ZEROES:
        nlb, slba = sqe.nlb, sqe.slba
        if sqe.sgl_len:
            return SC_SGL_INVALID_DATA, DIR_NONE, None, no_op
        if slba + nlb > ns.nsze:
            return SC_LBA_RANGE, DIR_NONE, None, no_op
        if conn.faults.device_full:
            return SC_CAP_EXCEEDED, DIR_NONE, None, no_op
        return 0, DIR_NONE, None, write_zeroes
    if opc == IoOpcode.DATASET_MANAGEMENT:
        nr = (sqe.cdw10 & 0xFF) + 1
        if sqe.sgl_len == 0 or sqe.sgl_len > nr * 16:  # nvmet_check_data_len_lte
            return SC_SGL_INVALID_DATA, DIR_OUT, None, no_op
        return 0, DIR_OUT, memoryview(bytearray(sqe.sgl_len)), dsm
    return SC_INVALID_OPCODE, DIR_NONE, None, no_op


def write_done(conn: Connection, sqe: Sqe, data: memoryview | None) -> Result:
    c = conn.counters
    c.writes += 1
    c.bytes_written += sqe.nlb << conn.ns.lba_shift  # type: ignore[union-attr]
    return OK


def flush(conn: Connection, sqe: Sqe, data: memoryview | None) -> Result:
    conn.ns.flush()  # type: ignore[union-attr]
    return OK


def write_zeroes(conn: Connection, sqe: Sqe, data: memoryview | None) -> Result:
    ns = conn.ns
    assert ns is not None
    ns.zero(sqe.slba << ns.lba_shift, sqe.nlb << ns.lba_shift)
    conn.counters.writes += 1
    return OK


def dsm(conn: Connection, sqe: Sqe, data: memoryview | None) -> Result:
    ns = conn.ns
    assert ns is not None and data is not None
    if not sqe.cdw11 & DSM_ATTR_DEALLOCATE:
        return OK  # IDR/IDW hints only: no-op (nvmet)
    ranges = decode_dsm_ranges(data[:len(data) // 16 * 16])
    for slba, nlb in ranges:
        if slba + nlb > ns.nsze:
            return error(SC_LBA_RANGE)
    for slba, nlb in ranges:
        if nlb:
            ns.zero(slba << ns.lba_shift, nlb << ns.lba_shift)
    return OK
