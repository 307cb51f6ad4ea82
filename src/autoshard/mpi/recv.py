"""recv: receives an array shaped like the template ``x`` from ``source`` (MPI_Recv)."""

from __future__ import annotations

import jax.numpy as jnp
from jax.extend.core import Primitive

from . import _check, _lowering, _sharding, _validation
from ._comm import comm_id, resolve
from ._native import MPI
from ._token import Token, check_token

mpi_recv_p = Primitive("mpi_recv")


def recv(x, source=MPI.ANY_SOURCE, *, tag=MPI.ANY_TAG, comm=None, status=None, token=None):
    """Receives into an array of ``x``'s shape and dtype; returns (result, token).

    ``status`` (an ``MPI.Status``) is filled when the receive completes.
    """
    check_token(token)
    comm = resolve(comm)
    source = _validation.rank_or_any(source, "source", "mpi.recv", comm.Get_size(), MPI.ANY_SOURCE,
                                     mpi_call="MPI_Recv")
    tag = _validation.tag(tag, "tag", "mpi.recv", allow_any=True)
    status_addr = _validation.status_address(status, "mpi.recv")
    y = mpi_recv_p.bind(jnp.asarray(x), source=source, tag=tag, comm=comm_id(comm),
                        status=status_addr)
    return y, Token()


def _abstract_eval(x, *, source, tag, comm, status):
    return _sharding.result(x)


def _lowering_rule(ctx, x, *, source, tag, comm, status):
    attrs = {"comm": comm, "source": source, "tag": tag, "status": status}
    # x gives the shape only: no alias.
    return _lowering.emit(ctx, "recv", [x], attrs=attrs, signature=_check.array(ctx.avals_in[0]))


def _batching_rule(args, dims, **params):
    (x,), (d,) = args, dims
    return mpi_recv_p.bind(jnp.moveaxis(x, d, 0), **params), 0


_lowering.register(mpi_recv_p, _lowering_rule, abstract_eval=_abstract_eval,
                   batching=_batching_rule)
