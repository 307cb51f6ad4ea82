"""Roots other than 0 (run at -np 3 by `make test-mpi`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

from autoshard import mpi


@pytest.fixture(params=["first", "last"])
def root(request, size):
    return 0 if request.param == "first" else size - 1


def test_bcast_root(root, rank):
    y, _ = jax.jit(lambda x: mpi.bcast(x, root))(jnp.full((2,), rank, jnp.int32))
    np.testing.assert_array_equal(y, [root, root])


def test_reduce_root(root, rank, size):
    y, _ = mpi.reduce(jnp.full((2,), rank + 1.0), MPI.SUM, root)
    expected = size * (size + 1) / 2 if rank == root else rank + 1
    np.testing.assert_array_equal(y, [expected, expected])


def test_gather_scatter_root(root, rank, size):
    y, _ = jax.jit(lambda x: mpi.gather(x, root))(jnp.int32(rank))
    if rank == root:
        np.testing.assert_array_equal(y, np.arange(size))
    x = jnp.arange(size, dtype=jnp.int32) * 10 if rank == root else jnp.int32(0)
    y, _ = mpi.scatter(x, root)
    assert y == 10 * rank
