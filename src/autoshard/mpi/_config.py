"""Environment variables of autoshard.mpi, read here and nowhere else, validated."""

from __future__ import annotations

import os

_FLAGS = {
    "": False,
    "0": False,
    "1": True,
    "false": False,
    "true": True,
    "no": False,
    "yes": True,
    "off": False,
    "on": True,
}


def _flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(name, "")
    if not value.strip():
        return default
    try:
        return _FLAGS[value.strip().lower()]
    except KeyError:
        raise ValueError(
            f"The environment variable {name} ({value!r}) must be 1 or 0 (also true/false, "
            f"yes/no, on/off). Set {name}=1 to enable it, {name}=0 to disable it, or unset "
            f"it for the default ({int(default)})."
        ) from None


def debug() -> bool:
    """AUTOSHARD_MPI_DEBUG=1: log every native MPI call on entry and exit (rank, op, bytes, time).

    mpi4jax's MPI4JAX_DEBUG=1 is accepted too (either turns the log on); at run time
    ``set_logging`` (in _native.py) switches it.
    """
    return _flag("AUTOSHARD_MPI_DEBUG") or _flag("MPI4JAX_DEBUG")


def abort_on_uncaught_exception() -> bool:
    """AUTOSHARD_MPI_ABORT=1: ``import autoshard.mpi`` opts in to aborting the job on a crash."""
    return _flag("AUTOSHARD_MPI_ABORT")


def huge_pages() -> bool:
    """AUTOSHARD_MPI_HUGE_PAGES=0: leave buffers of 4 MiB and more on the pages XLA gave them.

    On by default: such buffers are advised onto transparent huge pages, as NumPy's are,
    which large MPI transfers need to match mpi4py (see PreferHugePages in _ffi.cc).
    """
    return _flag("AUTOSHARD_MPI_HUGE_PAGES", default=True)


_CHECK_MODES = {"0": "off", "1": "every", "first": "first", "every": "every", "off": "off"}


def check() -> str:
    """AUTOSHARD_MPI_CHECK: when the ranks compare their arguments before an MPI call.

    "first" (unset, the default): a collective the first time a process makes it with these
    arguments on a communicator; "every" (1): every call, point-to-point included; "off" (0).
    See _check.py.
    """
    value = os.environ.get("AUTOSHARD_MPI_CHECK", "")
    key = value.strip().lower()
    if not key:
        return "first"
    if key in _CHECK_MODES:
        return _CHECK_MODES[key]
    if key in _FLAGS:
        return "every" if _FLAGS[key] else "off"
    raise ValueError(
        f"The environment variable AUTOSHARD_MPI_CHECK ({value!r}) must be 1 (or every: check "
        f"every MPI call), 0 (or off: never) or first (the default when unset: check each "
        f"collective the first time a process makes it with its arguments)."
    )
