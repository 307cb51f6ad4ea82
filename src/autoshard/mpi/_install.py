"""Where the native extension is, how it was built, and the messages naming what is missing.

Imports nothing that needs MPI, so that ``python -m autoshard.mpi`` can diagnose a broken
installation (see __main__.py).
"""

from __future__ import annotations

import pathlib
import sys

LIBRARY = pathlib.Path(__file__).with_name("_ffi.so")
_STATUS = LIBRARY.with_name("_build.txt")  # written by setup.py when the package is installed

REINSTALL = (
    "Install MPI (Debian/Ubuntu: apt-get install libopenmpi-dev openmpi-bin; or set MPICXX to "
    "your MPI C++ compiler wrapper), then reinstall autoshard so that it builds its extension: "
    "pip install --no-deps --force-reinstall <autoshard source or sdist> (in a checkout: "
    "`make native`). `python -m autoshard.mpi` prints a diagnosis."
)


def build_status() -> str:
    """What the install-time build did (the line setup.py wrote), or why that is unknown."""
    try:
        return _STATUS.read_text().strip()
    except OSError:
        return "no build record (autoshard was installed without running setup.py's build_ext)"


def missing_mpi4py(error: ImportError) -> str:
    return (f"autoshard.mpi needs mpi4py: {error}. Install it with pip install 'mpi4py>=4.0' "
            f"(it needs an MPI library: Debian/Ubuntu: apt-get install libopenmpi-dev "
            f"openmpi-bin). `python -m autoshard.mpi` prints a diagnosis.")


def missing_libmpi(error: ImportError) -> str:
    return (f"autoshard.mpi needs libmpi (the MPI library), which mpi4py could not load: "
            f"{error}. {REINSTALL}")


def missing_extension() -> str:
    return (f"autoshard.mpi needs its native extension {LIBRARY}, which is missing. The "
            f"install-time build reported: {build_status()}. {REINSTALL}")


def unloadable_extension(error: OSError) -> str:
    return (f"autoshard.mpi could not load its native extension {LIBRARY}: {error}. It was "
            f"{build_status()}; it must be rebuilt against the MPI library and jaxlib now "
            f"installed. {REINSTALL}")


def stale_extension() -> str:
    return (f"autoshard.mpi's native extension {LIBRARY} is older than its Python code (it was "
            f"{build_status()}). {REINSTALL}")


def diagnosing() -> bool:
    """True while ``python -m autoshard.mpi`` imports the package to run its __main__."""
    # orig_argv is [python, *options, "-m", module, *args]; argv is ["-m", *args] meanwhile.
    argv, orig = sys.argv, getattr(sys, "orig_argv", [])
    return argv[:1] == ["-m"] and len(orig) >= len(argv) and (
        orig[len(orig) - len(argv)] == "autoshard.mpi")
