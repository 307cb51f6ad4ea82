"""Process-level safety: pending MPI calls finish before MPI_Finalize; a crash aborts the job."""

from __future__ import annotations

import atexit
import sys
import time

import jax

from ._native import MPI, lib


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


def _excepthook(kind, value, traceback) -> None:
    """Prints the error, then aborts every rank: the others would wait for this one forever."""
    _previous_hook(kind, value, traceback)
    sys.stderr.flush()
    if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
        MPI.COMM_WORLD.Abort(1)


_previous_hook = sys.excepthook
_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    atexit.register(_flush)
    sys.excepthook = _excepthook
