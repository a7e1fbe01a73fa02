"""Exceptions raised by the NVMe/TCP host client. All are :class:`~adp_connector.device.DeviceError`."""

from __future__ import annotations

from adp_wire.status import Status

from ...device import DeviceError, DeviceUnavailable


class NvmeStatusError(DeviceError):
    """The controller completed a command with a non-success status (named in the message)."""

    def __init__(self, status: Status, what: str) -> None:
        super().__init__(f"{what} failed: {status}")
        self.status = status


class NvmeConnectError(NvmeStatusError):
    """Fabrics Connect was refused (wrong NQN, host not allowed, bad parameters...)."""


class NvmeTimeoutError(DeviceError):
    """A command did not complete within its timeout; its queue is torn down and reconnected."""


class NvmeTransportError(DeviceUnavailable):
    """The TCP connection failed, was closed, or the peer sent a malformed PDU or a TermReq."""


class NvmeProtocolError(NvmeTransportError):
    """The controller violated the NVMe/TCP protocol (bad PDU, unknown command id...)."""
