"""Argument checks shared by the operations. Errors give the rule, the values and the fix."""

from __future__ import annotations

import numpy as np
from jax import core as jax_core

from ._native import MPI

# Operation codes understood by the native handlers (_ffi.cc, enum OpCode).
_OP_NAMES = ("SUM", "PROD", "MIN", "MAX", "LAND", "LOR", "LXOR", "BAND", "BOR", "BXOR")
_MPI_OPS = [getattr(MPI, name) for name in _OP_NAMES]
_INT_ONLY = {"BAND", "BOR", "BXOR"}


def op_code(op, dtype) -> int:
    """The handler's code for the mpi4py reduction ``op`` on ``dtype``."""
    code = next((i for i, mpi_op in enumerate(_MPI_OPS) if op == mpi_op), None)
    if code is None:
        raise ValueError(
            f"op must be one of MPI.{', MPI.'.join(_OP_NAMES)}, got {op!r}. "
            "User-defined MPI operations are not supported."
        )
    name = _OP_NAMES[code]
    dtype = np.dtype(dtype)
    if name in _INT_ONLY and dtype.kind not in "iub":
        raise TypeError(f"MPI.{name} needs an integer or bool array, got dtype {dtype}.")
    if dtype.kind == "c" and name not in ("SUM", "PROD"):
        raise TypeError(f"MPI.{name} is not defined for complex dtype {dtype}; use SUM or PROD.")
    if dtype.name in ("bfloat16", "float16") and code > 3:
        raise TypeError(
            f"MPI.{name} is not available for {dtype}; 16-bit floats support SUM, PROD, MIN "
            "and MAX. Cast to float32 first."
        )
    if dtype.itemsize == 1 and dtype.kind == "f":
        raise TypeError(f"reductions over 8-bit float dtype {dtype} are not supported; cast to float32.")
    return code


def op_name(code: int) -> str:
    return _OP_NAMES[code]


SUM_CODE = 0


def static_int(value, name: str, fn: str, low: int | None = None, high: int | None = None,
               mpi_call: str | None = None) -> int:
    """Checks that ``value`` is a concrete Python/NumPy integer (not a tracer).

    With ``low`` and ``high`` it is a rank, ``low <= value < high``; ``mpi_call`` names the
    MPI function a point-to-point rank goes to, for the error (see _rank_error).
    """
    if isinstance(value, jax_core.Tracer):
        raise TypeError(
            f"{fn}: {name} must be a concrete integer known at trace time, got a traced value "
            f"{value}. Pass it as a Python int, or mark the argument static with "
            f"jax.jit(..., static_argnums=...)."
        )
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{fn}: {name} must be an int, got {type(value).__name__} {value!r}.")
    value = int(value)
    if low is not None and high is not None and not low <= value < high:
        raise ValueError(_rank_error(fn, name, high, value, mpi_call))
    return value


def _rank_error(fn: str, name: str, size: int, value: int, mpi_call: str | None,
                alternative: str = "") -> str:
    """The message for a rank outside the communicator.

    For a point-to-point call it also says what MPI would have done, in mpi4jax's words
    (whose tests look for them): the call fails at run time and the job aborts.
    """
    message = (f"{fn}: {name} must be a rank of the communicator, 0 <= {name} < {size}"
               f"{alternative}, got {value}.")
    if mpi_call is not None:
        message += (
            f" Checked before anything ran; left to MPI, the call would fail at run time "
            f"(mpi4jax reports 'r{MPI.COMM_WORLD.Get_rank()} | {mpi_call} returned error code "
            f"{MPI.ERR_RANK}') and abort the job.")
    return message


def rank_or_any(value, name: str, fn: str, size: int, any_value: int,
                mpi_call: str | None = None) -> int:
    """Like static_int for a rank or a tag that may also be MPI.ANY_SOURCE / MPI.ANY_TAG."""
    value = static_int(value, name, fn)
    if value == any_value:
        return value
    if size is not None and not 0 <= value < size:
        raise ValueError(_rank_error(fn, name, size, value, mpi_call, ", or MPI.ANY_SOURCE"))
    return value


def tag(value, name: str, fn: str, allow_any: bool = False) -> int:
    value = static_int(value, name, fn)
    if allow_any and value == MPI.ANY_TAG:
        return value
    if value < 0:
        raise ValueError(f"{fn}: {name} must be >= 0{' or MPI.ANY_TAG' if allow_any else ''}, got {value}.")
    return value


def same_shape(expected, actual, what: str, fn: str) -> None:
    if tuple(expected) != tuple(actual):
        raise ValueError(f"{fn}: {what} must have shape {tuple(expected)}, got {tuple(actual)}.")


def status_address(status, fn: str) -> int:
    if status is None:
        return 0
    if not isinstance(status, MPI.Status):
        raise TypeError(f"{fn}: status must be an mpi4py.MPI.Status or None, got {type(status).__name__}.")
    address = MPI._addressof(status)
    # The compiled call writes to this address whenever it runs, possibly long after the
    # caller dropped the object: keep it alive for the life of the process.
    _live_statuses[address] = status
    return address


_live_statuses: dict[int, object] = {}


def static_counts(counts, size: int, fn: str) -> tuple[int, ...]:
    """Checks a static sequence of non-negative row counts, one per rank."""
    if isinstance(counts, jax_core.Tracer):
        raise TypeError(
            f"{fn}: counts must be concrete integers known at trace time (they fix the result's "
            "shape), got a traced value. Pass a tuple of ints, or mark the argument static with "
            "jax.jit(..., static_argnums=...)."
        )
    if not isinstance(counts, (list, tuple)):
        counts = np.asarray(counts).reshape(-1).tolist()
    counts = tuple(static_int(c, "counts[i]", fn) for c in counts)
    if len(counts) != size or min(counts, default=0) < 0:
        raise ValueError(
            f"{fn}: counts must hold one non-negative int per rank ({size}), got {counts}."
        )
    return counts


def fits_int(num_bytes: int, fn: str) -> None:
    """MPI counts are C ints: buffers are limited to 2**31 - 1 bytes per call."""
    if num_bytes >= 2**31:
        raise ValueError(
            f"{fn}: {num_bytes} bytes exceed the 2**31 - 1 bytes one MPI call can move here; "
            "split the array into several calls."
        )
