#!/usr/bin/env bash
# Runs the whole test suite (after scripts/setup.sh). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
exec .venv/bin/python -m pytest -q -ra "$@"
