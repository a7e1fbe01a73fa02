"""The distributions work from a NON-editable install, without the source tree or its tests.

Builds wheels of wire, connector, emulator and testbed (``pip wheel --no-deps --no-build-isolation --no-index``,
from a copy of their sources WITHOUT their tests/ folders), installs them with ``pip install --no-deps --target``
into a temporary folder and runs, in fresh interpreters started with ``-S`` (no site-packages processing, so no
editable-install finder of the checkout) and only that folder plus this interpreter's third-party site-packages on
the path, the entry points that used to load test files: ``testbed verify``'s model helpers, ``tiny:`` benchmark
models, the CPU workaround directory, the engine runner and ``scripts/fuzz-target``. vLLM is not needed; generating
a ``tiny:`` model needs an interpreter with torch and transformers (the checkout's .venv-vllm, or
$ADP_KV_VLLM_PYTHON).

Building a wheel offline needs ``bdist_wheel`` (setuptools >= 70.1, or the ``wheel`` package: requirements-dev.txt).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTIONS = ("wire", "connector", "emulator", "testbed")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder the wheels of every distribution were installed into."""
    tmp = tmp_path_factory.mktemp("installed")
    sources = []
    for dist in DISTRIBUTIONS:  # a copy: a build writes build/ and *.egg-info beside the sources
        dst = tmp / "src" / dist
        shutil.copytree(ROOT / dist, dst, ignore=shutil.ignore_patterns("tests", "__pycache__", "*.egg-info",
                                                                       "build", "dist"))
        sources.append(str(dst))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    built = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w",
                            str(tmp / "wheels"), *sources], capture_output=True, text=True, timeout=300)
    if built.returncode != 0 and ("bdist_wheel" in built.stderr or "setuptools" in built.stderr) \
            and not os.environ.get("CI"):
        pytest.skip("cannot build wheels offline here: no setuptools, or setuptools < 70.1 without the 'wheel' "
                    "package (pip install -r requirements-dev.txt)")
    assert built.returncode == 0, built.stderr[-2000:]
    wheels = sorted(str(p) for p in (tmp / "wheels").glob("*.whl"))
    assert len(wheels) == len(DISTRIBUTIONS), wheels
    site = tmp / "site"
    inst = subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(site), *wheels],
                          capture_output=True, text=True, timeout=300)
    assert inst.returncode == 0, inst.stderr[-2000:]
    return site


def _env(site: Path, *front: str) -> dict[str, str]:
    """The installed folder, then this interpreter's third-party packages (crc32c, fastapi ...): no checkout."""
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "ADP_KV_"))}
    env["PYTHONPATH"] = os.pathsep.join([*front, str(site), *sorted(deps)])
    return env


def _python(site: Path, code: str, cwd: Path, *front: str, flags: tuple[str, ...] = ("-S",),
            **extra_env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=cwd, env={**_env(site, *front), **extra_env},
                          capture_output=True, text=True, timeout=600)


def test_installed_tree_has_no_tests_and_the_moved_modules(installed: Path) -> None:
    files = {p.relative_to(installed).as_posix() for p in installed.rglob("*.py")}
    assert not [f for f in files if "/tests/" in f or f.startswith("tests/")]
    for f in ("adp_testbed/models/checkpoints.py", "adp_testbed/models/engine.py",
              "adp_testbed/models/cpu_workarounds/sitecustomize.py", "adp_emulator/fuzz/harness.py",
              "adp_emulator/fuzz/generator.py", "adp_emulator/fuzz/rawhost.py"):
        assert f in files, f


def test_verify_helpers_and_engine_runner_load_from_the_install(installed: Path, tmp_path: Path) -> None:
    code = """
import importlib.util, json, sys
from adp_testbed import verify
vm = verify._models()
print(json.dumps({
    "verify": verify.__file__, "models": vm.__file__, "ensure_model": vm.ensure_model.__module__,
    "checkpoints": sys.modules["adp_testbed.models.checkpoints"].__file__,
    "engine": importlib.util.find_spec("adp_testbed.models.engine").origin,
    "workarounds": vm.CPU_WORKAROUNDS, "vllm_loaded": "vllm" in sys.modules,
    "path": sys.path}))
"""
    r = _python(installed, code, tmp_path)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    for key in ("verify", "models", "checkpoints", "engine", "workarounds"):
        assert Path(got[key]).resolve().is_relative_to(installed.resolve()), (key, got[key])
    assert got["ensure_model"] == "adp_testbed.models.checkpoints"
    assert (Path(got["workarounds"]) / "sitecustomize.py").is_file()
    assert not got["vllm_loaded"]
    venv = Path(sys.prefix).resolve()  # under CI the venv lives in the checkout: its site-packages are no source
    leaks = [p for p in got["path"] if p and Path(p).resolve().is_relative_to(ROOT)
             and not Path(p).resolve().is_relative_to(venv)]
    assert not leaks, got["path"]


def test_testbed_verify_runs_from_the_install(installed: Path, tmp_path: Path) -> None:
    """``testbed verify`` through the CLI: a family this machine cannot run answers 2 with its reason."""
    r = _python(installed, "import sys; from adp_testbed.cli import main; "
                           "sys.exit(main(['verify', '--family', 'dsa', '--json']))", tmp_path)
    assert r.returncode == 2, r.stderr
    assert json.loads(r.stdout)["runnable"] is False


def test_cpu_workaround_directory_is_a_sitecustomize_from_the_install(installed: Path, tmp_path: Path) -> None:
    """What an engine process gets: the directory on PYTHONPATH makes Python run the workaround at start-up."""
    code = ("import sys; m = sys.modules.get('sitecustomize'); "
            "print(m.__file__ if m else '', any(type(f).__name__ == '_PatchOnImport' for f in sys.meta_path))")
    r = _python(installed, code, tmp_path, str(installed / "adp_testbed/models/cpu_workarounds"), flags=())
    assert r.returncode == 0, r.stderr
    where, patched = r.stdout.split()
    assert Path(where).resolve() == (installed / "adp_testbed/models/cpu_workarounds/sitecustomize.py").resolve()
    assert patched == "True"


def _torch_python() -> str | None:
    """An interpreter with torch and transformers (what ``--vllm-python`` names for ``tiny:`` models)."""
    for cand in (os.environ.get("ADP_KV_VLLM_PYTHON"), str(ROOT / ".venv-vllm/bin/python")):
        if cand and Path(cand).exists() and subprocess.run([cand, "-c", "import torch, transformers, safetensors"],
                                                           capture_output=True, timeout=120).returncode == 0:
            return cand
    return None


def test_tiny_model_resolves_from_the_install(installed: Path, tmp_path: Path) -> None:
    """``--model tiny:dense`` (bench/serve.py): the checkpoint is generated by the vLLM interpreter from the
    installed checkpoints module, into an empty cache."""
    python = _torch_python()
    if python is None:
        if os.environ.get("CI"):
            pytest.fail("no interpreter with torch + transformers (.venv-vllm) to generate a tiny model")
        pytest.skip("no interpreter with torch + transformers (.venv-vllm)")
    cache = tmp_path / "cache"
    code = f"from adp_testbed.bench import serve; print(serve.resolve_model('tiny:dense', {python!r}))"
    r = _python(installed, code, tmp_path, ADP_KV_CACHE=str(cache))
    assert r.returncode == 0, r.stderr
    out = Path(r.stdout.strip().splitlines()[-1])
    assert out == cache / "models" / "dense"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 4 and cfg["hidden_size"] == 256
    assert list(out.glob("*.safetensors"))
    # an unknown family is one clear error, before any interpreter starts
    r = _python(installed, f"from adp_testbed.bench import serve; serve.resolve_model('tiny:nope', {python!r})",
                tmp_path, ADP_KV_CACHE=str(cache))
    assert r.returncode != 0 and "unknown tiny model 'nope'" in r.stderr


def test_fuzz_target_script_runs_from_the_install(installed: Path, tmp_path: Path) -> None:
    out = tmp_path / "fuzz.json"
    r = subprocess.run([sys.executable, "-S", str(ROOT / "scripts" / "fuzz-target"), "--engine", "random",
                        "--inputs", "60", "--check-every", "30", "--json", str(out), "--crash-dir",
                        str(tmp_path / "crashes")], cwd=tmp_path, env=_env(installed), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    st = json.loads(out.read_text())
    assert st["inputs"] == 60 and st["crashes"] == st["hangs"] == st["bad_output"] == 0
