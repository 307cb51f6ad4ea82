"""token= accepts None, an autoshard.mpi.Token and any JAX token, concrete or traced (as mpi4jax)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

from autoshard import mpi


def _ops(rank, size, token):
    """Every operation that takes a token, with ``token``; returns their results."""
    x = jnp.arange(4.0) + rank
    peer = (rank + 1) % size
    results = [
        mpi.allreduce(x, MPI.SUM, token=token)[0],
        mpi.reduce(x, MPI.SUM, 0, token=token)[0],
        mpi.scan(x, MPI.SUM, token=token)[0],
        mpi.bcast(x, 0, token=token)[0],
        mpi.allgather(x, token=token)[0],
        mpi.alltoall(jnp.stack([x] * size), token=token)[0],
        mpi.sendrecv(x, x, (rank - 1) % size, peer, token=token)[0],
    ]
    mpi.barrier(token=token)
    mpi.send(x, peer, tag=7, token=token)
    results.append(mpi.recv(x, (rank - 1) % size, tag=7, token=token)[0])
    return results


@pytest.mark.parametrize("kind", ["none", "autoshard", "jax_concrete", "jax_traced"])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_any_token_accepted_results_unchanged(kind, mode, rank, size):
    expected = _ops(rank, size, None)

    def run(_):
        token = {"none": None, "autoshard": mpi.Token(), "jax_traced": jax.lax.create_token(),
                 "jax_concrete": concrete}[kind]
        return _ops(rank, size, token)

    concrete = jax.lax.create_token()  # a concrete token, created outside any jit
    if kind == "jax_traced" and mode == "eager":
        pytest.skip("a traced token exists only under jit")
    got = jax.jit(run)(0) if mode == "jit" else run(0)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)


def test_bad_token_names_the_value_and_the_fix():
    with pytest.raises(TypeError, match=r"token must be None, an autoshard.mpi.Token .* or a JAX "
                                        r"token .*got str 'tok'.*omit token="):
        mpi.bcast(jnp.ones(2), 0, token="tok")
