"""`testbed` under bad input and misuse (issue 18 items 5-10): nothing on a card is destroyed without a flag,
`down` signals only our own process, `up` is locked and records its target before it reports success, the token
file does not follow links, and every bad option is one clear line with exit status 2 -- never a traceback."""

from __future__ import annotations

import argparse
import json
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from adp_connector.nvmeof.host import Controller, HostConfig
from adp_connector.store import PageStore
from adp_emulator.mgmt import write_token_file
from adp_emulator.target import TargetSettings, UserspaceTarget
from adp_testbed import cli
from adp_testbed import state as S
from adp_testbed.cli import main

MARKER = b"precious user data, not a page store".ljust(4096, b"!")
RUN = [sys.executable, "-c", "import sys; from adp_testbed.cli import main; sys.exit(main())"]


@pytest.fixture
def card() -> Iterator[UserspaceTarget]:
    with UserspaceTarget(TargetSettings(port=0, capacity_bytes=64 << 20)) as t:
        yield t


def _host(t: UserspaceTarget) -> Controller:
    h, p = t.address
    return Controller.connect(HostConfig(traddr=h, trsvcid=p, subnqn=t.settings.subnqn, io_queues=1))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------
# Item 5: commands that write to an existing namespace


@pytest.mark.parametrize("command", [
    ["bench", "store", "--pages", "4", "--page-size", "256K", "--batch", "2", "--queues", "1"],
    ["bench", "datapath", "--sizes", "128K", "--queues", "1", "--depths", "1", "--ops", "write", "--seconds", "0.1",
     "--working-set", "4M"],
])
def test_writing_benches_refuse_a_namespace_with_data(card: UserspaceTarget, command: list[str],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    with _host(card) as c:
        c.write(0, MARKER)
    where = f"127.0.0.1:{card.address[1]}"
    assert main([*command, "--target", where, "--nqn", card.settings.subnqn]) == 2
    err = capsys.readouterr().err
    assert "holds data" in err and "--yes-destroy" in err
    with _host(card) as c:
        assert c.read(0, len(MARKER)) == MARKER  # untouched
    assert main([*command, "--target", where, "--nqn", card.settings.subnqn, "--yes-destroy"]) == 0


@pytest.mark.parametrize("command", [["bench", "agents", "--arms", "baseline,adp"], ["bench", "restart"], ["demo"],
                                     ["verify", "--prompts", "1"]])
def test_vllm_commands_check_the_card_before_any_engine(card: UserspaceTarget, command: list[str],
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A card given with --target that cannot be reached, or whose namespace holds other data, is one line and exit
    2 before any engine starts (they used to run the baseline arm for minutes, or start verify's engines, then fail
    the verdict). Control: an empty namespace passes the check (the command then goes on to look for vLLM, which is
    stubbed away here so that nothing runs)."""
    from adp_testbed import verify
    from adp_testbed.bench import serve

    monkeypatch.setattr(verify, "_vllm_importable", lambda: True)  # verify's checks run here, not under .venv-vllm
    monkeypatch.setattr(verify, "_models", lambda: pytest.fail("an engine was about to start"))
    monkeypatch.setattr(serve, "vllm_python", lambda explicit=None: None)  # the benches stop right after the check
    closed = f"127.0.0.1:{_closed_port()}"
    assert main([*command, "--target", closed]) == 2
    assert "cannot reach the target" in capsys.readouterr().err
    where = ["--target", f"127.0.0.1:{card.address[1]}", "--nqn", card.settings.subnqn]
    with _host(card) as c:
        c.write(0, MARKER)
    assert main([*command, *where]) == 2
    assert "holds data" in capsys.readouterr().err
    with _host(card) as c:
        assert c.read(0, len(MARKER)) == MARKER  # untouched
        c.write(0, bytes(len(MARKER)))
    if command[0] == "verify":  # control: past the card's check, the next step is an engine (stubbed to fail)
        with pytest.raises(pytest.fail.Exception, match="an engine was about to start"):
            main([*command, *where])
    else:  # control: past the card's check, the next step is finding vLLM (stubbed to find none)
        assert main([*command, *where]) == 2
        assert "no interpreter with vLLM" in capsys.readouterr().err


def test_bench_store_refuses_a_page_store(card: UserspaceTarget, capsys: pytest.CaptureFixture[str]) -> None:
    with _host(card) as c:
        PageStore.format(c, partitions=2, avg_page_bytes=256 << 10)
        before = c.read(0, 1 << 20)
    args = ["bench", "store", "--pages", "4", "--page-size", "256K", "--batch", "2", "--queues", "1",
            "--target", f"127.0.0.1:{card.address[1]}"]
    assert main(args) == 2
    assert "holds a page store" in capsys.readouterr().err
    with _host(card) as c:
        assert c.read(0, 1 << 20) == before


def test_bench_store_with_a_page_size_off_the_block_size_runs() -> None:
    """The local card is sized in whole 4 KiB blocks: a 3-byte page used to give the target a capacity it refuses
    (a crash, exit 3); 4 KiB pages (the control) were always whole."""
    for size in ("3", "4K"):
        assert main(["bench", "store", "--pages", "4", "--page-size", size, "--batch", "2", "--queues", "1"]) == 0


def test_bench_store_on_an_empty_namespace_needs_no_flag(card: UserspaceTarget) -> None:
    assert main(["bench", "store", "--pages", "4", "--page-size", "256K", "--batch", "2", "--queues", "1",
                 "--target", f"127.0.0.1:{card.address[1]}"]) == 0


# ------------------------------------------------------------------------------------------------
# Items 6-8: down, up, the token file


def test_down_does_not_kill_a_process_that_is_not_ours(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sd = tmp_path / "state"
    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        S.save(S.state_dir(sd), S.TargetState("user", "127.0.0.1", 4420, "nqn.2026-11.io.awide:x", sleeper.pid,
                                              "host"))
        assert main(["--state-dir", str(sd), "down"]) == 0
        assert "not signalled" in capsys.readouterr().err
        time.sleep(0.2)
        assert sleeper.poll() is None  # still running
        # a recorded identity that no longer matches (pid reused) is refused too
        ident = S.process_identity(sleeper.pid)
        assert ident is not None
        S.save(sd, S.TargetState("user", "127.0.0.1", 4420, "nqn.2026-11.io.awide:x", sleeper.pid, "host",
                                 extra={"identity": {**ident, "start_ticks": ident["start_ticks"] - 1}}))
        assert main(["--state-dir", str(sd), "down"]) == 0
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()


def test_up_is_locked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sd = S.state_dir(tmp_path / "state")
    with S.locked(sd):
        assert main(["--state-dir", str(sd), "up", "--port", "0", "--capacity", "16M"]) == 2
    assert "another `testbed up`" in capsys.readouterr().err
    assert S.load(sd) is None and not (sd / "target.log").exists()  # nothing started


def test_up_that_cannot_record_its_target_stops_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    sd = tmp_path / "state"
    started: list[int] = []

    def failing_save(directory: Path, st: S.TargetState) -> None:
        started.append(st.pid)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(S, "save", failing_save)
    assert main(["--state-dir", str(sd), "up", "--port", "0", "--capacity", "16M"]) == 2
    assert "cannot write the state file" in capsys.readouterr().err
    assert started and not S.pid_alive(started[0])


def test_token_file_does_not_follow_links(tmp_path: Path) -> None:
    d = tmp_path / "private"
    d.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    victim.chmod(0o644)
    (d / "mgmt.token").symlink_to(victim)
    p = write_token_file(d / "mgmt.token", "secret-token")
    assert victim.read_text() == "keep me" and stat.S_IMODE(victim.stat().st_mode) == 0o644
    assert not p.is_symlink() and p.read_text() == "secret-token\n" and stat.S_IMODE(p.stat().st_mode) == 0o600
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(OSError, match="not writable by others"):
        write_token_file(shared / "t", "x")


def test_mdts_64m_accepted_by_up(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sd = str(tmp_path / "state")
    try:
        assert main(["--state-dir", sd, "up", "--port", "0", "--capacity", "128M", "--mdts", "64M"]) == 0, \
            capsys.readouterr().err
        st = S.load(Path(sd))
        assert st is not None
        with Controller.connect(HostConfig(traddr=st.traddr, trsvcid=st.trsvcid, subnqn=st.subnqn,
                                           io_queues=1)) as c:
            assert c.mdts_bytes == 64 << 20
    finally:
        main(["--state-dir", sd, "down"])


# ------------------------------------------------------------------------------------------------
# Item 10: one clear line and exit 2


def _cases(tmp: Path) -> list[tuple[list[str], str]]:
    afile = tmp / "a-file"
    afile.write_text("x")
    nested = tmp / "nested.json"
    nested.write_text("[" * 100_000)
    bad_pid = tmp / "badpid"
    bad_pid.mkdir()
    (bad_pid / "target.json").write_text(json.dumps({"backend": "user", "traddr": "127.0.0.1", "trsvcid": 1,
                                                     "subnqn": "nqn.x", "pid": "abc", "hosted": "host"}))
    sd = ["--state-dir", str(tmp / "sd")]
    closed = _closed_port()
    return [
        ([*sd, "up", "--port", "70000"], "70000"),
        (["bench", "datapath", "--target", "127.0.0.1"], "ADDR:PORT"),
        (["bench", "datapath", "--target", f"127.0.0.1:{closed}"], "cannot reach the target"),
        (["bench", "datapath", "--sizes", "12X"], "not a size"),
        (["bench", "datapath", "--queues", "0"], "outside"),
        (["bench", "datapath", "--depths", "0"], "outside"),
        (["bench", "datapath", "--ops", "reed"], "'reed' is not one of"),
        (["bench", "datapath", "--patterns", "zigzag"], "'zigzag' is not one of"),
        (["bench", "datapath", "--seconds", "nan"], "positive, finite"),
        (["bench", "store", "--target", f"127.0.0.1:{closed}"], "cannot reach the target"),
        (["--state-dir", str(afile), "status"], "not a directory"),
        (["--state-dir", "/proc/adp-kv-state", "up", "--port", "0"], "cannot use /proc/adp-kv-state"),
        (["--state-dir", str(bad_pid), "status"], "'pid' is 'abc'"),
        (["--state-dir", str(bad_pid), "down"], "'pid' is 'abc'"),
        ([*sd, "up", "--port", "0", "--config", str(nested)], "nested too deeply"),
        ([*sd, "up", "--port", "0", "--backing", "/proc/version"], "--backing"),
        ([*sd, "up", "--port", "0", "--nqn", "hello world"], "not an NQN"),
        ([*sd, "up", "--port", "0", "--host", "10.255.255.1"], "not an address of this machine"),
        ([*sd, "up", "--port", "0", "--timeout", "inf"], "positive, finite"),
        ([*sd, "up", "--port", "0", "--capacity", "64T"], "does not fit in RAM"),
        ([*sd, "up", "--backend", "kernel", "--overcommit"], "--overcommit is for the userspace target"),
        # counts and lengths below what a run can use stop at parse time (they used to start engines, then fail an
        # arm with an IndexError, or crash: --slabs 0, --queues 0, --page-size 0)
        (["bench", "agents", "--agents", "4,0"], "0 is outside [1,"),
        (["bench", "agents", "--history-len", "-5"], "-5 is outside [1,"),
        (["bench", "agents", "--turns", "0"], "0 is outside [1,"),
        (["bench", "agents", "--speed-floor", "-1"], "finite number >= 0"),
        (["bench", "sweep", "--users", "0"], "0 is outside [1,"),
        (["bench", "sweep", "--context-len", "0"], "0 is outside [1,"),
        (["bench", "sweep", "--suffix-len", "-1"], "-1 is outside [0,"),
        (["bench", "sweep", "--requests-per-user", "0"], "0 is outside [1,"),
        (["bench", "restart", "--prompts", "0"], "0 is outside [1,"),
        (["bench", "restore-path", "--gb", "0"], "positive, finite number"),
        (["bench", "restore-path", "--slabs", "0"], "0 is outside [1,"),
        (["bench", "restore-path", "--queues", "0"], "0 is outside [1,"),
        (["bench", "restore-path", "--page-size", "0"], "must be a positive size"),
        (["bench", "store", "--page-size", "0"], "must be a positive size"),
        (["bench", "datapath", "--working-set", "0"], "must be a positive size"),
        (["bench", "agents", "--card-bytes", "1K"], "must be at least 16M"),
        (["bench", "agents", "--kv-cache-bytes", "0"], "must be a positive size"),
        (["bench", "sweep", "--offload-bytes", "0"], "must be a positive size"),
        (["bench", "agents", "--arms", ","], "--arms names no arm"),
        (["verify", "--prompts", "0"], "0 is outside [1,"),
    ]


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    for argv, want in _cases(tmp_path):
        r = subprocess.run([*RUN, *argv], capture_output=True, text=True, timeout=60)
        assert "Traceback" not in r.stderr, (argv, r.stderr)
        assert r.returncode == 2, (argv, r.returncode, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and want in lines[0], (argv, r.stderr)


def test_output_read_only_in_part_is_not_a_crash(tmp_path: Path) -> None:
    """`testbed status | head -1`: the reader goes away before testbed writes; exit 0, no traceback. Control: the
    same command read to the end prints its line."""
    argv = [*RUN, "--state-dir", str(tmp_path / "sd"), "status"]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # before the interpreter has started: its first write finds no reader
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 0 and "Traceback" not in err and "crashed" not in err, err
    whole = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert whole.returncode == 0 and whole.stdout.strip() == "no target is up"


# ------------------------------------------------------------------------------------------------
# A fuzz-style pass over every option of every subcommand: parsing (and `up`'s pre-checks) never crash


_BAD_VALUES = ["", "-1", "0", "1e999", "nan", "inf", "-inf", "70000", "12X", "1.3", "abc", ",", "1,,2", "\x00",
               "/proc/version", "[" * 50, "127.0.0.1", ":", "nqn.", "9" * 40, " ", "hello world", "0x10", "-0"]


def _subparsers(p: argparse.ArgumentParser, prefix: list[str]) -> Iterator[tuple[list[str], argparse.ArgumentParser]]:
    yield prefix, p
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sp in a.choices.items():
                yield from _subparsers(sp, [*prefix, name])


def test_fuzz_every_option_no_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    ran: list[list[str]] = []

    def stub(args: argparse.Namespace) -> int:  # parse-time and pre-start checks only: never run a command
        if getattr(args, "command", None) == "up":
            cli._check_up_args(args)
        return 0

    real_build = cli.build_parser

    def build() -> argparse.ArgumentParser:
        p = real_build()
        for _, sp in _subparsers(p, []):
            if sp.get_default("func") is not None:
                sp.set_defaults(func=stub)
        return p

    monkeypatch.setattr(cli, "build_parser", build)
    monkeypatch.setenv("ADP_KV_STATE_DIR", str(tmp_path / "state"))
    n = 0
    for path, sp in _subparsers(real_build(), []):
        if not path:
            continue
        for action in sp._actions:
            if not action.option_strings or action.nargs == 0 or isinstance(action, argparse._HelpAction):
                continue
            for value in _BAD_VALUES:
                argv = [*path, action.option_strings[-1], value]
                n += 1
                try:
                    rc = main(argv)
                except SystemExit as e:
                    rc = e.code
                ran.append(argv)
                assert rc in (0, 2), (argv, rc)
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out
    assert n > 300


def test_two_concurrent_ups_one_wins(tmp_path: Path) -> None:
    """Item 7: two `up` started together on one state dir: one target, one refusal, `down` stops the one."""
    sd = str(tmp_path / "state")
    cmd = [*RUN, "--state-dir", sd, "up", "--port", "0", "--capacity", "16M"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=60) for p in procs]
    try:
        assert sorted(p.returncode for p in procs) == [0, 2], outs
        st = S.load(Path(sd))
        assert st is not None and S.pid_alive(st.pid)
        loser = next(o for p, o in zip(procs, outs, strict=True) if p.returncode == 2)
        assert "another `testbed up`" in loser[1] or "already up" in loser[1], loser
    finally:
        assert main(["--state-dir", sd, "down"]) == 0
    assert S.load(Path(sd)) is None


def test_restore_path_refuses_a_backing_file_with_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Item 5: `bench restore-path --backing FILE` formats FILE: one holding data is refused without the flag."""
    img = tmp_path / "card.img"
    img.write_bytes(bytes(8 << 20) + MARKER)  # data past the first MiB, found by the spread samples
    args = ["bench", "restore-path", "--gb", "0.01", "--page-size", "256K", "--batch-mb", "1", "--slabs", "2",
            "--helpers", "1", "--queues", "1", "--backing", str(img)]
    assert main(args) == 2
    assert "holds data" in capsys.readouterr().err
    assert img.read_bytes()[8 << 20:] == MARKER


def test_up_allow_host_is_enforced_on_loopback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Item 4 through the CLI: `testbed up --allow-host NQN` on 127.0.0.1 refuses a host with another NQN."""
    from adp_connector.device import DeviceError

    allowed = "nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555"
    other = "nqn.2014-08.org.nvmexpress:uuid:99999999-2222-3333-4444-555555555555"
    sd = str(tmp_path / "state")
    try:
        assert main(["--state-dir", sd, "up", "--port", "0", "--capacity", "16M", "--allow-host", allowed]) == 0
        st = S.load(Path(sd))
        assert st is not None

        def connect(hostnqn: str) -> Controller:
            return Controller.connect(HostConfig(traddr=st.traddr, trsvcid=st.trsvcid, subnqn=st.subnqn, io_queues=1,
                                                 hostnqn=hostnqn, auto_reconnect=False, connect_timeout=5))

        with pytest.raises(DeviceError):
            connect(other).close()
        with connect(allowed) as c:
            assert c.read(0, 4096) == bytes(4096)
    finally:
        main(["--state-dir", sd, "down"])
