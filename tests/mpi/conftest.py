"""MPI tests run in the plain suite (1 rank) and under mpirun (`make test-mpi`, 2 and 3 ranks)."""

import pytest

mpi = pytest.importorskip("autoshard.mpi", reason="autoshard.mpi needs MPI: run `make native`")
from mpi4py import MPI  # noqa: E402


def pytest_collection_modifyitems(items):
    for item in items:
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
