"""Error messages give the rule, the values and the fix."""

import jax
import jax.numpy as jnp
import pytest
from mpi4py import MPI

from autoshard import mpi


def test_traced_root():
    with pytest.raises(TypeError, match="static_argnums"):
        jax.jit(lambda x, r: mpi.bcast(x, r))(jnp.ones(2), 0)


def test_root_out_of_range(size):
    with pytest.raises(ValueError, match=rf"0 <= root < {size}, got {size}"):
        mpi.reduce(jnp.ones(2), MPI.SUM, size)


def test_shapes(size):
    with pytest.raises(ValueError, match=rf"\({size}, \.\.\.\), got \(\)"):
        mpi.alltoall(jnp.float32(1))
    if MPI.COMM_WORLD.Get_rank() == 0:
        with pytest.raises(ValueError, match="got \\(7, 2\\)"):
            mpi.scatter(jnp.ones((7, 2)), 0) if size != 7 else None


def test_bad_op_and_dtype():
    with pytest.raises(ValueError, match="op must be one of"):
        mpi.allreduce(jnp.ones(2), "sum")
    with pytest.raises(TypeError, match="integer or bool"):
        mpi.allreduce(jnp.ones(2), MPI.BAND)
    with pytest.raises(TypeError, match="SUM, PROD, MIN"):
        mpi.allreduce(jnp.ones(2, jnp.bfloat16), MPI.LAND)


def test_bad_comm_and_token():
    with pytest.raises(TypeError, match="mpi4py communicator"):
        mpi.allreduce(jnp.ones(2), MPI.SUM, comm=3)
    with pytest.raises(TypeError, match="token must be"):
        mpi.allreduce(jnp.ones(2), MPI.SUM, token=5)


def test_bad_tag():
    with pytest.raises(ValueError, match="tag must be >= 0"):
        mpi.send(jnp.ones(2), 0, tag=-3)
