"""Loads MPI (through mpi4py) and the native FFI handlers, and registers them with XLA.

Importing this module fails with an ImportError that names the missing piece.
"""

from __future__ import annotations

import ctypes
import pathlib

import jax

try:
    from mpi4py import MPI
except ImportError as err:  # mpi4py missing, or present but libmpi is not
    missing = "mpi4py" if getattr(err, "name", None) == "mpi4py" else "libmpi (the MPI library)"
    raise ImportError(
        f"autoshard.mpi needs {missing}: {err}. Install Open MPI and mpi4py with `make native` "
        "(Debian: apt-get install libopenmpi-dev openmpi-bin; then pip install 'mpi4py>=4.0')."
    ) from err

_LIBRARY = pathlib.Path(__file__).with_name("_ffi.so")
if not _LIBRARY.exists():
    raise ImportError(
        f"autoshard.mpi needs its native extension {_LIBRARY}, which is not built. "
        "Build it with `make native` (compiles _ffi.cc with mpicxx against jax.ffi.include_dir())."
    )
try:
    lib = ctypes.CDLL(str(_LIBRARY), mode=ctypes.RTLD_GLOBAL)
except OSError as err:
    raise ImportError(
        f"autoshard.mpi could not load its native extension {_LIBRARY}: {err}. "
        "Rebuild it against the installed MPI and jaxlib with `make native`."
    ) from err

lib.autoshard_mpi_register_comm.restype = ctypes.c_int64
lib.autoshard_mpi_register_comm.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int64]
lib.autoshard_mpi_inflight.restype = ctypes.c_int64
lib.autoshard_mpi_status_size.restype = ctypes.c_int64

TARGETS = (
    "allreduce", "reduce", "scan", "bcast", "gather", "scatter", "allgather",
    "allgatherv", "alltoall", "alltoallv", "send", "recv", "sendrecv", "barrier",
)


def target_name(op: str) -> str:
    """The XLA custom-call target name of one operation."""
    return f"autoshard_mpi_{op}"


for _op in TARGETS:
    jax.ffi.register_ffi_target(
        target_name(_op), jax.ffi.pycapsule(getattr(lib, target_name(_op))), platform="cpu"
    )

__all__ = ["MPI", "lib", "target_name"]
