"""Management backends: what the management API reads from and does to a target.

* :class:`UserspaceBackend` wraps a running :class:`~adp_emulator.target.UserspaceTarget` (same process).
* :class:`KernelBackend` reads a kernel target's workdir (``kernel-target.json``); nvmet has no
  counters or fault hooks, so those fields are null and those endpoints answer 501.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Protocol

MAX_CORRUPT_BYTES = 16 << 20
_PAGE = mmap.PAGESIZE
_ODD = bytes(i & 1 for i in range(256))  # translate table: mincore byte -> resident bit


class Unsupported(Exception):
    """The backend cannot do this (HTTP 501)."""


class Conflict(Exception):
    """Refused in the current state, e.g. wipe with live I/O connections (HTTP 409)."""


class MgmtBackend(Protocol):
    """What the management API needs from a target. Unknown values are None, never guessed."""

    kind: str

    def identity(self) -> dict[str, Any]: ...
    def usage(self) -> dict[str, Any]: ...
    def counters(self) -> dict[str, Any] | None: ...
    def health(self) -> dict[str, Any]: ...
    def wipe(self, nsid: int, force: bool) -> dict[str, Any]: ...
    def faults_state(self) -> dict[str, Any] | None: ...
    def drop_connections(self) -> int: ...
    def set_delay(self, seconds: float) -> None: ...
    def fail_next(self, count: int, status: str) -> None: ...
    def corrupt(self, nsid: int, offset: int, length: int, xor: int) -> None: ...
    def corrupt_next_reads(self, count: int) -> None: ...
    def set_device_full(self, full: bool) -> None: ...
    def clear_faults(self) -> None: ...


def resident_bytes(mm: mmap.mmap) -> int | None:
    """Bytes of ``mm`` resident in memory (mincore(2)); None if it cannot be measured."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        n = len(mm)
        vec = (ctypes.c_ubyte * ((n + _PAGE - 1) // _PAGE))()
        anchor = ctypes.c_char.from_buffer(mm)
        try:
            rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(n), vec)
        finally:
            del anchor
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    if rc != 0:
        return None
    return bytes(vec).translate(_ODD).count(1) * _PAGE


def _probe(host: str, port: int, timeout: float = 3.0) -> tuple[bool, str | None]:
    """ICReq/ICResp exchange with the target; (answered, error)."""
    from adp_emulator.kernel.probe import icreq_exchange

    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1" if host == "0.0.0.0" else "::1"
    try:
        icreq_exchange(host, port, timeout=timeout)
        return True, None
    except (OSError, ValueError) as e:
        return False, str(e) or type(e).__name__


_NULL_COUNTERS = {"commands": None, "reads": None, "writes": None, "bytes_read": None, "bytes_written": None,
                  "errors": None, "latency_us_log2": None, "latency_seconds_sum": None}


class UserspaceBackend:
    """The userspace target in this process: everything is measurable and every fault is available."""

    kind = "user"

    def __init__(self, target: Any) -> None:
        self.target = target

    def identity(self) -> dict[str, Any]:
        t, s = self.target, self.target.settings
        host, port = t.address
        nss = [{"nsid": n, "capacity_bytes": ns.capacity, "lba_size": ns.lba_size, "nguid": ns.nguid.hex(),
                "uuid": str(uuid.UUID(bytes=ns.uuid))} for n, ns in sorted(t.namespaces.items())]
        return {"backend": self.kind, "hosted": "host", "model": s.model, "serial": s.serial_number,
                "firmware": s.firmware, "subnqn": s.subnqn, "traddr": host, "trsvcid": port,
                "capacity_bytes": s.capacity_bytes, "lba_size": s.lba_size, "mdts_bytes": s.mdts_bytes,
                "max_io_queues": s.max_io_queues, "queue_depth": s.queue_depth,
                "backing": "file" if s.backing_path else "ram", "backing_path": s.backing_path,
                "kernel_version": None, "namespaces": nss}

    def _allocated(self, ns: Any) -> tuple[int | None, str | None]:
        if ns.path:
            try:
                return os.stat(ns.path).st_blocks * 512, "st_blocks"
            except OSError:
                return None, None
        got = resident_bytes(ns.mm)
        return (got, "mincore") if got is not None else (None, None)

    def usage(self) -> dict[str, Any]:
        nss = []
        for n, ns in sorted(self.target.namespaces.items()):
            alloc, method = self._allocated(ns)
            c = self.target.namespace_counters(n)
            nss.append({"nsid": n, "capacity_bytes": ns.capacity, "allocated_bytes": alloc,
                        "allocated_method": method, "bytes_written_total": c.bytes_written,
                        "bytes_read_total": c.bytes_read})
        allocs = [d["allocated_bytes"] for d in nss]
        return {"backend": self.kind, "capacity_bytes": sum(d["capacity_bytes"] for d in nss),
                "allocated_bytes": None if None in allocs else sum(allocs),
                "bytes_written_total": sum(d["bytes_written_total"] for d in nss), "namespaces": nss}

    def counters(self) -> dict[str, Any] | None:
        return self.target.counters()

    def health(self) -> dict[str, Any]:
        t = self.target
        host, port = t.address
        snap = t.counters()  # before the probe, whose own connection would be counted
        ok, err = _probe(host, port)
        return {"backend": self.kind, "status": "ok" if ok else "unreachable", "icresp": ok, "error": err,
                "uptime_s": round(time.monotonic() - t.started_at, 3), "connections": snap["connections"],
                "controllers": len(snap["controllers"]), "faults_armed": t.faults.armed}

    def wipe(self, nsid: int, force: bool) -> dict[str, Any]:
        ns = self.target.namespaces.get(nsid)
        if ns is None:
            raise KeyError(f"no namespace {nsid}")
        live = [q for q in self.target.counters()["queues"] if q["qid"] > 0]
        if live and not force:
            raise Conflict(f"{len(live)} I/O queue(s) are connected; disconnect the hosts or pass force=true")
        t0 = time.monotonic()
        ns.zero(0, ns.capacity)
        ns.flush()
        return {"nsid": nsid, "wiped_bytes": ns.capacity, "live_io_queues": len(live),
                "seconds": round(time.monotonic() - t0, 3)}

    def faults_state(self) -> dict[str, Any] | None:
        f = self.target.faults
        return {"supported": True, "armed": f.armed, "delay_s": f.delay_s, "device_full": f.device_full}

    def drop_connections(self) -> int:
        return self.target.faults.drop_connections()

    def set_delay(self, seconds: float) -> None:
        self.target.faults.set_delay(seconds)

    def fail_next(self, count: int, status: str) -> None:
        self.target.faults.fail_next_io(count, status)

    def corrupt(self, nsid: int, offset: int, length: int, xor: int) -> None:
        if nsid not in self.target.namespaces:
            raise KeyError(f"no namespace {nsid}")
        self.target.faults.corrupt(offset, length, xor, nsid)

    def corrupt_next_reads(self, count: int) -> None:
        self.target.faults.corrupt_next_reads(count)

    def set_device_full(self, full: bool) -> None:
        self.target.faults.set_device_full(full)

    def clear_faults(self) -> None:
        self.target.faults.clear()


_KERNEL_NO_FAULTS = ("the kernel backend (Linux nvmet) has no fault-injection hooks; "
                     "use the userspace backend (`testbed up --backend user`) for {what}")


class KernelBackend:
    """A kernel nvmet target started by :class:`~adp_emulator.kernel.KernelTarget` into ``workdir``.

    Identity comes from the config plus one Identify Controller/Namespace over NVMe/TCP (cached);
    health from an ICReq probe. Usage, counters and faults are not available (null / 501).
    """

    kind = "kernel"

    def __init__(self, workdir: str | os.PathLike[str], identify_timeout: float = 10.0) -> None:
        self.workdir = Path(workdir)
        self.identify_timeout = identify_timeout
        self._identified: dict[str, Any] | None = None
        self._id_lock = threading.Lock()

    def _state(self) -> dict[str, Any] | None:
        from adp_emulator.kernel.target import STATE_FILE

        try:
            return json.loads((self.workdir / STATE_FILE).read_text())
        except (OSError, ValueError):
            return None

    def _require_state(self) -> dict[str, Any]:
        st = self._state()
        if st is None:
            raise LookupError(f"no kernel target state in {self.workdir} (not started, or stopped)")
        return st

    @staticmethod
    def _subsystem(st: dict[str, Any]) -> dict[str, Any]:
        subs = st.get("config", {}).get("subsystems", [])
        return next((s for s in subs if s.get("nqn") == st.get("subnqn")), subs[0] if subs else {})

    def _identify(self, st: dict[str, Any]) -> dict[str, Any]:
        """Identify Controller + Namespace through the real host client (admin queue only), cached."""
        with self._id_lock:
            if self._identified is not None:
                return self._identified
            from adp_connector.nvmeof.host.controller import Controller, HostConfig

            sub = self._subsystem(st)
            allowed = sub.get("allowed_hosts") or []
            any_host = str(sub.get("attr", {}).get("allow_any_host", "1")) == "1"
            cfg = HostConfig(traddr=st["traddr"], trsvcid=int(st["trsvcid"]), subnqn=st["subnqn"],
                             hostnqn=None if any_host or not allowed else allowed[0], io_queues=0,
                             connect_timeout=self.identify_timeout, command_timeout=self.identify_timeout,
                             auto_reconnect=False)
            ctrl = Controller.connect(cfg)
            try:
                idc, idn = ctrl.identify, ctrl.namespace
                assert idc is not None and idn is not None
                self._identified = {"model": idc.mn.strip() or None, "serial": idc.sn.strip() or None,
                                    "firmware": idc.fr.strip() or None, "mdts_bytes": ctrl.mdts_bytes,
                                    "lba_size": ctrl.lba_size, "capacity_bytes": ctrl.capacity_bytes,
                                    "nsid": ctrl.nsid}
            finally:
                ctrl.close()
            return self._identified

    def identity(self) -> dict[str, Any]:
        st = self._require_state()
        attrs = self._subsystem(st).get("attr", {})
        try:
            got: dict[str, Any] = self._identify(st)
            err = None
        except Exception as e:  # the device did not answer Identify: report only what the config says
            got, err = {}, str(e) or type(e).__name__
        cap = got.get("capacity_bytes", st.get("guest_capacity_bytes"))
        nsid = got.get("nsid", 1)
        return {"backend": self.kind, "hosted": st.get("hosted"), "model": got.get("model", attrs.get("model")),
                "serial": got.get("serial", attrs.get("serial")), "firmware": got.get("firmware"),
                "subnqn": st.get("subnqn"), "traddr": st.get("traddr"),
                "trsvcid": int(st["trsvcid"]) if st.get("trsvcid") else None, "capacity_bytes": cap,
                "lba_size": got.get("lba_size"), "mdts_bytes": got.get("mdts_bytes"), "max_io_queues": None,
                "queue_depth": None, "backing": "ram" if st.get("hosted") == "vm" else "file", "backing_path": None,
                "kernel_version": st.get("kernel_version"), "accel": st.get("accel"), "identify_error": err,
                "namespaces": [{"nsid": nsid, "capacity_bytes": cap, "lba_size": got.get("lba_size"),
                                "nguid": None, "uuid": None}]}

    def usage(self) -> dict[str, Any]:
        st = self._require_state()
        cap = (self._identified or {}).get("capacity_bytes", st.get("guest_capacity_bytes"))
        return {"backend": self.kind, "capacity_bytes": cap, "allocated_bytes": None, "bytes_written_total": None,
                "namespaces": [{"nsid": 1, "capacity_bytes": cap, "allocated_bytes": None, "allocated_method": None,
                                "bytes_written_total": None, "bytes_read_total": None}]}

    def counters(self) -> dict[str, Any] | None:
        return None

    def health(self) -> dict[str, Any]:
        st = self._state()
        if st is None:
            return {"backend": self.kind, "status": "down", "icresp": False,
                    "error": f"no kernel target state in {self.workdir}", "uptime_s": None, "connections": None,
                    "controllers": None, "faults_armed": None}
        ok, err = _probe(st["traddr"], int(st["trsvcid"]))
        started = self._started_at()
        return {"backend": self.kind, "status": "ok" if ok else "unreachable", "icresp": ok, "error": err,
                "uptime_s": round(time.time() - started, 3) if started else None, "connections": None,
                "controllers": None, "faults_armed": None}

    def _started_at(self) -> float | None:
        from adp_emulator.kernel.target import STATE_FILE

        try:
            return (self.workdir / STATE_FILE).stat().st_mtime
        except OSError:
            return None

    def wipe(self, nsid: int, force: bool) -> dict[str, Any]:
        raise Unsupported("wipe is not available on the kernel backend (nvmet's namespace lives in the guest); "
                          "`testbed down` then `testbed up --backend kernel` gives a fresh, zeroed namespace")

    def faults_state(self) -> dict[str, Any] | None:
        return {"supported": False, "armed": None, "delay_s": None, "device_full": None}

    def drop_connections(self) -> int:
        raise Unsupported(_KERNEL_NO_FAULTS.format(what="dropping connections (restarting the guest would "
                                                        "lose the namespace)"))

    def set_delay(self, seconds: float) -> None:
        raise Unsupported(_KERNEL_NO_FAULTS.format(what="delays"))

    def fail_next(self, count: int, status: str) -> None:
        raise Unsupported(_KERNEL_NO_FAULTS.format(what="failing commands"))

    def corrupt(self, nsid: int, offset: int, length: int, xor: int) -> None:
        raise Unsupported(_KERNEL_NO_FAULTS.format(what="corrupting data"))

    def corrupt_next_reads(self, count: int) -> None:
        raise Unsupported(_KERNEL_NO_FAULTS.format(what="corrupting reads"))

    def set_device_full(self, full: bool) -> None:
        raise Unsupported(_KERNEL_NO_FAULTS.format(what="a full device"))

    def clear_faults(self) -> None:
        raise Unsupported(_KERNEL_NO_FAULTS.format(what="faults"))
