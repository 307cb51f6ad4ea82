"""Argument checks: what the ranks of an MPI call must agree on, written as its signature.

MPI leaves a call undefined when its ranks disagree on it (another operation, root,
reduction, dtype or shape): one rank gets a truncation error while another gets a wrong
array, or the values are garbage, or the job hangs. Each call therefore carries a signature,
the text of what its ranks must agree on, and before the MPI call the handler compares the
ranks' signatures over a communicator of its own (see "argument checks" in _ffi.cc). A
disagreement becomes the same error on every rank, naming each rank's call, and no rank
makes the call.

What must agree, per operation (MPI's own rules, applied to whole arrays):

* allreduce, reduce, scan, bcast, gather, allgather, alltoall: dtype and shape (and op,
  root); scatter: the dtype and shape of the piece each rank gets, and the root (the root's
  operand has one more dim);
* allgatherv: dtype, the shape of a row and the counts (each rank's row count differs);
  alltoallv: dtype and the shape of a row (max_rows and the run-time counts may differ);
* barrier: being a barrier;
* send/recv/sendrecv: the receiver needs the sender's dtype and a message no larger than its
  buffer; pairs form at run time (MPI.ANY_SOURCE), so these are checked message by message.

When, set by AUTOSHARD_MPI_CHECK (read in _config):

* unset or ``first`` (the default): a collective is checked the first time a process makes
  it with its signature on a communicator; afterwards that signature costs a set lookup,
  nothing is exchanged. Ranks that run the same program reach those first calls together,
  so a correct program never waits for a rank that skips its check. A program whose ranks
  disagree from the start (the common case) gets the error. A rank whose arguments change
  to new ones while another rank repeats a call it already checked (a smaller last batch on
  one rank) waits in its check while the other waits in the call: after 10 s the waiting
  rank prints a warning naming the call and this setting. Point-to-point is not checked.
* ``1`` (``every``): every call, point-to-point included (the sender sends its signature
  ahead of the data): a disagreement is always an error, at the cost of one small exchange
  per call.
* ``0`` (``off``): never.
"""

from __future__ import annotations

import hashlib

import numpy as np


def array(aval, dims=None) -> str:
    """``float32[3,4]``: the dtype and shape (``dims``, default the aval's) of an array."""
    shape = aval.shape if dims is None else dims
    return f"{np.dtype(aval.dtype).name}[{','.join(str(d) for d in shape)}]"


def attrs(op: str, signature: str) -> dict[str, str | int]:
    """The custom call's attributes for the signature ``op(signature)``: text and hash."""
    text = f"{op}({signature})"
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    # Below 2**62, so that the handler's -hash cannot overflow.
    return {"signature": text, "signature_hash": int.from_bytes(digest, "little") >> 2}


__all__ = ["array", "attrs"]
