"""The NVMe/TCP host client against the userspace target over real loopback TCP sockets.

The target is the real emulator (another layer, tested on its own in emulator/tests); this module
tests the client: bring-up, MDTS splitting, pipelining up to the queue depth, statuses as
exceptions, timeouts, keep-alive, reconnect, digests, and a 256 MiB end-to-end round trip.
"""

from __future__ import annotations

import hashlib
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from adp_connector.device import BlockDevice, DeviceUnavailable, ScatterList
from adp_connector.nvmeof.host import (
    Controller,
    HostConfig,
    NvmeConnectError,
    NvmeStatusError,
    NvmeTimeoutError,
    NvmeTransportError,
    discover,
)
from adp_wire.constants import LogPage

emulator = pytest.importorskip("adp_emulator.target", reason="the userspace target package is not installed")
TargetSettings, UserspaceTarget = emulator.TargetSettings, emulator.UserspaceTarget

NQN = "nqn.2026-11.io.awide:test-host-client"
MiB = 1 << 20


@pytest.fixture(scope="module")
def target():
    t = UserspaceTarget(TargetSettings(port=0, subnqn=NQN, capacity_bytes=512 * MiB, mdts_bytes=128 * 1024,
                                       max_io_queues=8, queue_depth=128))
    t.start()
    yield t
    t.stop()


def cfg(t, **kw) -> HostConfig:
    host, port = t.address
    kw.setdefault("subnqn", NQN)
    return HostConfig(traddr=host, trsvcid=port, **kw)


def test_connect_identify_and_protocol_conformance(target):
    with Controller.connect(cfg(target, io_queues=2)) as c:
        assert isinstance(c, BlockDevice)
        assert c.identify.subnqn == NQN
        assert c.identify.cntlid == c.cntlid
        assert c.lba_size == 4096 and c.capacity_bytes == 512 * MiB
        assert c.mdts_bytes == 128 * 1024 == c.max_transfer_bytes
        assert c.active_namespaces() == [1]
        descs = dict(c.namespace_descriptors(1))
        assert 3 in descs or 2 in descs  # UUID or NGUID present
        assert len(c._io) == 2


def test_discovery(target):
    host, port = target.address
    entries = discover(host, port)
    assert [e.subnqn for e in entries] == [NQN]
    assert entries[0].trsvcid == str(port)
    with Controller.connect(HostConfig(traddr=host, trsvcid=port, subnqn=None, io_queues=1)) as c:
        assert c.config.subnqn == NQN


@pytest.mark.parametrize("size", [4096, 64 * 1024, 128 * 1024, 128 * 1024 + 4096, 1 * MiB, 5 * MiB + 8192])
def test_roundtrip_sizes_below_at_above_mdts(target, size):
    with Controller.connect(cfg(target, io_queues=3)) as c:
        data = os.urandom(size)
        off = 7 * MiB
        before = c.stats.commands
        c.write(off, data)
        back = bytearray(size)
        c.read_into(off, memoryview(back))
        assert bytes(back) == data
        chunks = -(-size // c.max_transfer_bytes)
        assert c.stats.commands - before == 2 * chunks  # each direction split at MDTS


def test_max_transfer_cap_below_mdts(target):
    with Controller.connect(cfg(target, io_queues=1, max_transfer_bytes=16384)) as c:
        assert c.max_transfer_bytes == 16384
        data = os.urandom(100 * 1024)
        c.write(0, data)
        assert c.read(0, len(data)) == data
        assert c.stats.commands == 2 * 7


def test_pipelining_respects_queue_depth(target):
    with Controller.connect(cfg(target, io_queues=2, queue_depth=4)) as c:
        buf = os.urandom(64 * 1024)
        target.faults.set_delay(0.005)  # a slow device: submissions pile up whatever the machine's load
        try:
            futs = [c.submit_write(i * len(buf), buf) for i in range(64)]
            for f in futs:
                f.result(30)
        finally:
            target.faults.clear()
        depths = [q.max_in_flight for q in c._io]
        assert max(depths) == 4  # pipelined up to, never beyond, the depth
        reads = [bytearray(len(buf)) for _ in range(64)]
        futs = [c.submit_read(i * len(buf), memoryview(r)) for i, r in enumerate(reads)]
        for f in futs:
            f.result(30)
        assert all(bytes(r) == buf for r in reads)


def test_concurrent_callers_are_safe(target):
    with Controller.connect(cfg(target, io_queues=4)) as c:
        errors = []

        def worker(k: int) -> None:
            try:
                rng = random.Random(k)
                for _ in range(20):
                    n = rng.choice([4096, 128 * 1024, 300 * 1024 // 4096 * 4096])
                    off = (64 + 8 * k) * MiB + rng.randrange(0, 4 * MiB // 4096) * 4096
                    d = rng.randbytes(n)
                    c.write(off, d)
                    assert c.read(off, n) == d
            except BaseException as e:
                errors.append(e)

        ts = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors, errors


def test_flush_write_zeroes_deallocate(target):
    with Controller.connect(cfg(target, io_queues=1)) as c:
        c.write(0, b"\xAB" * 65536)
        c.flush()
        c.write_zeroes(4096, 8192)
        back = c.read(0, 65536)
        assert back[:4096] == b"\xAB" * 4096 and back[4096:12288] == bytes(8192) and back[12288:] == b"\xAB" * 53248
        c.deallocate(0, 65536)
        assert c.read(0, 65536) == bytes(65536)


def test_bad_input_is_a_clear_error_and_loses_nothing(target):
    with Controller.connect(cfg(target, io_queues=1)) as c:
        c.write(0, b"k" * 4096)
        with pytest.raises(ValueError, match="multiples of the LBA size"):
            c.write(10, b"x" * 4096)
        with pytest.raises(ValueError, match="exceeds the namespace capacity"):
            c.read(c.capacity_bytes, 4096)
        with pytest.raises(ValueError, match="writable"):
            c.submit_read(0, memoryview(b"x" * 4096))
        assert c.read(0, 4096) == b"k" * 4096


def test_status_errors_are_named(target):
    with Controller.connect(cfg(target, io_queues=1)) as c:
        with pytest.raises(NvmeStatusError, match="INVALID_FIELD") as e:
            c.get_log_page(0x55, 512)
        assert e.value.status.dnr
        target.faults.fail_next_io(1, "UNRECOVERED_READ_ERROR")
        try:
            with pytest.raises(NvmeStatusError, match="UNRECOVERED_READ_ERROR"):
                c.read(0, 4096)
        finally:
            target.faults.clear()
        assert len(c.read(0, 4096)) == 4096  # the queue keeps working after an error status
        assert c.get_log_page(LogPage.SMART, 512)[:1] is not None


def test_connect_errors(target):
    with pytest.raises(NvmeConnectError, match="CONNECT_INVALID_PARAMETERS"):
        Controller.connect(cfg(target, subnqn="nqn.2026-11.io.awide:no-such-subsystem"))
    with pytest.raises(NvmeTransportError, match="cannot reach"):
        Controller.connect(HostConfig(traddr="127.0.0.1", trsvcid=_free_port(), subnqn=NQN, connect_timeout=2))


def test_disallowed_host_is_refused():
    t = UserspaceTarget(TargetSettings(port=0, subnqn=NQN, capacity_bytes=16 * MiB, allow_any_host=False,
                                       allowed_hosts=["nqn.2026-11.io.awide:host:good"]))
    t.start()
    try:
        with pytest.raises(NvmeConnectError, match="CONNECT_INVALID_HOST"):
            Controller.connect(cfg(t, hostnqn="nqn.2026-11.io.awide:host:bad"))
        with Controller.connect(cfg(t, hostnqn="nqn.2026-11.io.awide:host:good", io_queues=1)) as c:
            c.write(0, b"g" * 4096)
    finally:
        t.stop()


def test_digests_roundtrip(target):
    with Controller.connect(cfg(target, io_queues=2, hdgst=True, ddgst=True)) as c:
        data = os.urandom(3 * MiB)
        c.write(16 * MiB, data)
        assert c.read(16 * MiB, len(data)) == data
        assert c._io[0].hdgst and c._io[0].ddgst


def test_scatter_list_slices_across_buffers() -> None:
    a, b, c = memoryview(bytearray(b"abc")), memoryview(bytearray(b"defgh")), memoryview(bytearray(b"ij"))
    sl = ScatterList([a, memoryview(bytearray()), b, c])
    assert len(sl) == 10 and len(sl.views) == 3
    assert [bytes(v) for v in sl[2:9].views] == [b"c", b"defgh", b"i"]
    assert [bytes(v) for v in sl[3:8].views] == [b"defgh"] and sl[10:20].views == []
    with pytest.raises(ValueError):
        sl[0:10:2]


@pytest.mark.parametrize("ddgst", [False, True], ids=["plain", "data-digest"])
def test_readv_scatters_one_range_over_buffers_with_mdts_commands(target, ddgst: bool) -> None:
    """A scatter read of 4 KiB + 300 KiB + 8 KiB + 4 KiB costs ceil(316 KiB / MDTS 128 KiB) = 3 commands (not one per
    buffer), and every byte lands where a contiguous read puts it."""
    with Controller.connect(cfg(target, io_queues=2, ddgst=ddgst)) as c:
        data = os.urandom(316 * 1024)
        c.write(40 * MiB, data)
        sizes = [4096, 300 * 1024, 8192, 4096]
        bufs = [bytearray(n) for n in sizes]
        before = c.stats.commands
        c.submit_readv(40 * MiB, bufs).result(10)
        assert c.stats.commands - before == 3
        assert b"".join(bufs) == data
        with pytest.raises(ValueError):
            c.submit_readv(40 * MiB, [bytearray(100)])  # not whole blocks: refused before any I/O
        with pytest.raises(ValueError):
            c.submit_readv(40 * MiB, [bytes(4096)])  # read-only


def test_commands_of_one_transfer_share_a_send(target, monkeypatch: pytest.MonkeyPatch) -> None:
    """A transfer split at the MDTS goes out as groups of up to 8 capsules per system call; a queue with fewer free
    slots than a group sends what it has before it waits (no deadlock at queue depth 2), and data is intact."""
    from adp_connector.nvmeof.host import queue as Q

    sends: list[int] = []
    real = Q.QueuePair._send_capsule

    def counting(self, bufs):  # one call = one sendmsg of capsules (I/O queues only: no keep-alives)
        if self.qid > 0:
            sends.append(len(bufs))
        return real(self, bufs)

    monkeypatch.setattr(Q.QueuePair, "_send_capsule", counting)
    with Controller.connect(cfg(target, io_queues=1, queue_depth=32)) as c:
        data = os.urandom(5 * 128 * 1024)
        c.write(48 * MiB, data)  # in-capsule writes of 128 KiB: header + data per command
        sends.clear()
        assert c.read(48 * MiB, len(data)) == data
        assert sends == [5]  # 5 read capsules, one send
        big = os.urandom(20 * 128 * 1024)
        sends.clear()
        c.write(56 * MiB, big)
        assert len(sends) == 3  # groups of 8 + 8 + 4
    with Controller.connect(cfg(target, io_queues=1, queue_depth=2)) as c:
        sends.clear()
        assert c.read(56 * MiB, len(big)) == big  # 20 commands through 2 slots
        assert len(sends) >= 10


def test_store_reads_header_and_payload_in_one_command(target) -> None:
    """The page store asks for a page's header and payload in one scatter read: a 1 MiB - 4 KiB page (above the
    store's inline size) plus its 4 KiB header costs 1 MiB / MDTS 128 KiB = 8 read commands (it used to cost 9)."""
    from adp_connector.store import PageStore, StoreConfig

    with Controller.connect(cfg(target, io_queues=1)) as c:
        PageStore.format(c, partitions=2, avg_page_bytes=64 * 1024)
        store = PageStore(c, StoreConfig(writer_id=b"readv-test-w0000", heartbeat_interval_s=0,
                                         claim_settle_s=0.01))
        try:
            page = os.urandom(MiB - 4096)
            assert store.save(b"k" * 32, page).ok
            buf = bytearray(len(page))
            before = c.stats.commands
            assert store.load(b"k" * 32, buf).ok and bytes(buf) == page
            assert c.stats.commands - before == 8
        finally:
            store.close()


def test_corrupted_wire_data_is_detected_with_data_digest(target):
    with Controller.connect(cfg(target, io_queues=1, ddgst=True)) as c:
        c.write(0, b"d" * 8192)
        target.faults.corrupt_next_reads(1)
        try:
            with pytest.raises(NvmeStatusError, match="DATA_TRANSFER_ERROR"):
                c.read(0, 8192)
        finally:
            target.faults.clear()
        assert c.read(0, 8192) == b"d" * 8192


def test_timeout_then_recovery(target):
    with Controller.connect(cfg(target, io_queues=1, command_timeout=0.5, reconnect_delay=0.2)) as c:
        target.faults.set_delay(2.0)
        try:
            t0 = time.monotonic()
            with pytest.raises(NvmeTimeoutError):
                c.read(0, 4096)
            assert time.monotonic() - t0 < 3.0
        finally:
            target.faults.clear()
        _wait_connected(c)
        assert len(c.read(0, 4096)) == 4096
        assert c.stats.timeouts >= 1 and c.stats.reconnects >= 1


def test_reconnect_after_dropped_connections(target):
    with Controller.connect(cfg(target, io_queues=2, reconnect_delay=0.2)) as c:
        c.write(0, b"r" * 8192)
        old = c.cntlid
        assert target.faults.drop_connections() >= 3
        with pytest.raises(DeviceUnavailable):
            for _ in range(100):  # the loss is noticed within a few ms
                c.read(0, 8192)
                time.sleep(0.01)
        _wait_connected(c)
        assert c.read(0, 8192) == b"r" * 8192
        assert c.cntlid != old and c.stats.connection_losses >= 1


def test_a_late_failure_of_an_old_queue_is_not_a_new_loss(target):
    """Regression (seen in CI under load): a torn-down queue's reader reporting its end after the reconnect tore the
    fresh association down, and the next read failed."""
    with Controller.connect(cfg(target, io_queues=2, reconnect_delay=0.2)) as c:
        c.write(0, b"q" * 4096)
        old = [c._admin, *c._io]
        c.reconnect()
        for q in old:
            c._queue_failed(q, NvmeTransportError("connection closed by the target"))
        assert c.connected and c.stats.connection_losses == 0
        assert c.read(0, 4096) == b"q" * 4096


def test_keep_alive_keeps_an_idle_association(target):
    with Controller.connect(cfg(target, io_queues=1, kato_ms=1000)) as c:
        time.sleep(2.6)  # > 2 x KATO without I/O: only Keep Alive keeps the controller
        assert c.connected
        assert len(c.read(0, 4096)) == 4096
        assert c.stats.connection_losses == 0


def test_keep_alive_expiry_is_enforced_by_the_target(target):
    c = Controller.connect(cfg(target, io_queues=1, kato_ms=1000, auto_reconnect=False))
    try:
        c._closed = True  # silence the host's keep-alive (simulates a hung host)
        c._wake.set()
        c._house.join(2)
        c._closed = False
        time.sleep(3.0)
        with pytest.raises(DeviceUnavailable):
            c.read(0, 4096)
    finally:
        c.close()


def test_end_to_end_256_mib_mixed_sizes_many_queues(target):
    total = 256 * MiB
    rng = random.Random(1)
    layout, off = [], 0
    while off < total:
        n = min(rng.choice([4096, 16384, 128 * 1024, 192 * 1024, MiB, 4 * MiB]), total - off)
        layout.append((off, n))
        off += n
    data = memoryview(bytearray(os.urandom(total)))
    with Controller.connect(cfg(target, io_queues=8, queue_depth=64)) as c:
        futs = [c.submit_write(o, data[o : o + n]) for o, n in layout]
        for f in futs:
            f.result(120)
        back = memoryview(bytearray(total))
        order = list(layout)
        rng.shuffle(order)
        futs = [c.submit_read(o, back[o : o + n]) for o, n in order]
        for f in futs:
            f.result(120)
        assert hashlib.sha256(back).digest() == hashlib.sha256(data).digest()
        assert sum(q.commands for q in c._io) > len(layout)  # large ones were split


def test_target_process_restart_is_survived(tmp_path: Path):
    """A real target process dies and comes back on the same port and backing file: the client reconnects."""
    port = _free_port()
    backing = tmp_path / "ns.img"
    cmd = [sys.executable, "-m", "adp_emulator", "serve", "--port", str(port), "--nqn", NQN, "--capacity", "64M",
           "--backing", str(backing)]

    def start() -> subprocess.Popen:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None and p.stdout.readline().startswith("ADP-EMULATOR READY")
        return p

    p = start()
    try:
        with Controller.connect(HostConfig(traddr="127.0.0.1", trsvcid=port, subnqn=NQN, io_queues=2,
                                           reconnect_delay=0.2)) as c:
            c.write(0, b"p" * 65536)
            c.flush()
            p.kill()
            p.wait()
            with pytest.raises(DeviceUnavailable):
                for _ in range(200):
                    c.read(0, 4096)
                    time.sleep(0.01)
            p = start()
            _wait_connected(c, 15)
            assert c.read(0, 65536) == b"p" * 65536
    finally:
        p.kill()
        p.wait()


def _wait_connected(c: Controller, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if c.connected:
            return
        time.sleep(0.05)
    raise AssertionError(f"controller did not reconnect within {timeout} s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
