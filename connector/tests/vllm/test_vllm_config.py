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
