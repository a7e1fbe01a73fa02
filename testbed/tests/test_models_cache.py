"""Generated checkpoints: runs started together share one generation (no torch needed: the writer is faked)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from adp_testbed.models import checkpoints


def test_concurrent_runs_generate_a_model_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs asking for the same model at once (validate.sh families with FAMILY_JOBS) both get it, written
    once; before the lock the second run's rename failed ("Directory not empty"). Control: with the model gone a
    later run writes it again, so the count is of writes, not a cache that never writes."""
    monkeypatch.setenv("ADP_KV_CACHE", str(tmp_path))
    writes: list[Path] = []

    def fake_generate(family: str, cfg_cls: str, model_cls: str, over: dict, out: Path) -> None:
        writes.append(out)
        time.sleep(0.3)  # long enough for the other thread to arrive meanwhile
        tmp = out.with_name(out.name + ".tmp")
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")
        (tmp / "model.safetensors").write_bytes(b"")
        tmp.rename(out)

    monkeypatch.setattr(checkpoints, "_generate", fake_generate)
    got: list[Path] = []
    threads = [threading.Thread(target=lambda: got.append(checkpoints.ensure_model("dense"))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 2 and got[0] == got[1] and (got[0] / "config.json").exists()
    assert len(writes) == 1
    import shutil

    shutil.rmtree(got[0])
    checkpoints.ensure_model("dense")
    assert len(writes) == 2  # control
