"""Every example command in README.md and docs/*.md parses with the real parsers (nothing is executed).

Fenced ``bash``/``sh``/plain code blocks are scanned for ``testbed ...``,
``.venv/bin/testbed ...``, ``python -m adp_testbed...``, ``python -m adp_emulator ...`` and ``scripts/...``
command lines; each is run through ``build_parser().parse_args`` of the program it names (``testbed``, the
emulator, ``scripts/soak``, ``scripts/fuzz-target``, the report); a shell script's options must be among its
``case`` patterns. Every documented ``--kv-transfer-config`` must be JSON that the connector's own
``parse_config`` accepts. A failure names the file and line.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.machinery
import importlib.util
import io
import json
import re
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from adp_testbed import options as O
from adp_testbed.cli import build_parser as cli_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}

#: Words that only prefix a command (``sudo``, ``time``), and ``VAR=value`` assignments.
PREFIX_WORDS = {"sudo", "time", "exec", "env", "nohup"}
ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
BOX_DRAWING = re.compile("[\u2500-\u257f]")


@dataclass(frozen=True)
class DocCommand:
    where: str  # file:line
    program: str  # testbed, emulator, report or script
    script: str | None  # scripts/... path
    argv: list[str]


def _shell_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of the lines in shell code blocks, continuations joined. Inline code spans are left
    out (they name commands and options in prose: `testbed bench store --target`), and so are untagged blocks
    that draw diagrams."""
    lang: str | None = None
    block: list[tuple[int, str]] = []
    for n, line in enumerate(text.splitlines(), 1):
        fence = re.match(r"^\s*```(\S*)", line)
        if fence and lang is None:
            lang, block = fence.group(1).lower(), []
            continue
        if fence:
            if lang in SHELL_LANGS and not any(BOX_DRAWING.search(t) for _, t in block):
                yield from _joined(block)
            lang = None
            continue
        if lang is not None:
            block.append((n, line))


def _joined(block: list[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    pending, start = "", 0
    for n, line in block:
        if not pending:
            start = n
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line
        pending = ""


def _segments(line: str) -> list[list[str]]:
    """The simple commands of one shell line: split at ``&&``, ``||``, ``|``, ``;``, ``(``, ``)`` (so
    ``URL=$(testbed status --json | ...)`` yields ``testbed status --json``); comments and redirections
    (``> FILE``) dropped."""
    lex = shlex.shlex(line, posix=True, punctuation_chars="();|&<>")
    lex.whitespace_split = True
    segs: list[list[str]] = [[]]
    redirect = False
    for tok in lex:
        if redirect:
            redirect = False
        elif tok and set(tok) <= set("<>&") and set(tok) & set("<>"):
            redirect = True
        elif tok and set(tok) <= set("();|&"):
            segs.append([])
        else:
            segs[-1].append(tok)
    return [s for s in segs if s]


def _command(words: list[str]) -> tuple[str, str | None, list[str]] | None:
    """(program, script, argv) if ``words`` runs one of ours."""
    while words and (words[0] in PREFIX_WORDS or ASSIGNMENT.match(words[0]) or words[0].endswith("$")):
        words = words[1:]
    if words and words[0] == "prlimit":
        words = words[1:]
        while words and words[0].startswith("-"):
            words = words[1:]
    if not words:
        return None
    head, rest = words[0], words[1:]
    if re.fullmatch(r"(?:\S*/)?python3?(?:\.\d+)?", head):
        if rest[:1] == ["-m"] and len(rest) > 1:
            mod, argv = rest[1], rest[2:]
            if mod in ("adp_testbed", "adp_testbed.cli"):
                return "testbed", None, argv
            if mod == "adp_testbed.bench.report":
                return "report", None, argv
            if mod == "adp_emulator":
                return "emulator", None, argv
            return None
        head, rest = (rest[0], rest[1:]) if rest and rest[0].startswith("scripts/") else ("", [])
    elif head in ("bash", "sh") and rest and rest[0].startswith("scripts/"):
        head, rest = rest[0], rest[1:]
    if re.fullmatch(r"(?:\.venv[\w-]*/bin/)?testbed", head):
        return "testbed", None, rest
    if re.fullmatch(r"(?:\.venv[\w-]*/bin/)?adp-emulator", head):
        return "emulator", None, rest
    if head.startswith("scripts/"):
        return "script", head, rest
    return None


def doc_commands(text: str, name: str) -> list[DocCommand]:
    """The example commands of one Markdown document."""
    out = []
    for n, line in _shell_lines(text):
        try:
            segs = _segments(line)
        except ValueError as e:  # only a line that names one of ours must be shell (JSON sketches are not)
            if re.search(r"testbed|adp_emulator|adp_testbed|scripts/", line):
                out.append(DocCommand(f"{name}:{n}", "shell", None, [f"<unparsable shell: {e}>"]))
            continue
        for words in segs:
            got = _command(words)
            if got:
                out.append(DocCommand(f"{name}:{n}", *got))
    return out


def _load_script(path: Path) -> object:
    loader = importlib.machinery.SourceFileLoader(f"docs_script_{path.name.replace('-', '_')}", str(path))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def _parser_for(cmd: DocCommand) -> Callable[[], argparse.ArgumentParser] | None:
    if cmd.program == "testbed":
        return cli_parser
    if cmd.program == "emulator":
        from adp_emulator.__main__ import build_parser

        return build_parser
    if cmd.program == "report":
        from adp_testbed.bench.report import build_parser as report_parser

        return report_parser
    path = ROOT / (cmd.script or "")
    if (path.is_file() and path.read_text().startswith("#!/usr/bin/env python")) or path.suffix == ".py":
        mod = _load_script(path)
        return getattr(mod, "build_parser", None)
    return None


def check(cmd: DocCommand) -> str | None:
    """None if ``cmd`` parses; else why not."""
    if cmd.program == "shell":
        return cmd.argv[0]
    if cmd.program == "script":
        path = ROOT / (cmd.script or "")
        if not path.is_file():
            return f"{cmd.script} does not exist"
        factory = _parser_for(cmd)
        if factory is None:
            text = path.read_text()
            if path.suffix == ".py" or text.startswith("#!/usr/bin/env python"):
                if "argparse" in text:
                    return f"{cmd.script} has no build_parser() to check its options with"
                return None  # positional arguments only (sys.argv)
            known = set(re.findall(r"^\s*(--[\w-]+)(?:\|[^)]*)?\)", text, re.M))
            if known:  # a shell script with a `case` over its options
                bad = [a.split("=")[0] for a in cmd.argv if a.startswith("--") and a.split("=")[0] not in known]
                if bad:
                    return f"{cmd.script} has no option {bad[0]} (it knows {sorted(known)})"
            return None
    else:
        factory = _parser_for(cmd)
    assert factory is not None
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = factory().parse_args(cmd.argv)
            O.resolve_target(args)
    except O.UsageError as e:
        return str(e)
    except SystemExit as e:
        if e.code not in (0, None):  # --help / --version exit 0
            return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {e.code}"
    return None


def all_commands() -> list[DocCommand]:
    return [c for doc in DOCS for c in doc_commands(doc.read_text(), str(doc.relative_to(ROOT)))]


def test_the_docs_hold_example_commands() -> None:
    """The scan finds the documented commands at all (else the test below checks nothing)."""
    cmds = all_commands()
    by = {c.program for c in cmds}
    assert len(cmds) >= 40 and {"testbed", "script", "emulator"} <= by, (len(cmds), by)
    assert any(c.where.startswith("README.md") and c.argv[:1] == ["demo"] for c in cmds)
    assert any(c.script == "scripts/soak" and c.argv for c in cmds)


def test_every_documented_command_parses() -> None:
    failures = [f"{c.where}: {c.program} {c.script or ''} {shlex.join(c.argv)}: {why}"
                for c in all_commands() if (why := check(c))]
    assert not failures, "documented commands that do not parse:\n" + "\n".join(failures)


@pytest.mark.parametrize("line, expect", [
    ("testbed bench datapath --no-such-option 1", "unrecognized arguments: --no-such-option"),
    ("testbed demo --vllm-pythn /usr/bin/python3", "unrecognized arguments"),
    (".venv/bin/testbed up --port 70000", "is not a TCP port"),
    ("python -m adp_emulator serve --made-up", "unrecognized arguments: --made-up"),
    ("scripts/soak --seconds 10 --not-an-option", "unrecognized arguments: --not-an-option"),
    ("scripts/fuzz-target --inputs 10 --hold-opn 4", "unrecognized arguments"),
    ("bash scripts/bootstrap --sytem", "has no option --sytem"),
    ("scripts/no-such-script --x", "does not exist"),
    ("testbed verify --target 10.0.0.1:4420 --trsvcid 4420", "not both"),
])
def test_a_wrong_command_is_caught(line: str, expect: str) -> None:
    """The checker rejects made-up options, bad values, missing scripts and conflicts, naming the line."""
    (cmd,) = doc_commands(f"```bash\n{line}\n```\n", "fake.md")
    assert cmd.where == "fake.md:2"
    why = check(cmd)
    assert why is not None and expect in why, why


def test_extraction_handles_shell_syntax() -> None:
    text = ("```sh\nURL=$(testbed status --json | python3 -c 'x')\n"
            "PYTHONHASHSEED=0 testbed bench restart \\\n  --preset cpu-smoke   # comment\n"
            "testbed up --port 0 && testbed down\nls testbed/tests\ntestbed status --json > s.json\n```\n"
            "Inline: `scripts/soak --seconds 5`.\n"
            "```python\ntestbed up --port 1\n```\n```\nscripts/soak --seconds 5\n```\n")
    got = [(c.where, c.program, c.argv) for c in doc_commands(text, "t.md")]
    assert got == [("t.md:2", "testbed", ["status", "--json"]),
                   ("t.md:3", "testbed", ["bench", "restart", "--preset", "cpu-smoke"]),
                   ("t.md:5", "testbed", ["up", "--port", "0"]), ("t.md:5", "testbed", ["down"]),
                   ("t.md:7", "testbed", ["status", "--json"]),
                   ("t.md:14", "script", ["--seconds", "5"])]


def kv_transfer_configs(text: str, name: str) -> list[tuple[str, str]]:
    """(file:line, JSON text) of every ``--kv-transfer-config '...'`` in the shell blocks of one document."""
    out = []
    for n, line in _shell_lines(text):
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        out += [(f"{name}:{n}", words[i + 1]) for i, w in enumerate(words[:-1]) if w == "--kv-transfer-config"]
    return out


def check_kv_transfer_config(raw: str) -> str | None:
    """None if the documented ``--kv-transfer-config`` is JSON that names ADPConnector and whose
    ``kv_connector_extra_config`` the connector accepts; else why not."""
    from adp_connector.vllm.config import ConfigError, parse_config

    try:
        cfg = json.loads(raw)
    except ValueError as e:
        return f"not JSON: {e}"
    if cfg.get("kv_connector") != "ADPConnector":
        return f"kv_connector is {cfg.get('kv_connector')!r}, not 'ADPConnector'"
    if cfg.get("kv_role") != "kv_both":
        return f"kv_role is {cfg.get('kv_role')!r} (the connector saves and loads: kv_both)"
    try:
        parse_config(cfg.get("kv_connector_extra_config"))
    except ConfigError as e:
        return str(e)
    return None


def test_documented_kv_transfer_configs_are_valid() -> None:
    found = [c for doc in DOCS for c in kv_transfer_configs(doc.read_text(), str(doc.relative_to(ROOT)))]
    assert len(found) >= 2, found  # README: the emulator and a card at an address
    bad = [f"{where}: {why}" for where, raw in found if (why := check_kv_transfer_config(raw))]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("raw, expect", [
    ('{"kv_connector": "ADPConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"tradr": "h"}}',
     "unknown kv_connector_extra_config key"),
    ('{"kv_connector": "ADPConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"trsvcid": "x"}}',
     "trsvcid"),
    ('{"kv_connector": "ADPConnector", "kv_role": "kv_both",', "not JSON"),
    ('{"kv_connector": "LMCacheConnector", "kv_role": "kv_both"}', "not 'ADPConnector'"),
])
def test_a_wrong_kv_transfer_config_is_caught(raw: str, expect: str) -> None:
    line = f"vllm serve m --kv-transfer-config '{raw}'"
    ((where, got),) = kv_transfer_configs(f"```bash\n{line}\n```\n", "fake.md")
    why = check_kv_transfer_config(got)
    assert where == "fake.md:2" and why is not None and expect in why, why
