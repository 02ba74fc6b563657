#!/usr/bin/env bash
# The GPU runbook: builds with --device cuda (tiny gpt-oss none/nvfp4/fp8, the embedded pair's default fp8
# and nvfp4) and `verify` on each, the batched runtime eager vs CUDA graphs at C = 1, 8, 32 in bf16 and
# float32, then (TRAIN_SECONDS > 0) a drafter leg; one table at the end (scripts/gpu_session.py says how).
# On a GPU machine with the project's dependencies (scripts/gpu_stage.sh / gpu_unstage.sh bring them):
#
#   OUT=/tmp/out scripts/gpu_session.sh [--train-seconds 150] [--budget-s 470] [...gpu_session.py flags]
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PY:-python3}" scripts/gpu_session.py --out "${OUT:-gpu-session-out}" "$@"
