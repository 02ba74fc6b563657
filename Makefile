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
