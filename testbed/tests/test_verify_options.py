"""``testbed verify`` options that shape the engine (no vLLM needed)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from adp_testbed import options as O
from adp_testbed import verify


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    verify.add_arguments(p)
    return p.parse_args(list(argv))


def test_block_size_reaches_the_engine_kwargs() -> None:
    assert _parse("--family", "swa").block_size is None
    ns = _parse("--family", "swa", "--block-size", "16")
    assert verify._with_block_size({"max_num_batched_tokens": 256}, ns.block_size) == {
        "max_num_batched_tokens": 256, "block_size": 16}
    # control: without the option the plan's kwargs are left as they are (the engine picks its block)
    plan = {"max_num_batched_tokens": 256}
    assert verify._with_block_size(plan, None) is plan


def test_every_family_has_a_plan_or_a_cuda_only_reason() -> None:
    for fam in verify.FAMILIES:
        assert fam == "mtp" or fam in verify._PLAN, fam
    assert "dsa" in verify._CUDA_ONLY and "Sparse Attention is not supported on CPU" in verify._CUDA_ONLY["dsa"]


def test_engine_kwargs_reach_the_engine_as_json_or_strings() -> None:
    import pytest

    from adp_testbed import options as O

    ns = _parse("--family", "gdn", "--engine-kwarg", "gdn_prefill_backend=triton", "--engine-kwarg",
                "max_num_batched_tokens=512")
    assert verify._engine_kwargs(ns.engine_kwarg) == {"gdn_prefill_backend": "triton", "max_num_batched_tokens": 512}
    assert verify._engine_kwargs(_parse("--family", "gdn").engine_kwarg) == {}  # control: nothing added
    with pytest.raises(O.UsageError, match="expected KEY=VALUE"):
        verify._engine_kwargs(["gdn_prefill_backend"])


def test_corrupting_state_pages_needs_the_local_userspace_target(tmp_path: object) -> None:
    import pytest

    from adp_testbed import options as O

    ns = _parse("--family", "gdn", "--corrupt-state-pages", "--backend", "kernel", "--workdir", str(tmp_path))
    assert ns.corrupt_state_pages
    with pytest.raises(O.UsageError, match="needs the local userspace target"):
        verify.run(ns)


def test_corrupting_every_page_needs_the_local_target_and_excludes_the_state_control(tmp_path: object) -> None:
    import pytest

    from adp_testbed import options as O

    ns = _parse("--family", "mla", "--corrupt-pages", "--target", "10.0.0.1:4420", "--workdir", str(tmp_path))
    assert ns.corrupt_pages and not ns.corrupt_state_pages
    O.resolve_target(ns)  # as verify.main does
    with pytest.raises(O.UsageError, match="--corrupt-pages needs the local userspace target"):
        verify.run(ns)
    both = _parse("--family", "gdn", "--corrupt-pages", "--corrupt-state-pages", "--workdir", str(tmp_path))
    with pytest.raises(O.UsageError, match="give one of"):
        verify.run(both)


def test_connector_opts_are_checked_before_any_engine_starts(tmp_path: object) -> None:
    import pytest

    from adp_testbed import options as O

    ns = _parse("--family", "dense", "--connector-opt", "staging_mb=1024", "--connector-opt", "restore_policy=always")
    assert verify._connector_opts(ns.connector_opt) == {"staging_mb": 1024, "restore_policy": "always"}
    assert verify._connector_opts([]) == {}  # control: nothing added
    bad = _parse("--family", "dense", "--connector-opt", "staging_mb=lots", "--workdir", str(tmp_path))
    with pytest.raises(O.UsageError, match=r"--connector-opt: .*staging_mb"):
        verify.run(bad)


def _interpreter(path: Path, finds_both: bool, record: Path) -> str:
    """A stand-in for an interpreter: answers the check for vllm and adp_testbed, then records the command line it
    was asked to run and exits 7."""
    path.write_text(f"#!/bin/sh\nif [ \"$1\" = -c ]; then exit {0 if finds_both else 3}; fi\n"
                    f"echo \"$@\" > {record}\necho \"$ADP_KV_VERIFY_UNDER_VLLM_PYTHON\" >> {record}\nexit 7\n")
    path.chmod(0o755)
    return str(path)


def test_verify_without_vllm_runs_again_under_the_vllm_interpreter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """`.venv/bin/testbed verify` (no vLLM there) runs the same command line under the vLLM interpreter and exits with
    its status, instead of failing its verdict on an import. Controls: a --vllm-python without vLLM is a usage error;
    with no interpreter to be found, or none in the run under the named one, the verdict is "not runnable here" (exit
    2, its reason, the JSON verdict); with vLLM importable here it runs in place."""
    from adp_testbed import cli
    from adp_testbed.bench import serve

    record = tmp_path / "argv.txt"
    good = _interpreter(tmp_path / "vllm-python", True, record)
    monkeypatch.setattr(verify, "_vllm_importable", lambda: False)
    monkeypatch.delenv("ADP_KV_VERIFY_UNDER_VLLM_PYTHON", raising=False)
    argv = ["verify", "--family", "dense", "--prompts", "1", "--vllm-python", good]
    assert cli.main(argv) == 7
    assert record.read_text().splitlines() == [f"-m adp_testbed.cli {' '.join(argv)}", good]
    capsys.readouterr()
    assert cli.main(["verify", "--vllm-python", _interpreter(tmp_path / "plain-python", False, record)]) == 2
    assert "cannot import both vllm and adp_testbed" in capsys.readouterr().err
    monkeypatch.setattr(serve, "vllm_python", lambda explicit=None: None)
    assert cli.main(["verify", "--json"]) == 2
    out = capsys.readouterr()
    got = json.loads(out.out)
    assert got["runnable"] is False and "no interpreter with it was found" in got["reason"], got
    assert out.err.strip().startswith("testbed verify: dense: vLLM is not importable here")
    monkeypatch.setenv("ADP_KV_VERIFY_UNDER_VLLM_PYTHON", good)
    assert "either" in str(verify._run_under_vllm_python(_parse("--vllm-python", good)))
    monkeypatch.setattr(verify, "_vllm_importable", lambda: True)
    assert verify._run_under_vllm_python(_parse("--vllm-python", good)) is None


@pytest.mark.parametrize("option", ["--prompts", "--prompt-len", "--max-tokens", "--block-size"])
def test_verify_counts_below_one_are_refused_at_parse_time(option: str) -> None:
    p = O.OneLineParser(prog="testbed verify")
    verify.add_arguments(p)
    with pytest.raises(SystemExit) as e:
        p.parse_args([option, "0"])
    assert e.value.code == 2
    assert getattr(p.parse_args([option, "1"]), option[2:].replace("-", "_")) == 1  # control: 1 is taken
