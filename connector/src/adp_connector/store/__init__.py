"""KV page store: content-keyed, variable-size pages on a BlockDevice namespace (format: docs/format.md).

Knows nothing of vLLM or NVMe; the NVMe/TCP client plugs in through :class:`adp_connector.device.BlockDevice`.
"""

from .format import FORMAT_MAJOR, FORMAT_MINOR, FormatError, Geometry
from .keys import KEY_BYTES, KeyNamespace, PageKey, chain_step
from .results import BatchHandle, PageResult, PageStatus, StoreStats
from .store import PageStore, StoreConfig

__all__ = [
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "KEY_BYTES",
    "BatchHandle",
    "FormatError",
    "Geometry",
    "KeyNamespace",
    "PageKey",
    "PageResult",
    "PageStatus",
    "PageStore",
    "StoreConfig",
    "StoreStats",
    "chain_step",
]
