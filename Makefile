# The two commands of the quick start: `make demo` and `make test`. Both install what is missing first.
PY := .venv/bin/python
NP ?= 2

.PHONY: setup test test-unit test-mpi test-torch test-robustness test-faults demo clean

setup:
	@bash scripts/setup.sh

test: setup
	@bash scripts/run_tests.sh all

test-unit: setup
	@bash scripts/run_tests.sh unit

test-mpi: setup
	@bash scripts/run_tests.sh mpi

test-torch: setup
	@bash scripts/run_tests.sh torch

test-robustness: setup
	@bash scripts/run_tests.sh robustness

test-faults: setup
	@bash scripts/run_tests.sh faults

demo: setup
	@bash scripts/demo.sh

clean:
	rm -rf .build runs
