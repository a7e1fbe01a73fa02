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


def test_bench_restore_path_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Pages saved once, restored through one helper and through a group of two, against a target in one
    process and one with an I/O worker: every point restores every page (a failure raises) and reports CPU."""
    pytest.importorskip("torch", reason="the restore pipeline stages through torch tensors (run with .venv-vllm)")
    out = tmp_path / "rp.json"
    assert main(["bench", "restore-path", "--gb", "0.04", "--page-size", "256K", "--batch-mb", "2", "--slabs", "4",
                 "--helpers", "1,2", "--queues", "2", "--target-workers", "0,1", "--mdts", "128K",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["target_workers"], r["helpers"]) for r in rows] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert all(r["gbps"] > 0 and r["ratio"] > 0 and r["helpers_cpu_s"] > 0 and r["bytes"] >= 40_000_000 - (256 << 10)
               for r in rows)
    assert all(r["helpers_cpu_s_per_gb"] > 0 and r["ceiling_receiver_cpu_s_per_gb"] > 0
               and r["ceiling_sender_cpu_s_per_gb"] > 0 for r in rows)
    # user + system is the total (rounding aside), each part measured: a helper both copies and computes
    assert all(abs(r["helpers_user_s_per_gb"] + r["helpers_sys_s_per_gb"] - r["helpers_cpu_s_per_gb"]) < 0.01
               and r["helpers_user_s_per_gb"] > 0 and r["helpers_sys_s_per_gb"] >= 0 for r in rows)
    # by thread role (clock ticks of 10 ms: a 40 MB restore may show zeros): every helper has queue receive loops
    # and a main thread, and the roles never add up to more than the helpers' own total
    for r in rows:
        roles = r["helpers_by_thread_s_per_gb"]
        assert {"rx", "tx", "main"} <= set(roles) and all(v >= 0 for d in roles.values() for v in d.values()), roles
        assert sum(v for d in roles.values() for v in d.values()) <= r["helpers_cpu_s_per_gb"] + 0.6, r
    assert "restore" in capsys.readouterr().out


def test_bench_restore_path_compares_save_processes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The save phase runs once per writer count: every page written at every point, spread over every writer
    (W=2: both hold pages; the W=1 control: one), reported with GB/s and CPU; a bad count is refused."""
    pytest.importorskip("torch", reason="the restore pipeline stages through torch tensors (run with .venv-vllm)")
    out = tmp_path / "rp.json"
    assert main(["bench", "restore-path", "--gb", "0.04", "--page-size", "256K", "--batch-mb", "2", "--slabs", "4",
                 "--helpers", "1", "--save-processes", "1,2", "--queues", "2", "--mdts", "128K",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    saves = rows[0]["saves"]
    n = rows[0]["bytes"] // (256 << 10)
    assert [s["save_processes"] for s in saves] == [1, 2] and saves[0]["vs_first"] == 1.0
    assert [len(s["pages_per_writer"]) for s in saves] == [1, 2]
    assert all(sum(s["pages_per_writer"]) == n and min(s["pages_per_writer"]) > 0 for s in saves)
    assert all(s["gbps"] > 0 and s["writers_cpu_s"] > 0 for s in saves)
    assert "save processes 2" in capsys.readouterr().out
    assert main(["bench", "restore-path", "--gb", "0.01", "--save-processes", "0"]) == 2


def test_bench_restore_path_as_the_connector_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--driver thread`` (the connector's driver thread, restores collected once per step) and ``--restore-gb``
    (restores one after another): every page restored, each restore timed; ``--driver poll`` with one restore is the
    control, whose row says so. Options that cannot apply are refused with one line."""
    pytest.importorskip("torch", reason="the restore pipeline stages through torch tensors (run with .venv-vllm)")
    out = tmp_path / "rp.json"
    args = ["bench", "restore-path", "--gb", "0.02", "--page-size", "256K", "--batch-mb", "1", "--slabs", "4",
            "--helpers", "1", "--queues", "1", "--mdts", "128K"]
    assert main([*args, "--driver", "thread", "--step-ms", "5", "--restore-gb", "0.005", "--json", str(out)]) == 0
    row = json.loads(out.read_text())[0]
    n = row["bytes"] // (256 << 10)
    per = 5_000_000 // (256 << 10)
    assert row["driver"] == "thread" and row["step_s"] == 0.005 and row["restore_bytes"] == per * (256 << 10)
    assert row["restores"] == -(-n // per) and 0 < row["restore_s_mean"] <= row["restore_s_max"] <= row["seconds"]
    assert row["driver_process_cpu_s_per_gb"] is not None and row["driver_process_cpu_s_per_gb"] >= 0
    assert "driver thread, 4 restores of up to 0.00498 GB one after another" in capsys.readouterr().out
    assert main([*args, "--driver", "poll", "--json", str(out)]) == 0
    row = json.loads(out.read_text())[0]
    assert row["driver"] == "poll" and row["restores"] == 1 and row["restore_bytes"] == row["bytes"]
    assert main([*args, "--layers", "4"]) == 2
    assert "use it with --into gpu" in capsys.readouterr().err
    assert main([*args, "--restore-gb", "-1"]) == 2
    assert main([*args, "--into", "gpu", "--layers", "3"]) == 2
    assert "even share per layer" in capsys.readouterr().err


def test_bench_gpu_sink_is_the_attention_layout() -> None:
    """The bench's block tensors (K and V halves per layer) take a page and give the same bytes back, each layer
    holding its share of the page in order, K before V (on the CPU, where the copy goes layer by layer); a page
    scattered to one block leaves the others untouched."""
    torch = pytest.importorskip("torch")
    from adp_testbed.bench.restore import gpu_sink

    kv = gpu_sink(4, 64, 4, device="cpu")
    page = torch.arange(64, dtype=torch.int8).view(1, 64)
    kv.scatter(0, [2], page)
    assert torch.equal(kv.gather(0, [2]), page)
    layer1 = kv.rows[0][1][1]  # (blocks, 2, 8): block-major view of a (2, blocks, 8) tensor
    assert layer1.shape == (4, 2, 8) and not layer1.is_contiguous()
    assert layer1[2, 0].tolist() == list(range(16, 24)) and layer1[2, 1].tolist() == list(range(24, 32))
    assert not kv.gather(0, [0, 1, 3]).any()


def test_state_dir_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADP_KV_STATE_DIR", str(tmp_path / "env-state"))
    assert S.state_dir() == tmp_path / "env-state" and os.path.isdir(tmp_path / "env-state")


def test_bench_restore_path_beside_a_python_load(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--python-load``: each helper count restores alone, then beside a bytecode thread once per switch interval
    (every page restored each time, the load's own rate reported); a bad interval is refused with one line."""
    pytest.importorskip("torch", reason="the restore pipeline stages through torch tensors (run with .venv-vllm)")
    out = tmp_path / "rp.json"
    assert main(["bench", "restore-path", "--gb", "0.02", "--page-size", "256K", "--batch-mb", "2", "--slabs", "4",
                 "--helpers", "1", "--queues", "1", "--mdts", "128K", "--python-load", "0.005,0.0005",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["python_load_switch_interval_s"] for r in rows] == [None, 0.005, 0.0005]
    assert rows[0]["python_load_loops_per_s"] is None and all(r["python_load_loops_per_s"] > 0 for r in rows[1:])
    assert all(r["gbps"] > 0 and r["bytes"] == rows[0]["bytes"] for r in rows)
    assert "beside a Python thread (switch interval 0.5 ms" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["bench", "restore-path", "--python-load", "0.005,0"])
    assert e.value.code == 2
    assert "positive seconds" in capsys.readouterr().err
