"""`testbed up / status / down` with the userspace backend: the happy path and every clear-message case."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from adp_connector.nvmeof.host import Controller, HostConfig
from adp_testbed import state as S
from adp_testbed.cli import main
from adp_testbed.sizes import format_size, parse_size


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def sd(tmp_path: Path):
    d = str(tmp_path / "state")
    yield d
    main(["--state-dir", d, "down"])


def test_up_status_down(sd: str, capsys: pytest.CaptureFixture[str]) -> None:
    port = _free_port()
    assert main(["--state-dir", sd, "up", "--port", str(port), "--capacity", "64M", "--mdts", "64K"]) == 0
    assert f"127.0.0.1:{port}" in capsys.readouterr().out
    assert main(["--state-dir", sd, "status", "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    for key in ("backend", "traddr", "trsvcid", "subnqn", "mgmt_url", "hosted", "running"):
        assert key in st
    assert (st["backend"], st["traddr"], st["trsvcid"], st["hosted"], st["running"]) == ("user", "127.0.0.1", port,
                                                                                       "host", True)
    # The target really serves NVMe/TCP with the asked geometry.
    with Controller.connect(HostConfig(traddr="127.0.0.1", trsvcid=port, subnqn=st["subnqn"], io_queues=1)) as c:
        assert c.capacity_bytes == 64 << 20 and c.mdts_bytes == 64 << 10
        c.write(0, b"x" * 4096)
    assert main(["--state-dir", sd, "down"]) == 0
    assert "stopped" in capsys.readouterr().out
    assert not S.pid_alive(st["pid"])
    assert main(["--state-dir", sd, "status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["running"] is False
    assert main(["--state-dir", sd, "down"]) == 0
    assert "no target is up" in capsys.readouterr().out


def test_starting_twice_is_refused(sd: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--state-dir", sd, "up", "--port", "0", "--capacity", "16M"]) == 0
    capsys.readouterr()
    assert main(["--state-dir", sd, "up", "--port", "0", "--capacity", "16M"]) == 2
    err = capsys.readouterr().err
    assert "already up" in err and "testbed down" in err


def test_busy_port_is_a_clear_error(sd: str, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["--state-dir", sd, "up", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"port {port}" in err and "busy" in err and "--port" in err
    assert S.load(Path(sd)) is None  # nothing recorded


def test_stale_state_is_replaced(sd: str, capsys: pytest.CaptureFixture[str]) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    S.save(S.state_dir(sd), S.TargetState("user", "127.0.0.1", 1, "nqn.x", dead.pid, "host"))
    assert main(["--state-dir", sd, "status"]) == 1
    assert "NOT running" in capsys.readouterr().out
    assert main(["--state-dir", sd, "up", "--port", "0", "--capacity", "16M"]) == 0
    assert "stale" in capsys.readouterr().err
    assert S.load(Path(sd)).pid != dead.pid


def test_unreadable_state_file(sd: str, capsys: pytest.CaptureFixture[str]) -> None:
    S.state_path(S.state_dir(sd)).write_text("{not json")
    assert main(["--state-dir", sd, "status"]) == 2
    assert "unreadable" in capsys.readouterr().err
    assert main(["--state-dir", sd, "down", "--force"]) == 0
    assert S.load(Path(sd)) is None


def test_bad_arguments_are_rejected(sd: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--state-dir", sd, "up", "--capacity", "lots"])
    assert e.value.code == 2
    assert "not a size" in capsys.readouterr().err
    assert main(["--state-dir", sd, "up", "--port", "0", "--mdts", "3000"]) == 2
    assert "mdts" in capsys.readouterr().err.lower()


def test_target_that_dies_at_start_reports_its_log(sd: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"subsystems": 5}')
    assert main(["--state-dir", sd, "up", "--port", "0", "--config", str(bad)]) == 2
    assert "exited with status" in capsys.readouterr().err


def test_sizes() -> None:
    assert parse_size("128K") == 131072 and parse_size("1G") == 1 << 30 and parse_size("64KiB") == 65536
    assert parse_size("1.5M") == 3 << 19 and parse_size(4096) == 4096
    assert format_size(131072) == "128K" and format_size(4097) == "4097"


def test_datapath_demo_end_to_end(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`testbed demo --datapath`: target, discovery, 64 MiB mixed-size round trip, target restart, re-read."""
    out = tmp_path / "demo.json"
    assert main(["demo", "--datapath", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "RESULT: PASS" in text
    r = json.loads(out.read_text())
    assert r["identical"] and r["identical_after_restart"] and r["commands"] > r["requests"]


def test_bench_datapath_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "dp.json"
    assert main(["bench", "datapath", "--sizes", "128K", "--queues", "1", "--depths", "2", "--ops", "read,write",
                 "--seconds", "0.2", "--working-set", "16M", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["op"] for r in rows} == {"read", "write"}
    assert all(r["gbps"] > 0 and r["ceiling_gbps"] > 0 and r["ratio"] > 0 for r in rows)
    # CPU per GB of the client, the local target and both ends of the ceiling, all measured in the run
    assert all(r["processes"] == 1 and r["client_cpu_s_per_gb"] > 0 and r["target_cpu_s_per_gb"] > 0
               and r["ceiling_receiver_cpu_s_per_gb"] > 0 and r["ceiling_sender_cpu_s_per_gb"] > 0 for r in rows)


def test_bench_datapath_client_processes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--processes 2`: two client processes with their own controllers run each point together (the connector's
    load_processes); the ceiling has processes x queues streams; the client CPU is the processes' own."""
    out = tmp_path / "dp.json"
    assert main(["bench", "datapath", "--sizes", "128K", "--queues", "1", "--depths", "2", "--ops", "read",
                 "--seconds", "0.3", "--working-set", "16M", "--processes", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["processes"] for r in rows] == [2]
    r = rows[0]
    assert r["bytes"] > 0 and r["client_cpu_s_per_gb"] > 0 and r["target_cpu_s_per_gb"] > 0
    assert "p=2 q=1" in capsys.readouterr().out


def test_stream_ceiling_reports_both_ends_cpu() -> None:
    """The loopback ceiling's CPU: each end's core-seconds are positive and no more than its threads could spend
    in the elapsed time (a per-process counter read from the wrong process, or wall time, would break either)."""
    from adp_testbed.bench.stream import StreamServer

    with StreamServer() as s:
        r = s.measure_cpu(2, 1 << 30, 1 << 20, "read")  # long enough for clock-tick CPU counts
        w = s.measure_cpu(2, 1 << 30, 1 << 20, "write")
    for got in (r, w):
        assert got.bytes == 1 << 30 and got.gbps > 0
        assert 0 < got.receiver_cpu_s <= 2 * got.seconds + 0.05 and 0 < got.sender_cpu_s <= 3 * got.seconds + 0.05
        assert got.as_row()["ceiling_receiver_cpu_s_per_gb"] == round(got.receiver_cpu_s_per_gb, 3)


def test_stream_landing_fills_each_streams_share_in_order() -> None:
    """Receivers given a region to land in (as restores land pages across staging) write their bytes one after another
    across their own share of it and report the same fields. The control: a stream that moves less than its share
    leaves the rest of it untouched (the bytes went where the order says, not into one reused buffer). A region under
    one chunk per stream, or one for writes, is refused before any stream runs."""
    from adp_testbed.bench.stream import StreamServer

    mib = 1 << 20
    with StreamServer() as s:
        whole = bytearray(8 * mib)  # two streams: 4 MiB each, 64 MiB moved by each, so every byte is written
        got = s.measure_cpu(2, 128 * mib, mib, "read", land=memoryview(whole))
        assert got.bytes == 128 * mib and got.gbps > 0 and 0 < got.receiver_cpu_s <= 2 * got.seconds + 0.05
        assert set(got.as_row("landing_")) == {"landing_gbps", "landing_receiver_cpu_s_per_gb",
                                               "landing_sender_cpu_s_per_gb"}
        assert whole.count(0xA5) == len(whole), f"first byte not landed: {whole.find(bytes(1))}"
        part = bytearray(16 * mib)  # two streams of 3 MiB: each fills the first 3 of its 8 MiB
        s.measure_cpu(2, 6 * mib, mib, "read", land=memoryview(part))
        for i in range(2):
            share = part[i * 8 * mib:(i + 1) * 8 * mib]
            assert share[:3 * mib].count(0xA5) == 3 * mib and share[3 * mib:].count(0) == 5 * mib
        for bad in ({"land": memoryview(bytearray(mib + 1))}, {"land": memoryview(whole), "mode": "write"}):
            with pytest.raises(ValueError, match="land needs"):
                s.measure_cpu(2, 128 * mib, mib, **bad)  # type: ignore[arg-type]


def test_stream_landing_short_receives_fill_the_whole_share() -> None:
    """A socket that returns short receives (as a busy host's does) still fills every byte of the share, the tail
    under one chunk included (CI once saw it left unwritten), and a stream without ``advance`` reuses the start."""
    from adp_testbed.bench.stream import receive

    class ShortReads:  # hands out 0xA5 in receives of at most 300 KiB
        def __init__(self, total: int) -> None:
            self.left = total

        def recv_into(self, view: memoryview) -> int:
            n = min(len(view), 300 << 10, self.left)
            view[:n] = b"\xa5" * n
            self.left -= n
            return n

    mib = 1 << 20
    share = bytearray(4 * mib)
    receive(ShortReads(16 * mib), memoryview(share), 16 * mib, mib, True)  # type: ignore[arg-type]
    assert share.count(0xA5) == len(share), f"first byte not landed: {share.find(bytes(1))}"
    same = bytearray(4 * mib)
    receive(ShortReads(16 * mib), memoryview(same), 16 * mib, mib, False)  # type: ignore[arg-type]
    assert same[:300 << 10].count(0xA5) == 300 << 10 and same[300 << 10:].count(0) == len(same) - (300 << 10)
    with pytest.raises(ConnectionError, match="closed early"):
        receive(ShortReads(mib), memoryview(share), 2 * mib, mib, True)  # type: ignore[arg-type]


def test_state_dir_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADP_KV_STATE_DIR", str(tmp_path / "env-state"))
    assert S.state_dir() == tmp_path / "env-state" and os.path.isdir(tmp_path / "env-state")


