"""Communicators: the default clone of COMM_WORLD and the tables the handlers look them up in.

Each communicator gets tables in the native extension, indexed by device ordinal:

* the process tables: outside a user's shard_map a process makes one MPI call per operation
  (on whichever device runs it), so every rank must use the communicator itself, whatever
  its device. One table maps every device to it; in a jit over several devices, where
  every device runs the call, a table per region size does too and marks the region: the
  first device to reach each call makes it, the others skip it (see
  _lowering._once_per_process and "one call per process" in _ffi.cc);
* the device table is for calls inside a user's shard_map, one per device, each on its own
  thread: each device talks through its own duplicate of the communicator (device 0 uses
  the communicator itself), so that the streams of MPI calls never mix.

Every entry also names the communicator its argument checks go through (see _check.py): a
duplicate of the entry's own, so that the checks' messages never meet the operations'.
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


def _register(comms, checks, num_region_devices=0) -> int:
    """Registers a table of communicators and of their checks'; returns its id.

    ``num_region_devices``: the size of the once-per-process region the table serves, if any.
    """
    def handles(table):
        return (ctypes.c_int64 * len(table))(*[MPI._handleof(c) for c in table])

    return lib.autoshard_mpi_register_comm(
        handles(comms), handles(checks), len(comms), num_region_devices)


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
        checks = [c.Dup() for c in comms]
        entry = (_register(comms, checks), comms + checks)
        _comm_ids[handle] = entry

        def process_table(num_region_devices):
            return _register([comm] * num_devices, [checks[0]] * num_devices,
                             num_region_devices or 0)

        _lowering.pair_comm_tables(entry[0], process_table)
    return entry[0]
