"""The connection to the card, shared by the scheduler and worker sides: connect lazily, survive an absent target.

:class:`StoreLink` owns one :class:`~adp_connector.nvmeof.host.Controller` and the :class:`PageStore` on it. A
background thread (re)connects every ``retry_interval_s`` while the target is unreachable; meanwhile ``store`` is
None and the connector acts as "no cache". Once up, the controller reconnects by itself after a drop (I/O raises
``DeviceUnavailable`` meanwhile, which the callers turn into misses / dropped saves).

Given an ``arena`` (the worker side, option ``io_process``), the controller and store live in a helper process
(:class:`~adp_connector.store.process.StoreProcess`) that moves pages in and out of the arena, or in several
(``load_processes``, ``save_processes``: a :class:`~adp_connector.store.process.StoreGroup` of writer and reader
helpers); if one dies, ``store`` turns None and the link starts the helpers again. A read-only link with
``io_process`` (the scheduler side) opens its store in a lookup helper of its own: the index refresh (every slot
table of the card, each ``refresh_interval_s``: a thousand NVMe reads on a 64 GiB card) and the NVMe/TCP queue
threads then run outside the engine-core process, off the GIL of the thread that schedules and launches the model.
The helper sends each change of its index back (``lookup_mirror``, on by default), so a lookup reads a copy in this
process and makes no round trip (without it, a lookup is one round trip to the helper).
"""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
import time
from types import SimpleNamespace
from typing import Any

from ..nvmeof.host import Controller, HostConfig
from ..store import PageStore, StoreConfig
from ..store.api import Store
from ..store.process import SharedArena, StoreGroup, StoreProcess
from .config import ADPConfig

log = logging.getLogger("vllm.adp_kv.backend")

STARTUP_PROBE_WAIT_S = 1.0  # engine start-up waits at most this long for a silent target to answer at all
LOOKUP_ARENA_BYTES = 1 << 20  # a lookup helper moves no pages; the helper protocol still maps an arena


def slot_shortfall(slots_per_segment: int, data_lbas: int, lba_size: int, page_bytes: int) -> str | None:
    """Why a segment of this geometry runs out of slots long before its data area holds ``page_bytes`` pages
    (None when the slot table is not the limit). A card formatted for larger pages (the format's
    ``avg_page_bytes`` hint) has only ``slots_per_segment`` commit slots per segment, however small the pages are:
    a writer then claims (and, on a full card, evicts) segments whose data areas are mostly empty (e.g. Gemma3 at
    block 16: 8 KiB pages, 4 groups)."""
    page_lbas = 1 + -(-page_bytes // lba_size)  # header block + payload (store/format.py Geometry.page_lbas)
    fit = data_lbas // page_lbas
    if slots_per_segment * 2 > fit:
        return None
    return (f"the card's slot table holds {slots_per_segment} pages per segment, its data area {fit} pages of "
            f"{page_bytes} bytes: it was formatted for larger pages, so each segment keeps at most "
            f"{slots_per_segment} pages (reformat the card, an empty one is formatted for this model's pages)")


class StoreLink:
    """A page store on the configured target, opened in the background.

    ``page_bytes``: this model's smallest page, the slot-table sizing hint when this link formats a new card (the
    store's default assumes 256 KiB pages; smaller pages would run out of slots before the data area fills).
    """

    def __init__(self, cfg: ADPConfig, *, writer: bool, identity: str, partition: int | None,
                 label: str, arena: SharedArena | None = None, page_bytes: int | None = None) -> None:
        self.cfg = cfg
        self.arena = arena
        self.page_bytes = page_bytes
        self._writer = writer
        self._writer_id = hashlib.blake2b(identity.encode(), digest_size=16).digest()
        self._partition = partition
        self._label = label
        self._lookup_arena: SharedArena | None = None  # a read-only link's lookup helper maps it
        self._lock = threading.Lock()
        self._ctrl: Controller | None = None
        self._store: Store | None = None
        self._stop = threading.Event()
        self.last_error: str = ""
        self.process_restarts = 0
        self._answered = threading.Event()  # the first attempt reached the target, or failed
        self._first_done = threading.Event()  # the first attempt opened the store, or failed
        self._start_thread()

    def _start_thread(self, old: StoreGroup | None = None) -> None:
        self._thread = threading.Thread(target=self._run, args=(old,), name=f"adpkv-link-{self._label}",
                                        daemon=True)
        self._thread.start()

    @property
    def store(self) -> Store | None:
        """The open store, or None while the target is unreachable."""
        return self._store

    def wait_ready(self, timeout: float) -> Store | None:
        """Wait up to ``timeout`` seconds for the store (tests, start-up)."""
        deadline = time.monotonic() + timeout
        while self._store is None and time.monotonic() < deadline and not self._stop.is_set():
            time.sleep(0.02)
        return self._store

    @property
    def address(self) -> str:
        return f"{self.cfg.traddr}:{self.cfg.trsvcid}"

    def wait_startup(self) -> Store | None:
        """Engine start-up: wait for the store while the target is known to answer. Returns at once when the first
        attempt failed (refused, no route), after :data:`STARTUP_PROBE_WAIT_S` when the target stays silent, else
        when the store is open or ``connect_timeout_s`` has passed; the link keeps connecting in the background."""
        deadline = time.monotonic() + max(self.cfg.connect_timeout_s, 0.1)
        if not self._answered.wait(min(STARTUP_PROBE_WAIT_S, max(self.cfg.connect_timeout_s, 0.1))):
            log.warning("ADP KV: target %s does not answer (%s); serving without the cache, connecting in the "
                        "background", self.address, self._label)
            return None
        if not self._first_done.wait(max(deadline - time.monotonic(), 0.0)):
            log.warning("ADP KV: page store on %s not open after %.1f s (%s); serving without the cache meanwhile",
                        self.address, self.cfg.connect_timeout_s, self._label)
        return self._store

    def _probe(self) -> None:
        """A TCP connection to the target and back (fast failure: the store open below may start a helper process
        first)."""
        try:
            socket.create_connection((self.cfg.traddr, self.cfg.trsvcid), max(self.cfg.connect_timeout_s, 0.1)).close()
        finally:
            self._answered.set()

    def _open(self) -> None:
        c = self.cfg
        self._probe()
        hc = HostConfig(traddr=c.traddr, trsvcid=c.trsvcid, subnqn=c.subnqn, io_queues=c.io_queues,
                        queue_depth=c.queue_depth, connect_timeout=max(c.connect_timeout_s, 0.1),
                        command_timeout=max(c.load_timeout_s, 1.0), reconnect_delay=max(c.retry_interval_s, 0.1))
        sc = StoreConfig(writer=self._writer, writer_id=self._writer_id, writer_label=self._label,
                         preferred_partition=self._partition, verify=c.verify, reformat=c.format_card,
                         refresh_interval_s=c.refresh_interval_s, io_threads=c.io_threads,
                         max_io_bytes=c.max_io_kib << 10, io_timeout_s=max(c.load_timeout_s, 1.0),
                         eviction=c.eviction, admission=c.admission)
        if self.page_bytes:
            sc.avg_page_bytes = self.page_bytes
        store: PageStore | StoreProcess | StoreGroup
        ctrl: Controller | None = None
        wait = 2 * max(c.connect_timeout_s, 0.1) + max(c.load_timeout_s, 1.0) + 10  # a helper's start-up
        if self.arena is None and not self._writer and c.io_process:
            if self._lookup_arena is None:
                self._lookup_arena = SharedArena(LOOKUP_ARENA_BYTES, name="adp-kv-lookup")
            lookup = StoreProcess.start(Controller.connect, (hc,), sc, self._lookup_arena,
                                        on_exit=self._process_exited, timeout=wait)
            if c.lookup_mirror:
                try:
                    n = lookup.mirror_index(wait)
                    if lookup.mirrored:
                        log.debug("ADP KV: the lookup helper's index (%d pages) is mirrored in this process", n)
                    else:
                        log.info("ADP KV: the card holds too many pages to copy its index here; lookups ask the "
                                 "lookup helper")
                except Exception as exc:  # lookups still work, one round trip each
                    log.warning("ADP KV: mirroring the lookup helper's index failed (%s); lookups ask the helper",
                                exc)
            store = lookup
        elif self.arena is not None:
            savers = c.save_processes if self._writer else 1  # a read-only link claims no writer slots
            if c.load_processes > 1 or savers > 1:
                store = StoreGroup.start(Controller.connect, (hc,), sc, self.arena,
                                         readers=max(0, c.load_processes - savers),
                                         writers=savers, on_exit=self._process_exited, timeout=wait)
            else:
                store = StoreProcess.start(Controller.connect, (hc,), sc, self.arena, on_exit=self._process_exited,
                                           timeout=wait)
        else:
            ctrl = Controller.connect(hc)
            try:
                store = PageStore(ctrl, sc)
            except BaseException:
                ctrl.close()
                raise
        with self._lock:
            if self._stop.is_set():
                store.close()
                if ctrl is not None:
                    ctrl.close()
                return
            self._ctrl, self._store = ctrl, store
        try:  # a diagnostic: it must never take the open store down with it
            self._check_slots(store)
        except Exception as exc:  # pragma: no cover - a geometry this check does not know
            log.warning("ADP KV: the card's slot-table check failed (%s); the store stays open", exc)

    def _check_slots(self, store: Any) -> None:
        """Warn when the card's slot table, not its data area, bounds what a writer keeps (any link can tell: the
        geometry is the card's; the worker's helper-process store does not expose it, the scheduler's does)."""
        geo = getattr(store, "geometry", None)
        if geo is None:  # a helper process reports the geometry at start-up
            info = getattr(store, "info", None)
            geo = info.get("geometry") if isinstance(info, dict) else None
            if geo is not None:
                geo = SimpleNamespace(**geo)
        if not self.page_bytes or geo is None:
            return
        why = slot_shortfall(geo.slots_per_segment, geo.data_lbas, geo.lba_size, self.page_bytes)
        if why:
            log.warning("ADP KV: %s", why)

    def _process_exited(self, reason: str) -> None:
        """The store's helper process went away: serve without the cache and start another one."""
        with self._lock:
            if self._stop.is_set():
                return
            old = self._store
            self._store = None
            self.process_restarts += 1
            self.last_error = reason
        log.warning("ADP KV: %s; serving without the cache until a new store process is up", reason)
        self._start_thread(old if isinstance(old, StoreGroup) else None)

    def _run(self, old: StoreGroup | None = None) -> None:
        if old is not None:  # the group's surviving helpers go first (the writer's lease is handed back)
            try:
                old.close(release=True, timeout=10)
            except Exception as exc:
                log.debug("ADP KV: closing the old store helpers: %s", exc)
        warned = False
        while not self._stop.is_set():
            try:
                self._open()
                log.info("ADP KV: page store open on %s (%s)", self.address, self._label)
                self._first_done.set()
                return
            except Exception as exc:  # unreachable target, no namespace, bad format...
                self.last_error = f"{type(exc).__name__}: {exc}"
                if not warned:
                    log.warning("ADP KV: target %s unreachable (%s); serving without the cache, retrying every "
                                "%.1f s (%s)", self.address, self.last_error, self.cfg.retry_interval_s, self._label)
                    warned = True
                self._first_done.set()
            self._stop.wait(max(self.cfg.retry_interval_s, 0.05))

    def close(self) -> None:
        """Stop connecting; close the store (releasing the writer lease) and the controller."""
        self._stop.set()
        with self._lock:
            store, ctrl = self._store, self._ctrl
            self._store = self._ctrl = None
        if store is not None:
            try:
                store.close()
            except Exception as exc:
                log.warning("ADP KV: closing the page store: %s", exc)
        if ctrl is not None:
            try:
                ctrl.close()
            except Exception:
                pass
        if self._lookup_arena is not None:
            self._lookup_arena.close()
            self._lookup_arena = None
