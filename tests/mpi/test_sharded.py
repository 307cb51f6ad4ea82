"""Operations on arrays sharded over the process's devices (issue 21, item 6).

A process makes one MPI call on its whole array, so every operation gives what it gives on
the same array replicated. On a mesh with Explicit axes (``jax.make_mesh``'s default) the
sharding is part of the array's type: a result keeps its operand's sharding along the dims
they share (here the last one, sharded in every case), and dims the operation adds are not
sharded (see src/autoshard/mpi/_sharding.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec
from mpi4py import MPI

from autoshard import mpi
from autoshard.mpi._native import lib

WIDTH = 8  # the last dim, sharded over the 4 devices of every mesh below


def _mesh(kind):
    if kind == "explicit":
        return jax.make_mesh((4,), ("d",)), "d"
    if kind == "explicit-2d":
        return jax.make_mesh((2, 2), ("a", "b")), ("a", "b")
    return jax.make_mesh((4,), ("d",), axis_types=(AxisType.Auto,)), "d"


def _put(x, mesh, axes):
    """``x`` with its last dim sharded over ``axes`` of ``mesh``, and replicated on ``mesh``."""
    spec = PartitionSpec(*(None,) * (x.ndim - 1), axes)
    return jax.device_put(x, NamedSharding(mesh, spec)), jax.device_put(x, NamedSharding(mesh, PartitionSpec()))


def _rows(rank, *shape):
    return jnp.asarray(100 * rank + np.arange(np.prod(shape), dtype=np.float32).reshape(shape))


def _cases(rank, size):
    """name -> (this rank's operand, the operation)."""
    full = _rows(rank, size, WIDTH)
    ring = ((rank - 1) % size, (rank + 1) % size)
    counts = (2,) * size
    return {
        "allreduce": (full, lambda x: mpi.allreduce(x, MPI.SUM)[0]),
        "reduce": (full, lambda x: mpi.reduce(x, MPI.SUM, 0)[0]),
        "scan": (full, lambda x: mpi.scan(x, MPI.MAX)[0]),
        "bcast": (full, lambda x: mpi.bcast(x, size - 1)[0]),
        "gather": (full, lambda x: mpi.gather(x, 0)[0]),
        "scatter": (full if rank == 0 else jnp.zeros(WIDTH), lambda x: mpi.scatter(x, 0)[0]),
        "allgather": (full, lambda x: mpi.allgather(x)[0]),
        "allgatherv": (_rows(rank, 2, WIDTH), lambda x: mpi.allgatherv(x, counts)[0]),
        "alltoall": (full, lambda x: mpi.alltoall(x)[0]),
        "alltoallv": (_rows(rank, size, 3, WIDTH),
                      lambda x: mpi.alltoallv(x, jnp.full(size, 2, jnp.int32),
                                              jnp.full(size, 2, jnp.int32))[0]),
        "sendrecv": (full, lambda x: mpi.sendrecv(x * 2, x, *ring)[0]),
    }


def _num_calls(fn, *args):
    before = lib.autoshard_mpi_num_calls()
    out = jax.block_until_ready(fn(*args))
    return out, lib.autoshard_mpi_num_calls() - before


def test_issue_repro_allreduce_on_sharded_array(rank, size):
    """Repro E: jit(allreduce) on a P("d") array raised KeyError: 'd'."""
    mesh = jax.make_mesh((4,), ("d",))
    x = jax.device_put(jnp.arange(8.0) + rank, NamedSharding(mesh, PartitionSpec("d")))
    f = jax.jit(lambda x: mpi.allreduce(x, MPI.SUM)[0])
    y, num_calls = _num_calls(f, x)
    assert num_calls == 1
    expected = sum(np.arange(8.0) + r for r in range(size))
    np.testing.assert_array_equal(y, expected)
    assert y.sharding.spec == PartitionSpec("d")
    assert [s.data.shape for s in y.addressable_shards] == [(2,)] * 4
    # The same values as on the replicated array (the case that always worked), eagerly too.
    replicated = jax.device_put(x, NamedSharding(mesh, PartitionSpec()))
    np.testing.assert_array_equal(y, f(replicated))
    np.testing.assert_array_equal(mpi.allreduce(x, MPI.SUM)[0], expected)
    # Compiled: the shards gathered once, one MPI call, the result sliced (no other traffic
    # than the bit-exact sum that hands the caller's result to the other devices).
    hlo = f.lower(x).compile().as_text()
    assert hlo.count("custom_call_target=\"autoshard_mpi_allreduce\"") == 1
    assert hlo.count(" all-gather(") == 1
    assert hlo.count(" all-reduce(") == 1


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("kind", ["explicit", "explicit-2d", "auto"])
@pytest.mark.parametrize("name", list(_cases(0, 1)))
def test_sharded_equals_replicated(name, kind, mode, rank, size):
    x, op = _cases(rank, size)[name]
    mesh, axes = _mesh(kind)
    sharded, replicated = _put(x, mesh, axes)
    expected = jax.block_until_ready(jax.jit(op)(replicated))  # its MPI call done
    fn = jax.jit(op) if mode == "jit" else op
    y, num_calls = _num_calls(fn, sharded)
    assert num_calls == 1
    assert y.shape == expected.shape and y.dtype == expected.dtype
    np.testing.assert_array_equal(y, expected)
    if kind != "auto":  # the result keeps the operand's sharding along the dims they share
        assert y.sharding.spec == PartitionSpec(*(None,) * (y.ndim - 1), axes)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_send_recv_sharded(kind, rank, size):
    if size < 2:
        pytest.skip("point-to-point needs 2 ranks")
    mesh, axes = _mesh(kind)
    x, _ = _put(_rows(rank, 2, WIDTH), mesh, axes)

    def f(x):
        if rank == 0:
            return mpi.send(x * 3, 1, tag=5)
        if rank == 1:
            return mpi.recv(x, 0, tag=5)[0]
        return x

    y = jax.jit(f)(x)
    if rank == 1:
        np.testing.assert_array_equal(y, 3 * _rows(0, 2, WIDTH))
        if kind != "auto":
            assert y.sharding.spec == PartitionSpec(None, axes)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_grad_and_vmap_sharded(kind, rank, size):
    mesh, axes = _mesh(kind)
    x, _ = _put(_rows(rank, 2, WIDTH), mesh, axes)
    # The transpose of allreduce is the identity: no MPI call, and no sum over the devices
    # (which gave 4x the gradient, as bits, on any multi-device jit).
    f = jax.jit(jax.grad(lambda x: mpi.allreduce(x * x, MPI.SUM)[0].sum()))
    g, num_calls = _num_calls(f, x)
    assert num_calls == 1
    np.testing.assert_array_equal(g, 2 * _rows(rank, 2, WIDTH))
    y = jax.jit(jax.vmap(lambda v: mpi.allgather(v)[0]))(x)
    assert y.shape == (2, size, WIDTH)
    np.testing.assert_array_equal(y, np.stack([_rows(r, 2, WIDTH) for r in range(size)], 1))
    if kind != "auto":
        assert g.sharding.spec == x.sharding.spec
        assert y.sharding.spec == PartitionSpec(None, None, axes)


@pytest.mark.parametrize("devices", [(2, 3), (4, 5, 6, 7)])
def test_sub_mesh_without_device_0(devices, rank, size):
    """The call is made by whichever device reaches it first: it gave zeros when device 0,
    which used to be the one to call, was not among the jit's devices."""
    mesh = jax.sharding.Mesh(np.array([jax.devices()[d] for d in devices]), ("d",))
    x = jax.device_put(_rows(rank, 2, WIDTH), NamedSharding(mesh, PartitionSpec(None, "d")))
    y, num_calls = _num_calls(jax.jit(lambda x: mpi.allreduce(x, MPI.SUM)[0]), x)
    assert num_calls == 1
    np.testing.assert_array_equal(y, sum(_rows(r, 2, WIDTH) for r in range(size)))
    assert {d.id for d in y.devices()} == set(devices)
