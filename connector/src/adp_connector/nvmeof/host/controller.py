"""The NVMe/TCP host: one controller association (admin queue + N I/O queues) to one subsystem.

:class:`Controller` is the ONE client used for the userspace emulator, the Linux kernel target and a
real ADP card alike; only the address differs. It implements :class:`adp_connector.device.BlockDevice`
for one namespace: byte-addressed reads and writes of any size, split at the controller's MDTS (and
MAXH2CDATA on the wire) and spread over the I/O queues, pipelined up to the queue depth.

Thread-safe: every public method may be called from any thread. A housekeeping thread sends Keep
Alive every KATO/2, enforces per-command timeouts and re-establishes the association after a lost
connection (while it is down, I/O raises :class:`~adp_connector.device.DeviceUnavailable` at once).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

from adp_wire import sqe as S
from adp_wire.constants import (
    CC_EN,
    CSTS_CFS,
    CSTS_RDY,
    DISCOVERY_NQN,
    SUBTYPE_NVME,
    Cns,
    Feature,
    LogPage,
    Property,
)
from adp_wire.sqe import Cqe, Sqe
from adp_wire.structs import (
    DiscoveryEntry,
    IdentifyController,
    IdentifyNamespace,
    decode_discovery_header,
    decode_discovery_log,
    decode_ns_descriptors,
    decode_ns_list,
    default_host_nqn,
)

from ...device import Buffer, DeviceError, DeviceUnavailable
from .errors import NvmeStatusError, NvmeTransportError
from .nvm import MAX_NLB, NvmCommands
from .queue import QueuePair, QueueParams
from .transport import TcpTransport, Transport

log = logging.getLogger(__name__)

DEFAULT_MAX_TRANSFER = 1 << 20  # used when the controller reports MDTS 0 (no limit)


@dataclass
class HostConfig:
    """Where and how to connect. ``subnqn=None`` asks the discovery controller at the same address."""

    traddr: str = "127.0.0.1"
    trsvcid: int = 4420
    subnqn: str | None = None
    hostnqn: str | None = None
    hostid: bytes = field(default_factory=lambda: uuid.uuid4().bytes)
    nsid: int | None = None  # None: the first active namespace
    io_queues: int = 4
    queue_depth: int = 32
    kato_ms: int = 10_000
    hdgst: bool = False
    ddgst: bool = False
    connect_timeout: float = 10.0
    command_timeout: float = 30.0
    max_transfer_bytes: int | None = None  # cap below the controller's MDTS (tests, tuning)
    reconnect_delay: float = 1.0
    auto_reconnect: bool = True
    disable_sq_flow_control: bool = True  # reads end with C2HData SUCCESS, no CapsuleResp (Linux: -d)
    use_discovered_address: bool = False  # with subnqn=None: also take TRADDR/TRSVCID from the discovery log
    transport: Transport = field(default_factory=TcpTransport)

    def __post_init__(self) -> None:
        if self.hostnqn is None:
            self.hostnqn = default_host_nqn(self.hostid)
        if not 0 <= self.io_queues <= 128:
            raise ValueError(f"io_queues must be 0..128, got {self.io_queues}")
        if not 1 <= self.queue_depth <= 1023:
            raise ValueError(f"queue_depth must be 1..1023, got {self.queue_depth}")
        if self.kato_ms < 0:
            raise ValueError("kato_ms must be >= 0")


@dataclass
class HostStats:
    commands: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    errors: int = 0
    timeouts: int = 0
    reconnects: int = 0
    connection_losses: int = 0


class Controller(NvmCommands):
    """A live association with one NVMe-oF subsystem; a BlockDevice for one of its namespaces."""

    def __init__(self, config: HostConfig, discovery: bool = False) -> None:
        self.config = config
        self.discovery = discovery
        self.stats = HostStats()
        self.cntlid = 0
        self.identify: IdentifyController | None = None
        self.namespace: IdentifyNamespace | None = None
        self.nsid = 0
        self._admin: QueuePair | None = None
        self._io: list[QueuePair] = []
        self._rr = itertools.count()
        self._lost: BaseException | None = None
        self._closed = False
        self._assoc_lock = threading.RLock()
        self._next_reconnect = 0.0
        self._wake = threading.Event()
        self._house: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------------
    # Association

    @classmethod
    def connect(cls, config: HostConfig) -> Controller:
        """Connect (via discovery when ``config.subnqn`` is None) and bring the controller up."""
        if config.subnqn is None:
            entries = discover(config.traddr, config.trsvcid, config.hostnqn, config.transport,
                               config.connect_timeout)
            nvm = [e for e in entries if e.subtype == SUBTYPE_NVME]
            if not nvm:
                raise DeviceError(f"discovery at {config.traddr}:{config.trsvcid} lists no NVM subsystem")
            # Only the NQN is taken from the log: behind NAT or port forwarding (a QEMU guest, a container)
            # the entry's TRADDR/TRSVCID are the target's own view and may be unreachable from here.
            config.subnqn = nvm[0].subnqn
            if config.use_discovered_address:
                config.traddr, config.trsvcid = nvm[0].traddr or config.traddr, int(nvm[0].trsvcid or config.trsvcid)
        ctrl = cls(config)
        ctrl._establish()
        ctrl._house = threading.Thread(target=ctrl._housekeeping, name="nvme-host-keepalive", daemon=True)
        ctrl._house.start()
        return ctrl

    def _open_queue(self, qid: int, depth: int, in_capsule: int) -> QueuePair:
        cfg = self.config
        try:
            sock = cfg.transport.connect(cfg.traddr, cfg.trsvcid, cfg.connect_timeout)
        except OSError as e:
            raise NvmeTransportError(f"cannot reach {cfg.traddr}:{cfg.trsvcid}: {e}") from e
        q = QueuePair(sock, qid, depth, QueueParams(cfg.hdgst, cfg.ddgst, cfg.connect_timeout, in_capsule),
                      on_failure=self._queue_failed)
        try:
            q.initialize()
        except BaseException:
            q.close()
            raise
        return q

    def _establish(self) -> None:
        """Admin queue, enable, identify, I/O queues. Raises DeviceError subclasses."""
        cfg = self.config
        subnqn = DISCOVERY_NQN if self.discovery else cfg.subnqn
        assert subnqn is not None and cfg.hostnqn is not None
        admin = self._open_queue(0, 31, 8192)
        self._admin = admin
        try:
            self.cntlid = admin.connect(subnqn, cfg.hostnqn, cfg.hostid, 0xFFFF, cfg.kato_ms,
                                        cfg.connect_timeout)
            self._enable()
            self.identify = IdentifyController.decode(self._admin_read(S.identify_cmd(Cns.CONTROLLER), 4096))
            if self.identify.cntlid != self.cntlid:
                raise DeviceError(f"Identify reports CNTLID {self.identify.cntlid}, Connect gave {self.cntlid}")
            if self.discovery:
                return
            if self.identify.sgls & 0x3 == 0:
                raise DeviceError("controller does not support SGLs (mandatory on NVMe/TCP)")
            self._identify_namespace()
            nq = self._set_queue_count(cfg.io_queues) if cfg.io_queues else 0
            depth = min(cfg.queue_depth, max(1, self._mqes() - 1), max(1, self.identify.maxcmd - 1))
            io_capsule = self.identify.in_capsule_data_size
            self._io = []
            for qid in range(1, nq + 1):
                q = self._open_queue(qid, depth, io_capsule)
                self._io.append(q)
                q.connect(subnqn, cfg.hostnqn, cfg.hostid, self.cntlid, 0, cfg.connect_timeout,
                          disable_sq_flow_control=cfg.disable_sq_flow_control)
            if not all(q.alive for q in [admin, *self._io]):
                raise NvmeTransportError("a queue failed while the association was being established")
        except BaseException:
            self._teardown()
            raise
        self._lost = None

    def _enable(self) -> None:
        cap = self.property_get(Property.CAP, size8=True)
        self._cap = cap
        css = 6 if cap & (1 << 43) else 0
        cc = CC_EN | (6 << 16) | (4 << 20) | (css << 4)
        self.property_set(Property.CC, cc)
        timeout = max(1, (cap >> 24) & 0xFF) * 0.5
        deadline = time.monotonic() + timeout
        while True:
            csts = self.property_get(Property.CSTS)
            if csts == 0xFFFFFFFF or csts & CSTS_CFS:
                raise DeviceError(f"controller fatal status while enabling (CSTS={csts:#x})")
            if csts & CSTS_RDY:
                break
            if time.monotonic() > deadline:
                raise DeviceError("controller did not become ready (CSTS.RDY)")
            time.sleep(0.002)
        self.version = self.property_get(Property.VS)

    def _mqes(self) -> int:
        return (self._cap & 0xFFFF) + 1

    def _set_queue_count(self, wanted: int) -> int:
        cqe = self.admin(S.set_features_cmd(Feature.NUMBER_OF_QUEUES, ((wanted - 1) << 16) | (wanted - 1)))
        granted = min(cqe.dw0 & 0xFFFF, cqe.dw0 >> 16) + 1
        if granted < 1:
            raise DeviceError("controller granted no I/O queues")
        return min(wanted, granted)

    def _identify_namespace(self) -> None:
        ids = decode_ns_list(self._admin_read(S.identify_cmd(Cns.ACTIVE_NS_LIST, nsid=0), 4096))
        if not ids:
            raise DeviceError(f"subsystem {self.config.subnqn} has no active namespace")
        nsid = self.config.nsid or ids[0]
        if nsid not in ids:
            raise DeviceError(f"namespace {nsid} is not active (active: {ids})")
        self.nsid = nsid
        self.namespace = IdentifyNamespace.decode(self._admin_read(S.identify_cmd(Cns.NAMESPACE, nsid=nsid), 4096))
        if self.namespace.ncap == 0:
            raise DeviceError(f"namespace {nsid} has no capacity")

    def _teardown(self) -> None:
        queues = [*self._io, self._admin]
        self._io = []
        self._admin = None
        for q in queues:
            if q is not None:
                q.close()

    def _queue_failed(self, queue: QueuePair, error: BaseException) -> None:
        if self._closed:
            return
        if queue is not self._admin and queue not in self._io:
            # A queue of an association already torn down, whose reader noticed its end late (a busy host): not a
            # loss of the current association (counting it tore a fresh association down right after a reconnect).
            return
        if self._lost is None:
            self._lost = error
            self.stats.connection_losses += 1
            log.warning("NVMe/TCP association to %s:%s lost: %s", self.config.traddr, self.config.trsvcid, error)
        self._next_reconnect = time.monotonic() + self.config.reconnect_delay
        self._wake.set()

    def reconnect(self) -> None:
        """Tear the association down and establish it again (new controller id)."""
        with self._assoc_lock:
            self._lost = self._lost or NvmeTransportError("reconnect requested")
            self._teardown()
            self._establish()
            self.stats.reconnects += 1

    @property
    def connected(self) -> bool:
        """The association is up: no loss noticed and every queue alive (a queue whose failure is still being
        reported by its reader already counts as down, so a caller that just saw it fail never reads True)."""
        admin = self._admin
        return (self._lost is None and not self._closed and admin is not None and admin.alive
                and all(q.alive for q in self._io))

    def _housekeeping(self) -> None:
        kato = self.config.kato_ms / 1000.0
        next_ka = time.monotonic() + kato / 2 if kato else float("inf")
        while not self._closed:
            self._wake.wait(0.05)
            self._wake.clear()
            if self._closed:
                return
            now = time.monotonic()
            if self._lost is not None:
                with self._assoc_lock:
                    if self._lost is None or self._closed:  # reconnected by another thread meanwhile
                        continue
                    if self._admin is not None or self._io:
                        self._teardown()
                    if self.config.auto_reconnect and now >= self._next_reconnect:
                        try:
                            self.reconnect()
                            log.info("NVMe/TCP association re-established (cntlid %d)", self.cntlid)
                            next_ka = time.monotonic() + kato / 2 if kato else float("inf")
                        except Exception as e:  # keep trying at the configured pace
                            self._next_reconnect = time.monotonic() + self.config.reconnect_delay
                            log.debug("reconnect failed: %s", e)
                continue
            for q in [self._admin, *self._io]:
                if q is not None and q.expire(now):
                    self.stats.timeouts += 1
            if now >= next_ka:
                next_ka = now + kato / 2
                admin = self._admin
                if admin is not None and admin.alive:
                    try:
                        admin.submit(S.keep_alive_cmd(), what="Keep Alive", timeout=max(kato, 1.0))
                    except DeviceError:
                        pass

    def close(self) -> None:
        """Shut the controller down (CC.SHN) and close every connection."""
        if self._closed:
            return
        if self.connected:
            try:
                self.property_set(Property.CC, CC_EN | (6 << 16) | (4 << 20) | (1 << 14), timeout=2.0)
            except DeviceError:
                pass
        self._closed = True
        self._wake.set()
        with self._assoc_lock:
            self._teardown()
        if self._house is not None and self._house is not threading.current_thread():
            self._house.join(timeout=2)

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------
    # Admin commands

    def _admin_queue(self) -> QueuePair:
        admin = self._admin
        if admin is None or self._closed:
            raise DeviceUnavailable(f"not connected to {self.config.traddr}:{self.config.trsvcid}: {self._lost}")
        return admin

    def admin(self, sqe: Sqe, data: Buffer | None = None, read_into: memoryview | None = None,
              timeout: float | None = None, what: str = "") -> Cqe:
        """Run one admin command synchronously; raises NvmeStatusError naming the status."""
        t = timeout or self.config.command_timeout
        fut = self._admin_queue().submit(sqe, memoryview(data) if data is not None else None, read_into,
                                         what or f"admin opcode {sqe.opcode:#x}", t)
        return fut.result(t + 5)

    def _admin_read(self, sqe: Sqe, length: int) -> bytes:
        buf = bytearray(length)
        self.admin(sqe, read_into=memoryview(buf), what=f"admin opcode {sqe.opcode:#x}")
        return bytes(buf)

    def property_get(self, offset: int, size8: bool = False, timeout: float | None = None) -> int:
        cqe = self.admin(S.property_get_cmd(offset, size8), timeout=timeout, what=f"Property Get {offset:#x}")
        return cqe.dw0 | (cqe.dw1 << 32 if size8 else 0)

    def property_set(self, offset: int, value: int, timeout: float | None = None) -> None:
        self.admin(S.property_set_cmd(offset, value), timeout=timeout, what=f"Property Set {offset:#x}")

    def identify_namespace(self, nsid: int) -> IdentifyNamespace:
        return IdentifyNamespace.decode(self._admin_read(S.identify_cmd(Cns.NAMESPACE, nsid=nsid), 4096))

    def active_namespaces(self) -> list[int]:
        return decode_ns_list(self._admin_read(S.identify_cmd(Cns.ACTIVE_NS_LIST), 4096))

    def namespace_descriptors(self, nsid: int) -> list[tuple[int, bytes]]:
        return decode_ns_descriptors(self._admin_read(S.identify_cmd(Cns.NS_DESCRIPTORS, nsid=nsid), 4096))

    def get_log_page(self, lid: int, length: int, offset: int = 0, nsid: int = 0) -> bytes:
        return self._admin_read(S.get_log_page_cmd(lid, length, offset, nsid), length)

    def get_features(self, fid: int) -> int:
        return self.admin(S.get_features_cmd(fid), what=f"Get Features {fid:#x}").dw0

    def set_features(self, fid: int, value: int) -> int:
        return self.admin(S.set_features_cmd(fid, value), what=f"Set Features {fid:#x}").dw0

    def keep_alive(self) -> None:
        self.admin(S.keep_alive_cmd(), what="Keep Alive")

    def discovery_log(self) -> list[DiscoveryEntry]:
        """Read the whole discovery log (discovery controllers only), retrying if it changes meanwhile."""
        for _ in range(5):
            genctr, numrec = decode_discovery_header(self.get_log_page(LogPage.DISCOVERY, 1024))
            full = self.get_log_page(LogPage.DISCOVERY, 1024 + 1024 * numrec) if numrec else b""
            again, _ = decode_discovery_header(self.get_log_page(LogPage.DISCOVERY, 1024))
            if again == genctr:
                return decode_discovery_log(full)[1] if numrec else []
        raise DeviceError("discovery log kept changing while being read")

    # ------------------------------------------------------------------------------------------------
    # BlockDevice

    @property
    def lba_size(self) -> int:
        assert self.namespace is not None, "not an I/O controller"
        return self.namespace.lba_size

    @property
    def capacity_bytes(self) -> int:
        assert self.namespace is not None, "not an I/O controller"
        return self.namespace.nsze * self.lba_size

    @property
    def mdts_bytes(self) -> int | None:
        """The controller's maximum data transfer size in bytes (None = no limit reported)."""
        assert self.identify is not None
        if self.identify.mdts == 0:
            return None
        mpsmin = 4096 << ((getattr(self, "_cap", 0) >> 48) & 0xF)
        return mpsmin << self.identify.mdts

    @property
    def max_transfer_bytes(self) -> int:
        mdts, cap = self.mdts_bytes, self.config.max_transfer_bytes
        if mdts is None:  # no limit reported: the configured size, else a moderate default
            limit = cap or DEFAULT_MAX_TRANSFER
        else:
            limit = min(mdts, cap) if cap else mdts
        limit = min(limit, MAX_NLB * self.lba_size)
        return max(self.lba_size, limit - limit % self.lba_size)

    def _io_queue(self) -> QueuePair:
        if self._closed:
            raise DeviceUnavailable("controller closed")
        if self._lost is not None:
            raise DeviceUnavailable(f"target {self.config.traddr}:{self.config.trsvcid} unreachable: {self._lost}")
        io = self._io
        if not io:
            raise DeviceUnavailable("no I/O queues")
        if len(io) == 1:
            return io[0]
        # Round-robin, skipping a queue that is much busier than the next one.
        a = io[next(self._rr) % len(io)]
        b = io[next(self._rr) % len(io)]
        return a if a.in_flight <= b.in_flight else b


def discover(traddr: str, trsvcid: int = 4420, hostnqn: str | None = None, transport: Transport | None = None,
             timeout: float = 10.0) -> list[DiscoveryEntry]:
    """Ask the discovery controller at ``traddr:trsvcid`` which subsystems it offers."""
    cfg = HostConfig(traddr=traddr, trsvcid=trsvcid, subnqn=DISCOVERY_NQN, hostnqn=hostnqn, io_queues=0,
                     kato_ms=0, connect_timeout=timeout, command_timeout=timeout, auto_reconnect=False,
                     transport=transport or TcpTransport())
    ctrl = Controller(cfg, discovery=True)
    try:
        ctrl._establish()
        return ctrl.discovery_log()
    finally:
        ctrl.close()


__all__ = ["Controller", "HostConfig", "HostStats", "NvmeStatusError", "discover"]
