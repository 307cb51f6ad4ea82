"""barrier: blocks until every rank has reached it (MPI_Barrier); returns only the token."""

from __future__ import annotations

from jax.extend.core import Primitive

from . import _lowering
from ._comm import comm_id, resolve
from ._token import Token, check_token

mpi_barrier_p = Primitive("mpi_barrier")
mpi_barrier_p.multiple_results = True


def barrier(*, comm=None, token=None):
    """Synchronises all ranks of ``comm``; returns a token. Never removed as dead code."""
    check_token(token)
    comm = resolve(comm)
    mpi_barrier_p.bind(comm=comm_id(comm))
    return Token()


def _abstract_eval(*, comm):
    return []


def _lowering_rule(ctx, *, comm):
    return _lowering.emit(ctx, "barrier", [], attrs={"comm": comm}, signature="")


def _batching_rule(args, dims, **params):
    # No operands, so never batched: one barrier for the whole batch.
    return mpi_barrier_p.bind(**params), []


_lowering.register(mpi_barrier_p, _lowering_rule, abstract_eval=_abstract_eval,
                   batching=_batching_rule)
