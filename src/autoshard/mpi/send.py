"""send: sends ``x`` to rank ``dest`` (MPI_Send); returns only the token."""

from __future__ import annotations

import jax.numpy as jnp
from jax.extend.core import Primitive

from . import _check, _lowering, _validation
from ._comm import comm_id, resolve
from ._token import Token, check_token

mpi_send_p = Primitive("mpi_send")
mpi_send_p.multiple_results = True


def send(x, dest, *, tag=0, comm=None, token=None):
    """Sends ``x`` to ``dest`` with ``tag``; returns a token. Never removed as dead code."""
    check_token(token)
    comm = resolve(comm)
    dest = _validation.static_int(dest, "dest", "mpi.send", 0, comm.Get_size(),
                                mpi_call="MPI_Send")
    tag = _validation.tag(tag, "tag", "mpi.send")
    mpi_send_p.bind(jnp.asarray(x), dest=dest, tag=tag, comm=comm_id(comm))
    return Token()


def _abstract_eval(x, *, dest, tag, comm):
    return []


def _lowering_rule(ctx, x, *, dest, tag, comm):
    return _lowering.emit(ctx, "send", [x], attrs={"comm": comm, "dest": dest, "tag": tag},
                          signature=_check.array(ctx.avals_in[0]))


def _batching_rule(args, dims, **params):
    (x,), (d,) = args, dims
    return mpi_send_p.bind(jnp.moveaxis(x, d, 0), **params), []


_lowering.register(mpi_send_p, _lowering_rule, abstract_eval=_abstract_eval,
                   batching=_batching_rule)
