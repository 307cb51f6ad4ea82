"""sendrecv: sends ``sendbuf`` to ``dest`` while receiving a ``recvbuf``-shaped array from ``source``."""

from __future__ import annotations

import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad

from . import _check, _lowering, _sharding, _validation
from ._comm import comm_id, resolve
from ._native import MPI
from ._token import Token, check_token

mpi_sendrecv_p = Primitive("mpi_sendrecv")


def sendrecv(sendbuf, recvbuf, source, dest, *, sendtag=0, recvtag=MPI.ANY_TAG, comm=None,
             status=None, token=None):
    """MPI_Sendrecv; ``recvbuf`` is a template for the result's shape and dtype.

    Returns (result, token). Differentiable: the transpose sends the cotangent back, from
    ``dest`` to ``source`` (``source`` must then be a rank, not MPI.ANY_SOURCE).
    """
    check_token(token)
    comm = resolve(comm)
    size = comm.Get_size()
    source = _validation.rank_or_any(source, "source", "mpi.sendrecv", size, MPI.ANY_SOURCE,
                                     mpi_call="MPI_Sendrecv")
    dest = _validation.static_int(dest, "dest", "mpi.sendrecv", 0, size, mpi_call="MPI_Sendrecv")
    sendtag = _validation.tag(sendtag, "sendtag", "mpi.sendrecv")
    recvtag = _validation.tag(recvtag, "recvtag", "mpi.sendrecv", allow_any=True)
    status_addr = _validation.status_address(status, "mpi.sendrecv")
    y = mpi_sendrecv_p.bind(jnp.asarray(sendbuf), jnp.asarray(recvbuf), source=source, dest=dest,
                            sendtag=sendtag, recvtag=recvtag, comm=comm_id(comm),
                            status=status_addr)
    return y, Token()


def _abstract_eval(sendbuf, recvbuf, **params):
    return _sharding.result(recvbuf)


def _lowering_rule(ctx, sendbuf, recvbuf, *, source, dest, sendtag, recvtag, comm, status):
    attrs = {"comm": comm, "source": source, "dest": dest, "sendtag": sendtag,
             "recvtag": recvtag, "status": status}
    # Received in place into recvbuf's buffer, as mpi4py does: in a loop that carries both
    # buffers, nothing is copied. Not when recvbuf is sendbuf itself (sendrecv(x, x, ...)):
    # MPI buffers must not overlap, and a fresh result then costs no copy either.
    aliases = None if sendbuf == recvbuf else {1: 0}
    sent, received = (_check.array(a) for a in ctx.avals_in)
    return _lowering.emit(ctx, "sendrecv", [sendbuf, recvbuf], attrs=attrs, aliases=aliases,
                          signature=f"sendbuf {sent}, recvbuf {received}")


def _batching_rule(args, dims, **params):
    sendbuf, recvbuf = args
    d_send, d_recv = dims
    size = next(a.shape[d] for a, d in zip(args, dims, strict=False) if d is not None)
    sendbuf, recvbuf = (
        jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
        for a, d in zip(args, dims, strict=False))
    return mpi_sendrecv_p.bind(sendbuf, recvbuf, **params), 0


def _jvp_rule(primals, tangents, **params):
    sendbuf, recvbuf = primals
    t_send, _ = tangents
    y = mpi_sendrecv_p.bind(sendbuf, recvbuf, **params)
    if type(t_send) is ad.Zero:
        # The peer may still send a non-zero tangent: receive it anyway to stay matched.
        t_send = jnp.zeros_like(sendbuf)
    return y, mpi_sendrecv_p.bind(t_send, jnp.zeros_like(recvbuf), **params)


def _transpose_rule(ct, sendbuf, recvbuf, *, source, dest, sendtag, recvtag, comm, status):
    if source == MPI.ANY_SOURCE:
        raise ValueError(
            "mpi.sendrecv: differentiating needs a concrete source rank to send the cotangent "
            "back to, got MPI.ANY_SOURCE. Pass the source rank explicitly."
        )
    send_aval = sendbuf.aval if ad.is_undefined_primal(sendbuf) else sendbuf
    if type(ct) is ad.Zero:
        ct = jnp.zeros(ct.aval.shape, ct.aval.dtype)
    ct_send = mpi_sendrecv_p.bind(
        ct, jnp.zeros(send_aval.shape, send_aval.dtype), source=dest, dest=source,
        sendtag=recvtag if recvtag != MPI.ANY_TAG else sendtag, recvtag=MPI.ANY_TAG, comm=comm,
        status=0)
    ct_recv = ad.Zero(recvbuf.aval) if ad.is_undefined_primal(recvbuf) else None
    return [ct_send if ad.is_undefined_primal(sendbuf) else None, ct_recv]


_lowering.register(mpi_sendrecv_p, _lowering_rule, abstract_eval=_abstract_eval,
                   batching=_batching_rule, jvp=_jvp_rule, transpose=_transpose_rule)
