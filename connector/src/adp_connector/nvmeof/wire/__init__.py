"""Transition alias: the NVMe/TCP codec now lives in its own distribution, :mod:`adp_wire`.

``adp_connector.nvmeof.wire`` re-exports :mod:`adp_wire`'s names, and each of its submodules
(``.constants``, ``.pdu``, ``.sqe``, ...) *is* the module of :mod:`adp_wire` (same object), so old
imports keep working. New code imports :mod:`adp_wire`.
"""

from adp_wire import *  # noqa: F403
from adp_wire import __all__ as __all__
