"""Random-weight tiny models for the connector's vLLM tests, ``testbed verify`` and ``tiny:`` benchmark models.

* :mod:`.checkpoints`: one random-weight checkpoint per model family (dense, swa, mla, gdn, mamba, mtp ...),
  generated once and cached;
* :mod:`.engine`: a one-shot vLLM engine runner in its own process (a real engine restart per run);
* :mod:`.cpu_workarounds`: the directory of CPU-only vLLM patches put on an engine's PYTHONPATH.

Importing this package needs neither vLLM nor torch; they are imported where a checkpoint is generated or an engine
runs.
"""

from __future__ import annotations

from .checkpoints import DSA, FAMILIES, MLA_GPU, cache_dir, check_dsa_checkpoint, ensure_model
from .cpu_workarounds import PATH as CPU_WORKAROUNDS
from .engine import (
    adp_connector,
    connector_totals,
    metric_total,
    prompts,
    run_engine,
    run_process_group,
    run_subprocess,
    vllm_version,
)

_metric = metric_total  # the name connector/tests/vllm/test_vllm_fault_matrix.py calls

__all__ = ["CPU_WORKAROUNDS", "DSA", "FAMILIES", "MLA_GPU", "adp_connector", "cache_dir", "check_dsa_checkpoint",
           "connector_totals", "ensure_model", "metric_total", "prompts", "run_engine", "run_process_group",
           "run_subprocess", "vllm_version"]
