"""MPI tests run in the plain suite (1 rank) and under mpirun (`make test-mpi`, 2 and 3 ranks)."""

import pathlib

import pytest

try:
    from mpi4py import MPI

    from autoshard import mpi
except ImportError as e:   # no mpi4py, no libmpi, or the native part not built
    MPI = mpi = None
    WHY_SKIPPED = f"autoshard.mpi needs MPI ({e}); run `make native`"

    class _WithoutMpi(pytest.File):
        def collect(self):
            pytest.skip(WHY_SKIPPED)

    def pytest_pycollect_makemodule(module_path, parent):
        """Each MPI test module is reported skipped, not imported (it imports mpi4py)."""
        return _WithoutMpi.from_parent(parent, path=module_path)


def pytest_collection_modifyitems(config, items):
    # pytest calls this hook with every item of the session, not only this directory's.
    here = pathlib.Path(__file__).parent
    for item in items:
        if here not in item.path.parents:
            continue
        item.add_marker(pytest.mark.mpi)
        # A rank whose partner failed would wait forever; fail the test instead.
        item.add_marker(pytest.mark.timeout(120))


@pytest.fixture
def comm():
    return MPI.COMM_WORLD


@pytest.fixture
def rank(comm):
    return comm.Get_rank()


@pytest.fixture
def size(comm):
    return comm.Get_size()
