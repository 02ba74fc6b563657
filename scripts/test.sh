#!/usr/bin/env bash
# Runs the whole test suite (after scripts/setup.sh). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# The Slurm integration tests need a real one-node cluster: install slurm-wlm + munge (Debian,
# as root; a no-op once installed). The tests start and stop the daemons themselves.
if [ "$(id -u)" -eq 0 ]; then
  bash scripts/install_slurm.sh
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  sudo bash scripts/install_slurm.sh
else
  echo "[test] not root: Slurm tests will be skipped unless slurm-wlm is already installed" >&2
fi
# One torch thread per process: the suite runs servers, clients and Slurm jobs side by side on 2
# cores, and oversubscribed OpenMP threads make multi-token matmuls many times slower.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Test modules run on up to 4 workers side by side (pytest-xdist; one per core: 2 on the CI's
# 2 cores, 1397 s -> 653 s for the whole suite), each module whole on one worker (--dist loadfile:
# a module's servers, Slurm cluster and fixtures stay in one process). DFLASH_TRT_TEST_WORKERS=0
# runs everything in this one process.
# (nproc reads OMP_NUM_THREADS, set to 1 above: ask it without)
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 1)
workers=${DFLASH_TRT_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}
parallel=()
[ "$workers" -gt 1 ] && parallel=(-n "$workers" --dist loadfile)
set +e
# The vLLM peer tests are opt-in (`make test-peer`) even where the peer is installed.
.venv/bin/python -m pytest -q -ra --durations=15 "${parallel[@]}" -m "not peer" "$@"
rc=$?
# pytest exits 5 when it collected no test: that is a failure of the suite, not a pass.
[ "$rc" -eq 5 ] && echo "[test] no tests were collected" >&2
# The guards' mutation check (tests/mutants.toml, docs/testing.md) after a whole suite that passed:
# ~4-5 min on the 2-core machine (97 mutants, 2026-11-29). No baseline: the suite has just run every guard on this tree.
# Its scratch copies are the tree's git files: outside a git checkout it is left out, and says so.
if [ "$rc" -eq 0 ] && [ "$#" -eq 0 ]; then
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    PYTHONPATH=$PWD .venv/bin/python scripts/mutation_check.py --no-baseline || rc=$?
  else
    echo "[test] not a git checkout: the mutation check (make mutants) left out" >&2
  fi
fi
exit "$rc"
