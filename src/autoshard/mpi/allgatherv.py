"""allgatherv: every rank gets the rows of every rank concatenated, ``counts[i]`` rows from rank i."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive

from . import _check, _lowering, _sharding, _validation
from ._comm import comm_id, resolve
from ._token import Token, check_token

mpi_allgatherv_p = Primitive("mpi_allgatherv")


def allgatherv(x, counts, *, comm=None, token=None):
    """MPI_Allgatherv: ``x`` has ``counts[rank]`` rows; returns (rows of all ranks, token).

    ``counts`` is a sequence of ints, one per rank, the same on every rank (shapes are static
    under ``jax.jit``). The result has shape ``(sum(counts), *x.shape[1:])``, rank 0's rows
    first. For counts known only at run time, pad and use ``alltoallv``.
    """
    check_token(token)
    comm = resolve(comm)
    size, rank = comm.Get_size(), comm.Get_rank()
    counts = _validation.static_counts(counts, size, "mpi.allgatherv")
    x = jnp.asarray(x)
    if x.ndim == 0 or x.shape[0] != counts[rank]:
        raise ValueError(
            f"mpi.allgatherv: x must have counts[{rank}] = {counts[rank]} rows on rank {rank}, "
            f"i.e. shape ({counts[rank]}, ...), got {x.shape}. Pass this rank's rows only."
        )
    _validation.fits_int(sum(counts) * math.prod(x.shape[1:]) * x.dtype.itemsize, "mpi.allgatherv")
    return mpi_allgatherv_p.bind(x, counts=counts, comm=comm_id(comm)), Token()


def _abstract_eval(x, *, counts, comm):
    return _sharding.result(x, (sum(counts), *x.shape[1:]), drop=1, add=1)


def _lowering_rule(ctx, x, *, counts, comm):
    (aval,) = ctx.avals_in
    row_bytes = int(np.prod(aval.shape[1:], dtype=np.int64)) * aval.dtype.itemsize
    signature = f"rows of {_check.array(aval, aval.shape[1:])}, counts={counts}"
    return _lowering.emit(ctx, "allgatherv", [x], signature=signature,
                          attrs={"comm": comm, "counts": counts, "row_bytes": row_bytes})


def _batching_rule(args, dims, **params):
    # Rows stay on axis 0; the batch becomes part of each row.
    (x,), (d,) = args, dims
    return mpi_allgatherv_p.bind(jnp.moveaxis(x, d, 1), **params), 1


_lowering.register(mpi_allgatherv_p, _lowering_rule, abstract_eval=_abstract_eval,
                   batching=_batching_rule)
