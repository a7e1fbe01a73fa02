"""One CLI vocabulary (issue 19 item 4): the same target options on every command, `--json [PATH]` meaning the
same everywhere, `up --config` keeping the file's port, `up --mgmt-port`, defaults and exit codes in `--help`,
`--version`, documented exit statuses, and hints that name options which exist."""

from __future__ import annotations

import json
import re
import socket
import urllib.parse
from pathlib import Path

import pytest

from adp_emulator.config import default_config, save_config
from adp_testbed import options as O
from adp_testbed.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
NQN = "nqn.2026-11.io.awide:vocab"
#: Every command that uses a target that is already running.
TARGET_COMMANDS = [["bench", "datapath"], ["bench", "store"], ["bench", "restart"], ["bench", "agents"],
                   ["bench", "sweep"], ["verify"], ["demo"]]
JSON_COMMANDS = [["status"], ["demo"], ["verify"], ["bench", "datapath"], ["bench", "store"],
                 ["bench", "restore-path"], ["bench", "restart"], ["bench", "agents"], ["bench", "sweep"]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parse(argv: list[str]):
    args = build_parser().parse_args(argv)
    O.resolve_target(args)
    return args


@pytest.mark.parametrize("cmd", TARGET_COMMANDS, ids=" ".join)
def test_the_same_target_options_everywhere(cmd: list[str]) -> None:
    """`--target ADDR:PORT --nqn NQN` and the connector's `--traddr/--trsvcid/--subnqn` mean the same."""
    a = _parse([*cmd, "--target", "192.0.2.10:4421", "--nqn", NQN])
    b = _parse([*cmd, "--traddr", "192.0.2.10", "--trsvcid", "4421", "--subnqn", NQN])
    for args in (a, b):
        assert (args.target, args.traddr, args.trsvcid, args.nqn) == ("192.0.2.10:4421", "192.0.2.10", 4421, NQN)
    none = _parse(cmd)
    assert none.target is None and none.nqn is None


@pytest.mark.parametrize("argv, msg", [
    (["--target", "192.0.2.10:4420", "--trsvcid", "4420"], "not both"),
    (["--traddr", "192.0.2.10"], "--traddr needs --trsvcid"),
])
def test_conflicting_target_options_are_a_usage_error(argv: list[str], msg: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "datapath", *argv]) == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_up_takes_the_connector_names_too() -> None:
    a = _parse(["up", "--host", "127.0.0.1", "--port", "4425", "--nqn", NQN])
    b = _parse(["up", "--traddr", "127.0.0.1", "--trsvcid", "4425", "--subnqn", NQN])
    assert (a.host, a.port, a.nqn) == (b.host, b.port, b.nqn) == ("127.0.0.1", 4425, NQN)
    d = _parse(["up"])
    assert (d.host, d.port, d.mgmt_port) == (None, None, 0)  # filled in (127.0.0.1:4420) only without --config


def test_up_config_keeps_the_file_port_and_mgmt_port(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`up --config FILE` serves on the file's port (not 4420) and `--mgmt-port` picks the API's port; `--port`
    given explicitly still overrides the file."""
    sd = str(tmp_path / "state")
    file_port, mgmt_port = _free_port(), _free_port()
    assert file_port != 4420
    cfg = tmp_path / "target.json"
    save_config(default_config(port=file_port, nqn=NQN), cfg)
    try:
        assert main(["--state-dir", sd, "up", "--config", str(cfg), "--mgmt-port", str(mgmt_port)]) == 0
        capsys.readouterr()
        assert main(["--state-dir", sd, "status", "--json"]) == 0
        st = json.loads(capsys.readouterr().out)
        assert (st["trsvcid"], st["subnqn"]) == (file_port, NQN)
        assert urllib.parse.urlsplit(st["mgmt_url"]).port == mgmt_port
    finally:
        main(["--state-dir", sd, "down"])
    override = _free_port()
    try:
        assert main(["--state-dir", sd, "up", "--config", str(cfg), "--port", str(override)]) == 0
        capsys.readouterr()
        assert main(["--state-dir", sd, "status", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["trsvcid"] == override
    finally:
        main(["--state-dir", sd, "down"])


def test_help_shows_defaults_and_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["up"], ["bench", "datapath"], ["bench", "store"], ["demo"], ["verify"], ["status"], []):
        with pytest.raises(SystemExit) as e:
            main([*argv, "--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert O.EXIT_CODES in out, argv
        if argv == ["up"]:
            for shown in ("default 4420", "default: nqn.2026-11.io.awide:adp-kv", "default 1G", "default 128K",
                          "(default: 0)", "default: 20.0"):
                assert shown in re.sub(r"\s+", " ", out), shown
        if argv == ["bench", "datapath"]:
            assert "(default: quick)" in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and re.fullmatch(r"testbed \d+\.\d+\.\d+\S*\n", capsys.readouterr().out)


@pytest.mark.parametrize("cmd", JSON_COMMANDS, ids=" ".join)
def test_json_option_is_the_same_everywhere(cmd: list[str]) -> None:
    """`--json` alone and `--json -` mean stdout; `--json PATH` a file; absent, no JSON."""
    assert _parse([*cmd, "--json"]).json == "-"
    assert _parse([*cmd, "--json", "-"]).json == "-"
    assert _parse([*cmd, "--json", "out.json"]).json == "out.json"
    assert _parse(cmd).json is None


def test_status_json_to_stdout_or_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sd = str(tmp_path / "state")
    assert main(["--state-dir", sd, "status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["running"] is False
    assert main(["--state-dir", sd, "status", "--json", str(tmp_path / "s.json")]) == 0
    assert capsys.readouterr().out.strip() == "no target is up"  # text on stdout, JSON in the file
    assert json.loads((tmp_path / "s.json").read_text())["running"] is False


DATAPATH = ["bench", "datapath", "--sizes", "128K", "--queues", "1", "--depths", "1", "--ops", "read",
            "--seconds", "0.1", "--working-set", "8M"]


def test_bench_datapath_stdout_is_json_only_when_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`bench datapath --json`: stdout parses as one JSON document (the table is on stderr). Without --json,
    stdout is the table and the summary as text (the negative control: it does not parse as JSON)."""
    assert main([*DATAPATH, "--json"]) == 0
    got = capsys.readouterr()
    doc = json.loads(got.out)
    assert doc["rows"] and "one_queue_read_best" in doc["summary"]
    assert "GB/s" in got.err and "ceiling" in got.err
    assert main(DATAPATH) == 0
    text = capsys.readouterr().out
    assert "GB/s" in text and "best one-queue read" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_exit_statuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """0 ok, 1 a failed check, 2 usage, 3 a crash (with its traceback), 130 interrupted."""
    from adp_testbed import cli

    assert main(["--state-dir", str(tmp_path), "status"]) == 0
    with pytest.raises(SystemExit) as e:
        main(["bench", "datapath", "--no-such-option"])
    assert e.value.code == 2
    assert main(["bench", "datapath", "--target", "192.0.2.10:4420", "--traddr", "192.0.2.10"]) == 2

    def crash(args):
        raise RuntimeError("a bug")

    def failed(args):
        return 1

    def interrupted(args):
        raise KeyboardInterrupt

    capsys.readouterr()
    for func, code in ((crash, 3), (failed, 1), (interrupted, 130)):
        monkeypatch.setattr(cli, "cmd_status", func)  # build_parser binds the command at each call
        assert cli.main(["--state-dir", str(tmp_path), "status"]) == code
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: a bug" in err and "crashed (exit status 3)" in err


def test_exit_statuses_are_documented() -> None:
    readme = re.sub(r"\s+", " ", (ROOT / "README.md").read_text())
    for code, what in (("0", "success"), ("1", "an acceptance or correctness check failed"), ("2", "usage"),
                       ("3", "a crash"), ("130", "interrupted")):
        assert f"`{code}` {what}" in readme, code
    for code in ("0", "1", "2", "3", "130"):
        assert re.search(rf"^  {code} +\S", O.EXIT_CODES, re.M), code


def test_demo_hint_names_options_that_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """With no vLLM interpreter found, `demo` says to give --vllm-python, and demo accepts it."""
    from adp_testbed.bench import serve

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ADP_KV_VLLM_PYTHON", raising=False)
    monkeypatch.setattr(serve, "vllm_python", lambda explicit=None: None)
    assert main(["demo", "--vllm-python", str(tmp_path / "no-python")]) == 2
    err = capsys.readouterr().err
    hinted = re.findall(r"(?<![\w-])(--[a-z][\w-]*)", err)
    assert "--vllm-python" in hinted
    for opt in hinted:
        build_parser().parse_args(["demo", opt, "x"] if opt == "--vllm-python" else ["demo", opt])


def test_datapath_demo_refuses_the_vllm_demo_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--datapath", "--target", "192.0.2.10:4420"]) == 2
    assert "--target is for the vLLM demo" in capsys.readouterr().err


def test_verify_prints_text_unless_json_is_asked(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`verify`: text without --json, only the JSON verdict with --json, the file with --json PATH."""
    from adp_testbed import verify

    verdict = {"family": "dense", "ok": True, "runnable": True, "pages_compared": 4, "totals": {"a": 1}}
    monkeypatch.setattr(verify, "run", lambda args: dict(verdict))
    monkeypatch.setattr(verify, "_vllm_importable", lambda: True)  # it runs here (not again under .venv-vllm)
    assert main(["verify"]) == 0
    out = capsys.readouterr().out
    assert "pages_compared" in out and out.rstrip().endswith("RESULT: PASS")
    with pytest.raises(json.JSONDecodeError):
        json.loads(out)
    assert main(["verify", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == verdict
    assert main(["verify", "--json", str(tmp_path / "v.json")]) == 0
    assert "RESULT: PASS" in capsys.readouterr().out
    assert json.loads((tmp_path / "v.json").read_text()) == verdict
    monkeypatch.setattr(verify, "run", lambda args: dict(verdict, ok=False))
    assert main(["verify"]) == 1 and "RESULT: FAIL" in capsys.readouterr().out


def test_kernel_backend_port_follows_the_same_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """`up --backend kernel`: without --port the config's port (the file's, else 4420); --port overrides it;
    --port 0 asks for any free port. (The kernel target itself is replaced: only what it is given is checked.)"""
    import adp_emulator.kernel as K

    seen: list[tuple[int | None, str]] = []

    class FakeKernelTarget:
        def __init__(self, cfg, workdir, host_port=None, **kw):
            seen.append((host_port, cfg.ports[0].trsvcid))

        def start(self, timeout):
            raise K.KernelBackendError("not started in this test")

    monkeypatch.setattr(K, "KernelTarget", FakeKernelTarget)
    from adp_testbed import state

    monkeypatch.setattr(state, "bind_problem", lambda host, port: None)  # 4420 may be in use on a shared machine
    file_port, other = _free_port(), _free_port()
    cfg = tmp_path / "target.json"
    save_config(default_config(port=file_port, nqn=NQN), cfg)
    sd = str(tmp_path / "state")
    for extra in ([], ["--config", str(cfg)], ["--config", str(cfg), "--port", str(other)], ["--port", "0"]):
        assert main(["--state-dir", sd, "up", "--backend", "kernel", *extra]) == 2
    assert "not started in this test" in capsys.readouterr().err
    assert seen == [(None, "4420"), (None, str(file_port)), (other, str(other)), (0, "4420")]


#: Options of other programs that testbed's source names: `vllm serve` (bench/serve.py builds its command line;
#: `--engine-arg=--block-size=16` is the help's example) and nvidia-smi (the hardware line of the report).
OTHER_PROGRAMS = {"--block-size", "--query-gpu", "--format", "--served-model-name", "--skip-tokenizer-init",
                  "--dtype", "--load-format", "--enable-prefix-caching", "--prefix-caching-hash-algo",
                  "--uvicorn-log-level", "--disable-uvicorn-access-log", "--enforce-eager", "--kv-cache-memory-bytes",
                  "--gpu-memory-utilization", "--max-num-seqs", "--max-num-batched-tokens", "--kv-transfer-config",
                  "--subprocesses", "--nonblocking", "--gil", "--idle"}  # the last four: py-spy record (--profile)


def _all_options() -> set[str]:
    import argparse

    from adp_emulator.__main__ import build_parser as emulator_parser
    from adp_testbed.bench.report import build_parser as report_parser

    def walk(p: argparse.ArgumentParser, acc: set[str]) -> set[str]:
        for a in p._actions:
            acc.update(a.option_strings)
            if isinstance(a, argparse._SubParsersAction):
                for sp in a.choices.values():
                    walk(sp, acc)
        return acc

    return walk(build_parser(), set()) | walk(emulator_parser(), set()) | walk(report_parser(), set())


def options_named_in(source: str) -> list[tuple[int, str]]:
    """(line, option) for every ``--option`` inside a string literal of ``source`` (messages, hints, help)."""
    import io
    import tokenize

    out = []
    for t in tokenize.generate_tokens(io.StringIO(source).readline):
        if t.type == tokenize.STRING or t.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            out += [(t.start[0], o) for o in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]+", t.string)]
    return out


def test_every_option_a_message_names_exists() -> None:
    """Hints and messages (`give --vllm-python`, `Pass --yes-destroy`, ...) name only options that exist."""
    known = _all_options() | OTHER_PROGRAMS
    src = ROOT / "testbed" / "src" / "adp_testbed"
    bad = [f"{f.relative_to(ROOT)}:{n}: {o}" for f in sorted(src.rglob("*.py"))
           for n, o in options_named_in(f.read_text()) if o not in known]
    assert not bad, bad
    # negative control: a hint with a made-up option is found
    planted = 'raise UsageError("no interpreter (give --vllm-pythn)")\n'
    assert [o for _, o in options_named_in(planted) if o not in known] == ["--vllm-pythn"]


def test_emulator_serve_takes_the_same_names() -> None:
    from adp_emulator.__main__ import build_parser as emulator_parser

    a = emulator_parser().parse_args(["serve", "--host", "127.0.0.1", "--port", "4425", "--nqn", NQN])
    b = emulator_parser().parse_args(["serve", "--traddr", "127.0.0.1", "--trsvcid", "4425", "--subnqn", NQN])
    assert (a.host, a.port, a.nqn) == (b.host, b.port, b.nqn) == ("127.0.0.1", 4425, NQN)
