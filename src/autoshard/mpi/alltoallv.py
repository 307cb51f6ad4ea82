"""alltoallv: ``send_counts[i]`` rows of ``x[i]`` go to rank i; counts may be run-time values."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive

from . import _check, _lowering, _sharding, _validation
from ._comm import comm_id, resolve
from ._token import Token, check_token
from .alltoall import alltoall

mpi_alltoallv_p = Primitive("mpi_alltoallv")


def alltoallv(x, send_counts, recv_counts=None, *, comm=None, token=None):
    """MPI_Alltoallv on padded blocks; returns (result, token).

    ``x`` has shape ``(size, max_rows, ...)``: the first ``send_counts[i]`` rows of ``x[i]``
    go to rank i. The result has the same shape: ``result[j, :recv_counts[j]]`` came from
    rank j, the remaining rows are zeros. Counts are int arrays of shape ``(size,)`` and may
    be traced (data-dependent); each must lie in ``[0, max_rows]`` (checked at run time).
    ``recv_counts`` defaults to an ``alltoall`` of ``send_counts`` (one more MPI call); pass
    it when it is known. Every rank must use the same ``max_rows``.
    """
    check_token(token)
    comm = resolve(comm)
    size = comm.Get_size()
    x = jnp.asarray(x)
    if x.ndim < 2 or x.shape[0] != size:
        raise ValueError(
            f"mpi.alltoallv: x must have shape (size, max_rows, ...) = ({size}, max_rows, ...), "
            f"got {x.shape}. Put the rows for rank i, padded to max_rows, at x[i]."
        )
    send_counts = _counts(send_counts, size, "send_counts")
    if recv_counts is None:
        recv_counts, token = alltoall(send_counts, comm=comm, token=token)
    recv_counts = _counts(recv_counts, size, "recv_counts")
    _validation.fits_int(x.size * x.dtype.itemsize, "mpi.alltoallv")
    y = mpi_alltoallv_p.bind(x, send_counts, recv_counts, comm=comm_id(comm))
    return y, Token()


def _counts(counts, size, name):
    counts = jnp.asarray(counts)
    if counts.shape != (size,) or not jnp.issubdtype(counts.dtype, jnp.integer):
        raise ValueError(
            f"mpi.alltoallv: {name} must be an integer array of shape ({size},) (one count per "
            f"rank), got {counts.dtype} {counts.shape}."
        )
    return counts.astype(np.int32)  # MPI counts are C ints


def _abstract_eval(x, send_counts, recv_counts, *, comm):
    return _sharding.result(x)


def _lowering_rule(ctx, x, send_counts, recv_counts, *, comm):
    aval = ctx.avals_in[0]
    row_bytes = int(np.prod(aval.shape[2:], dtype=np.int64)) * aval.dtype.itemsize
    attrs = {"comm": comm, "row_bytes": row_bytes, "max_rows": aval.shape[1]}
    signature = f"rows of {_check.array(aval, aval.shape[2:])}"  # max_rows may differ
    return _lowering.emit(ctx, "alltoallv", [x, send_counts, recv_counts], attrs=attrs,
                          signature=signature)


def _batching_rule(args, dims, **params):
    x, send_counts, recv_counts = args
    d, d_send, d_recv = dims
    if d_send is not None or d_recv is not None:
        raise NotImplementedError(
            "mpi.alltoallv: vmap over the counts is not supported (one MPI call serves the "
            "whole batch, so the counts must be shared). Batch x only, or loop over the batch."
        )
    # The batch becomes part of each row.
    return mpi_alltoallv_p.bind(jnp.moveaxis(x, d, 2), send_counts, recv_counts, **params), 2


_lowering.register(mpi_alltoallv_p, _lowering_rule, abstract_eval=_abstract_eval,
                   batching=_batching_rule)
