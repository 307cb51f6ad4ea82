"""Communicators: the default clone of COMM_WORLD and the per-device tables the handlers use.

A jitted computation spanning several local devices runs each device's part on its own
thread; each device therefore talks through its own duplicate of the communicator
(device 0 uses the communicator itself), so that the streams of MPI calls never mix.
"""

from __future__ import annotations

import ctypes

import jax

from ._native import MPI, lib

_default_comm = None
_comm_ids: dict[int, tuple[int, list]] = {}


def default_comm():
    """The communicator used when ``comm=None``: a cached clone of COMM_WORLD."""
    global _default_comm
    if _default_comm is None:
        _default_comm = MPI.COMM_WORLD.Clone()
    return _default_comm


def resolve(comm):
    """Returns the mpi4py communicator to use for ``comm`` (None: the default)."""
    if comm is None:
        return default_comm()
    if not isinstance(comm, MPI.Comm):
        raise TypeError(
            f"comm must be an mpi4py communicator (mpi4py.MPI.Comm) or None, got "
            f"{type(comm).__name__}. Pass e.g. MPI.COMM_WORLD or comm.Split(...)."
        )
    if comm == MPI.COMM_NULL:
        raise ValueError("comm is MPI.COMM_NULL; this rank is not part of the communicator.")
    return comm


def _num_local_devices() -> int:
    return max(d.id for d in jax.local_devices(backend="cpu")) + 1


def comm_id(comm) -> int:
    """The integer id of ``comm``'s per-device table in the native extension (created once).

    Creating a table duplicates the communicator (a collective call), which happens at the
    first trace that uses it: every rank traces the same program, so in the same order.
    """
    handle = MPI._handleof(comm)
    entry = _comm_ids.get(handle)
    if entry is None:
        comms = [comm] + [comm.Dup() for _ in range(_num_local_devices() - 1)]
        handles = (ctypes.c_int64 * len(comms))(*[MPI._handleof(c) for c in comms])
        entry = (lib.autoshard_mpi_register_comm(handles, len(comms)), comms)
        _comm_ids[handle] = entry
    return entry[0]
