# MPI: system packages, mpi4py, the native FFI handlers, mpirun tests and the benchmark.
# Included by the main Makefile (uses $(PY), $(VENV), $(STAMP)).
.PHONY: native mpi-deps mpi4jax test-mpi bench-mpi

MPI_EXT := src/autoshard/mpi/_ffi.so
MPI_SRC := src/autoshard/mpi/_ffi.cc
MPIRUN := mpirun --oversubscribe --allow-run-as-root
# Keep a hung rank from stalling CI forever (the tests also abort on crashes).
MPI_TIMEOUT := timeout --signal=KILL 600

# Open MPI (Debian packages) and mpi4py, installed only when missing.
mpi-deps: $(STAMP)
	@command -v mpicxx >/dev/null && command -v mpirun >/dev/null || { \
	  echo "installing libopenmpi-dev openmpi-bin"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenmpi-dev openmpi-bin >/dev/null; }
	@$(PY) -c "import mpi4py" 2>/dev/null || $(PY) -m pip install -q "mpi4py>=4.0"

native: mpi-deps $(MPI_EXT)

# The extension is built by the package's own install (setup.py's build hook: the MPI compiler
# wrapper against jax.ffi.include_dir()), exactly as `pip install autoshard` builds it; here
# into the editable checkout, without build isolation so that it sees this MPI and jaxlib.
$(MPI_EXT): $(MPI_SRC) setup.py $(STAMP)
	$(PY) -m pip install -q "setuptools>=77" wheel
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	@test -f $@ || { echo "native extension not built: $$(cat src/autoshard/mpi/_build.txt)"; exit 1; }

test-mpi: native
	$(MPI_TIMEOUT) $(MPIRUN) -np 2 $(PY) -m pytest -q -p no:cacheprovider tests/mpi
	$(MPI_TIMEOUT) $(MPIRUN) -np 3 $(PY) -m pytest -q -p no:cacheprovider tests/mpi/test_roots.py \
	  tests/mpi/test_notoken.py

# mpi4jax, for the benchmark's comparison column only (never needed by the tests; when it cannot
# be installed the benchmark prints why and skips the column). Its setup.py builds a CUDA
# extension whenever it finds nvcc (here a CUDA toolkit without a GPU); CUDA_PATH naming a
# directory without CUDA headers makes it build the CPU extension alone. Built against this
# jaxlib and MPI (no build isolation), with nanobind kept out of the environment.
MPI4JAX_VERSION := 0.9.1.post2
mpi4jax: mpi-deps
	@$(PY) -c "import mpi4jax" 2>/dev/null || { tmp=$$(mktemp -d); \
	  { $(PY) -m pip install -q --target $$tmp/nanobind nanobind && \
	    CUDA_PATH=$$tmp PYTHONPATH=$$tmp/nanobind $(PY) -m pip install -q --no-deps \
	      --no-build-isolation "mpi4jax==$(MPI4JAX_VERSION)"; } \
	  || echo "mpi4jax $(MPI4JAX_VERSION) not installed: benchmarks/mpi.py skips its column"; \
	  rm -rf $$tmp; }

bench-mpi: native mpi4jax
	$(MPI_TIMEOUT) $(MPIRUN) -np 2 $(PY) benchmarks/mpi.py
