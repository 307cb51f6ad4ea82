"""mpi4jax 0.8+'s token-free API: ``import autoshard.mpi.notoken as mpi4jax``.

The same twelve operations as ``autoshard.mpi``, on the same primitives, with mpi4jax 0.9's
signatures and return values: each returns its result alone; ``send`` and ``barrier`` return
an empty list (what binding a primitive without results gives, as in mpi4jax). Program order
is kept without tokens, as in ``autoshard.mpi`` (see _lowering.py). Passing ``token=`` is an
error here, as in mpi4jax 0.8+; ``autoshard.mpi`` keeps the token API of mpi4jax before 0.8.

Differences from mpi4jax on purpose (README, "Compatibility"): ``jax.jacfwd`` through
``sendrecv`` works (mpi4jax raises RuntimeError); a destination or root outside the
communicator is an error before anything runs (mpi4jax's MPI call fails at run time and
aborts the job); the debug log (``set_logging(True)``, MPI4JAX_DEBUG=1 or
AUTOSHARD_MPI_DEBUG=1) goes to stderr in autoshard's format.
"""

from __future__ import annotations

from ._native import MPI as _MPI
from ._native import get_logging as get_logging
from ._native import set_logging as set_logging
from .allgather import allgather as _allgather
from .allreduce import allreduce as _allreduce
from .alltoall import alltoall as _alltoall
from .barrier import barrier as _barrier
from .bcast import bcast as _bcast
from .gather import gather as _gather
from .recv import recv as _recv
from .reduce import reduce as _reduce
from .scan import scan as _scan
from .scatter import scatter as _scatter
from .send import send as _send
from .sendrecv import sendrecv as _sendrecv


class _NotSet:
    """The default of ``token=``: anything else passed there is an error."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NOTSET"


NOTSET = _NotSet()


def _refuse_token(token, fn: str) -> None:
    if token is not NOTSET:
        raise RuntimeError(
            f"{fn}: token= is not accepted by the token-free API (mpi4jax 0.8 and later), got "
            f"{token!r}. Operations run in program order without tokens: write "
            f"`y = {fn}(x, ...)` instead of `y, token = {fn}(x, ..., token=token)`, or import "
            f"autoshard.mpi, which keeps the token API of mpi4jax before 0.8."
        )


def allreduce(x, op, *, comm=None, token=NOTSET):
    """Reduces ``x`` with ``op`` (an mpi4py ``MPI.Op``) over all ranks; returns the result."""
    _refuse_token(token, "allreduce")
    return _allreduce(x, op, comm=comm)[0]


def reduce(x, op, root, *, comm=None, token=NOTSET):
    """Reduces ``x`` with ``op`` onto ``root``; other ranks get ``x`` back."""
    _refuse_token(token, "reduce")
    return _reduce(x, op, root, comm=comm)[0]


def scan(x, op, *, comm=None, token=NOTSET):
    """Inclusive prefix reduction of ``x`` with ``op`` over ranks 0..rank."""
    _refuse_token(token, "scan")
    return _scan(x, op, comm=comm)[0]


def bcast(x, root, *, comm=None, token=NOTSET):
    """Every rank gets ``root``'s ``x``; all ranks pass arrays of the same shape and dtype."""
    _refuse_token(token, "bcast")
    return _bcast(x, root, comm=comm)[0]


def gather(x, root, *, comm=None, token=NOTSET):
    """``root`` gets every rank's ``x`` stacked, shape (nproc, *x.shape); others get ``x``."""
    _refuse_token(token, "gather")
    return _gather(x, root, comm=comm)[0]


def scatter(x, root, *, comm=None, token=NOTSET):
    """Rank i gets row i of ``root``'s ``x`` (shape (nproc, ...)); other ranks' ``x`` is a template."""
    _refuse_token(token, "scatter")
    return _scatter(x, root, comm=comm)[0]


def allgather(x, *, comm=None, token=NOTSET):
    """Every rank gets every rank's ``x`` stacked, shape (nproc, *x.shape)."""
    _refuse_token(token, "allgather")
    return _allgather(x, comm=comm)[0]


def alltoall(x, *, comm=None, token=NOTSET):
    """Row i of ``x`` (shape (nproc, ...)) goes to rank i; row j of the result came from rank j."""
    _refuse_token(token, "alltoall")
    return _alltoall(x, comm=comm)[0]


def send(x, dest, *, tag=0, comm=None, token=NOTSET):
    """Sends ``x`` to rank ``dest`` with ``tag``; returns an empty list, as mpi4jax does."""
    _refuse_token(token, "send")
    _send(x, dest, tag=tag, comm=comm)
    return []


def recv(x, source=_MPI.ANY_SOURCE, *, tag=_MPI.ANY_TAG, comm=None, status=None, token=NOTSET):
    """Receives an array of ``x``'s shape and dtype from ``source``; fills ``status`` if given."""
    _refuse_token(token, "recv")
    return _recv(x, source, tag=tag, comm=comm, status=status)[0]


def sendrecv(sendbuf, recvbuf, source, dest, *, sendtag=0, recvtag=_MPI.ANY_TAG, comm=None,
             status=None, token=NOTSET):
    """Sends ``sendbuf`` to ``dest`` while receiving a ``recvbuf``-shaped array from ``source``."""
    _refuse_token(token, "sendrecv")
    return _sendrecv(sendbuf, recvbuf, source, dest, sendtag=sendtag, recvtag=recvtag,
                     comm=comm, status=status)[0]


def barrier(*, comm=None, token=NOTSET):
    """Waits until every rank of ``comm`` has reached it; returns an empty list, as mpi4jax does."""
    _refuse_token(token, "barrier")
    _barrier(comm=comm)
    return []


def has_cuda_support() -> bool:
    """False: the native handlers run on CPU devices only (jax arrays on GPU are not supported)."""
    return False


def has_sycl_support() -> bool:
    """False: there are no SYCL (Intel XPU) handlers."""
    return False


__all__ = [
    "allgather", "allreduce", "alltoall", "barrier", "bcast", "gather", "get_logging",
    "has_cuda_support", "has_sycl_support", "recv", "reduce", "scan", "scatter", "send",
    "sendrecv", "set_logging",
]
