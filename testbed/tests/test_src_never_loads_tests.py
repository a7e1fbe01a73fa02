"""Product code (every file under */src/) never imports or loads anything under */tests/.

A static scan of every Python file under ``<distribution>/src/`` and of the Python scripts under scripts/: an
import of a module that lives in a tests folder (``vllm_models``, ``target_client``, ``test_*`` ...), an import
through a ``tests`` package, or a string that is a path into a tests folder (``"tests"`` as a path component,
``".../tests/..."`` without spaces: what ``sys.path.insert``, ``spec_from_file_location`` or ``Path(...) / "tests"``
need). Prose that names a test file (a docstring, a message with spaces) is not a load. The negative controls feed
the scanner the patterns the tree used before the move, and clean code.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_PATH_INTO_TESTS = re.compile(r"^[\w.~/${}-]*(^|/)tests(/[\w./-]*)?$")


def _test_module_names(root: Path) -> set[str]:
    """Stems of every Python module under a tests folder (what ``sys.path.insert(tests)`` makes importable)."""
    return {p.stem for p in root.glob("*/tests/**/*.py")} - {"__init__"}


def _docstring_nodes(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def scan_source(text: str, test_modules: set[str], name: str = "<src>") -> list[str]:
    """Every place in ``text`` that imports or loads something under a tests folder."""
    tree = ast.parse(text, name)
    docs = _docstring_nodes(tree)
    found = []
    for node in ast.walk(tree):
        mods: list[str] = []
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods = [("." * node.level) + node.module]
        for mod in mods:
            parts = mod.lstrip(".").split(".")
            if "tests" in parts or (not mod.startswith(".") and parts[0] in test_modules):
                found.append(f"{name}:{node.lineno}: imports {mod}")
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
                and _PATH_INTO_TESTS.match(node.value)):
            found.append(f"{name}:{node.lineno}: path into tests {node.value!r}")
    return found


def _product_files(root: Path) -> list[Path]:
    """Every Python file under */src/, and the Python scripts under scripts/ (commands a user runs)."""
    scripts = [p for p in sorted(root.glob("scripts/**/*")) if p.is_file() and (
        p.suffix == ".py" or (p.read_bytes()[:40].startswith(b"#!") and b"python" in p.read_bytes()[:40]))]
    return sorted(root.glob("*/src/**/*.py")) + scripts


def test_no_src_file_imports_or_loads_tests() -> None:
    names = _test_module_names(ROOT)
    assert {"target_client", "test_fuzz_target", "card"} <= names  # the scan knows the tests' modules
    files = _product_files(ROOT)
    assert len(files) > 50 and ROOT / "scripts" / "fuzz-target" in files, files
    found = [hit for f in files for hit in scan_source(f.read_text(), names, str(f.relative_to(ROOT)))]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("code", [
    # the patterns product code used before the move (testbed verify, bench/serve.py, scripts/fuzz-target)
    'path = Path(__file__).resolve().parents[3] / "connector" / "tests" / "vllm" / "vllm_models.py"',
    'sys.path.insert(0, str(ROOT / "emulator" / "tests"))',
    'helpers = repo_root() / "connector/tests/vllm"',
    "import vllm_models",
    "import test_fuzz_target as tf",
    "from target_client import RawQueue",
    "from connector.tests.vllm import card",
    "def f():\n    import card\n",
    "from ..tests import card",
], ids=["parents-tests", "syspath-tests", "path-literal", "import-moved", "import-test-module", "from-helper",
        "tests-package", "lazy-import", "relative-tests"])
def test_negative_control_scanner_flags_a_load_of_tests(code: str) -> None:
    assert scan_source(code, {"vllm_models", "test_fuzz_target", "target_client", "card"})


def test_negative_control_scanner_passes_clean_code() -> None:
    code = '''"""Docstring naming connector/tests/vllm/test_vllm_layouts.py is prose."""
from adp_testbed import models
from . import tests_helpers
import unittest
MSG = "covered by connector/tests/vllm/test_vllm_layouts.py (not a load)"
p = Path("results") / "latest"
'''
    assert scan_source(code, {"vllm_models", "card"}) == []
