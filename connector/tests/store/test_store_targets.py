"""The page store over the real NVMe/TCP client, against both target backends.

``user``: our userspace target (file-backed; a "restart" stops the target and starts a new one over
the same file). ``kernel``: Linux nvmet in a QEMU guest (its namespace lives in guest RAM, so a
"restart" there restarts everything on the host side: store, client and connections).
The core checks of the store's acceptance run on both: round trips, restart persistence, a
200k-token chain with multi-MiB pages at a 64 KiB transfer limit, and two engines sharing one namespace.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from store_testutil import fast_config

from adp_connector.nvmeof.host import Controller, HostConfig
from adp_connector.store import KeyNamespace, PageStore, StoreConfig

target_mod = pytest.importorskip("adp_emulator.target", reason="the userspace target package is not installed")

NQN = "nqn.2026-11.io.awide:store-targets"
MiB = 1 << 20
MDTS = 64 << 10


class Backend:
    """One running target of either kind; ``connect()`` gives a fresh client (a new engine process)."""

    def __init__(self, kind: str, workdir: Path) -> None:
        self.kind = kind
        self.workdir = workdir
        self._user = None
        self._kernel = None
        self.capacity = 0
        self.start()

    def start(self) -> None:
        if self.kind == "user":
            self.capacity = 512 * MiB
            self._user = target_mod.UserspaceTarget(target_mod.TargetSettings(
                port=0, subnqn=NQN, capacity_bytes=self.capacity, mdts_bytes=MDTS,
                backing_path=str(self.workdir / "ns.img")))
            self._user.start()
            self.addr = self._user.address
        else:
            from adp_emulator.config import default_config
            from adp_emulator.kernel import KernelTarget

            cfg = default_config(nqn=NQN)
            cfg.adp.capacity_bytes = 256 * MiB
            self._kernel = KernelTarget(cfg, self.workdir / "kernel", host_port=0)
            info = self._kernel.start(timeout=60)
            self.addr = (info["traddr"], int(info["trsvcid"]))
            self.capacity = 256 * MiB

    def restart(self) -> None:
        """Userspace: a new target process object over the same backing file. Kernel: nothing (see module doc)."""
        if self._user is not None:
            self._user.stop()
            self.start()

    def config(self, **kw: object) -> StoreConfig:
        """The tests' store config for this backend. A segment claim retries any attempt slower than half its
        settle time (the race argument needs the write and the read-back inside it); the kernel target runs under
        QEMU (TCG where the host has no KVM) and reads its tables slower than the 5 ms of ``fast_config``'s settle,
        so every attempt would be retried and the saves fail ``no_space``. It gets the store's default settle."""
        if self.kind == "kernel":
            kw.setdefault("claim_settle_s", 0.25)
        return fast_config(**kw)

    def connect(self) -> Controller:
        host, port = self.addr
        return Controller.connect(HostConfig(traddr=host, trsvcid=port, subnqn=NQN, io_queues=3, queue_depth=32,
                                             max_transfer_bytes=MDTS, command_timeout=60))

    def stop(self) -> None:
        if self._user is not None:
            self._user.stop()
        if self._kernel is not None:
            self._kernel.stop()


@pytest.fixture(scope="module", params=["user", pytest.param("kernel", marks=pytest.mark.kernel)])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    if request.param == "kernel" and not os.environ.get("CI"):
        import shutil

        if shutil.which("qemu-system-x86_64") is None:
            pytest.skip("qemu-system-x86_64 is not installed (scripts/install-kernel-deps.sh installs it)")
    with tempfile.TemporaryDirectory(prefix="adp-store-") as d:
        b = Backend(request.param, Path(d))
        try:
            yield b
        finally:
            b.stop()


def _fresh(backend: Backend, **cfg) -> tuple[Controller, PageStore]:
    ctrl = backend.connect()
    return ctrl, PageStore(ctrl, backend.config(**cfg))


def test_round_trip_and_restart(backend: Backend) -> None:
    ctrl = backend.connect()
    PageStore.format(ctrl, partitions=4)
    store = PageStore(ctrl, backend.config(writer_id=b"engine-A-rank-00"))
    ns = KeyNamespace("round-trip", "bfloat16", "LBHNC", 16)
    keys = ns.chain_tokens(list(range(16 * 12)))
    sizes = [1, 4095, 4096, 4097, 65536, MDTS + 1, 200_000, 1 * MiB + 3, 2 * MiB, 3 * MiB + 17, 777, 5 * MiB]
    pages = [os.urandom(n) for n in sizes]
    assert all(r.ok for r in store.save_batch(keys, pages).wait(120))
    outs = [bytearray(n) for n in sizes]
    assert store.load_batch(keys, outs).ok_count(120) == len(keys)
    assert [bytes(o) for o in outs] == pages
    store.close()
    ctrl.close()

    backend.restart()
    ctrl, s2 = _fresh(backend, writer=False)
    assert s2.lookup(keys) == len(keys)
    outs = [bytearray(n) for n in sizes]
    assert s2.load_batch(keys, outs).ok_count(120) == len(keys)
    assert [bytes(o) for o in outs] == pages
    assert s2.stats.verify_failures == 0
    s2.close()
    ctrl.close()


def test_200k_token_chain_multi_mib_pages(backend: Backend) -> None:
    ctrl = backend.connect()
    PageStore.format(ctrl, partitions=2, avg_page_bytes=64 << 10)
    bs = 256
    tokens = [(i * 2654435761) % 151_000 for i in range(782 * bs)]  # 200,192 tokens
    attn = KeyNamespace("hybrid-200k", "bfloat16", "BLHNC", bs, group_id=0)
    ka, km = attn.chain_tokens(tokens), attn.with_group(1).chain_tokens(tokens)
    s = PageStore(ctrl, backend.config(window_bytes=16 << 20))
    pages = {k: os.urandom(64) * 625 for k in ka}  # 40,000-byte attention pages
    state = {km[i]: os.urandom(3 * MiB + 12_345) for i in [*range(0, 782, 100), 781]}  # multi-MiB state
    pages.update(state)
    assert all(r.ok for r in s.save_batch(list(pages), list(pages.values())).wait(300))
    s.close()
    ctrl.close()
    backend.restart()
    ctrl, s2 = _fresh(backend, writer=False)
    assert s2.lookup(ka) == 782 and all(s2.contains(list(state)))
    outs = [bytearray(len(v)) for v in pages.values()]
    assert s2.load_batch(list(pages), outs).ok_count(300) == len(pages)
    assert all(bytes(o) == v for o, v in zip(outs, pages.values(), strict=True))
    assert ctrl.max_transfer_bytes == MDTS  # every command was split at 64 KiB (the target enforces MDTS too)
    s2.close()
    ctrl.close()


def test_two_engines_share_one_namespace(backend: Backend) -> None:
    c1, c2 = backend.connect(), backend.connect()
    PageStore.format(c1, partitions=4)
    a = PageStore(c1, backend.config(writer_id=b"engine-A-rank-00"))
    b = PageStore(c2, backend.config(writer_id=b"engine-B-rank-00"))
    assert a.partition != b.partition
    ns = KeyNamespace("shared", "bfloat16", "LBHNC", 16)
    ka, kb = ns.chain_tokens(list(range(160))), ns.chain_tokens(list(range(1000, 1160)))
    da, db = [os.urandom(70_000) for _ in ka], [os.urandom(70_000) for _ in kb]
    ha, hb = a.save_batch(ka, da), b.save_batch(kb, db)
    assert all(r.ok for r in ha.wait(120)) and all(r.ok for r in hb.wait(120))
    a.refresh()
    b.refresh()
    assert a.lookup(kb) == len(kb) and b.lookup(ka) == len(ka)
    outs = [bytearray(70_000) for _ in kb]
    assert a.load_batch(kb, outs).ok_count(120) == len(kb)
    assert [bytes(o) for o in outs] == db
    for s, c in ((a, c1), (b, c2)):
        s.close()
        c.close()
