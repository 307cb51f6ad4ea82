"""Variable counts per rank: allgatherv (static counts) and alltoallv (run-time counts)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autoshard import mpi

MODES = ["eager", "jit"]


def run(mode, fn, *args):
    return jax.jit(fn)(*args) if mode == "jit" else fn(*args)


def rows(rank, count, dtype=jnp.float32, width=3):
    # Row k of rank r holds 100 r + 10 k + column.
    return (100 * rank + 10 * jnp.arange(count)[:, None] + jnp.arange(width)).astype(dtype)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32, jnp.bfloat16])
def test_allgatherv(mode, dtype, rank, size):
    counts = tuple(r + 1 for r in range(size))  # rank r has r + 1 rows
    y, token = run(mode, lambda x: mpi.allgatherv(x, counts), rows(rank, counts[rank], dtype))
    expected = np.concatenate([np.asarray(rows(r, counts[r], dtype)) for r in range(size)])
    assert y.shape == (sum(counts), 3) and y.dtype == dtype and isinstance(token, mpi.Token)
    np.testing.assert_array_equal(np.asarray(y, np.float64), expected.astype(np.float64))


def test_allgatherv_empty_and_transposed_and_vmap(rank, size):
    counts = (0,) * (size - 1) + (2,)  # only the last rank contributes
    x = rows(rank, counts[rank], width=2).T.T if counts[rank] else jnp.zeros((0, 2))
    y, _ = mpi.allgatherv(x, counts)
    np.testing.assert_array_equal(y, rows(size - 1, 2, width=2))
    x = jnp.arange(6.0).reshape(3, 2).T + rank  # (2, 3), non-contiguous input
    counts = (2,) * size
    y, _ = jax.jit(lambda x: mpi.allgatherv(x, counts))(x)
    np.testing.assert_array_equal(y, np.concatenate([np.arange(6.0).reshape(3, 2).T + r
                                                     for r in range(size)]))
    batch = jnp.stack([x, 2 * x])  # vmap over a leading batch axis
    y = jax.vmap(lambda v: mpi.allgatherv(v, counts)[0])(batch)
    assert y.shape == (2, 2 * size, 3)
    np.testing.assert_array_equal(y[1], 2 * np.concatenate([np.arange(6.0).reshape(3, 2).T + r
                                                            for r in range(size)]))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("given", [True, False])
def test_alltoallv(mode, given, rank, size):
    max_rows = size + 1
    # Rank r sends (r + j) % max_rows + 0 rows to rank j, computed inside the jit.
    def f(x):
        send = (rank + jnp.arange(size)) % max_rows
        recv = (jnp.arange(size) + rank) % max_rows if given else None
        return mpi.alltoallv(x, send, recv)

    x = jnp.stack([rows(rank, max_rows) + 1000 * j for j in range(size)])
    y, token = run(mode, f, x)
    assert y.shape == (size, max_rows, 3) and isinstance(token, mpi.Token)
    for j in range(size):
        n = (j + rank) % max_rows
        np.testing.assert_array_equal(y[j, :n], rows(j, n) + 1000 * rank)
        np.testing.assert_array_equal(y[j, n:], 0)


def test_alltoallv_vmap(rank, size):
    x = jnp.stack([rows(rank, 2) + 1000 * j for j in range(size)])
    counts = jnp.ones(size, jnp.int32)
    y = jax.vmap(lambda v: mpi.alltoallv(v, counts, counts)[0])(jnp.stack([x, -x]))
    assert y.shape == (2, size, 2, 3)
    for j in range(size):
        np.testing.assert_array_equal(y[1, j, 0], -(rows(j, 1)[0] + 1000 * rank))
        np.testing.assert_array_equal(y[:, j, 1], 0)


def test_variable_errors(rank, size):
    with pytest.raises(ValueError, match=rf"counts\[{rank}\] = 5 rows on rank {rank}.*got \(2, 3\)"):
        mpi.allgatherv(jnp.ones((2, 3)), (5,) * size)
    with pytest.raises(ValueError, match=rf"one non-negative int per rank \({size}\)"):
        mpi.allgatherv(jnp.ones((2, 3)), (2,) * (size + 1))
    with pytest.raises(TypeError, match="static_argnums"):
        jax.jit(lambda c: mpi.allgatherv(jnp.ones((2, 3)), c))(jnp.full(size, 2))
    with pytest.raises(ValueError, match=rf"\({size}, max_rows, \.\.\.\), got \(3,\)"):
        mpi.alltoallv(jnp.ones(3), jnp.zeros(size, jnp.int32))
    with pytest.raises(ValueError, match=rf"send_counts must be an integer array of shape \({size},\)"):
        mpi.alltoallv(jnp.ones((size, 2)), jnp.zeros(size + 1, jnp.int32))
    with pytest.raises(Exception, match=r"count out of range .* \[0, 2\]"):
        mpi.alltoallv(jnp.ones((size, 2)), jnp.full(size, 3), jnp.full(size, 3))[0].block_until_ready()
