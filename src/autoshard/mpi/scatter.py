"""scatter: the root passes (size, *shape) and rank i gets row i; others pass a (*shape) template."""

from __future__ import annotations

import jax.numpy as jnp
from jax.extend.core import Primitive

from . import _check, _lowering, _sharding, _validation
from ._comm import comm_id, resolve
from ._token import Token, check_token

mpi_scatter_p = Primitive("mpi_scatter")


def scatter(x, root, *, comm=None, token=None):
    """MPI_Scatter from ``root``; returns (result, token).

    On the root ``x`` has shape (size, *shape); on the other ranks ``x`` only gives the
    shape and dtype of the result, (*shape).
    """
    check_token(token)
    comm = resolve(comm)
    size = comm.Get_size()
    root = _validation.static_int(root, "root", "mpi.scatter", 0, size)
    x = jnp.asarray(x)
    is_root = comm.Get_rank() == root
    if is_root and (x.ndim == 0 or x.shape[0] != size):
        raise ValueError(
            f"mpi.scatter: on the root (rank {root}) the Scatter input must have shape "
            f"(nproc, ...) with nproc the communicator size, ({size}, ...), got {x.shape}. "
            f"Stack one row per rank along the first dim."
        )
    return mpi_scatter_p.bind(x, root=root, comm=comm_id(comm), is_root=is_root), Token()


def _abstract_eval(x, *, root, comm, is_root):
    return _sharding.result(x, x.shape[1:], drop=1) if is_root else _sharding.result(x)


def _lowering_rule(ctx, x, *, root, comm, is_root):
    aliases = None if is_root else {0: 0}
    # The piece each rank gets: the root's operand has one more (leading) dim.
    piece = _check.array(ctx.avals_out[0])
    return _lowering.emit(ctx, "scatter", [x], attrs={"comm": comm, "root": root},
                          signature=f"{piece} per rank, root={root}", aliases=aliases)


def _batching_rule(args, dims, **params):
    (x,), (d,) = args, dims
    x = jnp.moveaxis(x, d, 1 if params["is_root"] else 0)
    return mpi_scatter_p.bind(x, **params), 0


_lowering.register(mpi_scatter_p, _lowering_rule, abstract_eval=_abstract_eval,
                   batching=_batching_rule)
