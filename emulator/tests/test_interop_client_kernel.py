"""Interop: our host client (adp_connector.nvmeof.host) against the Linux kernel target nvmet.

One QEMU guest per module (``kernel_target`` fixture). nvmet grants MAXH2CDATA 4 MiB, reports MDTS 0 (no
limit; our client then splits at 1 MiB unless ``max_transfer_bytes`` says otherwise), IOCCSZ 1028 (16 KiB
in-capsule), 4096-byte LBAs and a 256 MiB namespace. The sizes below sit below, at and above each of
those limits. Only the loopback port forward is used; the guest's own address is never contacted.
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from adp_connector.nvmeof.host import Controller, HostConfig, NvmeStatusError, TcpTransport

pytestmark = pytest.mark.kernel

NQN = "nqn.2026-11.io.awide:adp-kv"
CAPACITY = 256 << 20
KiB, MiB = 1 << 10, 1 << 20

SIZES = {
    "4KiB": 4 * KiB,
    "16KiB_in_capsule_limit": 16 * KiB,
    "20KiB_first_r2t": 16 * KiB + 4 * KiB,
    "1MiB_client_cap": 1 * MiB,
    "1MiB+4KiB": 1 * MiB + 4 * KiB,
    "4MiB_maxh2cdata": 4 * MiB,
    "4MiB+4KiB": 4 * MiB + 4 * KiB,
    "9MiB": 9 * MiB,
}


def pattern(seed: str, n: int) -> bytes:
    """``n`` deterministic, non-repeating bytes."""
    block = hashlib.sha256(seed.encode()).digest() * 128  # 4 KiB
    out = bytearray(n)
    for off in range(0, n, 4096):
        chunk = hashlib.sha256(block[:32] + off.to_bytes(8, "little")).digest() * 128
        out[off : off + 4096] = chunk[: min(4096, n - off)]
    return bytes(out)


@pytest.fixture(scope="module")
def kernel_target(guest_image: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One nvmet guest for the whole module: the ``start()`` info dict."""
    from adp_emulator.config import default_config
    from adp_emulator.kernel import KernelTarget

    cfg = default_config(nqn=NQN)
    cfg.adp.capacity_bytes = CAPACITY
    t = KernelTarget(cfg, tmp_path_factory.mktemp("kt-interop"), host_port=0, image=guest_image,
                     guest_capacity_bytes=CAPACITY)
    try:
        yield t.start(timeout=60)
    finally:
        t.stop()


def config(target: dict[str, Any], **kw: Any) -> HostConfig:
    base: dict[str, Any] = {"traddr": "127.0.0.1", "trsvcid": int(target["trsvcid"]), "subnqn": NQN,
                            "io_queues": 4, "queue_depth": 32, "command_timeout": 60}
    base.update(kw)
    return HostConfig(**base)


@pytest.fixture(scope="module")
def ctrl(kernel_target: dict[str, Any]) -> Iterator[Controller]:
    c = Controller.connect(config(kernel_target))
    yield c
    c.close()


def roundtrip(c: Controller, offset: int, data: bytes) -> None:
    c.write(offset, data)
    assert c.read(offset, len(data)) == data


# ---------------------------------------------------------------------------------------------


def test_connect_and_identify(ctrl: Controller, kernel_target: dict[str, Any]) -> None:
    assert kernel_target["traddr"] == "127.0.0.1" and kernel_target["hosted"] in ("vm", "host")
    idc = ctrl.identify
    assert idc is not None and ctrl.namespace is not None
    assert idc.subnqn == NQN and idc.cntlid == ctrl.cntlid
    assert idc.mdts == 0 and ctrl.mdts_bytes is None
    assert idc.ioccsz == 1028 and idc.in_capsule_data_size == 16 * KiB
    assert idc.sgls & 0x3 == 1 and idc.icdoff == 0 and idc.kas > 0
    assert idc.oncs & 0x0C == 0x0C  # DSM + Write Zeroes
    assert ctrl.lba_size == 4096 and ctrl.capacity_bytes == CAPACITY
    assert ctrl.max_transfer_bytes == 1 * MiB  # MDTS 0 -> client default cap
    assert len(ctrl._io) == 4
    assert ctrl.active_namespaces() == [1]


def test_discovery_keeps_loopback_address(kernel_target: dict[str, Any]) -> None:
    """subnqn=None: the NQN comes from nvmet's discovery log; the address stays 127.0.0.1 (the log says 10.0.2.15)."""
    cfg = config(kernel_target, subnqn=None, io_queues=1)
    with Controller.connect(cfg) as c:
        assert cfg.subnqn == NQN and cfg.traddr == "127.0.0.1"
        assert c.identify is not None and c.identify.subnqn == NQN


@pytest.mark.parametrize("size", list(SIZES.values()), ids=list(SIZES))
def test_write_read_sizes(ctrl: Controller, size: int) -> None:
    # each size gets its own 16 MiB-aligned region so the tests are independent
    offset = list(SIZES.values()).index(size) * 16 * MiB
    roundtrip(ctrl, offset, pattern(f"size-{size}", size))


def test_unaligned_offsets_across_limits(ctrl: Controller) -> None:
    """Transfers that start mid-way and straddle the 1 MiB split points."""
    data = pattern("straddle", 3 * MiB + 12 * KiB)
    roundtrip(ctrl, 130 * MiB + 1020 * KiB, data)


@pytest.mark.parametrize("cap", [16 * KiB, 512 * KiB, 1 * MiB])
def test_max_transfer_bytes_below_default(kernel_target: dict[str, Any], cap: int) -> None:
    with Controller.connect(config(kernel_target, io_queues=2, max_transfer_bytes=cap)) as c:
        assert c.max_transfer_bytes == cap
        data = pattern(f"cap-{cap}", 2 * MiB + 4 * KiB)
        roundtrip(c, 140 * MiB, data)
        assert c.stats.commands == 2 * -(-len(data) // cap)


def test_max_transfer_bytes_above_default(kernel_target: dict[str, Any]) -> None:
    """nvmet reports no MDTS: an explicit cap above the 1 MiB default is honoured (4 MiB = one H2CData PDU)."""
    cap = 4 * MiB
    with Controller.connect(config(kernel_target, io_queues=2, max_transfer_bytes=cap)) as c:
        assert c.max_transfer_bytes == cap
        data = pattern(f"cap-{cap}", 9 * MiB)
        roundtrip(c, 150 * MiB, data)
        assert c.stats.commands == 2 * -(-len(data) // cap)


def test_nvmet_refuses_single_commands_above_4_mib(kernel_target: dict[str, Any]) -> None:
    """Measured: Linux 6.1 nvmet answers an 8 MiB command with SGL Data Block Invalid although it reports
    MDTS 0 (the Linux host never sends more than 4 MiB per command). The client reports the status by name."""
    with Controller.connect(config(kernel_target, io_queues=1, max_transfer_bytes=8 * MiB)) as c:
        with pytest.raises(NvmeStatusError, match="SGL_DATA_BLOCK_INVALID"):
            c.write(150 * MiB, pattern("too-big", 8 * MiB))
        data = pattern("after", 64 * KiB)  # the association is unaffected
        roundtrip(c, 150 * MiB, data)


def test_concurrent_io_on_several_queues(ctrl: Controller) -> None:
    before = [q.commands for q in ctrl._io]
    errors: list[BaseException] = []
    region = 170 * MiB

    def worker(i: int) -> None:
        try:
            base = region + i * 4 * MiB
            futs = []
            blobs = [pattern(f"w{i}-{j}", 256 * KiB) for j in range(8)]
            for j, b in enumerate(blobs):
                futs.append(ctrl.submit_write(base + j * 256 * KiB, b))
            for f in futs:
                f.result(60)
            bufs = [bytearray(256 * KiB) for _ in blobs]
            rfuts = [ctrl.submit_read(base + j * 256 * KiB, memoryview(buf)) for j, buf in enumerate(bufs)]
            for f in rfuts:
                f.result(60)
            assert [bytes(b) for b in bufs] == blobs
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    used = [q.commands - b for q, b in zip(ctrl._io, before, strict=True)]
    assert all(n > 0 for n in used), f"commands per queue: {used}"
    assert max(q.max_in_flight for q in ctrl._io) > 1


def test_keep_alive_across_idle_period(kernel_target: dict[str, Any]) -> None:
    """KATO 1 s (nvmet rounds up to whole seconds): idle 3 s; Keep Alive every KATO/2 keeps the controller."""
    with Controller.connect(config(kernel_target, io_queues=1, kato_ms=1000, auto_reconnect=False)) as c:
        cntlid = c.cntlid
        c.write(200 * MiB, pattern("ka", 8 * KiB))
        time.sleep(3.0)
        assert c.connected and c.stats.connection_losses == 0 and c.stats.reconnects == 0
        assert c.read(200 * MiB, 8 * KiB) == pattern("ka", 8 * KiB)
        assert c.cntlid == cntlid
        assert c.get_features(0x0F) == 1000


def test_without_keep_alive_nvmet_drops_controller(kernel_target: dict[str, Any]) -> None:
    """Negative control for the test above: KATO 1 s and no Keep Alive -> nvmet tears the association down."""
    cfg = config(kernel_target, io_queues=1, kato_ms=1000, auto_reconnect=False)
    c = Controller.connect(cfg)
    try:
        house = c._house
        c._closed = True  # stop the housekeeping thread (and with it Keep Alive) without closing the sockets
        c._wake.set()
        assert house is not None
        house.join(5)
        c._closed = False
        time.sleep(4.0)
        with pytest.raises(Exception):  # noqa: B017  (transport error or unavailable: the socket was shut)
            c.read(200 * MiB, 4096, timeout=5)
    finally:
        c.close()


@pytest.mark.parametrize("size", [4 * KiB, 16 * KiB, 20 * KiB, 4 * MiB + 4 * KiB], ids=["4K", "16K", "20K", "4M+4K"])
def test_header_and_data_digests(kernel_target: dict[str, Any], size: int) -> None:
    with Controller.connect(config(kernel_target, io_queues=2, hdgst=True, ddgst=True)) as c:
        roundtrip(c, 210 * MiB, pattern(f"dg-{size}", size))
        assert c.stats.connection_losses == 0


def test_flush(ctrl: Controller) -> None:
    assert ctrl.identify is not None and ctrl.identify.vwc & 1
    ctrl.write(220 * MiB, pattern("fl", 64 * KiB))
    ctrl.flush()


def test_deallocate_reads_zeroes(ctrl: Controller) -> None:
    """ONCS bit 2: nvmet punches a hole in its file; deallocated blocks read back as zeroes."""
    ctrl.write(224 * MiB, pattern("dsm", 64 * KiB))
    ctrl.deallocate(224 * MiB + 16 * KiB, 32 * KiB)
    got = ctrl.read(224 * MiB, 64 * KiB)
    want = pattern("dsm", 64 * KiB)
    assert got[: 16 * KiB] == want[: 16 * KiB]
    assert got[16 * KiB : 48 * KiB] == bytes(32 * KiB)
    assert got[48 * KiB :] == want[48 * KiB :]


@pytest.mark.parametrize("deallocate", [False, True], ids=["plain", "deac"])
def test_write_zeroes(ctrl: Controller, deallocate: bool) -> None:
    """ONCS bit 3 is advertised, but the guest's namespace is a tmpfs file and tmpfs has no FALLOC_FL_ZERO_RANGE:
    nvmet answers SCT 1 / SC 0x83 (-EOPNOTSUPP). On a disk-backed nvmet it succeeds; accept exactly these two."""
    off = 228 * MiB + (64 * KiB if deallocate else 0)
    ctrl.write(off, pattern("wz", 32 * KiB))
    try:
        ctrl.write_zeroes(off, 32 * KiB, deallocate=deallocate)
    except NvmeStatusError as e:
        assert (e.status.sct, e.status.sc) == (1, 0x83), e.status
        assert ctrl.read(off, 32 * KiB) == pattern("wz", 32 * KiB)
    else:
        assert ctrl.read(off, 32 * KiB) == bytes(32 * KiB)


def test_out_of_range_is_refused_client_side(ctrl: Controller) -> None:
    with pytest.raises(ValueError):
        ctrl.read(CAPACITY - 4096, 8192)


def test_reconnect_keeps_data(kernel_target: dict[str, Any]) -> None:
    with Controller.connect(config(kernel_target, io_queues=2)) as c:
        data = os.urandom(64 * KiB)
        c.write(232 * MiB, data)
        old = c.cntlid
        c.reconnect()
        assert c.cntlid != old
        assert c.read(232 * MiB, len(data)) == data


class _SlowTransport(TcpTransport):
    """TCP with 100 ms per connection set-up: establishing spans several 50 ms housekeeping ticks."""

    def connect(self, traddr: str, trsvcid: int, timeout: float) -> socket.socket:
        time.sleep(0.1)
        return super().connect(traddr, trsvcid, timeout)


def test_reconnect_with_slow_connect_keeps_association(kernel_target: dict[str, Any]) -> None:
    """Deterministic form of the reconnect race: the housekeeping thread must not tear down the association
    that ``reconnect()`` has just established."""
    with Controller.connect(config(kernel_target, io_queues=2, transport=_SlowTransport())) as c:
        data = os.urandom(64 * KiB)
        c.write(236 * MiB, data)
        c.reconnect()
        assert c.read(236 * MiB, len(data)) == data
        assert c.stats.reconnects == 1
