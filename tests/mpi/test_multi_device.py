"""A jit over several local devices makes one MPI call per process, on the process's whole array.

The semantics: the local devices' shards together form the buffer the process contributes,
and every device gets the whole result. So 2 ranks x 2 local devices reproduce what 4 ranks
with one device each compute, once the two halves of each buffer are read as two ranks.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from mpi4py import MPI

from autoshard import mpi
from autoshard.mpi._native import lib

NUM_LOCAL = 2  # local devices per process in these tests


def _virtual(v):
    """What virtual rank ``v`` of a (NUM_LOCAL x size)-rank job holds."""
    return np.arange(3.0) + 10 * v


def _process_array(rank):
    """This process's buffer: the rows of its virtual ranks, one per local device."""
    devices = jax.local_devices()[:NUM_LOCAL]
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    rows = np.stack([_virtual(NUM_LOCAL * rank + d) for d in range(NUM_LOCAL)])
    return jax.device_put(jnp.asarray(rows), NamedSharding(mesh, PartitionSpec("d")))


def _calls(fn, *args):
    """Result of ``fn(*args)`` and the number of MPI calls this process made for it."""
    before = lib.autoshard_mpi_num_calls()
    out = jax.block_until_ready(fn(*args))
    return out, lib.autoshard_mpi_num_calls() - before


def test_matches_single_device_ranks(rank, size):
    x = _process_array(rank)
    num_virtual = NUM_LOCAL * size
    ranks = np.stack([_virtual(v) for v in range(num_virtual)])

    def f(x):
        total, token = mpi.allreduce(x, MPI.SUM)
        gathered, token = mpi.allgather(x, token=token)
        root, token = mpi.bcast(x, 0, token=token)
        prefix, _ = mpi.scan(x, MPI.SUM, token=token)
        return total, gathered, root, prefix

    (total, gathered, root, prefix), num_calls = _calls(jax.jit(f), x)
    assert num_calls == 4  # one per operation, not one per device
    # allreduce over 4 ranks = allreduce over 2 ranks, then the sum of the local rows.
    np.testing.assert_array_equal(total.sum(0), ranks.sum(0))
    # allgather over 4 ranks = allgather over 2 ranks with each buffer's rows as ranks.
    np.testing.assert_array_equal(gathered.reshape(num_virtual, 3), ranks)
    np.testing.assert_array_equal(root, ranks[:NUM_LOCAL])
    np.testing.assert_array_equal(prefix, ranks.reshape(size, NUM_LOCAL, 3)[:rank + 1].sum(0))


def test_point_to_point_once_per_process(rank, size):
    x = _process_array(rank)
    peer, source = (rank + 1) % size, (rank - 1) % size

    def f(x):
        y, token = mpi.sendrecv(x, x, source, peer)
        mpi.send(x * 2, peer, tag=3, token=token)
        z, _ = mpi.recv(x, source, tag=3)
        return y, z

    (y, z), num_calls = _calls(jax.jit(f), x)
    assert num_calls == 3
    expected = np.stack([_virtual(NUM_LOCAL * source + d) for d in range(NUM_LOCAL)])
    np.testing.assert_array_equal(y, expected)
    np.testing.assert_array_equal(z, 2 * expected)
    # Every device holds the whole result (bit-exact, -0.0 included).
    negative_zeros = jax.device_put(jnp.full(x.shape, -0.0), x.sharding)
    signed = jax.jit(lambda v: mpi.bcast(v, 0)[0])(negative_zeros)
    assert all(np.signbit(np.asarray(s.data)).all() for s in signed.addressable_shards)
