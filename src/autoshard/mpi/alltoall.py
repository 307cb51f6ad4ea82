"""alltoall: row i of ``x`` (shape (size, ...)) goes to rank i; row j of the result came from rank j."""

from __future__ import annotations

import jax.numpy as jnp
from jax.extend.core import Primitive

from . import _check, _lowering, _sharding
from ._comm import comm_id, resolve
from ._token import Token, check_token

mpi_alltoall_p = Primitive("mpi_alltoall")


def alltoall(x, *, comm=None, token=None):
    """MPI_Alltoall; ``x`` must have first dim equal to the communicator size.

    Returns (result, token).
    """
    check_token(token)
    comm = resolve(comm)
    size = comm.Get_size()
    x = jnp.asarray(x)
    if x.ndim == 0 or x.shape[0] != size:
        raise ValueError(
            f"mpi.alltoall: x must have shape (nproc, ...) with nproc the communicator size, "
            f"({size}, ...), got {x.shape}. Put the row for rank i at x[i]."
        )
    return mpi_alltoall_p.bind(x, comm=comm_id(comm)), Token()


def _abstract_eval(x, *, comm):
    return _sharding.result(x)


def _lowering_rule(ctx, x, *, comm):
    signature = _check.array(ctx.avals_in[0])
    return _lowering.emit(ctx, "alltoall", [x], attrs={"comm": comm}, signature=signature)


def _batching_rule(args, dims, **params):
    (x,), (d,) = args, dims
    x = jnp.moveaxis(x, d, 1)
    return mpi_alltoall_p.bind(x, **params), 1


_lowering.register(mpi_alltoall_p, _lowering_rule, abstract_eval=_abstract_eval,
                   batching=_batching_rule)
