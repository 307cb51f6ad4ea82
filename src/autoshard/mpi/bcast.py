"""bcast: every rank gets the root's ``x`` (MPI_Bcast)."""

from __future__ import annotations

import jax.numpy as jnp
from jax.extend.core import Primitive

from . import _check, _lowering, _sharding, _validation
from ._comm import comm_id, resolve
from ._token import Token, check_token

mpi_bcast_p = Primitive("mpi_bcast")


def bcast(x, root, *, comm=None, token=None):
    """Broadcasts the root's ``x``; all ranks pass arrays of the same shape and dtype.

    Returns (result, token).
    """
    check_token(token)
    comm = resolve(comm)
    root = _validation.static_int(root, "root", "mpi.bcast", 0, comm.Get_size())
    x = jnp.asarray(x)
    return mpi_bcast_p.bind(x, root=root, comm=comm_id(comm)), Token()


def _abstract_eval(x, *, root, comm):
    return _sharding.result(x)


def _lowering_rule(ctx, x, *, root, comm):
    # In place: the root's buffer already holds the data, the others receive into it.
    signature = f"{_check.array(ctx.avals_in[0])}, root={root}"
    return _lowering.emit(ctx, "bcast", [x], attrs={"comm": comm, "root": root},
                          signature=signature, aliases={0: 0})


def _batching_rule(args, dims, **params):
    (x,), (d,) = args, dims
    x = jnp.moveaxis(x, d, 0)
    return mpi_bcast_p.bind(x, **params), 0


_lowering.register(mpi_bcast_p, _lowering_rule, abstract_eval=_abstract_eval,
                   batching=_batching_rule)
