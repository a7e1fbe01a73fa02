"""Structure-aware fuzzing of the userspace NVMe/TCP target over real loopback sockets.

The generator, the runner and the invariant checks are :mod:`adp_emulator.fuzz` (also driven by
``scripts/fuzz-target``, the long run). Each fuzz input is one TCP connection; the target must answer with
well-formed PDUs and close it within a deadline. After every batch a long-lived "witness" association must still
serve a verified write/read, a fresh association must come up, and the target's thread count and the process RSS
must stay bounded. No ERROR record may be logged by the target.
"""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from adp_emulator.fuzz import (
    WITNESS_LBA,
    FuzzHarness,
    HypothesisSrc,
    RandomSrc,
    Witness,
    gen_input,
    rss_bytes,
    run_input,
)
from adp_emulator.fuzz.generator import LBA
from adp_emulator.fuzz.rawhost import RawQueue, open_admin, open_io
from adp_wire import CapsuleCmd, H2CData, encode_bytes
from adp_wire.constants import IoOpcode, SglId
from adp_wire.sqe import connect_cmd, rw_cmd

# ----------------------------------------------------------------------------------------------------
# Tests

FUZZ_SECONDS = float(os.environ.get("ADP_KV_FUZZ_SECONDS", "12"))
FUZZ_EXAMPLES = int(os.environ.get("ADP_KV_FUZZ_EXAMPLES", "1000"))
BATCH = 25


@pytest.fixture(scope="module")
def harness() -> Iterator[FuzzHarness]:
    h = FuzzHarness()
    yield h
    h.close()


def test_generator_is_deterministic_for_a_seed() -> None:
    w = Witness()
    a = [gen_input(RandomSrc(random.Random(7)), w).chunks for _ in range(1)]
    b = [gen_input(RandomSrc(random.Random(7)), w).chunks for _ in range(1)]
    assert a == b


def test_fuzz_target_hypothesis(harness: FuzzHarness) -> None:
    """Hypothesis-driven inputs for ~FUZZ_SECONDS; invariants after every input and every batch."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    stop_at = time.monotonic() + FUZZ_SECONDS
    stats = {"inputs": 0, "hangs": 0}

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True, print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def one(data: Any) -> None:
        inp = gen_input(HypothesisSrc(data), harness.witness)  # always draw: keeps generation consistent
        if time.monotonic() > stop_at:
            return
        out = run_input(harness.addr, inp)
        stats["inputs"] += 1
        assert not out.hung, f"target neither answered nor closed within the deadline ({inp.stage} {inp.kinds})"
        assert not out.bad_output, out.bad_output
        assert not harness.errors.records, harness.errors.records[:3]
        if stats["inputs"] % BATCH == 0:
            harness.check()

    one()
    harness.check()
    assert stats["inputs"] >= 50, stats


def test_fuzz_target_random_mutational(harness: FuzzHarness) -> None:
    """A quick seeded random pass of the same generator (different distribution than hypothesis)."""
    rng = random.Random(int(os.environ.get("ADP_KV_FUZZ_SEED", "20261101")))
    stop_at = time.monotonic() + FUZZ_SECONDS / 3
    n = 0
    while time.monotonic() < stop_at and n < 5000:
        inp = gen_input(RandomSrc(rng), harness.witness)
        out = run_input(harness.addr, inp)
        n += 1
        assert not out.hung and not out.bad_output, (out, inp.stage, inp.kinds)
        if n % BATCH == 0:
            harness.check()
    harness.check()
    assert n >= 50


def test_other_connections_survive_concurrent_fuzzing(harness: FuzzHarness) -> None:
    """Fuzz from 3 threads while the witness keeps doing verified I/O."""
    stop = threading.Event()
    failures: list[str] = []

    def fuzzer(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(400):
            if stop.is_set():
                return
            out = run_input(harness.addr, gen_input(RandomSrc(rng), harness.witness))
            if out.hung or out.bad_output:
                failures.append(repr(out))

    threads = [threading.Thread(target=fuzzer, args=(s,), daemon=True) for s in (1, 2, 3)]
    for t in threads:
        t.start()
    t_end = time.monotonic() + 4
    rounds = 0
    try:
        while time.monotonic() < t_end:
            harness.witness_rw(harness.io, WITNESS_LBA + 16)
            rounds += 1
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not failures, failures[:3]
    assert rounds > 10
    harness.check()


# ----------------------------------------------------------------------------------------------------
# Regression tests for bugs the fuzzers found (see docs/reliability.md)


def run_regression(fn: Callable[[FuzzHarness], None]) -> None:
    """Run one regression body against a fresh harness (keeps module state clean)."""
    h = FuzzHarness()
    try:
        fn(h)
        h.check()
    finally:
        h.close()


def _bad_digest_write(h: FuzzHarness, in_capsule: bool) -> tuple[int, bytes, bytes]:
    """Store ``old`` at LBA 100, then send a Write of other bytes whose data digest is wrong."""
    old = bytes(range(256)) * 16
    cqe, _ = h.io.cmd(rw_cmd(IoOpcode.WRITE, 1, 100, 1, LBA), old)
    assert cqe.status.ok
    adm = open_admin(h.addr, ddgst=True)
    io = open_io(h.addr, adm.cntlid, qid=2, ddgst=True)
    try:
        sqe = rw_cmd(IoOpcode.WRITE, 1, 100, 1, LBA, in_capsule=in_capsule)
        sqe.cid = 9
        if in_capsule:
            raw = bytearray(encode_bytes(CapsuleCmd(sqe.encode(), b"\xee" * LBA), False, True))
        else:
            io.send_pdu(CapsuleCmd(sqe.encode()))
            r2t = io.recv_pdu()
            raw = bytearray(encode_bytes(H2CData(9, r2t.ttag, 0, b"\xee" * LBA, last=True), False, True))
        raw[-1] ^= 0x01  # wrong data digest
        io.send_raw(bytes(raw))
        while 9 not in io.done:
            io.poll()
        status = io.done[9].status.word
    finally:
        io.close()
        adm.close()
    _, got = h.io.cmd(rw_cmd(IoOpcode.READ, 1, 100, 1, LBA))
    return status, old, got


@pytest.mark.parametrize("in_capsule", [True, False], ids=["in_capsule", "r2t"])
def test_regression_write_with_bad_data_digest_leaves_media_unchanged(in_capsule: bool) -> None:
    """BUG-1: a Write failing its data digest (Transient Transport Error) must not modify the media.

    The target receives Write data straight into the namespace mmap and checks the digest only
    afterwards, so the corrupted bytes are already stored when the command fails (nvmet checks the
    digest before executing the write). Fails until fixed.
    """
    def body(h: FuzzHarness) -> None:
        status, old, got = _bad_digest_write(h, in_capsule)
        assert status != 0, "a Write with a wrong data digest must fail"
        assert got == old, "the failed Write's corrupted payload reached the media"

    run_regression(body)


def test_regression_outstanding_r2t_bounded_on_admin_queue() -> None:
    """BUG-2: more R2T-solicited commands than 65536 on one queue crash the connection (TTAG overflow).

    The admin queue accepts any SQSIZE (up to 65536) and the target keeps up to 2*SQSIZE commands
    waiting for H2CData, each with a 1 KiB buffer (~128 MiB for one connection); the 65537th
    R2T's TTAG overflows the 16-bit field, struct.error escapes into the generic handler
    ("internal error") and the connection is reset without a C2HTermReq. Correct: outstanding
    commands are bounded by SQSIZE (extra ones fail or end the connection with a TermReq), never an
    internal error. Fails until fixed.
    """
    def body(h: FuzzHarness) -> None:
        q = RawQueue(h.addr, timeout=30)
        q.icreq()
        assert q.connect(0, 0x10000).status.ok
        q.enable()
        s = connect_cmd(0, 32)
        s.sgl_id = SglId.TRANSPORT_DATA_BLOCK  # Connect data solicited by R2T, never sent
        blob = bytearray()
        for i in range(0x10000 + 8):
            s.cid = i & 0xFFFF
            blob += encode_bytes(CapsuleCmd(s.encode()))
        rss0 = rss_bytes()
        reader_out: list[BaseException] = []

        def reader() -> None:
            try:
                while True:
                    q.recv_pdu()
            except BaseException as e:
                reader_out.append(e)

        th = threading.Thread(target=reader, daemon=True)
        th.start()
        try:
            q.sock.sendall(bytes(blob))
            q.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        th.join(60)
        q.close()
        errors = list(h.errors.records)
        h.errors.records.clear()
        assert not errors, f"target hit an internal error: {errors[:2]}"
        assert rss_bytes() - rss0 < 64 << 20, "one connection pinned > 64 MiB of pending transfers"

    run_regression(body)
