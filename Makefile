# autoshard: the two set-up commands are `make demo` and `make test` (see README.md).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CPU8 := XLA_FLAGS=--xla_force_host_platform_device_count=8

.PHONY: demo test test-fast test-slow lint bench venv clean

venv: $(STAMP)

# Re-install when the project metadata changes; `make test` keeps the environment up to date.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,bench]"
	touch $@

demo: $(STAMP)
	$(CPU8) $(PY) -m autoshard.examples.gpt

# The whole suite: single-process tests, then the MPI tests under mpirun (mk/mpi.mk).
test: $(STAMP) native
	$(PY) -m ruff check src tests benchmarks
	$(PY) -m pytest -q --durations=15
	$(MAKE) --no-print-directory test-mpi

test-fast: $(STAMP)
	$(PY) -m pytest -q -x

test-slow: $(STAMP) native
	$(PY) -m pytest -q -m slow

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks

bench: $(STAMP) native
	$(CPU8) $(PY) benchmarks/suite.py
	$(CPU8) $(PY) benchmarks/solver.py
	$(CPU8) $(PY) benchmarks/dispatch.py
	$(CPU8) $(PY) benchmarks/programs.py
	$(MAKE) --no-print-directory bench-mpi

# Issue 25: four model families against expert jax.jit plans, and a decoder layer sweep
# (about 35 min on 2 heavily shared cores; benchmarks/results/families.{json,md}).
.PHONY: bench-families
bench-families: $(STAMP)
	$(PY) benchmarks/families.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache src/autoshard/mpi/_ffi.so \
	  src/autoshard/mpi/_build.txt

# MPI: system packages, mpi4py, native FFI handlers, mpirun tests and benchmark.
include mk/mpi.mk
