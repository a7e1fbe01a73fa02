"""Userspace target: read data spliced from the namespace's pages (os.sendfile) against the copying path."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from target_client import RawQueue, open_admin, open_io, running_target

from adp_emulator.target import TargetSettings
from adp_emulator.target import connection as target_connection
from adp_wire.constants import IoOpcode
from adp_wire.sqe import rw_cmd

R, W = IoOpcode.READ, IoOpcode.WRITE


def _blob(n: int, seed: int) -> bytes:
    return bytes((i * 131 + seed * 7 + (i >> 9)) & 0xFF for i in range(n))


@pytest.fixture
def sendfile_calls(monkeypatch):
    """Counts the target's sendfile calls (queues served in this process only)."""
    calls: list[tuple[int, int]] = []
    real = os.sendfile

    def counting(out: int, fd: int, offset: int, count: int) -> int:
        calls.append((offset, count))
        return real(out, fd, offset, count)

    monkeypatch.setattr(target_connection.os, "sendfile", counting)
    return calls


def _write_then_read(address, lba_size: int = 4096, ddgst: bool = False) -> list[tuple[bytes, bytes]]:
    """Writes a few extents (one LBA up to 64 KiB), reads each back; returns (written, read) pairs."""
    a = open_admin(address, ddgst=ddgst)
    io = open_io(address, a.cntlid, ddgst=ddgst)
    pairs = []
    with a, io:
        for i, (slba, nbytes) in enumerate([(0, lba_size), (40, 8 * lba_size), (400, 64 * 1024)]):
            data = _blob(nbytes, i + 1)
            assert io.cmd(rw_cmd(W, 1, slba, nbytes // lba_size, nbytes), data, h2c_chunk=16384)[0].status.ok
            c, back = io.cmd(rw_cmd(R, 1, slba, nbytes // lba_size, nbytes))
            assert c.status.ok
            pairs.append((data, bytes(back)))
    return pairs


@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "io-workers"])
@pytest.mark.parametrize("splice", [True, False], ids=["splice", "copy"])
def test_reads_identical_either_way(workers: int, splice: bool) -> None:
    with running_target(mdts_bytes=64 * 1024, io_workers=workers, splice_reads=splice) as t:
        for data, back in _write_then_read(t.address):
            assert back == data


def test_splice_path_is_taken_and_copy_path_is_not(sendfile_calls) -> None:
    with running_target(mdts_bytes=64 * 1024, splice_reads=True) as t:
        pairs = _write_then_read(t.address)
    assert all(back == data for data, back in pairs)
    # one sendfile per read, at the read's byte offset in the namespace
    assert sorted(sendfile_calls) == [(0, 4096), (40 * 4096, 8 * 4096), (400 * 4096, 64 * 1024)]
    sendfile_calls.clear()
    with running_target(mdts_bytes=64 * 1024, splice_reads=False) as t:
        assert all(back == data for data, back in _write_then_read(t.address))
    assert sendfile_calls == []


def test_file_backing_with_512_byte_blocks(tmp_path, sendfile_calls) -> None:
    with running_target(mdts_bytes=64 * 1024, backing_path=str(tmp_path / "ns.img"), lba_size=512) as t:
        assert all(back == data for data, back in _write_then_read(t.address, lba_size=512))
    assert (40 * 512, 8 * 512) in sendfile_calls


def test_data_digest_and_read_faults_copy(sendfile_calls) -> None:
    """A data digest covers the bytes this process sends, and an injected corruption alters a copy: both copy."""
    with running_target(mdts_bytes=64 * 1024) as t:
        assert all(back == data for data, back in _write_then_read(t.address, ddgst=True))
        assert sendfile_calls == []
        a = open_admin(t.address)
        io = open_io(t.address, a.cntlid)
        with a, io:
            data = _blob(4096, 9)
            assert io.cmd(rw_cmd(W, 1, 7, 1, 4096), data)[0].status.ok
            t.faults.corrupt_next_reads(1)
            assert io.cmd(rw_cmd(R, 1, 7, 1, 4096))[1][0] != data[0]
            assert io.cmd(rw_cmd(R, 1, 7, 1, 4096))[1] == data  # the store itself was never altered
        t.faults.clear()
    assert len(sendfile_calls) == 1  # only the read after the corrupted one was spliced


def test_success_flag_completion_spliced(sendfile_calls) -> None:
    """SQ flow control off: the C2HData carries SUCCESS and no CapsuleResp follows, spliced as well."""
    with running_target(mdts_bytes=64 * 1024) as t:
        a = open_admin(t.address)
        with a, RawQueue(t.address) as io:
            io.icreq()
            assert io.connect(1, 32, cntlid=a.cntlid, cattr=0x4).status.ok
            data = _blob(16384, 3)
            assert io.cmd(rw_cmd(W, 1, 90, 4, 16384), data)[0].status.ok
            c, back = io.cmd(rw_cmd(R, 1, 90, 4, 16384))
            assert c.status.ok and back == data
            assert io.cmd(rw_cmd(R, 1, 90, 1, 4096))[1] == data[:4096]  # the stream stayed in step
    assert len(sendfile_calls) == 2


def test_negative_control_wrong_splice_offset_is_caught(monkeypatch) -> None:
    """The byte comparison above can fail: a splice one block off returns the neighbour's bytes."""
    real = os.sendfile
    monkeypatch.setattr(target_connection.os, "sendfile",
                        lambda out, fd, offset, count: real(out, fd, offset + 4096, count))
    with running_target(mdts_bytes=64 * 1024) as t:
        pairs = _write_then_read(t.address)
    assert any(back != data for data, back in pairs)


def test_setting_is_validated() -> None:
    with pytest.raises(ValueError, match="splice_reads"):
        TargetSettings(splice_reads="yes")  # type: ignore[arg-type]
    assert TargetSettings().splice_reads is True


def test_serve_copy_reads_flag() -> None:
    from adp_emulator.__main__ import _build_parser, _settings

    assert _settings(_build_parser().parse_args(["serve", "--port", "0", "--copy-reads"])).splice_reads is False
    assert _settings(_build_parser().parse_args(["serve", "--port", "0"])).splice_reads is True
