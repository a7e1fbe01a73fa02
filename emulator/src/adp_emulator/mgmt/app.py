"""The management API app: FastAPI routes over a :class:`~adp_emulator.mgmt.backends.MgmtBackend`.

``create_app(backend)`` serves identity, usage, counters, health, Prometheus ``/metrics``, wipe and
fault injection. Auth: every mutating request needs ``Authorization: Bearer <token>`` (401 without
one or with another scheme, 403 with a wrong one); GETs are open unless ``protect_reads`` (used when
bound to a non-loopback address). A guard in front of the app (:class:`RequestGuard`) checks the
token and the body size (413 over :data:`MAX_BODY_BYTES`) before a byte of the body is read.
See docs/management-api.md.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field

from .backends import _NULL_COUNTERS, MAX_CORRUPT_BYTES, Conflict, MgmtBackend, Unsupported
from .metrics import CONTENT_TYPE, registry_for

API_PREFIX = "/api/v1"
#: Largest request body accepted (every request model is a few fields of JSON).
MAX_BODY_BYTES = 64 * 1024


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


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_Scope = dict[str, Any]
_Receive = Callable[[], Awaitable[dict[str, Any]]]
_Send = Callable[[dict[str, Any]], Awaitable[None]]
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def token_check(token: str, authorization: str | None) -> tuple[int, str] | None:
    """None if ``authorization`` (the header's value) carries ``token``; else (HTTP status, reason)."""
    scheme, _, cred = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not cred.strip():
        return 401, "missing bearer token (Authorization: Bearer <token>)"
    if not hmac.compare_digest(cred.strip().encode(), token.encode()):
        return 403, "invalid token"
    return None


class RequestGuard:
    """ASGI middleware run before routing: the token (for requests that need one) and the body size are
    checked from the headers alone, so an unauthenticated or oversized body is answered (401/403/413)
    without being parsed (an unauthenticated one within the size cap is read and dropped first, so the answer
    reaches the client); a body that outgrows :data:`MAX_BODY_BYTES` while streaming gets 413 too."""

    def __init__(self, app: Callable[..., Awaitable[None]], token: str, protect_reads: bool,
                 max_body: int = MAX_BODY_BYTES) -> None:
        self.app, self.token, self.protect_reads, self.max_body = app, token, protect_reads, max_body

    def _needs_token(self, method: str, path: str) -> bool:
        if method not in _SAFE_METHODS:
            return True
        return self.protect_reads and (path.startswith(API_PREFIX) or path == "/metrics")

    async def __call__(self, scope: _Scope, receive: _Receive, send: _Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self._needs_token(scope["method"], scope["path"]):
            bad = token_check(self.token, headers.get("authorization"))
            if bad is not None:
                extra = [(b"www-authenticate", b"Bearer")] if bad[0] == 401 else []
                length = headers.get("content-length", "")
                if not (length.isdigit() and int(length) > self.max_body):  # never read a body over the cap
                    await _discard_body(receive, self.max_body)
                await _answer(send, bad[0], bad[1], extra)
                return
        try:
            declared = int(headers.get("content-length", "0") or 0)
        except ValueError:
            await _answer(send, 400, "bad Content-Length")
            return
        if declared > self.max_body:
            await _answer(send, 413, f"request body over {self.max_body} bytes")
            return
        seen = 0

        async def capped_receive() -> dict[str, Any]:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_body:  # a chunked body that outgrows the cap: the route answers 413
                    raise HTTPException(413, f"request body over {self.max_body} bytes")
            return msg

        await self.app(scope, capped_receive, send)


async def _discard_body(receive: _Receive, limit: int) -> None:
    """Read and drop a request body of up to ``limit`` bytes before an early answer. Unread, the body stays in the
    socket when the server closes the connection, and the client gets a reset instead of the answer (1 in ~40
    unauthenticated POSTs here); a larger body is left unread (the client sent more than any request may)."""
    seen = 0
    while seen <= limit:
        msg = await receive()
        if msg["type"] != "http.request":
            return
        seen += len(msg.get("body", b""))
        if not msg.get("more_body", False):
            return


async def _answer(send: _Send, status: int, detail: str, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *(extra or [])]})
    await send({"type": "http.response.body", "body": body})


def create_app(backend: MgmtBackend, token: str | None = None, *, protect_reads: bool = False) -> FastAPI:
    """The management API over ``backend``. ``token`` (generated when None; see ``app.state.token``)
    guards every mutating endpoint; ``protect_reads`` also guards the GETs (non-loopback binds)."""
    token = token or secrets.token_urlsafe(32)
    app = FastAPI(title="ADP KV emulator management API", version="1",
                  description="Identity, usage, counters, health, metrics, wipe and fault injection of an "
                              "emulated ADP (docs/management-api.md).")
    app.state.token = token
    app.state.backend = backend
    app.add_middleware(RequestGuard, token=token, protect_reads=protect_reads)
    registry = registry_for(backend)
    bearer = HTTPBearer(auto_error=False, description="the management token")

    def require_token(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:  # noqa: B008
        # RequestGuard answers first; this dependency documents the scheme in /openapi.json and
        # stays as a second check should the app be mounted without the guard.
        bad = token_check(token, None if creds is None else f"{creds.scheme} {creds.credentials}")
        if bad is not None:
            raise HTTPException(bad[0], bad[1], headers={"WWW-Authenticate": "Bearer"} if bad[0] == 401 else None)

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
        from prometheus_client import generate_latest

        return PlainTextResponse(generate_latest(registry).decode(), media_type=CONTENT_TYPE)

    return app
