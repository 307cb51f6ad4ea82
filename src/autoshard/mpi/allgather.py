"""allgather: every rank gets ``x`` of every rank stacked, shape (size, *x.shape)."""

from __future__ import annotations

import jax.numpy as jnp
from jax.extend.core import Primitive

from . import _check, _lowering, _sharding
from ._comm import comm_id, resolve
from ._token import Token, check_token

mpi_allgather_p = Primitive("mpi_allgather")


def allgather(x, *, comm=None, token=None):
    """MPI_Allgather of ``x``; returns (result of shape (size, *x.shape), token)."""
    check_token(token)
    comm = resolve(comm)
    x = jnp.asarray(x)
    return mpi_allgather_p.bind(x, comm=comm_id(comm), size=comm.Get_size()), Token()


def _abstract_eval(x, *, comm, size):
    return _sharding.result(x, (size, *x.shape), add=1)


def _lowering_rule(ctx, x, *, comm, size):
    signature = _check.array(ctx.avals_in[0])
    return _lowering.emit(ctx, "allgather", [x], attrs={"comm": comm}, signature=signature)


def _batching_rule(args, dims, **params):
    (x,), (d,) = args, dims
    return mpi_allgather_p.bind(x, **params), d + 1


_lowering.register(mpi_allgather_p, _lowering_rule, abstract_eval=_abstract_eval,
                   batching=_batching_rule)
