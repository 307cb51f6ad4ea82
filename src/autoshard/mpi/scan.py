"""scan: rank r gets the reduction of ``x`` over ranks 0..r (MPI_Scan, inclusive)."""

from __future__ import annotations

import jax.numpy as jnp
from jax.extend.core import Primitive

from . import _check, _lowering, _sharding, _validation
from ._comm import comm_id, resolve
from ._token import Token, check_token

mpi_scan_p = Primitive("mpi_scan")


def scan(x, op, *, comm=None, token=None):
    """Inclusive prefix reduction of ``x`` with ``op`` over ranks; returns (result, token)."""
    check_token(token)
    comm = resolve(comm)
    x = jnp.asarray(x)
    code = _validation.op_code(op, x.dtype)
    return mpi_scan_p.bind(x, op=code, comm=comm_id(comm)), Token()


def _abstract_eval(x, *, op, comm):
    return _sharding.result(x)


def _lowering_rule(ctx, x, *, op, comm):
    signature = f"{_check.array(ctx.avals_in[0])}, op={_validation.op_name(op)}"
    return _lowering.emit(ctx, "scan", [x], attrs={"comm": comm, "op": op},
                          signature=signature, aliases={0: 0})  # in place (MPI_IN_PLACE)


def _batching_rule(args, dims, **params):
    (x,), (d,) = args, dims
    return mpi_scan_p.bind(x, **params), d


_lowering.register(mpi_scan_p, _lowering_rule, abstract_eval=_abstract_eval,
                   batching=_batching_rule)
