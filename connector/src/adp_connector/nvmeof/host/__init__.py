"""The NVMe/TCP host client: the ONE client for the emulator, the kernel target and a real ADP card.

    from adp_connector.nvmeof.host import Controller, HostConfig
    with Controller.connect(HostConfig(traddr="127.0.0.1", trsvcid=4420, subnqn=NQN)) as dev:
        dev.write(0, data)
        dev.read_into(0, memoryview(buf))
"""

from .controller import Controller, HostConfig, HostStats, discover
from .errors import (
    NvmeConnectError,
    NvmeProtocolError,
    NvmeStatusError,
    NvmeTimeoutError,
    NvmeTransportError,
)
from .transport import TcpTransport, Transport

__all__ = [
    "Controller",
    "HostConfig",
    "HostStats",
    "NvmeConnectError",
    "NvmeProtocolError",
    "NvmeStatusError",
    "NvmeTimeoutError",
    "NvmeTransportError",
    "TcpTransport",
    "Transport",
    "discover",
]
