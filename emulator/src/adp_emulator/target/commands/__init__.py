"""The command sets the userspace target serves, one module each, behind one :func:`parse`.

* :mod:`.fabrics` - Connect, Property Get/Set (opcode 0x7F, any queue before Connect).
* :mod:`.admin` - the admin queue's commands.
* :mod:`.nvm` - the I/O queues' commands.
* :mod:`.result` - what handlers return (:data:`Result`, :func:`error`, :data:`OK`) and the status words.

The connection (:mod:`..connection`) frames PDUs and moves data; it asks :func:`parse` what a command
needs and calls the handler it names once the data is in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from adp_wire.constants import SQE_FLAGS_SGL, AdminOpcode

from . import admin, fabrics, nvm
from .result import (
    DIR_IN,
    DIR_NONE,
    DIR_OUT,
    OK,
    SC_INVALID_FIELD,
    SC_INVALID_OPCODE,
    Handler,
    Parsed,
    Result,
    error,
    no_op,
)

if TYPE_CHECKING:  # pragma: no cover
    from adp_wire.sqe import Sqe

    from ..connection import Connection

__all__ = ["DIR_IN", "DIR_NONE", "DIR_OUT", "OK", "Handler", "Parsed", "Result", "error", "parse"]

_FABRICS = int(AdminOpcode.FABRICS)
_PSDT_FUSE_MASK = 0xC3  # PSDT (bits 7:6) and FUSE (bits 1:0) of the SQE flags


def parse(conn: Connection, sqe: Sqe) -> Parsed:
    """What ``sqe`` needs before it runs on ``conn``: (status, direction, data buffer, handler)."""
    if sqe.flags & _PSDT_FUSE_MASK != SQE_FLAGS_SGL:  # PSDT must be SGL (01b), no fused operations (nvmet_req_init)
        return SC_INVALID_FIELD, DIR_NONE, None, no_op
    if sqe.opcode == _FABRICS:
        return fabrics.parse(conn, sqe)
    if conn.qid < 0:  # only Connect before Connect
        return SC_INVALID_OPCODE, DIR_NONE, None, no_op
    if conn.qid == 0:
        return admin.parse(conn, sqe)
    return nvm.parse(conn, sqe)
