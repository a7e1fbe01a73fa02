"""Userspace NVMe/TCP target (the ``emulator`` backend).

    from adp_emulator.target import TargetSettings, UserspaceTarget
    with UserspaceTarget(TargetSettings(port=0)) as t:
        host, port = t.address
"""

from .counters import IoCounters
from .faults import Faults
from .server import UserspaceTarget
from .settings import TargetSettings, parse_size, settings_from_config

__all__ = ["Faults", "IoCounters", "TargetSettings", "UserspaceTarget", "parse_size", "settings_from_config"]
