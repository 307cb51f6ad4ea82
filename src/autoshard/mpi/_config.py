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
    """AUTOSHARD_MPI_DEBUG=1: log every native MPI call on entry and exit (rank, op, bytes, time)."""
    return _flag("AUTOSHARD_MPI_DEBUG")


def abort_on_uncaught_exception() -> bool:
    """AUTOSHARD_MPI_ABORT=1: ``import autoshard.mpi`` opts in to aborting the job on a crash."""
    return _flag("AUTOSHARD_MPI_ABORT")


def huge_pages() -> bool:
    """AUTOSHARD_MPI_HUGE_PAGES=0: leave buffers of 4 MiB and more on the pages XLA gave them.

    On by default: such buffers are advised onto transparent huge pages, as NumPy's are,
    which large MPI transfers need to match mpi4py (see PreferHugePages in _ffi.cc).
    """
    return _flag("AUTOSHARD_MPI_HUGE_PAGES", default=True)
