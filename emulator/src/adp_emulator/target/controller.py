"""Controller state: one per association (registers, features, keep-alive, AERs, queues, error log).

The commands that read and change it are in :mod:`.commands` (by command set). Behaviour mirrors
Linux nvmet (drivers/nvme/target/core.c, admin-cmd.c, discovery.c) so differential tests against the
kernel target agree.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from adp_wire.constants import (
    ADRFAM_IPV4,
    ADRFAM_IPV6,
    CC_EN,
    CC_SHN_MASK,
    CNTRLTYPE_DISCOVERY,
    CNTRLTYPE_IO,
    CSTS_CFS,
    CSTS_RDY,
    CSTS_SHST_COMPLETE,
    DISCOVERY_NQN,
)
from adp_wire.status import Status
from adp_wire.structs import (
    DiscoveryEntry,
    ErrorLogEntry,
    IdentifyController,
    SmartLog,
    encode_discovery_log,
    encode_ns_list,
)

if TYPE_CHECKING:  # pragma: no cover
    from .connection import Connection
    from .server import UserspaceTarget


SC_INTERNAL = Status.named("INTERNAL_ERROR").word  # what parked AERs complete with on teardown

# Register values (nvmet_init_cap): CSS NVM (bit 37) + "I/O command sets" (bit 43), TO 15 (7.5 s).
CAP_BASE = (1 << 37) | (1 << 43) | (15 << 24)
VS_VALUE = 0x020100  # NVMe 2.1.0, as recent nvmet reports
AERL = 3  # 4 outstanding AERs, 0's based
ERROR_LOG_SLOTS = 64
OAES_NS_ATTR = 1 << 8
OAES_DISC_CHANGE = 1 << 31
CTRATT = 0x1 | 0x40  # 128-bit host id, traffic-based keep-alive (nvmet)
ONCS = 0x04 | 0x08  # Dataset Management, Write Zeroes
CMIC = 0x02  # more than one controller may exist (new association while an old one tears down)

class Controller:
    """State of one association: registers, features, keep-alive, AERs, queues, error log."""

    def __init__(self, target: UserspaceTarget, cntlid: int, hostnqn: str, hostid: bytes, discovery: bool,
                 kato_ms: int) -> None:
        self.target = target
        self.cntlid = cntlid
        self.hostnqn = hostnqn
        self.hostid = hostid
        self.discovery = discovery
        self.lock = threading.Lock()
        self.cc = 0
        self.csts = 0
        self.kato_ms = kato_ms
        self.aec = 0
        self.last_activity = time.monotonic()
        self.queues: dict[int, Connection] = {}
        self.aers: deque[tuple[Connection, int]] = deque()
        self.pending_events: deque[int] = deque()
        self.changed_ns: list[int] = []  # Changed Namespace List log (LID 0x04), cleared when read
        self.errors: deque[ErrorLogEntry] = deque(maxlen=ERROR_LOG_SLOTS)
        self.error_count = 0
        self.dead = False
        self.max_qid = 0 if discovery else target.settings.max_io_queues

    @property
    def ready(self) -> bool:
        return bool(self.csts & CSTS_RDY)

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    def log_error(self, sqid: int, cid: int, status: int, opcode: int, nsid: int = 0, lba: int = 0) -> None:
        with self.lock:
            self.error_count += 1
            self.errors.appendleft(ErrorLogEntry(self.error_count, sqid, cid, status & 0xFFFE, 0xFFFF, lba,
                                                 nsid, opcode))

    # -- asynchronous events -------------------------------------------------------------------------
    def post_event(self, dw0: int, aec_bit: int) -> None:
        """Complete a parked AER with ``dw0`` if the event class is enabled, else drop it."""
        if not self.aec & aec_bit:
            return
        with self.lock:
            if self.aers:
                conn, cid = self.aers.popleft()
            else:
                self.pending_events.append(dw0)
                return
        conn.send_completion(cid, 0, dw0)

    def note_namespace_changed(self, nsid: int) -> None:
        with self.lock:
            if nsid not in self.changed_ns and len(self.changed_ns) < 1024:
                self.changed_ns.append(nsid)

    def changed_ns_log(self, retain: bool) -> bytes:
        """LID 0x04: up to 1024 changed NSIDs, zero padded; reading clears it unless RAE is set."""
        with self.lock:
            ids = list(self.changed_ns)
            if not retain:
                self.changed_ns.clear()
        return encode_ns_list(ids)  # the same layout as the active namespace list

    def fail_aers(self, status: int = SC_INTERNAL) -> None:
        """Fail every parked AER (nvmet does this on controller teardown)."""
        with self.lock:
            aers = list(self.aers)
            self.aers.clear()
        for conn, cid in aers:
            conn.send_completion(cid, status)

    # -- registers ------------------------------------------------------------------------------------
    def cap(self) -> int:
        return CAP_BASE | (self.target.settings.queue_depth - 1)

    def set_cc(self, new: int) -> None:
        """Property Set CC (nvmet_update_cc)."""
        old = self.cc
        self.cc = new
        if new & CC_EN and not old & CC_EN:
            iosqes, iocqes = (new >> 16) & 0xF, (new >> 20) & 0xF
            mps, ams, css = (new >> 7) & 0xF, (new >> 11) & 0x7, (new >> 4) & 0x7
            bad = mps != 0 or ams != 0 or css not in (0, 6)
            if not self.discovery:
                bad = bad or iosqes != 6 or iocqes != 4
            if bad:
                self.csts = CSTS_CFS
            else:
                self.csts |= CSTS_RDY
                self.touch()
        if not new & CC_EN and old & CC_EN:
            self._clear()
        if new & CC_SHN_MASK and not old & CC_SHN_MASK:
            self._clear()
            self.csts |= CSTS_SHST_COMPLETE
        if not new & CC_SHN_MASK and old & CC_SHN_MASK:
            self.csts &= ~CSTS_SHST_COMPLETE

    def _clear(self) -> None:
        self.csts &= ~CSTS_RDY
        self.cc = 0
        self.fail_aers()

    # -- data structures ------------------------------------------------------------------------------
    def identify_controller(self) -> bytes:
        s = self.target.settings
        idc = IdentifyController(
            sn=s.serial_number, mn=s.model, fr=s.firmware, subnqn=DISCOVERY_NQN if self.discovery else s.subnqn,
            vid=0x1B36, ssvid=0x1B36, cmic=0 if self.discovery else CMIC, mdts=s.mdts_field, cntlid=self.cntlid,
            ver=VS_VALUE, oaes=OAES_DISC_CHANGE if self.discovery else OAES_NS_ATTR, ctratt=CTRATT,
            cntrltype=CNTRLTYPE_DISCOVERY if self.discovery else CNTRLTYPE_IO, aerl=AERL, lpa=0x04,
            elpe=ERROR_LOG_SLOTS - 1, kas=10, maxcmd=s.queue_depth, nn=0 if self.discovery else 1,
            oncs=0 if self.discovery else ONCS, vwc=0 if self.discovery else 1,
            ioccsz=(64 + s.in_capsule_bytes) // 16, mnan=0,
        )
        return idc.encode()

    def smart_log(self) -> bytes:
        c = self.target.namespace_counters(1)
        return SmartLog(
            data_units_read=-(-c.bytes_read // 512_000), data_units_written=-(-c.bytes_written // 512_000),
            host_read_commands=c.reads, host_write_commands=c.writes, power_cycles=1,
            power_on_hours=int((time.monotonic() - self.target.started_at) // 3600),
            error_log_entries=self.error_count,
        ).encode()

    def error_log(self) -> bytes:
        with self.lock:
            return b"".join(e.encode() for e in self.errors)

    def discovery_log(self, conn: Connection) -> bytes:
        t = self.target
        entries = []
        if t.host_allowed(self.hostnqn):
            traddr = conn.local_addr[0] if t.settings.host in ("0.0.0.0", "::") else t.settings.host
            entries.append(DiscoveryEntry(
                subnqn=t.settings.subnqn, traddr=traddr, trsvcid=str(t.address[1]),
                adrfam=ADRFAM_IPV6 if ":" in traddr else ADRFAM_IPV4,
                treq=0x4,  # SQ flow control disable supported
                portid=1, asqsz=32,
            ))
        return encode_discovery_log(1, entries)


def counters_snapshot(ctrl: Controller) -> dict[str, Any]:
    return {"cntlid": ctrl.cntlid, "hostnqn": ctrl.hostnqn, "discovery": ctrl.discovery,
            "cc": ctrl.cc, "csts": ctrl.csts, "kato_ms": ctrl.kato_ms, "errors": ctrl.error_count,
            "queues": sorted(ctrl.queues)}
