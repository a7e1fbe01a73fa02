"""How the host reaches a target: a pluggable factory of connected stream sockets.

The controller never creates sockets itself; it asks its :class:`Transport`. ``TcpTransport`` is the
real one (emulator or a real card: same code, another address). Tests may plug a transport that
wraps ``socket.socketpair`` or injects faults.
"""

from __future__ import annotations

import socket
from typing import Protocol


class Transport(Protocol):
    def connect(self, traddr: str, trsvcid: int, timeout: float) -> socket.socket:
        """Return a connected, blocking stream socket."""
        ...


class TcpTransport:
    """Plain TCP (NVMe/TCP over IPv4 or IPv6), TCP_NODELAY, large socket buffers left to autotuning."""

    def connect(self, traddr: str, trsvcid: int, timeout: float) -> socket.socket:
        sock = socket.create_connection((traddr, trsvcid), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
        return sock
