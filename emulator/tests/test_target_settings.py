"""Userspace target: settings validation, config mapping, CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from target_client import open_admin, open_io

from adp_emulator.target import TargetSettings, UserspaceTarget, parse_size, settings_from_config
from adp_wire.constants import IoOpcode
from adp_wire.sqe import rw_cmd


@pytest.mark.parametrize("field,value", [
    ("host", "not-an-ip"), ("port", 70000), ("subnqn", ""), ("subnqn", "nqn.2014-08.org.nvmexpress.discovery"),
    ("capacity_bytes", 1000), ("lba_size", 1024), ("mdts_bytes", 3 * 4096), ("mdts_bytes", 2048),
    ("max_io_queues", 0), ("queue_depth", 1), ("allowed_hosts", ["x" * 300]), ("in_capsule_bytes", 100),
    ("maxh2cdata", 1000), ("serial", "s" * 21), ("model", "\x01"), ("keep_alive_default_ms", -1),
    ("allow_any_host", "yes"), ("backing_path", ""),
])
def test_validation_names_the_field(field, value) -> None:
    with pytest.raises(ValueError, match=field):
        TargetSettings(**{field: value})


def test_defaults_and_sizes() -> None:
    s = TargetSettings()
    assert (s.port, s.lba_size, s.mdts_bytes, s.mdts_field) == (4420, 4096, 128 * 1024, 5)
    assert len(s.serial_number) <= 20
    assert parse_size("1G") == 1 << 30 and parse_size("128K") == 131072 and parse_size("4096") == 4096
    assert parse_size("2MiB") == 2 << 20
    with pytest.raises(ValueError):
        parse_size("lots")


def test_port_zero_and_context_manager() -> None:
    with UserspaceTarget(TargetSettings(port=0, capacity_bytes=1 << 20)) as t:
        host, port = t.address
        assert host == "127.0.0.1" and port > 0
        open_admin(t.address).close()


def test_settings_from_config(tmp_path) -> None:
    config = pytest.importorskip("adp_emulator.config")
    cfg = config.default_config(port=4555, nqn="nqn.2026-11.io.awide:test", backing_path=str(tmp_path / "b.img"))
    cfg.adp.capacity_bytes = 1 << 24
    cfg.adp.io_workers = 3
    s = settings_from_config(cfg)
    assert s.io_workers == 3
    assert (s.port, s.subnqn, s.capacity_bytes, s.backing_path) == (
        4555, "nqn.2026-11.io.awide:test", 1 << 24, str(tmp_path / "b.img"))
    assert s.allow_any_host is True and s.in_capsule_bytes == (cfg.adp.inline_data_size or s.mdts_bytes)
    assert settings_from_config(config.default_config(), port=0).backing_path is None


def test_cli_serve_ready_and_sigterm(tmp_path) -> None:
    backing = tmp_path / "cli.img"
    p = subprocess.Popen(
        [sys.executable, "-m", "adp_emulator", "serve", "--port", "0", "--capacity", "4M", "--lba-size", "512",
         "--mdts", "64K", "--backing", str(backing), "--nqn", "nqn.2026-11.io.awide:cli", "--io-workers", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline().split()
        assert line[:2] == ["ADP-EMULATOR", "READY"] and line[4] == "nqn.2026-11.io.awide:cli"
        q = open_admin((line[2], int(line[3])), subnqn="nqn.2026-11.io.awide:cli")
        io = open_io((line[2], int(line[3])), q.cntlid, subnqn="nqn.2026-11.io.awide:cli")  # served by the worker
        assert io.cmd(rw_cmd(IoOpcode.READ, 1, 0, 1, 512))[0].status.ok
        io.close()
        q.close()
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=10) == 0
        assert backing.stat().st_size == 4 << 20
    finally:
        p.kill()
        p.wait()
    bad = subprocess.run([sys.executable, "-m", "adp_emulator", "serve", "--lba-size", "512", "--capacity", "1000"],
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "--capacity" in bad.stderr and "TargetSettings" not in bad.stderr
