"""The one-shot engine runner's choice of process layout (`adp_testbed.models.engine`); no vLLM needed."""

from __future__ import annotations

import pytest

from adp_testbed.models.engine import _in_process


def test_auto_runs_the_engine_core_in_process_on_a_cpu_at_one_rank() -> None:
    assert _in_process({}, {}, cuda_available=lambda: False)
    assert _in_process({"in_process": "auto"}, {"tensor_parallel_size": 1}, cuda_available=lambda: False)


def test_auto_keeps_vllms_processes_on_a_gpu_or_at_more_ranks() -> None:
    """Controls: a CUDA host (the H200's validation runs) and TP/PP above one keep vLLM's own layout."""
    assert not _in_process({}, {}, cuda_available=lambda: True)
    assert not _in_process({}, {"tensor_parallel_size": 2}, cuda_available=lambda: False)
    assert not _in_process({}, {"pipeline_parallel_size": 2}, cuda_available=lambda: False)


def test_the_spec_overrides_auto_and_a_bad_value_is_refused() -> None:
    def never() -> bool:
        raise AssertionError("an explicit choice must not probe the GPU")

    assert not _in_process({"in_process": False}, {}, cuda_available=never)
    assert _in_process({"in_process": True}, {}, cuda_available=never)
    with pytest.raises(ValueError, match="in_process must be"):
        _in_process({"in_process": "yes"}, {}, cuda_available=never)
