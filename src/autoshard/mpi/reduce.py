"""reduce: the root gets the reduction of ``x`` over all ranks; other ranks get ``x`` back."""

from __future__ import annotations

import jax.numpy as jnp
from jax.extend.core import Primitive

from . import _check, _lowering, _sharding, _validation
from ._comm import comm_id, resolve
from ._token import Token, check_token

mpi_reduce_p = Primitive("mpi_reduce")


def reduce(x, op, root, *, comm=None, token=None):
    """MPI_Reduce of ``x`` with ``op`` to ``root``; returns (result, token)."""
    check_token(token)
    comm = resolve(comm)
    root = _validation.static_int(root, "root", "mpi.reduce", 0, comm.Get_size())
    x = jnp.asarray(x)
    code = _validation.op_code(op, x.dtype)
    return mpi_reduce_p.bind(x, op=code, root=root, comm=comm_id(comm)), Token()


def _abstract_eval(x, *, op, root, comm):
    return _sharding.result(x)


def _lowering_rule(ctx, x, *, op, root, comm):
    signature = f"{_check.array(ctx.avals_in[0])}, op={_validation.op_name(op)}, root={root}"
    return _lowering.emit(ctx, "reduce", [x], attrs={"comm": comm, "op": op, "root": root},
                          signature=signature, aliases={0: 0})


def _batching_rule(args, dims, **params):
    (x,), (d,) = args, dims
    return mpi_reduce_p.bind(x, **params), d


_lowering.register(mpi_reduce_p, _lowering_rule, abstract_eval=_abstract_eval,
                   batching=_batching_rule)
