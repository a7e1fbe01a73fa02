"""`testbed bench restore-path`: the connector's restore machinery without vLLM. These tests need torch (the restore
pipeline stages through torch tensors), so scripts/test runs them in the vLLM tier's environment."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adp_testbed.cli import main

pytest.importorskip("torch", reason="the restore pipeline stages through torch tensors (run with .venv-vllm)")


def _rows(tmp_path: Path, *args: str) -> list[dict]:
    """Run ``testbed bench restore-path ARGS`` (it must succeed) and return its JSON rows."""
    out = tmp_path / "rp.json"
    assert main(["bench", "restore-path", *args, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_bench_restore_path_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Pages saved once, restored through one helper and through a group of two, against a target in one
    process and one with an I/O worker: every point restores every page (a failure raises) and reports CPU."""
    rows = _rows(tmp_path, "--gb", "0.04", "--page-size", "256K", "--batch-mb", "2", "--slabs", "4", "--helpers", "1,2",
                 "--queues", "2", "--target-workers", "0,1", "--mdts", "128K")
    assert [(r["target_workers"], r["helpers"]) for r in rows] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert all(r["environment"]["cpu_cores"] >= 1 and r["environment"]["kernel"] for r in rows)  # where it ran
    assert all(r["landing_gbps"] > 0 and r["landing_receiver_cpu_s_per_gb"] > 0 for r in rows)
    assert all(r["gbps"] > 0 and r["ratio"] > 0 and r["helpers_cpu_s"] > 0 and r["bytes"] >= 40_000_000 - (256 << 10)
               for r in rows)
    assert all(r["helpers_cpu_s_per_gb"] > 0 and r["ceiling_receiver_cpu_s_per_gb"] > 0
               and r["ceiling_sender_cpu_s_per_gb"] > 0 for r in rows)
    # user + system is the total (rounding aside); either part may be 0 here: /proc counts 10 ms clock ticks, and
    # a 40 MB restore costs a few of them in all (5 runs: user 0 in 2 of 20 rows)
    assert all(abs(r["helpers_user_s_per_gb"] + r["helpers_sys_s_per_gb"] - r["helpers_cpu_s_per_gb"]) < 0.01
               and r["helpers_user_s_per_gb"] >= 0 and r["helpers_sys_s_per_gb"] >= 0 for r in rows)
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
    rows = _rows(tmp_path, "--gb", "0.04", "--page-size", "256K", "--batch-mb", "2", "--slabs", "4", "--helpers", "1",
                 "--save-processes", "1,2", "--queues", "2", "--mdts", "128K")
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
    args = ["--gb", "0.02", "--page-size", "256K", "--batch-mb", "1", "--slabs", "4", "--helpers", "1", "--queues", "1",
            "--mdts", "128K"]
    row = _rows(tmp_path, *args, "--driver", "thread", "--step-ms", "5", "--restore-gb", "0.005")[0]
    n = row["bytes"] // (256 << 10)
    per = 5_000_000 // (256 << 10)
    assert row["driver"] == "thread" and row["step_s"] == 0.005 and row["restore_bytes"] == per * (256 << 10)
    assert row["restores"] == -(-n // per) and 0 < row["restore_s_mean"] <= row["restore_s_max"] <= row["seconds"]
    assert row["driver_process_cpu_s_per_gb"] is not None and row["driver_process_cpu_s_per_gb"] >= 0
    assert "driver thread, 4 restores of up to 0.00498 GB one after another" in capsys.readouterr().out
    row = _rows(tmp_path, *args, "--driver", "poll")[0]
    assert row["driver"] == "poll" and row["restores"] == 1 and row["restore_bytes"] == row["bytes"]
    assert main(["bench", "restore-path", *args, "--layers", "4"]) == 2
    assert "use it with --into gpu" in capsys.readouterr().err
    assert main(["bench", "restore-path", *args, "--restore-gb", "-1"]) == 2
    assert main(["bench", "restore-path", *args, "--into", "gpu", "--layers", "3"]) == 2
    assert "even share per layer" in capsys.readouterr().err


def test_bench_gpu_sink_is_the_attention_layout() -> None:
    """The bench's block tensors (K and V halves per layer) take a page and give the same bytes back, each layer
    holding its share of the page in order, K before V (on the CPU, where the copy goes layer by layer); a page
    scattered to one block leaves the others untouched."""
    import torch

    from adp_testbed.bench.restore import gpu_sink

    kv = gpu_sink(4, 64, 4, device="cpu")
    page = torch.arange(64, dtype=torch.int8).view(1, 64)
    kv.scatter(0, [2], page)
    assert torch.equal(kv.gather(0, [2]), page)
    layer1 = kv.rows[0][1][1]  # (blocks, 2, 8): block-major view of a (2, blocks, 8) tensor
    assert layer1.shape == (4, 2, 8) and not layer1.is_contiguous()
    assert layer1[2, 0].tolist() == list(range(16, 24)) and layer1[2, 1].tolist() == list(range(24, 32))
    assert not kv.gather(0, [0, 1, 3]).any()


def test_bench_restore_path_beside_a_python_load(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--python-load``: each helper count restores alone, then beside a bytecode thread once per switch interval
    (every page restored each time, the load's own rate reported); a bad interval is refused with one line."""
    rows = _rows(tmp_path, "--gb", "0.02", "--page-size", "256K", "--batch-mb", "2", "--slabs", "4", "--helpers", "1",
                 "--queues", "1", "--mdts", "128K", "--python-load", "0.005,0.0005")
    assert [r["python_load_switch_interval_s"] for r in rows] == [None, 0.005, 0.0005]
    assert rows[0]["python_load_loops_per_s"] is None and all(r["python_load_loops_per_s"] > 0 for r in rows[1:])
    assert all(r["gbps"] > 0 and r["bytes"] == rows[0]["bytes"] for r in rows)
    assert "beside a Python thread (switch interval 0.5 ms" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["bench", "restore-path", "--python-load", "0.005,0"])
    assert e.value.code == 2
    assert "positive seconds" in capsys.readouterr().err
