"""Each operation eagerly and under jit, on int/float dtypes, scalars and transposed inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

from autoshard import mpi

DTYPES = [jnp.float32, jnp.int32, jnp.float64, jnp.bfloat16]
MODES = ["eager", "jit"]


def run(mode, fn, *args):
    return jax.jit(fn)(*args) if mode == "jit" else fn(*args)


def data(rank, dtype, shape=(3, 2)):
    return (jnp.arange(np.prod(shape)).reshape(shape) + rank).astype(dtype)


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce(mode, dtype, rank, size):
    x = data(rank, dtype)
    y, token = run(mode, lambda x: mpi.allreduce(x, MPI.SUM), x)
    expected = sum(np.asarray(data(r, np.float64)) for r in range(size))
    np.testing.assert_allclose(np.asarray(y, np.float64), expected)
    assert y.dtype == dtype and isinstance(token, mpi.Token)


@pytest.mark.parametrize("op,fn", [(MPI.MAX, np.max), (MPI.MIN, np.min), (MPI.PROD, np.prod)])
def test_allreduce_ops(op, fn, rank, size):
    x = jnp.array([rank + 1, 2 - rank], jnp.int32)
    y, _ = mpi.allreduce(x, op)
    ranks = np.array([[r + 1, 2 - r] for r in range(size)])
    np.testing.assert_array_equal(y, fn(ranks, axis=0))


@pytest.mark.parametrize("mode", MODES)
def test_scalar_and_transposed(mode, rank, size):
    y, _ = run(mode, lambda x: mpi.allreduce(x, MPI.SUM), jnp.float32(rank))
    assert y.shape == () and y == sum(range(size))
    x = data(rank, jnp.float32, (2, 3))
    y, _ = run(mode, lambda x: mpi.allreduce(x.T, MPI.SUM), x)
    np.testing.assert_allclose(y, sum(np.asarray(data(r, np.float32, (2, 3))).T for r in range(size)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce(mode, dtype, rank, size):
    x = data(rank, dtype)
    y, _ = run(mode, lambda x: mpi.reduce(x, MPI.SUM, 0), x)
    expected = sum(np.asarray(data(r, np.float64)) for r in range(size)) if rank == 0 else x
    np.testing.assert_allclose(np.asarray(y, np.float64), np.asarray(expected, np.float64))


@pytest.mark.parametrize("mode", MODES)
def test_scan(mode, rank, size):
    y, _ = run(mode, lambda x: mpi.scan(x, MPI.SUM), jnp.full((2,), rank + 1, jnp.int32))
    np.testing.assert_array_equal(y, np.full((2,), sum(r + 1 for r in range(rank + 1))))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bcast(mode, dtype, rank):
    y, _ = run(mode, lambda x: mpi.bcast(x, 0), data(rank, dtype))
    np.testing.assert_array_equal(np.asarray(y, np.float64), np.asarray(data(0, np.float64)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int64, jnp.bfloat16])
def test_gather_allgather(mode, dtype, rank, size):
    x = data(rank, dtype)
    y, _ = run(mode, lambda x: mpi.gather(x.T, 0), x)
    if rank == 0:
        assert y.shape == (size, 2, 3)
        for r in range(size):
            np.testing.assert_array_equal(np.asarray(y[r], np.float64), np.asarray(data(r, np.float64)).T)
    else:
        np.testing.assert_array_equal(y, x.T)
    y, _ = run(mode, mpi.allgather, x)
    assert y.shape == (size, 3, 2)
    for r in range(size):
        np.testing.assert_array_equal(np.asarray(y[r], np.float64), np.asarray(data(r, np.float64)))


@pytest.mark.parametrize("mode", MODES)
def test_scatter(mode, rank, size):
    x = jnp.arange(size * 2, dtype=jnp.int32).reshape(size, 2) if rank == 0 else jnp.zeros(2, jnp.int32)
    y, _ = run(mode, lambda x: mpi.scatter(x, 0), x)
    np.testing.assert_array_equal(y, [2 * rank, 2 * rank + 1])


@pytest.mark.parametrize("mode", MODES)
def test_alltoall(mode, rank, size):
    x = jnp.array([[100 * rank + j] for j in range(size)], jnp.float32)
    y, _ = run(mode, mpi.alltoall, x)
    np.testing.assert_array_equal(y, [[100 * j + rank] for j in range(size)])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32, jnp.bfloat16])
def test_sendrecv_ring(mode, dtype, rank, size):
    x = data(rank, dtype)
    status = MPI.Status()
    y, _ = run(mode, lambda x: mpi.sendrecv(x, x, (rank - 1) % size, (rank + 1) % size,
                                            status=status), x)
    np.testing.assert_array_equal(np.asarray(y, np.float64), np.asarray(data((rank - 1) % size, np.float64)))
    assert status.Get_source() == (rank - 1) % size


@pytest.mark.parametrize("mode", MODES)
def test_send_recv(mode, rank, size):
    if size < 2:
        pytest.skip("point-to-point needs 2 ranks")
    x = data(rank, jnp.float32)

    def f(x):
        if rank == 0:
            mpi.send(x * 2, 1, tag=7)
            return x
        if rank == 1:
            status = MPI.Status()
            y, _ = mpi.recv(x, 0, tag=7, status=status)
            return y
        return x

    y = run(mode, f, x)
    if rank == 1:
        np.testing.assert_array_equal(y, data(0, jnp.float32) * 2)


@pytest.mark.parametrize("mode", MODES)
def test_barrier_and_token_threading(mode):
    def f(x):
        token = mpi.barrier()
        y, token = mpi.allreduce(x, MPI.SUM, token=token)
        return y, mpi.barrier(token=token)

    y, token = run(mode, f, jnp.ones(2))
    assert isinstance(token, mpi.Token)
    np.testing.assert_array_equal(y, MPI.COMM_WORLD.Get_size())


def test_custom_comm(rank, size):
    comm = MPI.COMM_WORLD.Split(color=rank % 2, key=rank)
    y, _ = mpi.allreduce(jnp.ones(()), MPI.SUM, comm=comm)
    assert y == comm.Get_size()
