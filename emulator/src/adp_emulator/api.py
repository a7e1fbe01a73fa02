"""Management plane of the emulator: a FastAPI app over a small backend protocol.

``create_app(backend)`` serves identity, usage, counters, health, Prometheus ``/metrics``, wipe and
fault injection for either backend:

* :class:`UserspaceBackend` wraps a running :class:`~adp_emulator.target.UserspaceTarget` (same process).
* :class:`KernelBackend` reads a kernel target's workdir (``kernel-target.json``); nvmet has no
  counters or fault hooks, so those fields are null and those endpoints answer 501.

Auth: every mutating request needs ``Authorization: Bearer <token>`` (401 without one, 403 with a
wrong one); GETs are open unless ``protect_reads`` (used when bound to a non-loopback address).
:class:`ApiServer` runs the app with uvicorn in a background thread. See docs/management-api.md.
"""

from __future__ import annotations

import ctypes
import hmac
import ipaddress
import json
import logging
import mmap
import os
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field

log = logging.getLogger(__name__)

API_PREFIX = "/api/v1"
MAX_CORRUPT_BYTES = 16 << 20
_PAGE = mmap.PAGESIZE
_ODD = bytes(i & 1 for i in range(256))  # translate table: mincore byte -> resident bit


class Unsupported(Exception):
    """The backend cannot do this (HTTP 501)."""


class Conflict(Exception):
    """Refused in the current state, e.g. wipe with live I/O connections (HTTP 409)."""


class MgmtBackend(Protocol):
    """What the management API needs from a target. Unknown values are None, never guessed."""

    kind: str

    def identity(self) -> dict[str, Any]: ...
    def usage(self) -> dict[str, Any]: ...
    def counters(self) -> dict[str, Any] | None: ...
    def health(self) -> dict[str, Any]: ...
    def wipe(self, nsid: int, force: bool) -> dict[str, Any]: ...
    def faults_state(self) -> dict[str, Any] | None: ...
    def drop_connections(self) -> int: ...
    def set_delay(self, seconds: float) -> None: ...
    def fail_next(self, count: int, status: str) -> None: ...
    def corrupt(self, nsid: int, offset: int, length: int, xor: int) -> None: ...
    def corrupt_next_reads(self, count: int) -> None: ...
    def set_device_full(self, full: bool) -> None: ...
    def clear_faults(self) -> None: ...


# ----------------------------------------------------------------------------------------------------
# Backends


def resident_bytes(mm: mmap.mmap) -> int | None:
    """Bytes of ``mm`` resident in memory (mincore(2)); None if it cannot be measured."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        n = len(mm)
        vec = (ctypes.c_ubyte * ((n + _PAGE - 1) // _PAGE))()
        anchor = ctypes.c_char.from_buffer(mm)
        try:
            rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(n), vec)
        finally:
            del anchor
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    if rc != 0:
        return None
    return bytes(vec).translate(_ODD).count(1) * _PAGE


def _probe(host: str, port: int, timeout: float = 3.0) -> tuple[bool, str | None]:
    """ICReq/ICResp exchange with the target; (answered, error)."""
    from adp_emulator.kernel.probe import icreq_exchange

    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1" if host == "0.0.0.0" else "::1"
    try:
        icreq_exchange(host, port, timeout=timeout)
        return True, None
    except (OSError, ValueError) as e:
        return False, str(e) or type(e).__name__


_NULL_COUNTERS = {"commands": None, "reads": None, "writes": None, "bytes_read": None, "bytes_written": None,
                  "errors": None, "latency_us_log2": None}


class UserspaceBackend:
    """The userspace target in this process: everything is measurable and every fault is available."""

    kind = "user"

    def __init__(self, target: Any) -> None:
        self.target = target

    def identity(self) -> dict[str, Any]:
        t, s = self.target, self.target.settings
        host, port = t.address
        nss = [{"nsid": n, "capacity_bytes": ns.capacity, "lba_size": ns.lba_size, "nguid": ns.nguid.hex(),
                "uuid": str(uuid.UUID(bytes=ns.uuid))} for n, ns in sorted(t.namespaces.items())]
        return {"backend": self.kind, "hosted": "host", "model": s.model, "serial": s.serial_number,
                "firmware": s.firmware, "subnqn": s.subnqn, "traddr": host, "trsvcid": port,
                "capacity_bytes": s.capacity_bytes, "lba_size": s.lba_size, "mdts_bytes": s.mdts_bytes,
                "max_io_queues": s.max_io_queues, "queue_depth": s.queue_depth,
                "backing": "file" if s.backing_path else "ram", "backing_path": s.backing_path,
                "kernel_version": None, "namespaces": nss}

    def _allocated(self, ns: Any) -> tuple[int | None, str | None]:
        if ns.path:
            try:
                return os.stat(ns.path).st_blocks * 512, "st_blocks"
            except OSError:
                return None, None
        got = resident_bytes(ns.mm)
        return (got, "mincore") if got is not None else (None, None)

    def usage(self) -> dict[str, Any]:
        nss = []
        for n, ns in sorted(self.target.namespaces.items()):
            alloc, method = self._allocated(ns)
            c = self.target.namespace_counters(n)
            nss.append({"nsid": n, "capacity_bytes": ns.capacity, "allocated_bytes": alloc,
                        "allocated_method": method, "bytes_written_total": c.bytes_written,
                        "bytes_read_total": c.bytes_read})
        allocs = [d["allocated_bytes"] for d in nss]
        return {"backend": self.kind, "capacity_bytes": sum(d["capacity_bytes"] for d in nss),
                "allocated_bytes": None if None in allocs else sum(allocs),
                "bytes_written_total": sum(d["bytes_written_total"] for d in nss), "namespaces": nss}

    def counters(self) -> dict[str, Any] | None:
        return self.target.counters()

    def health(self) -> dict[str, Any]:
        t = self.target
        host, port = t.address
        snap = t.counters()  # before the probe, whose own connection would be counted
        ok, err = _probe(host, port)
        return {"backend": self.kind, "status": "ok" if ok else "unreachable", "icresp": ok, "error": err,
                "uptime_s": round(time.monotonic() - t.started_at, 3), "connections": snap["connections"],
                "controllers": len(snap["controllers"]), "faults_armed": t.faults.armed}

    def wipe(self, nsid: int, force: bool) -> dict[str, Any]:
        ns = self.target.namespaces.get(nsid)
        if ns is None:
            raise KeyError(f"no namespace {nsid}")
        live = [q for q in self.target.counters()["queues"] if q["qid"] > 0]
        if live and not force:
            raise Conflict(f"{len(live)} I/O queue(s) are connected; disconnect the hosts or pass force=true")
        t0 = time.monotonic()
        ns.zero(0, ns.capacity)
        ns.flush()
        return {"nsid": nsid, "wiped_bytes": ns.capacity, "live_io_queues": len(live),
                "seconds": round(time.monotonic() - t0, 3)}

    def faults_state(self) -> dict[str, Any] | None:
        f = self.target.faults
        return {"supported": True, "armed": f.armed, "delay_s": f.delay_s, "device_full": f.device_full}

    def drop_connections(self) -> int:
        return self.target.faults.drop_connections()

    def set_delay(self, seconds: float) -> None:
        self.target.faults.set_delay(seconds)

    def fail_next(self, count: int, status: str) -> None:
        self.target.faults.fail_next_io(count, status)

    def corrupt(self, nsid: int, offset: int, length: int, xor: int) -> None:
        if nsid not in self.target.namespaces:
            raise KeyError(f"no namespace {nsid}")
        self.target.faults.corrupt(offset, length, xor, nsid)

    def corrupt_next_reads(self, count: int) -> None:
        self.target.faults.corrupt_next_reads(count)

    def set_device_full(self, full: bool) -> None:
        self.target.faults.set_device_full(full)

    def clear_faults(self) -> None:
        self.target.faults.clear()


_KERNEL_NO_FAULTS = ("the kernel backend (Linux nvmet) has no fault-injection hooks; "
                     "use the userspace backend (`testbed up --backend user`) for {what}")


class KernelBackend:
    """A kernel nvmet target started by :class:`~adp_emulator.kernel.KernelTarget` into ``workdir``.

    Identity comes from the config plus one Identify Controller/Namespace over NVMe/TCP (cached);
    health from an ICReq probe. Usage, counters and faults are not available (null / 501).
    """

    kind = "kernel"

    def __init__(self, workdir: str | os.PathLike[str], identify_timeout: float = 10.0) -> None:
        self.workdir = Path(workdir)
        self.identify_timeout = identify_timeout
        self._identified: dict[str, Any] | None = None
        self._id_lock = threading.Lock()

    def _state(self) -> dict[str, Any] | None:
        from adp_emulator.kernel.target import STATE_FILE

        try:
            return json.loads((self.workdir / STATE_FILE).read_text())
        except (OSError, ValueError):
            return None

    def _require_state(self) -> dict[str, Any]:
        st = self._state()
        if st is None:
            raise LookupError(f"no kernel target state in {self.workdir} (not started, or stopped)")
        return st

    @staticmethod
    def _subsystem(st: dict[str, Any]) -> dict[str, Any]:
        subs = st.get("config", {}).get("subsystems", [])
        return next((s for s in subs if s.get("nqn") == st.get("subnqn")), subs[0] if subs else {})

    def _identify(self, st: dict[str, Any]) -> dict[str, Any]:
        """Identify Controller + Namespace through the real host client (admin queue only), cached."""
        with self._id_lock:
            if self._identified is not None:
                return self._identified
            from adp_connector.nvmeof.host.controller import Controller, HostConfig

            sub = self._subsystem(st)
            allowed = sub.get("allowed_hosts") or []
            any_host = str(sub.get("attr", {}).get("allow_any_host", "1")) == "1"
            cfg = HostConfig(traddr=st["traddr"], trsvcid=int(st["trsvcid"]), subnqn=st["subnqn"],
                             hostnqn=None if any_host or not allowed else allowed[0], io_queues=0,
                             connect_timeout=self.identify_timeout, command_timeout=self.identify_timeout,
                             auto_reconnect=False)
            ctrl = Controller.connect(cfg)
            try:
                idc, idn = ctrl.identify, ctrl.namespace
                assert idc is not None and idn is not None
                self._identified = {"model": idc.mn.strip() or None, "serial": idc.sn.strip() or None,
                                    "firmware": idc.fr.strip() or None, "mdts_bytes": ctrl.mdts_bytes,
                                    "lba_size": ctrl.lba_size, "capacity_bytes": ctrl.capacity_bytes,
                                    "nsid": ctrl.nsid}
            finally:
                ctrl.close()
            return self._identified

    def identity(self) -> dict[str, Any]:
        st = self._require_state()
        attrs = self._subsystem(st).get("attr", {})
        try:
            got: dict[str, Any] = self._identify(st)
            err = None
        except Exception as e:  # the device did not answer Identify: report only what the config says
            got, err = {}, str(e) or type(e).__name__
        cap = got.get("capacity_bytes", st.get("guest_capacity_bytes"))
        nsid = got.get("nsid", 1)
        return {"backend": self.kind, "hosted": st.get("hosted"), "model": got.get("model", attrs.get("model")),
                "serial": got.get("serial", attrs.get("serial")), "firmware": got.get("firmware"),
                "subnqn": st.get("subnqn"), "traddr": st.get("traddr"),
                "trsvcid": int(st["trsvcid"]) if st.get("trsvcid") else None, "capacity_bytes": cap,
                "lba_size": got.get("lba_size"), "mdts_bytes": got.get("mdts_bytes"), "max_io_queues": None,
                "queue_depth": None, "backing": "ram" if st.get("hosted") == "vm" else "file", "backing_path": None,
                "kernel_version": st.get("kernel_version"), "accel": st.get("accel"), "identify_error": err,
                "namespaces": [{"nsid": nsid, "capacity_bytes": cap, "lba_size": got.get("lba_size"),
                                "nguid": None, "uuid": None}]}

    def usage(self) -> dict[str, Any]:
        st = self._require_state()
        cap = (self._identified or {}).get("capacity_bytes", st.get("guest_capacity_bytes"))
        return {"backend": self.kind, "capacity_bytes": cap, "allocated_bytes": None, "bytes_written_total": None,
                "namespaces": [{"nsid": 1, "capacity_bytes": cap, "allocated_bytes": None, "allocated_method": None,
                                "bytes_written_total": None, "bytes_read_total": None}]}

    def counters(self) -> dict[str, Any] | None:
        return None

    def health(self) -> dict[str, Any]:
        st = self._state()
        if st is None:
            return {"backend": self.kind, "status": "down", "icresp": False,
                    "error": f"no kernel target state in {self.workdir}", "uptime_s": None, "connections": None,
                    "controllers": None, "faults_armed": None}
        ok, err = _probe(st["traddr"], int(st["trsvcid"]))
        started = self._started_at()
        return {"backend": self.kind, "status": "ok" if ok else "unreachable", "icresp": ok, "error": err,
                "uptime_s": round(time.time() - started, 3) if started else None, "connections": None,
                "controllers": None, "faults_armed": None}

    def _started_at(self) -> float | None:
        from adp_emulator.kernel.target import STATE_FILE

        try:
            return (self.workdir / STATE_FILE).stat().st_mtime
        except OSError:
            return None

    def wipe(self, nsid: int, force: bool) -> dict[str, Any]:
        raise Unsupported("wipe is not available on the kernel backend (nvmet's namespace lives in the guest); "
                          "`testbed down` then `testbed up --backend kernel` gives a fresh, zeroed namespace")

    def faults_state(self) -> dict[str, Any] | None:
        return {"supported": False, "armed": None, "delay_s": None, "device_full": None}

    def drop_connections(self) -> int:
        raise Unsupported(_KERNEL_NO_FAULTS.format(what="dropping connections (restarting the guest would "
                                                        "lose the namespace)"))

    def set_delay(self, seconds: float) -> None:
        raise Unsupported(_KERNEL_NO_FAULTS.format(what="delays"))

    def fail_next(self, count: int, status: str) -> None:
        raise Unsupported(_KERNEL_NO_FAULTS.format(what="failing commands"))

    def corrupt(self, nsid: int, offset: int, length: int, xor: int) -> None:
        raise Unsupported(_KERNEL_NO_FAULTS.format(what="corrupting data"))

    def corrupt_next_reads(self, count: int) -> None:
        raise Unsupported(_KERNEL_NO_FAULTS.format(what="corrupting reads"))

    def set_device_full(self, full: bool) -> None:
        raise Unsupported(_KERNEL_NO_FAULTS.format(what="a full device"))

    def clear_faults(self) -> None:
        raise Unsupported(_KERNEL_NO_FAULTS.format(what="faults"))


# ----------------------------------------------------------------------------------------------------
# Request / response models (they document the API in /openapi.json)


class Identity(BaseModel):
    backend: str
    hosted: str | None
    model: str | None
    serial: str | None
    firmware: str | None
    subnqn: str | None
    traddr: str | None
    trsvcid: int | None
    capacity_bytes: int | None
    lba_size: int | None
    mdts_bytes: int | None = Field(description="max data transfer size; null if unknown or unlimited")
    max_io_queues: int | None
    queue_depth: int | None
    backing: str | None
    backing_path: str | None
    kernel_version: str | None
    namespaces: list[dict[str, Any]]
    model_config = {"extra": "allow"}


class Usage(BaseModel):
    backend: str
    capacity_bytes: int | None
    allocated_bytes: int | None = Field(description="bytes backed by memory/disk (RAM: resident pages via "
                                                    "mincore, touched by writes or reads; file: st_blocks)")
    bytes_written_total: int | None
    namespaces: list[dict[str, Any]]


class Health(BaseModel):
    backend: str
    status: str = Field(description="ok | unreachable | down")
    icresp: bool
    error: str | None
    uptime_s: float | None
    connections: int | None
    controllers: int | None
    faults_armed: bool | None


class WipeRequest(BaseModel):
    force: bool = Field(False, description="wipe even while hosts have I/O queues connected")


class DelayRequest(BaseModel):
    seconds: float = Field(ge=0, le=60, description="sleep before each I/O command; 0 switches it off")


class FailNextRequest(BaseModel):
    count: int = Field(ge=0, le=1_000_000)
    status: str = Field("INTERNAL_ERROR", description="NVMe status name, e.g. CAPACITY_EXCEEDED")


class CorruptRequest(BaseModel):
    nsid: int = Field(1, ge=1)
    offset: int = Field(ge=0, description="namespace byte offset")
    length: int = Field(1, ge=1, le=MAX_CORRUPT_BYTES)
    xor: int = Field(0xFF, ge=1, le=0xFF)


class CountRequest(BaseModel):
    count: int = Field(1, ge=0, le=1_000_000)


class DeviceFullRequest(BaseModel):
    full: bool = True


# ----------------------------------------------------------------------------------------------------
# Prometheus text format


def _esc(v: object) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**kv: object) -> str:
    return "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in kv.items()) + "}" if kv else ""


def prometheus_text(backend: MgmtBackend) -> str:
    """Render health, usage and counters as Prometheus text exposition format 0.0.4."""
    out: list[str] = []
    declared: set[str] = set()

    def metric(name: str, typ: str, help_: str, value: float | None, **labels: object) -> None:
        if value is None:
            return
        if name not in declared:
            declared.add(name)
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {typ}")
        out.append(f"{name}{_labels(**labels)} {value}")

    h = backend.health()
    metric("adp_up", "gauge", "1 if the target answers an NVMe/TCP ICReq", int(h["icresp"]), backend=backend.kind)
    metric("adp_uptime_seconds", "gauge", "seconds since the target started", h["uptime_s"])
    metric("adp_connections", "gauge", "open TCP connections (all queues)", h["connections"])
    metric("adp_controllers", "gauge", "live controllers", h["controllers"])
    u = backend.usage()
    for ns in u["namespaces"]:
        metric("adp_namespace_capacity_bytes", "gauge", "namespace size", ns["capacity_bytes"], nsid=ns["nsid"])
        metric("adp_namespace_allocated_bytes", "gauge", "bytes backed by memory or disk", ns["allocated_bytes"],
               nsid=ns["nsid"])
    f = backend.faults_state()
    if f and f.get("supported"):
        metric("adp_fault_delay_seconds", "gauge", "injected delay per I/O command", f["delay_s"])
        metric("adp_fault_device_full", "gauge", "1 while writes fail with Capacity Exceeded", int(f["device_full"]))
    c = backend.counters()
    if c is not None:
        series: list[tuple[str, dict[str, Any], dict[str, object]]] = [
            ("adp_namespace", d, {"nsid": n}) for n, d in sorted(c["namespaces"].items())]
        series += [("adp_queue", q, {"cntlid": q["cntlid"], "qid": q["qid"]}) for q in c["queues"]]
        for scope in ("adp_namespace", "adp_queue"):  # a family's samples must be contiguous
            for key, help_ in (("commands", "commands completed"), ("reads", "read commands"),
                               ("writes", "write commands"), ("bytes_read", "bytes read"),
                               ("bytes_written", "bytes written"), ("errors", "commands failed")):
                for prefix, d, lab in series:
                    if prefix == scope:
                        metric(f"{prefix}_{key}_total", "counter", help_, d[key], **lab)
        for prefix, d, lab in series:
            name = f"{prefix}_latency_seconds"
            if name not in declared:
                declared.add(name)
                out += [f"# HELP {name} command latency (log2 buckets; no _sum is kept)", f"# TYPE {name} histogram"]
            hist = {int(k): v for k, v in d["latency_us_log2"].items()}
            top = max(hist, default=0)
            cum = 0
            bound = 1
            while True:  # bucket with lower bound L holds [L, 2L) us (L=0: < 1 us)
                cum += hist.get(bound >> 1, 0)
                out.append(f"{name}_bucket{_labels(**lab, le=repr(bound / 1e6))} {cum}")
                if (bound >> 1) >= top:
                    break
                bound <<= 1
            out.append(f"{name}_bucket{_labels(**lab, le='+Inf')} {cum}")
            out.append(f"{name}_count{_labels(**lab)} {cum}")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------------------------------
# The app


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def create_app(backend: MgmtBackend, token: str | None = None, *, protect_reads: bool = False) -> FastAPI:
    """The management API over ``backend``. ``token`` (generated when None; see ``app.state.token``)
    guards every mutating endpoint; ``protect_reads`` also guards the GETs (non-loopback binds)."""
    token = token or secrets.token_urlsafe(32)
    app = FastAPI(title="ADP KV emulator management API", version="1",
                  description="Identity, usage, counters, health, metrics, wipe and fault injection of an "
                              "emulated ADP (docs/management-api.md).")
    app.state.token = token
    app.state.backend = backend
    bearer = HTTPBearer(auto_error=False, description="the management token")

    def require_token(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:  # noqa: B008
        if creds is None or creds.scheme.lower() != "bearer":
            raise HTTPException(401, "missing bearer token (Authorization: Bearer <token>)",
                                headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(creds.credentials.encode(), token.encode()):
            raise HTTPException(403, "invalid token")

    auth = [Depends(require_token)]
    read_auth = auth if protect_reads else []

    @app.exception_handler(Unsupported)
    def _unsupported(_: Request, e: Unsupported) -> JSONResponse:
        return JSONResponse({"detail": str(e), "backend": backend.kind}, status_code=501)

    @app.exception_handler(Conflict)
    def _conflict(_: Request, e: Conflict) -> JSONResponse:
        return JSONResponse({"detail": str(e)}, status_code=409)

    @app.exception_handler(LookupError)
    def _lookup(_: Request, e: LookupError) -> JSONResponse:
        return JSONResponse({"detail": str(e).strip("'\"")}, status_code=404)

    @app.exception_handler(ValueError)
    def _value(_: Request, e: ValueError) -> JSONResponse:
        return JSONResponse({"detail": str(e)}, status_code=400)

    def get(path: str, **kw: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        return app.get(API_PREFIX + path, dependencies=read_auth, **kw)

    def post(path: str, **kw: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        return app.post(API_PREFIX + path, dependencies=auth, **kw)

    @get("/identity", response_model=Identity, tags=["device"])
    def identity() -> dict[str, Any]:
        """Model, serial, firmware, NQN, address, capacity, LBA size, MDTS, namespaces."""
        return backend.identity()

    @get("/usage", response_model=Usage, tags=["device"])
    def usage() -> dict[str, Any]:
        """Capacity, allocated bytes (null where not measurable) and lifetime bytes written."""
        return backend.usage()

    @get("/health", response_model=Health, tags=["device"],
         responses={503: {"model": Health, "description": "the target does not answer"}})
    def health() -> JSONResponse:
        """ICReq probe of the NVMe/TCP listener; 200 when it answers, 503 otherwise."""
        h = backend.health()
        return JSONResponse(h, status_code=200 if h["status"] == "ok" else 503)

    @get("/counters", tags=["counters"])
    def counters() -> dict[str, Any]:
        """Per-namespace totals, per-queue counters, controllers, connections (null on the kernel backend)."""
        c = backend.counters()
        if c is None:
            return {"supported": False, "namespaces": None, "queues": None, "controllers": None, "connections": None}
        return {"supported": True, **c}

    @get("/namespaces/{nsid}/counters", tags=["counters"])
    def namespace_counters(nsid: int) -> dict[str, Any]:
        """One namespace's totals: commands, reads, writes, bytes, errors, latency_us_log2."""
        c = backend.counters()
        if c is None:
            return {"nsid": nsid, **_NULL_COUNTERS}
        if str(nsid) not in c["namespaces"]:
            raise HTTPException(404, f"no namespace {nsid}")
        return {"nsid": nsid, **c["namespaces"][str(nsid)]}

    @get("/queues", tags=["counters"])
    def queues() -> list[dict[str, Any]] | None:
        """Per-queue counters of connected queues (cntlid, qid, peer, ...); null on the kernel backend."""
        c = backend.counters()
        return None if c is None else c["queues"]

    @post("/namespaces/{nsid}/wipe", tags=["device"])
    def wipe(nsid: int, body: WipeRequest | None = None) -> dict[str, Any]:
        """Zero the namespace (memory/disk released). 409 while hosts have I/O queues, unless force."""
        return backend.wipe(nsid, bool(body and body.force))

    @get("/faults", tags=["faults"])
    def faults() -> dict[str, Any] | None:
        """Current fault switches."""
        return backend.faults_state()

    @post("/faults/drop-connections", tags=["faults"])
    def drop() -> dict[str, int]:
        """Close every TCP connection now (hosts see a transport error and reconnect)."""
        return {"dropped": backend.drop_connections()}

    @post("/faults/delay", tags=["faults"])
    def delay(body: DelayRequest) -> dict[str, Any] | None:
        """Sleep ``seconds`` before executing each I/O command."""
        backend.set_delay(body.seconds)
        return backend.faults_state()

    @post("/faults/fail-next", tags=["faults"])
    def fail_next(body: FailNextRequest) -> dict[str, Any]:
        """Complete the next ``count`` I/O commands with ``status``."""
        from adp_wire.status import status_names

        if body.status not in status_names():
            raise HTTPException(400, f"unknown status {body.status!r}; one of {', '.join(status_names())}")
        backend.fail_next(body.count, body.status)
        return {"count": body.count, "status": body.status}

    @post("/faults/corrupt", tags=["faults"])
    def corrupt(body: CorruptRequest) -> dict[str, Any]:
        """XOR ``length`` stored bytes at namespace byte ``offset`` (simulated media corruption)."""
        backend.corrupt(body.nsid, body.offset, body.length, body.xor)
        return body.model_dump()

    @post("/faults/corrupt-next-reads", tags=["faults"])
    def corrupt_reads(body: CountRequest) -> dict[str, int]:
        """Flip a byte in the wire copy of the next ``count`` read payloads (stored data untouched)."""
        backend.corrupt_next_reads(body.count)
        return {"count": body.count}

    @post("/faults/device-full", tags=["faults"])
    def device_full(body: DeviceFullRequest) -> dict[str, Any] | None:
        """While ``full``, Write and Write Zeroes fail with Capacity Exceeded."""
        backend.set_device_full(body.full)
        return backend.faults_state()

    @post("/faults/clear", tags=["faults"])
    def clear() -> dict[str, Any] | None:
        """Switch every fault off."""
        backend.clear_faults()
        return backend.faults_state()

    @app.get("/metrics", response_class=PlainTextResponse, dependencies=read_auth, tags=["counters"])
    def metrics() -> PlainTextResponse:
        """Prometheus text exposition format."""
        return PlainTextResponse(prometheus_text(backend), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


# ----------------------------------------------------------------------------------------------------
# Serving


def write_token_file(path: str | os.PathLike[str], token: str) -> Path:
    """Write ``token`` to ``path`` readable by the owner only (0600)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (token + "\n").encode())
    finally:
        os.close(fd)
    return p


class ApiServer:
    """uvicorn serving ``app`` on ``host:port`` (0 = any free port) in a daemon thread."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((host, port))
        except OSError:
            self.sock.close()
            raise
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        h = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{h}:{self.port}"

    def start(self, timeout: float = 10.0) -> ApiServer:
        """Start serving; returns once uvicorn accepts connections."""
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name="adp-mgmt-api", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"management API did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.sock.close()
