"""``kv_connector_extra_config`` validation (no vLLM needed: runs in the main venv too)."""

from __future__ import annotations

import pytest

from adp_connector.vllm.config import ADPConfig, ConfigError, options_table, parse_config


def test_config_defaults_and_errors() -> None:
    c = parse_config({"traddr": "10.0.0.2", "trsvcid": 4420, "subnqn": "nqn.x", "verify": False})
    assert (c.traddr, c.trsvcid, c.subnqn, c.verify, c.io_queues) == ("10.0.0.2", 4420, "nqn.x", False, 4)
    with pytest.raises(ConfigError, match="unknown"):
        parse_config({"tradr": "x"})
    with pytest.raises(ConfigError, match="trsvcid"):
        parse_config({"trsvcid": "4420"})
    with pytest.raises(ConfigError, match="verify"):
        parse_config({"verify": 1})
    with pytest.raises(ConfigError, match="> 0"):
        parse_config({"io_queues": 0})
    assert "| `traddr` |" in options_table()


def test_every_option_is_documented() -> None:
    from dataclasses import fields
    from pathlib import Path

    doc = (Path(__file__).parents[3] / "docs" / "connector.md").read_text()
    for f in fields(ADPConfig):
        assert f"| `{f.name}` |" in doc, f.name


def test_defaults_derived_from_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """load_processes, io_queues and staging_mb follow the host (cores, a CUDA GPU, RAM) unless set."""
    from adp_connector.vllm import config

    assert config.host_defaults(16, True, 125 << 30) == {"load_processes": 12, "save_processes": 2, "io_queues": 2,
                                                         "staging_mb": 8000}  # the H200 box
    assert config.host_defaults(16, True, 512 << 30)["staging_mb"] == 8192  # capped
    assert config.host_defaults(64, True, 128 << 30)["load_processes"] == 12  # capped
    assert config.host_defaults(8, True, 128 << 30)["load_processes"] == 6
    assert config.host_defaults(2, True, 4 << 30) == {"load_processes": 1, "save_processes": 1, "io_queues": 2,
                                                      "staging_mb": 1024}
    assert config.host_defaults(64, False, 32 << 30) == {"load_processes": 1, "save_processes": 1, "io_queues": 4,
                                                         "staging_mb": 2048}  # no GPU
    monkeypatch.setattr(config, "host_defaults", lambda: {"load_processes": 3, "staging_mb": 1500})
    c = parse_config({})
    assert (c.load_processes, c.staging_mb, c.io_queues) == (3, 1500, 4)
    c = parse_config({"load_processes": 1, "staging_mb": 0})  # control: what the user sets wins
    assert (c.load_processes, c.staging_mb) == (1, 0)
    monkeypatch.setattr(config, "host_defaults", lambda: {"load_processes": 12, "io_queues": 2})
    assert (parse_config({}).io_queues, parse_config({"io_queues": 8}).io_queues) == (2, 8)
    assert "host: " in options_table()
    monkeypatch.setattr(config, "host_defaults", lambda: {"load_processes": 4, "save_processes": 2, "staging_mb": 1})
    assert parse_config({}).save_processes == 2  # the GPU host's derived writers
    assert parse_config({"load_processes": 1}).save_processes == 1  # never more writers than helpers
    assert parse_config({"load_processes": 1, "save_processes": 3}).save_processes == 3  # control: explicit wins


def test_cuda_gpu_presence_follows_the_driver_and_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    from adp_connector.vllm import config

    monkeypatch.setattr(config.os, "listdir", lambda p: ["0000:01:00.0"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert config.cuda_gpu_present()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not config.cuda_gpu_present()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(config.os, "listdir", lambda p: (_ for _ in ()).throw(FileNotFoundError(p)))
    assert not config.cuda_gpu_present()


@pytest.mark.parametrize("key", ["connect_timeout_s", "retry_interval_s", "load_timeout_s", "refresh_interval_s"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_timeouts_are_refused(key: str, bad: float) -> None:
    with pytest.raises(ConfigError, match=rf"{key}.*finite") as err:
        parse_config({key: bad})
    assert "\n" not in str(err.value)
    assert getattr(parse_config({key: 2.5}), key) == 2.5  # control: a finite value passes


def test_max_io_kib_below_the_lba_size_is_refused() -> None:
    for bad in (1, 2, 3):
        with pytest.raises(ConfigError, match=r"max_io_kib.*LBA") as err:
            parse_config({"max_io_kib": bad})
        assert "\n" not in str(err.value)
    assert parse_config({"max_io_kib": 0}).max_io_kib == 0  # control: MDTS, and sizes of a whole LBA or more
    assert parse_config({"max_io_kib": 4}).max_io_kib == 4
    assert parse_config({"max_io_kib": 128}).max_io_kib == 128


def test_save_processes_is_validated() -> None:
    assert parse_config({}).save_processes == 1  # one writer helper unless asked
    assert parse_config({"save_processes": 4}).save_processes == 4  # control: a valid count is kept
    for bad in (0, -1, 17):
        with pytest.raises(ConfigError, match="save_processes"):
            parse_config({"save_processes": bad})
    with pytest.raises(ConfigError, match="save_processes"):
        parse_config({"save_processes": True})


def test_pending_save_cap_follows_staging_unless_given(monkeypatch: pytest.MonkeyPatch) -> None:
    from adp_connector.vllm import config

    monkeypatch.setattr(config, "host_defaults", lambda: {"load_processes": 1, "staging_mb": 8000})
    base = {"traddr": "127.0.0.1", "trsvcid": 4420, "subnqn": "nqn.x"}
    assert config.parse_config(base).max_pending_save_mb == 8000
    assert config.parse_config({**base, "staging_mb": 2048}).max_pending_save_mb == 4096  # never below 4096
    assert config.parse_config({**base, "max_pending_save_mb": 512}).max_pending_save_mb == 512


def test_switch_interval_option() -> None:
    assert parse_config({}).switch_interval_ms == 0.0  # vLLM's process is left as it is unless asked
    assert parse_config({"switch_interval_ms": 0.5}).switch_interval_ms == 0.5
    assert parse_config({"switch_interval_ms": 1}).switch_interval_ms == 1.0
    with pytest.raises(ConfigError, match=">= 0"):
        parse_config({"switch_interval_ms": -1})
    with pytest.raises(ConfigError, match="switch_interval_ms"):
        parse_config({"switch_interval_ms": "0.5"})


def test_switch_interval_applies_to_the_process(caplog: pytest.LogCaptureFixture) -> None:
    import logging
    import sys

    pytest.importorskip("torch")
    from adp_connector.vllm.worker import apply_switch_interval

    before = sys.getswitchinterval()

    def ours() -> list[str]:
        return [r.getMessage() for r in caplog.records if "switch interval" in r.getMessage()]

    try:
        with caplog.at_level(logging.INFO, logger="vllm.adp_kv"):
            apply_switch_interval(0.0)  # the control: 0 changes nothing and logs nothing
            assert sys.getswitchinterval() == before and not ours()
            apply_switch_interval(0.5)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        assert any("-> 0.5 ms" in m for m in ours())
    finally:
        sys.setswitchinterval(before)


def test_save_spill_option_and_its_derived_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """save_spill_mb: null (derived), 0 (drop at once) or MiB; on a CPU KV cache the derived size is staging_mb,
    on a GPU a quarter of the free memory, at most 8 GiB."""
    torch = pytest.importorskip("torch")
    from adp_connector.vllm import worker as W

    assert parse_config({}).save_spill_mb is None
    assert parse_config({"save_spill_mb": 0}).save_spill_mb == 0
    assert parse_config({"save_spill_mb": None}).save_spill_mb is None
    with pytest.raises(ConfigError, match=">= 0"):
        parse_config({"save_spill_mb": -1})
    with pytest.raises(ConfigError, match="save_spill_mb"):
        parse_config({"save_spill_mb": 1.5})
    cpu = torch.device("cpu")
    assert W.save_spill_bytes(parse_config({"staging_mb": 1024}), cpu) == 1024 << 20
    assert W.save_spill_bytes(parse_config({"save_spill_mb": 64}), cpu) == 64 << 20
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (80 << 30, 140 << 30))
    assert W.save_spill_bytes(parse_config({}), gpu) == W.SAVE_SPILL_MAX_MB << 20
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (37 << 30, 80 << 30))  # GPU run 23's sweep
    assert W.save_spill_bytes(parse_config({}), gpu) == (37 << 30) // 2
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (8 << 30, 140 << 30))
    assert W.save_spill_bytes(parse_config({}), gpu) == 4 << 30
    assert W.save_spill_bytes(parse_config({"save_spill_mb": 0}), gpu) == 0


def test_eviction_option_reaches_the_store_choices() -> None:
    from adp_connector.store.core import EVICTION_POLICIES
    from adp_connector.vllm.config import EVICTIONS

    assert EVICTIONS == EVICTION_POLICIES
    assert parse_config({}).eviction == "slru" and parse_config({"eviction": "lru"}).eviction == "lru"
    with pytest.raises(ConfigError, match=r"eviction'\] must be one of slru, lru, got 'fifo'"):
        parse_config({"eviction": "fifo"})


def test_admission_option_reaches_the_store_choices() -> None:
    from adp_connector.store.core import ADMISSION_POLICIES, StoreConfig
    from adp_connector.vllm.config import ADMISSIONS

    assert ADMISSIONS == ADMISSION_POLICIES
    assert parse_config({}).admission == "frequency" == StoreConfig().admission
    assert parse_config({"admission": "always"}).admission == "always"
    with pytest.raises(ConfigError, match=r"admission'\] must be one of frequency, always, got 'lfu'"):
        parse_config({"admission": "lfu"})
    with pytest.raises(ValueError, match=r"StoreConfig\.admission must be one of frequency, always, got 'lfu'"):
        StoreConfig(admission="lfu")


def test_restore_batches_in_flight_default_and_override() -> None:
    """``restore_batches`` null: four per batch the helpers run at once (96 with a 16-core GPU host's 12 helpers of
    2 I/O threads); a number is taken as given; 0 is refused like every count."""
    pytest.importorskip("torch")  # the worker half imports it
    from adp_connector.vllm.worker import restore_inflight

    gpu_host = {"load_processes": 12, "save_processes": 2, "io_threads": 2}
    assert restore_inflight(parse_config(gpu_host)) == 96
    assert restore_inflight(parse_config({**gpu_host, "restore_batches": 24})) == 24
    assert restore_inflight(parse_config({**gpu_host, "io_process": False})) == 8  # one process: its io_threads
    with pytest.raises(ConfigError, match=r"restore_batches.*> 0"):
        parse_config({"restore_batches": 0})
