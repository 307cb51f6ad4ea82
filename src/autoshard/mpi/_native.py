"""Loads MPI (through mpi4py) and the native FFI handlers, and registers them with XLA.

Importing this module fails with an ImportError that names the missing piece and the fix
(messages in _install.py). The extension is built by setup.py when autoshard is installed.
"""

from __future__ import annotations

import ctypes

import jax

from . import _config, _install

try:
    from mpi4py import MPI
except ImportError as err:  # mpi4py missing, or present but libmpi is not
    if getattr(err, "name", None) == "mpi4py":
        raise ImportError(_install.missing_mpi4py(err)) from err
    raise ImportError(_install.missing_libmpi(err)) from err

if not _install.LIBRARY.exists():
    raise ImportError(_install.missing_extension())
try:
    lib = ctypes.CDLL(str(_install.LIBRARY), mode=ctypes.RTLD_GLOBAL)
except OSError as err:
    raise ImportError(_install.unloadable_extension(err)) from err
_ABI_VERSION = 4  # autoshard_mpi_abi_version() in _ffi.cc
if getattr(lib, "autoshard_mpi_abi_version", lambda: 1)() != _ABI_VERSION:
    raise ImportError(_install.stale_extension())
lib.autoshard_mpi_abi_version.restype = ctypes.c_int64

lib.autoshard_mpi_register_comm.restype = ctypes.c_int64
lib.autoshard_mpi_register_comm.argtypes = [
    ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64), ctypes.c_int64, ctypes.c_int64,
]
lib.autoshard_mpi_inflight.restype = ctypes.c_int64
lib.autoshard_mpi_status_size.restype = ctypes.c_int64
lib.autoshard_mpi_num_calls.restype = ctypes.c_int64
lib.autoshard_mpi_set_debug.argtypes = [ctypes.c_int64]
_logging = _config.debug()


def set_logging(enable: bool) -> None:
    """Turns the debug log of every native MPI call on or off (mpi4jax's ``set_logging``).

    Each call then prints "r{rank} | {op} {bytes} B ..." to stderr on entry and on exit. At
    import the log follows AUTOSHARD_MPI_DEBUG (or mpi4jax's MPI4JAX_DEBUG); see _config.py.
    """
    global _logging
    if not isinstance(enable, (bool, int)):
        raise TypeError(f"set_logging takes True or False, got {type(enable).__name__} {enable!r}.")
    _logging = bool(enable)
    lib.autoshard_mpi_set_debug(int(_logging))


def get_logging() -> bool:
    """Whether the debug log of native MPI calls is on (see ``set_logging``)."""
    return _logging


lib.autoshard_mpi_set_debug(int(_logging))
lib.autoshard_mpi_set_huge_pages.argtypes = [ctypes.c_int64]
lib.autoshard_mpi_num_collapsed.restype = ctypes.c_int64
lib.autoshard_mpi_num_checks.restype = ctypes.c_int64
lib.autoshard_mpi_set_check.argtypes = [ctypes.c_int64]
lib.autoshard_mpi_set_check_warn_ms.argtypes = [ctypes.c_int64]
CHECK_MODES = {"off": 0, "first": 1, "every": 2}  # enum CheckMode in _ffi.cc
# When the ranks compare their arguments before a call (AUTOSHARD_MPI_CHECK, see _check.py).
lib.autoshard_mpi_set_check(CHECK_MODES[_config.check()])
# Buffers of 4 MiB and more go onto transparent huge pages (AUTOSHARD_MPI_HUGE_PAGES=0: not).
lib.autoshard_mpi_set_huge_pages(int(_config.huge_pages()))

TARGETS = (
    "allreduce",
    "reduce",
    "scan",
    "bcast",
    "gather",
    "scatter",
    "allgather",
    "allgatherv",
    "alltoall",
    "alltoallv",
    "send",
    "recv",
    "sendrecv",
    "barrier",
)


def target_name(op: str) -> str:
    """The XLA custom-call target name of one operation."""
    return f"autoshard_mpi_{op}"


for _op in TARGETS:
    jax.ffi.register_ffi_target(
        target_name(_op), jax.ffi.pycapsule(getattr(lib, target_name(_op))), platform="cpu"
    )

__all__ = ["MPI", "get_logging", "lib", "set_logging", "target_name"]
