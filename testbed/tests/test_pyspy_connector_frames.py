"""scripts/gpu/pyspy_connector_frames.py: py-spy raw stacks of a profiled engine split by process, by the engine
core's phase and by the connector's entry point."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "pyspy_connector_frames.py"
_spec = importlib.util.spec_from_file_location("pyspy_connector_frames", SCRIPT)
assert _spec is not None and _spec.loader is not None
frames_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(frames_mod)

_CORE = 'process 7:"python -c from multiprocessing.spawn import spawn_main; spawn_main() --multiprocessing-fork"'
_LOOP = "run_engine_core (vllm/v1/engine/core.py:1);EngineCoreProc.run_busy_loop (vllm/v1/engine/core.py:2)"
RAW = "\n".join([
    f"{_CORE};<module> (<string>:1);EngineCoreProc.__init__ (vllm/v1/engine/core.py:3);load_model (x.py:1) 50",
    f"{_CORE};<module> (<string>:1);{_LOOP};GPUModelRunner.execute_model (vllm/v1/worker/gpu/model_runner.py:9) 7",
    f"{_CORE};<module> (<string>:1);{_LOOP};ADPConnector.start_load_kv (adp_connector/vllm/connector.py:5) 3",
    f"{_CORE};Thread.run (threading.py:1);RestorePipeline._drive (adp_connector/pipeline/restore.py:4) 4",
    f"{_CORE};Thread.run (threading.py:1);EngineCoreProc.process_input_sockets (vllm/v1/engine/core.py:8) 2",
    'process 9:"python -m adp_connector.store.process";StoreProcess.run (adp_connector/store/process.py:1) 11',
]) + "\n"


def test_engine_core_samples_split_by_phase_and_entry_point(tmp_path: Path) -> None:
    path = tmp_path / "pyspy.txt"
    path.write_text(RAW)
    procs, entries, phases = frames_mod.summarize(str(path))
    assert procs == {"engine-core": 66, "store helper": 11}
    assert phases == {"start-up (imports, compile, graph capture)": 50, "busy loop: vLLM": 7,
                      "busy loop: inside the connector's calls": 3, "connector threads": 4, "other threads": 2}
    assert entries == {"ADPConnector.start_load_kv (adp_connector/vllm/connector.py)": 3,
                       "RestorePipeline._drive (adp_connector/pipeline/restore.py)": 4}
