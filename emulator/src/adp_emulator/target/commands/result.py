"""What every command handler returns, and the pieces the command sets share.

A command set's ``parse(conn, sqe)`` checks a command before its data moves and returns a
:data:`Parsed`: (status word, data direction, the buffer its host-to-controller data lands in or
None, the handler). Once the data is in, the connection calls ``handler(conn, sqe, data)``, which
returns a :data:`Result`, or None when the completion is sent later (an AER) or already went out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from adp_wire.status import Status

if TYPE_CHECKING:  # pragma: no cover
    from adp_wire.sqe import Sqe

    from ..connection import Connection


def _w(name: str) -> int:
    return Status.named(name).word


SC_INVALID_OPCODE = _w("INVALID_OPCODE")
SC_INVALID_FIELD = _w("INVALID_FIELD")
SC_INTERNAL = _w("INTERNAL_ERROR")
SC_INVALID_NS = _w("INVALID_NAMESPACE")
SC_CMD_SEQ = _w("COMMAND_SEQUENCE_ERROR")
SC_SGL_INVALID_DATA = _w("SGL_DATA_BLOCK_INVALID")
SC_SGL_INVALID_OFFSET = _w("SGL_OFFSET_INVALID")
SC_SGL_INVALID_TYPE = _w("SGL_DESCRIPTOR_TYPE_INVALID")
SC_KA_INVALID = _w("KEEP_ALIVE_TIMER_INVALID")
SC_LBA_RANGE = _w("LBA_OUT_OF_RANGE")
SC_CAP_EXCEEDED = _w("CAPACITY_EXCEEDED")
SC_TRANSIENT = _w("TRANSIENT_TRANSPORT_ERROR")
SC_AER_LIMIT = _w("ASYNC_EVENT_REQUEST_LIMIT_EXCEEDED")
SC_CONNECT_FORMAT = _w("CONNECT_INCOMPATIBLE_FORMAT")
SC_CONNECT_BUSY = _w("CONNECT_CONTROLLER_BUSY")
SC_CONNECT_INVALID_PARAM = _w("CONNECT_INVALID_PARAMETERS")
SC_CONNECT_INVALID_HOST = _w("CONNECT_INVALID_HOST")

Result = tuple[int, int, int, "bytes | None"]  # status word, DW0, DW1, data for the host
OK: Result = (0, 0, 0, None)

# Data direction of a command.
DIR_NONE, DIR_OUT, DIR_IN = 0, 1, 2

Handler = Callable[["Connection", "Sqe", "memoryview | None"], "Result | None"]
Parsed = tuple[int, int, "memoryview | None", Handler]


def error(word: int, dw0: int = 0) -> Result:
    """A failed command's result: status ``word`` (e.g. ``SC_INVALID_FIELD``) and, where the status
    defines one, a DW0 (Connect's invalid-parameter offset)."""
    return (word, dw0, 0, None)


def no_op(conn: Connection, sqe: Sqe, data: memoryview | None) -> Result:
    """The handler of a command refused at parse time (its status is already decided) or with nothing to do."""
    return OK


def expect(sqe: Sqe, length: int, direction: int, handler: Handler) -> Parsed:
    """Check the SGL length a command implies (nvmet_check_transfer_len); a buffer for data it carries."""
    if sqe.sgl_len != length:
        return SC_SGL_INVALID_DATA, direction, None, handler
    dest = memoryview(bytearray(length)) if direction == DIR_OUT and length else None
    return 0, direction, dest, handler
