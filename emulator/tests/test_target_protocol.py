"""Both targets a Connection can run under provide what :class:`ConnectionTarget` declares."""

from __future__ import annotations

import pytest

from adp_emulator.target import TargetSettings, UserspaceTarget
from adp_emulator.target.connection import ConnectionTarget, FaultSource
from adp_emulator.target.faults import Faults
from adp_emulator.target.worker import WorkerFaults, WorkerTarget


def missing(obj: object, protocol: type) -> list[str]:
    """Members of ``protocol`` (methods and annotated attributes) that ``obj`` lacks or has uncallable."""
    names = set(getattr(protocol, "__annotations__", {}))
    methods = {n for n, v in vars(protocol).items() if callable(v) and (not n.startswith("__"))}
    out = [n for n in sorted(names) if not hasattr(obj, n)]
    out += [n for n in sorted(methods) if not callable(getattr(obj, n, None))]
    return out


def test_userspace_target_serves_connections() -> None:
    t = UserspaceTarget(TargetSettings(port=0, capacity_bytes=1 << 20))
    assert missing(t, ConnectionTarget) == []
    assert missing(t.faults, FaultSource) == [] and isinstance(t.faults, Faults)


class _FakeLink:
    def request(self, msg: dict) -> None:
        return None


def test_worker_target_serves_connections_and_refuses_associations() -> None:
    faults = WorkerFaults(_FakeLink(), {"delay_s": 0.0, "device_full": False, "armed": False})  # type: ignore[arg-type]
    w = WorkerTarget(_FakeLink(), TargetSettings(), object(), faults)  # type: ignore[arg-type]
    assert missing(w, ConnectionTarget) == []
    assert missing(faults, FaultSource) == []
    assert not w.host_allowed("nqn.x") and w.create_controller("nqn.x", b"", False, 0) is None
    assert w.find_controller(1, False, "nqn.x") is None


def test_missing_member_is_reported() -> None:  # negative control of the check itself
    class Half:
        settings = namespaces = faults = None

        def host_allowed(self, hostnqn: str) -> bool:
            return True

    assert "create_controller" in missing(Half(), ConnectionTarget)
    with pytest.raises(AssertionError):
        assert missing(object(), ConnectionTarget) == []
