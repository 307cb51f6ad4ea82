"""Process-level safety, all of it opt-in or started by the first MPI operation, never by import.

* Pending MPI calls finish before MPI_Finalize: an exit handler registered when the first
  MPI operation is traced (``activate``).
* A crash on one rank would leave the others waiting in their next collective forever.
  ``abort_on_uncaught_exception()`` (or AUTOSHARD_MPI_ABORT=1 at import) chains a
  ``sys.excepthook`` that prints the error as before and then calls MPI_Abort, ending the
  whole job. ``python -m mpi4py script.py`` gives the same protection without this package.
"""

from __future__ import annotations

import atexit
import sys
import time

import jax

from . import _lowering
from ._native import MPI, lib

_active = False


def activate() -> None:
    """Starts what a process using MPI operations needs (once): the exit flush, the DCE hook."""
    global _active
    if _active:
        return
    _active = True
    atexit.register(_flush)
    _lowering.keep_mpi_holders()


def _flush() -> None:
    """Waits for dispatched computations (and the MPI calls in them) before MPI_Finalize.

    Registered after mpi4py's own exit handler, so it runs first (atexit is LIFO).
    """
    try:
        jax.effects_barrier()
        for array in jax.live_arrays():
            array.block_until_ready()
    except Exception:  # noqa: BLE001 -- best effort while the interpreter exits
        pass
    deadline = time.monotonic() + 60.0
    while lib.autoshard_mpi_inflight() > 0 and time.monotonic() < deadline:
        time.sleep(0.001)


def abort_on_uncaught_exception() -> None:
    """Makes an uncaught exception on any rank abort the whole MPI job (opt-in, idempotent).

    Chains to the ``sys.excepthook`` in place when called: that hook still prints (or
    handles) the error first; then, with more than one rank, ``MPI_Abort`` ends every rank
    instead of leaving the others blocked in their next collective.
    """
    if getattr(sys.excepthook, "autoshard_mpi", False):
        return
    previous = sys.excepthook

    def excepthook(kind, value, traceback) -> None:
        previous(kind, value, traceback)
        sys.stderr.flush()
        if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
            MPI.COMM_WORLD.Abort(1)

    excepthook.autoshard_mpi = True
    sys.excepthook = excepthook
