#!/usr/bin/env bash
# The main job on the embedded default pair. Grows with the project: generate -> build -> serve.
set -euo pipefail
cd "$(dirname "$0")/.."
DFLASH=.venv/bin/dflash-trt
$DFLASH generate --tiny --compare "Explain speculative decoding in one sentence."
