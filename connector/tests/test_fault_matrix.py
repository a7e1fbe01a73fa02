"""Fault matrix at the page-store / NVMe-TCP client level (issue item 2, below the vLLM connector).

Every test injects one fault while PageStore batches run against the userspace target over
loopback and checks the same contract:

* no wrong bytes: a page from ``load_batch`` is byte-identical to what was saved, or is reported
  ``missing`` / ``verify_failed`` / ``error`` (never a torn or foreign page with status OK);
* no failed request: ``save_batch`` / ``load_batch`` never raise, and the client recovers after the
  fault (a later batch succeeds);
* the counters (host stats, store stats, target counters) show what happened.

Engine-level faults (through vLLM): connector/tests/vllm/test_vllm_fault_matrix.py; table in docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from adp_connector.nvmeof.host import Controller, HostConfig
from adp_connector.store import KeyNamespace, PageStatus, PageStore, StoreConfig

emulator = pytest.importorskip("adp_emulator.target", reason="the userspace target package is not installed")
TargetSettings, UserspaceTarget = emulator.TargetSettings, emulator.UserspaceTarget

SUBNQN = "nqn.2026-11.io.awide:adp-kv"
MiB = 1 << 20
NS = KeyNamespace("fault-matrix/model", "bfloat16", "LBHNC;h=8;d=128", 16)
ACCEPTABLE_MISS = {PageStatus.MISSING, PageStatus.VERIFY_FAILED, PageStatus.ERROR}


def payload(key: bytes, n: int) -> bytes:
    """Deterministic, key-unique bytes (any misplaced or torn byte is detectable)."""
    out = bytearray()
    block = hashlib.sha256(key).digest()
    while len(out) < n:
        out += block
        block = hashlib.sha256(block).digest()
    return bytes(out[:n])


def make_keys(n: int, salt: int = 0) -> list[bytes]:
    return [bytes(k) for k in NS.chain_tokens([salt * 1_000_000 + i for i in range(16 * n)])]


def store_config(**kw: Any) -> StoreConfig:
    base: dict[str, Any] = {"claim_settle_s": 0.01, "heartbeat_interval_s": 0, "partitions": 4,
                            "avg_page_bytes": 64 << 10, "io_timeout_s": 10.0}
    base.update(kw)
    return StoreConfig(**base)


def host_config(addr: tuple[str, int], **kw: Any) -> HostConfig:
    base: dict[str, Any] = {"subnqn": SUBNQN, "io_queues": 2, "queue_depth": 32, "command_timeout": 5.0,
                            "reconnect_delay": 0.1, "connect_timeout": 5.0}
    base.update(kw)
    return HostConfig(traddr=addr[0], trsvcid=addr[1], **base)


def wait_connected(ctrl: Controller, timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while not ctrl.connected and time.monotonic() < end:
        time.sleep(0.05)
    assert ctrl.connected, "the client did not reconnect after the fault"


class Ledger:
    """Expected page contents and the tally of what loads returned."""

    def __init__(self) -> None:
        self.sizes: dict[bytes, int] = {}
        self.ok = self.missed = self.wrong = 0
        self.bytes_verified = 0

    def save(self, store: PageStore, keys: list[bytes], size: int | list[int], timeout: float = 60) -> list[Any]:
        sizes = size if isinstance(size, list) else [size] * len(keys)
        try:
            res = store.save_batch(keys, [payload(k, n) for k, n in zip(keys, sizes, strict=True)]).wait(timeout)
        except Exception as e:  # the contract: batches never raise
            pytest.fail(f"save_batch raised {e!r}")
        for k, n, r in zip(keys, sizes, res, strict=True):
            if r.status in (PageStatus.OK, PageStatus.EXISTS):
                self.sizes[k] = n
        return res

    def load(self, store: PageStore, keys: list[bytes] | None = None, timeout: float = 60) -> list[Any]:
        keys = list(self.sizes) if keys is None else keys
        bufs = [bytearray(self.sizes.get(k, 4096)) for k in keys]
        try:
            res = store.load_batch(keys, bufs).wait(timeout)
        except Exception as e:
            pytest.fail(f"load_batch raised {e!r}")
        for k, b, r in zip(keys, bufs, res, strict=True):
            if r.ok:
                n = self.sizes.get(k)
                if n is None or r.nbytes != n or bytes(b[:n]) != payload(k, n):
                    self.wrong += 1
                else:
                    self.ok += 1
                    self.bytes_verified += n
            else:
                assert r.status in ACCEPTABLE_MISS, r
                self.missed += 1
        assert self.wrong == 0, f"{self.wrong} pages returned with wrong bytes"
        return res


@pytest.fixture(params=[0, 2], ids=["in-process", "io-workers"])
def target(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The target with its I/O queues served in its own process, or by two worker processes."""
    t = UserspaceTarget(TargetSettings(port=0, capacity_bytes=64 * MiB, mdts_bytes=128 * 1024,
                                       max_io_queues=8, queue_depth=64, io_workers=request.param))
    t.start()
    yield t
    t.stop()


@contextlib.contextmanager
def opened(addr: tuple[str, int], hkw: dict[str, Any] | None = None,
           skw: dict[str, Any] | None = None) -> Iterator[tuple[Controller, PageStore]]:
    ctrl = Controller.connect(host_config(addr, **(hkw or {})))
    store = PageStore(ctrl, store_config(**(skw or {})))
    try:
        yield ctrl, store
    finally:
        with contextlib.suppress(Exception):
            store.close()
        ctrl.close()


def _in_background(fn: Any, delay: float) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        fn()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


# ----------------------------------------------------------------------------------------------------
# In-process target faults


def test_connection_dropped_mid_batch(target: Any) -> None:
    led = Ledger()
    with opened(target.address) as (ctrl, store):
        led.save(store, make_keys(8), 48 << 10)
        keys = make_keys(64, salt=1)
        th = _in_background(target.faults.drop_connections, 0.02)
        res = led.save(store, keys, 96 << 10)
        th.join()
        wait_connected(ctrl)
        led.load(store)
        # recovery: what failed can be saved again and everything loads
        led.save(store, [k for k, r in zip(keys, res, strict=True) if not r.ok], 96 << 10)
        res = led.load(store)
        assert all(r.ok for r in res), [r.status for r in res if not r.ok][:5]
        assert ctrl.stats.connection_losses >= 1 and ctrl.stats.reconnects >= 1


def test_keep_alive_expiry(target: Any) -> None:
    led = Ledger()
    with opened(target.address, {"kato_ms": 5000}) as (ctrl, store):
        led.save(store, make_keys(8), 32 << 10)
        old = ctrl.cntlid
        with target._lock:
            ctrls = list(target._controllers.values())
        end = time.monotonic() + 5
        while ctrl.stats.connection_losses == 0 and time.monotonic() < end:
            # The host went silent for longer than KATO: the target's timer fires. Marked again each pass: with
            # I/O workers, traffic from just before the silence is reported to the target up to 0.1 s later.
            for c in ctrls:
                c.last_activity = time.monotonic() - 3600
            time.sleep(0.02)
        assert ctrl.stats.connection_losses >= 1, "the host did not notice the keep-alive teardown"
        wait_connected(ctrl)
        assert ctrl.cntlid != old
        led.save(store, make_keys(8, salt=2), 32 << 10)
        assert all(r.ok for r in led.load(store))


def test_device_full(target: Any) -> None:
    led = Ledger()
    with opened(target.address) as (_ctrl, store):
        led.save(store, make_keys(8), 32 << 10)
        errs0 = target.counters()["namespaces"]["1"]["errors"]
        target.faults.set_device_full(True)
        res = led.save(store, make_keys(8, salt=3), 32 << 10)
        assert all(r.status in (PageStatus.ERROR, PageStatus.NO_SPACE) for r in res), [r.status for r in res]
        assert all(r.ok for r in led.load(store))  # reads keep working while full
        target.faults.set_device_full(False)
        res = led.save(store, make_keys(8, salt=3), 32 << 10)
        assert all(r.ok for r in res)
        assert all(r.ok for r in led.load(store))
        assert target.counters()["namespaces"]["1"]["errors"] > errs0
        assert store.stats.save_failed >= 8


def test_bit_flipped_in_stored_page(target: Any) -> None:
    led = Ledger()
    with opened(target.address) as (_ctrl, store):
        keys = make_keys(6)
        led.save(store, keys, 40 << 10)
        loc = store._own[keys[2]]
        lba = store.geometry.lba_size
        target.faults.corrupt(loc.lba * lba + lba + 1234, 1, 0x10)  # one payload bit
        res = led.load(store)
        by_key = dict(zip(list(led.sizes), res, strict=True))
        assert by_key[keys[2]].status is PageStatus.VERIFY_FAILED
        assert sum(r.ok for r in res) == 5
        assert store.stats.verify_failures == 1


@pytest.mark.parametrize("ddgst", [True, False], ids=["data_digest", "no_digest"])
def test_corrupted_read_on_the_wire(target: Any, ddgst: bool) -> None:
    led = Ledger()
    with opened(target.address, {"ddgst": ddgst, "hdgst": ddgst}) as (ctrl, store):
        led.save(store, make_keys(8), 40 << 10)
        target.faults.corrupt_next_reads(4)
        keys = list(led.sizes)
        res = led.load(store)  # digest error (transport) or checksum mismatch (store): a miss, never wrong bytes
        assert led.missed >= 1
        wait_connected(ctrl)
        # recompute: a page reported bad is forgotten by the store (then missing) and saved again
        led.save(store, [k for k, r in zip(keys, res, strict=True) if not r.ok], 40 << 10)
        assert all(r.ok for r in led.load(store))
        if ddgst:
            assert store.stats.io_errors >= 1 or ctrl.stats.connection_losses >= 1
        else:
            assert store.stats.verify_failures >= 1


def test_slow_device_delay_injection(target: Any) -> None:
    led = Ledger()
    with opened(target.address, {"command_timeout": 0.5}, {"io_timeout_s": 0.5}) as (ctrl, store):
        led.save(store, make_keys(4), 16 << 10)
        target.faults.set_delay(0.05)  # slow but within timeouts: everything succeeds
        assert all(r.ok for r in led.save(store, make_keys(4, salt=4), 16 << 10))
        target.faults.set_delay(1.5)  # slower than the command timeout: misses, no exceptions
        led.load(store, timeout=30)
        target.faults.clear()
        assert ctrl.stats.timeouts >= 1
        wait_connected(ctrl)
        assert all(r.ok for r in led.load(store))


def test_failed_commands(target: Any) -> None:
    led = Ledger()
    with opened(target.address) as (_ctrl, store):
        led.save(store, make_keys(8), 32 << 10)
        target.faults.fail_next_io(3, "INTERNAL_ERROR")
        led.save(store, make_keys(8, salt=5), 32 << 10)
        target.faults.fail_next_io(2, "INTERNAL_ERROR")
        led.load(store)
        target.faults.clear()
        assert all(r.ok for r in led.load(store))
        assert store.stats.io_errors >= 1


def test_two_writers_same_namespace(target: Any) -> None:
    """Two engines (two associations, two stores) save overlapping keys concurrently."""
    led_a, led_b = Ledger(), Ledger()
    shared = make_keys(24, salt=6)
    with opened(target.address) as (_ca, sa), opened(target.address) as (_cb, sb):
        assert sa.partition != sb.partition
        ta = threading.Thread(target=led_a.save, args=(sa, shared + make_keys(8, salt=7), 24 << 10))
        tb = threading.Thread(target=led_b.save, args=(sb, shared[::-1] + make_keys(8, salt=8), 24 << 10))
        ta.start()
        tb.start()
        ta.join(60)
        tb.join(60)
        sa.refresh()
        sb.refresh()
        both = {**led_a.sizes, **led_b.sizes}
        led_a.sizes = dict(both)
        led_b.sizes = dict(both)
        ra, rb = led_a.load(sa), led_b.load(sb)
        assert sum(r.ok for r in ra) == sum(r.ok for r in rb) == len(both)


# ----------------------------------------------------------------------------------------------------
# Target process killed (kill -9) and restarted on the same port and backing file


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TargetProcess:
    """``python -m adp_emulator serve`` as a child process."""

    def __init__(self, port: int, backing: Path, capacity: str = "64M") -> None:
        self.port, self.backing, self.capacity = port, backing, capacity
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> TargetProcess:
        end = time.monotonic() + 15
        while True:  # the port may still be in TIME_WAIT/held right after a kill
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "adp_emulator", "serve", "--port", str(self.port), "--backing",
                 str(self.backing), "--capacity", self.capacity], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True)
            line = self.proc.stdout.readline() if self.proc.stdout else ""
            if line.startswith("ADP-EMULATOR READY"):
                return self
            self.proc.wait(5)
            if time.monotonic() > end:
                raise RuntimeError(f"target did not start: {line!r}")
            time.sleep(0.2)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def target_proc(tmp_path: Path) -> Iterator[TargetProcess]:
    tp = TargetProcess(_free_port(), tmp_path / "ns.img").start()
    yield tp
    tp.stop()


@pytest.mark.parametrize("during", ["write", "read"])
def test_target_killed_and_restarted(target_proc: TargetProcess, during: str) -> None:
    addr = ("127.0.0.1", target_proc.port)
    led = Ledger()
    wid = os.urandom(16)
    with opened(addr, {"reconnect_delay": 0.2, "command_timeout": 3.0},
                {"writer_id": wid, "io_timeout_s": 5.0}) as (ctrl, store):
        led.save(store, make_keys(16), 64 << 10)
        big = make_keys(96, salt=9)
        if during == "read":
            led.save(store, big, 96 << 10)
        th = _in_background(target_proc.kill, 0.05)
        if during == "write":
            led.save(store, big, 96 << 10)
        else:
            led.load(store)
        th.join()
        target_proc.start()
        wait_connected(ctrl)
        led.load(store)  # the same instance after the reconnect
        led.save(store, make_keys(4, salt=10), 8 << 10)
        assert ctrl.stats.connection_losses >= 1 and ctrl.stats.reconnects >= 1
    # a restarted engine: new association, the same writer id recovers its partition
    with opened(addr, skw={"writer_id": wid}) as (_c2, s2):
        res = led.load(s2)
        assert sum(r.ok for r in res) >= 16  # the pages committed before the kill survive
    assert led.wrong == 0


def test_engine_killed_mid_save(target: Any, tmp_path: Path) -> None:
    """A writer process (the engine's store) is kill -9'd mid-save; the restarted one never serves torn pages."""
    host, port = target.address
    wid = os.urandom(16).hex()
    child = f"""
import hashlib, sys
from adp_connector.nvmeof.host import Controller, HostConfig
from adp_connector.store import KeyNamespace, PageStore, StoreConfig
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_fault_matrix import make_keys, payload, store_config, host_config
ctrl = Controller.connect(host_config(({host!r}, {port})))
store = PageStore(ctrl, store_config(writer_id=bytes.fromhex({wid!r})))
print("READY", flush=True)
for salt in range(100, 200):
    keys = make_keys(16, salt)
    store.save_batch(keys, [payload(k, 96 << 10) for k in keys]).wait(60)
    print("SAVED", salt, flush=True)
"""
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    saved: list[int] = []
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "READY"
        while len(saved) < 2:
            line = proc.stdout.readline()
            assert line, "writer died early"
            saved.append(int(line.split()[1]))
        time.sleep(0.03)
    finally:
        proc.kill()
        proc.wait(10)
    led = Ledger()
    for salt in range(100, 200):
        for k in make_keys(16, salt):
            led.sizes[k] = 96 << 10
    with opened(target.address, skw={"writer_id": bytes.fromhex(wid)}) as (_c, store):
        res = led.load(store)
        ok = sum(r.ok for r in res)
        assert ok >= 16 * len(saved), (ok, saved)  # acknowledged batches are durable
    assert led.wrong == 0


# ----------------------------------------------------------------------------------------------------
# Access control (issue item 4; the management API's token checks live in emulator/tests/test_api.py)

ALLOWED = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-0000-0000-000000000001"
STRANGER = "nqn.2014-08.org.nvmexpress:uuid:bbbbbbbb-0000-0000-0000-000000000002"


def test_access_control_host_allow_list_and_digests() -> None:
    from adp_connector.nvmeof.host import NvmeConnectError, NvmeTransportError

    assert TargetSettings().host == "127.0.0.1" and TargetSettings().allow_any
    assert not TargetSettings(host="0.0.0.0").allow_any  # off loopback: allow-list only by default
    t = UserspaceTarget(TargetSettings(port=0, capacity_bytes=16 * MiB, allowed_hosts=[ALLOWED],
                                       allow_any_host=False, require_data_digest=True)).start()
    try:
        with pytest.raises(NvmeConnectError) as ei:
            Controller.connect(host_config(t.address, hostnqn=STRANGER, ddgst=True))
        assert ei.value.status.name == "CONNECT_INVALID_HOST", ei.value.status
        with pytest.raises((NvmeTransportError, NvmeConnectError)):  # no data digest: refused at ICReq
            Controller.connect(host_config(t.address, hostnqn=ALLOWED, ddgst=False))
        with Controller.connect(host_config(t.address, hostnqn=ALLOWED, ddgst=True)) as c:
            c.write(0, b"\x5a" * 4096)
            assert c.read(0, 4096) == b"\x5a" * 4096
    finally:
        t.stop()
