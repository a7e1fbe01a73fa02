"""Management plane of the emulator: backends (what a target offers), metrics (Prometheus), the app
(FastAPI routes, auth) and the server (uvicorn thread, token file). See docs/management-api.md."""

from .app import API_PREFIX, MAX_BODY_BYTES, create_app, is_loopback
from .backends import Conflict, KernelBackend, MgmtBackend, Unsupported, UserspaceBackend, resident_bytes
from .metrics import prometheus_text
from .server import ApiServer, write_token_file

__all__ = ["API_PREFIX", "MAX_BODY_BYTES", "ApiServer", "Conflict", "KernelBackend", "MgmtBackend", "Unsupported",
           "UserspaceBackend", "create_app", "is_loopback", "prometheus_text", "resident_bytes", "write_token_file"]
