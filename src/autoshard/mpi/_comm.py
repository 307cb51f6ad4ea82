"""Communicators: the default clone of COMM_WORLD and the tables the handlers look them up in.

Each communicator gets tables in the native extension, indexed by device ordinal:

* the process tables: outside a user's shard_map a process makes one MPI call per operation
  (on whichever device runs it), so every rank must use the communicator itself, whatever
  its device. One table maps every device to it; in a jit over several devices, where
  every device runs the call, a table per leader device maps only the leader to it and the
  others to nothing (they skip the call; see _lowering._once_per_process);
* the device table is for calls inside a user's shard_map, one per device, each on its own
  thread: each device talks through its own duplicate of the communicator (device 0 uses
  the communicator itself), so that the streams of MPI calls never mix.
"""

from __future__ import annotations

import ctypes

import jax

from . import _lowering, _runtime
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


def _register(comms) -> int:
    """Registers a table of communicators (None: that device skips its calls); returns its id."""
    handles = (ctypes.c_int64 * len(comms))(*[0 if c is None else MPI._handleof(c) for c in comms])
    return lib.autoshard_mpi_register_comm(handles, len(comms))


def comm_id(comm) -> int:
    """The integer id of ``comm``'s device table in the native extension (created once).

    This id is what the primitives carry; the lowering swaps in the process table's id
    where a call runs once per process (see _lowering.pair_comm_tables). Creating the tables duplicates the communicator (a
    collective call), which happens at the first trace that uses it: every rank traces the
    same program, so in the same order.
    """
    _runtime.activate()
    handle = MPI._handleof(comm)
    entry = _comm_ids.get(handle)
    if entry is None:
        num_devices = _num_local_devices()
        comms = [comm] + [comm.Dup() for _ in range(num_devices - 1)]
        entry = (_register(comms), comms)
        _comm_ids[handle] = entry
        _lowering.pair_comm_tables(entry[0], lambda leader: _register(
            [comm if leader in (None, d) else None for d in range(num_devices)]))
    return entry[0]
