"""allreduce: every rank gets the reduction of ``x`` over all ranks (MPI_Allreduce)."""

from __future__ import annotations

import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad

from . import _check, _lowering, _sharding, _validation
from ._comm import comm_id, resolve
from ._token import Token, check_token

mpi_allreduce_p = Primitive("mpi_allreduce")


def allreduce(x, op, *, comm=None, token=None):
    """Reduces ``x`` with ``op`` (an mpi4py ``MPI.Op``) across ranks; returns (result, token).

    With ``op=MPI.SUM`` it is differentiable: the JVP is an allreduce of the tangent and the
    transpose is the identity, i.e. gradients treat the (identical) result on every rank as
    one value, as mpi4jax does.
    """
    check_token(token)
    comm = resolve(comm)
    x = jnp.asarray(x)
    code = _validation.op_code(op, x.dtype)
    return mpi_allreduce_p.bind(x, op=code, comm=comm_id(comm), transpose=False), Token()


def _abstract_eval(x, *, op, comm, transpose):
    return _sharding.result(x)


def _lowering_rule(ctx, x, *, op, comm, transpose):
    if transpose:
        return [x]
    signature = f"{_check.array(ctx.avals_in[0])}, op={_validation.op_name(op)}"
    return _lowering.emit(ctx, "allreduce", [x], attrs={"comm": comm, "op": op},
                          signature=signature, aliases={0: 0})  # in place (MPI_IN_PLACE)


def _batching_rule(args, dims, **params):
    (x,), (d,) = args, dims
    return mpi_allreduce_p.bind(x, **params), d


def _jvp_rule(primals, tangents, *, op, comm, transpose):
    (x,), (t,) = primals, tangents
    if op != _validation.SUM_CODE:
        raise NotImplementedError(
            f"allreduce is differentiable only with MPI.SUM, got MPI.{_validation.op_name(op)}. "
            "Use MPI.SUM, or wrap the call in jax.lax.stop_gradient."
        )
    y = mpi_allreduce_p.bind(x, op=op, comm=comm, transpose=transpose)
    if type(t) is ad.Zero:
        return y, ad.Zero.from_primal_value(y)
    return y, mpi_allreduce_p.bind(t, op=op, comm=comm, transpose=transpose)


def _transpose_rule(ct, x, *, op, comm, transpose):
    if type(ct) is ad.Zero:
        return [ad.Zero(x.aval)]
    return [mpi_allreduce_p.bind(ct, op=op, comm=comm, transpose=not transpose)]


_lowering.register(mpi_allreduce_p, _lowering_rule, abstract_eval=_abstract_eval,
                   batching=_batching_rule, jvp=_jvp_rule, transpose=_transpose_rule,
                   calls_mpi=lambda params: not params["transpose"])
