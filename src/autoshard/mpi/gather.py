"""gather: the root gets ``x`` of every rank stacked, shape (size, *x.shape); others get ``x``."""

from __future__ import annotations

import jax.numpy as jnp
from jax.extend.core import Primitive

from . import _check, _lowering, _sharding, _validation
from ._comm import comm_id, resolve
from ._token import Token, check_token

mpi_gather_p = Primitive("mpi_gather")


def gather(x, root, *, comm=None, token=None):
    """MPI_Gather of ``x`` to ``root``; returns (result, token)."""
    check_token(token)
    comm = resolve(comm)
    size = comm.Get_size()
    root = _validation.static_int(root, "root", "mpi.gather", 0, size)
    x = jnp.asarray(x)
    is_root = comm.Get_rank() == root
    return mpi_gather_p.bind(x, root=root, comm=comm_id(comm), size=size, is_root=is_root), Token()


def _abstract_eval(x, *, root, comm, size, is_root):
    return _sharding.result(x, (size, *x.shape), add=1) if is_root else _sharding.result(x)


def _lowering_rule(ctx, x, *, root, comm, size, is_root):
    aliases = None if is_root else {0: 0}
    signature = f"{_check.array(ctx.avals_in[0])}, root={root}"
    return _lowering.emit(ctx, "gather", [x], attrs={"comm": comm, "root": root},
                          signature=signature, aliases=aliases)


def _batching_rule(args, dims, **params):
    (x,), (d,) = args, dims
    x = jnp.moveaxis(x, d, 0)
    return mpi_gather_p.bind(x, **params), 1 if params["is_root"] else 0


_lowering.register(mpi_gather_p, _lowering_rule, abstract_eval=_abstract_eval,
                   batching=_batching_rule)
