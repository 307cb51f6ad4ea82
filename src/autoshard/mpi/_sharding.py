"""Shardings around a process's MPI call: what the operands become and what the result is.

A process makes one MPI call on its whole array, however its local devices hold it (see
_lowering._once_per_process): the operands are gathered whole before the call and every
device gets the whole result. On a mesh with Explicit axes (``jax.make_mesh``'s default) an
array's sharding is part of its type, so each operation also says what sharding its result
has (``result``), and the lowering gathers the operands (``replicated``) and then slices the
result to that sharding (``resharded``, no communication):

* a result shaped like an operand (allreduce, reduce, scan, bcast, alltoall, alltoallv, recv,
  sendrecv's received buffer, gather and scatter off the root) keeps that operand's sharding;
* a dim the operation adds or resizes is not sharded (allgather's and the gather root's
  leading rank dim, allgatherv's rows), and the scatter root's result loses the dim it
  scatters, with that dim's sharding.

Arrays on meshes with Auto axes carry no sharding in their type; there XLA chooses the
result's sharding, as for any other operation.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec


def _spec(aval) -> tuple:
    spec = tuple(aval.sharding.spec)
    return spec + (None,) * (len(aval.shape) - len(spec))


def result(x, shape=None, *, drop: int = 0, add: int = 0):
    """The aval of a result of ``shape`` (default ``x``'s) whose dims follow ``x``'s.

    The first ``drop`` dims of ``x`` are gone and ``add`` new, unsharded dims lead.
    """
    shape = x.shape if shape is None else tuple(shape)
    spec = (None,) * add + _spec(x)[drop:]
    assert len(spec) == len(shape), (x, shape, drop, add)
    sharding = NamedSharding(x.sharding.mesh, PartitionSpec(*spec))
    return x.update(shape=shape, weak_type=False, sharding=sharding)


def _sharded(aval) -> bool:
    return any(p is not None for p in aval.sharding.spec)


def replicated(x):
    """``x`` whole on every device (an all-gather) where its type shards it."""
    aval = jax.typeof(x)
    if not _sharded(aval):
        return x
    return jax.sharding.reshard(x, NamedSharding(aval.sharding.mesh, PartitionSpec()))


def resharded(x, aval):
    """The whole ``x`` sliced to ``aval``'s sharding where ``aval``'s type shards it."""
    if not _sharded(aval):
        return x
    return jax.sharding.reshard(x, aval.sharding)


__all__ = ["replicated", "resharded", "result"]
