"""Test helpers for the userspace target: the raw-socket host (now :mod:`adp_emulator.fuzz.rawhost`, re-exported
here), a running target on a free port, and status words by name.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator
from typing import Any

from adp_emulator.fuzz.rawhost import (
    CC_ENABLE,
    HOSTID,
    HOSTNQN,
    SUBNQN,
    Closed,
    RawQueue,
    TermReceived,
    discovery_admin,
    open_admin,
    open_io,
)
from adp_emulator.target import TargetSettings, UserspaceTarget
from adp_wire.status import Status

__all__ = ["CC_ENABLE", "HOSTID", "HOSTNQN", "SUBNQN", "U32", "Closed", "RawQueue", "TermReceived",
           "discovery_admin", "open_admin", "open_io", "running_target", "w"]


def w(name: str) -> int:
    """Status word for a status name (DNR per the codec's default)."""
    return Status.named(name).word


@contextlib.contextmanager
def running_target(**kw: Any) -> Iterator[UserspaceTarget]:
    """A started target on a free loopback port with small defaults."""
    kw.setdefault("port", 0)
    kw.setdefault("capacity_bytes", 16 << 20)
    t = UserspaceTarget(TargetSettings(**kw))
    t.start()
    try:
        yield t
    finally:
        t.stop()


U32 = struct.Struct("<I")
