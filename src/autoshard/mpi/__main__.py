"""``python -m autoshard.mpi`` (or ``mpirun -np N python -m autoshard.mpi``): a diagnosis.

Reports the MPI library and its version, mpi4py, the native extension and how it was
built, this process's rank and size, and runs one allreduce. Exits with status 1 and a line
naming what is missing (and the fix) when autoshard.mpi cannot be used.
"""

from __future__ import annotations

import os
import platform
import sys

from . import _install


def _report(lines: list[tuple[str, str]], rank: int) -> None:
    width = max(len(key) for key, _ in lines)
    for key, value in lines:
        print(f"r{rank} | {key.ljust(width)}  {value}", flush=True)


def diagnose() -> int:
    import jax  # noqa: PLC0415

    lines = [("python", f"{platform.python_version()} ({sys.executable})"),
             ("jax / jaxlib", f"{jax.__version__} / {jax.lib.__version__}"),
             ("extension", f"{_install.LIBRARY} "
                           f"({'present' if _install.LIBRARY.exists() else 'missing'})"),
             ("extension build", _install.build_status()),
             ("AUTOSHARD_MPI_DEBUG", os.environ.get("AUTOSHARD_MPI_DEBUG", "(unset)")),
             ("AUTOSHARD_MPI_HUGE_PAGES", os.environ.get("AUTOSHARD_MPI_HUGE_PAGES", "(unset: on)"))]
    rank = 0
    try:
        import mpi4py  # noqa: PLC0415

        lines.append(("mpi4py", f"{mpi4py.__version__} ({os.path.dirname(mpi4py.__file__)})"))
        from mpi4py import MPI  # noqa: PLC0415

        rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
        lines += [("MPI library", MPI.Get_library_version().strip().splitlines()[0]),
                  ("MPI standard", ".".join(map(str, MPI.Get_version()))),
                  ("rank / size", f"{rank} / {size} on {MPI.Get_processor_name()}")]
        from . import _native  # noqa: F401, PLC0415  (loads and registers the extension)
    except ImportError as err:
        message = str(err)
        if "autoshard.mpi" not in message:  # raw mpi4py error: phrase it like the import would
            name = getattr(err, "name", None)
            message = (_install.missing_mpi4py(err) if name == "mpi4py"
                       else _install.missing_libmpi(err))
        _report([*lines, ("PROBLEM", message)], rank)
        return 1
    import jax.numpy as jnp  # noqa: PLC0415

    from .allreduce import allreduce  # noqa: PLC0415

    total = int(jax.jit(lambda x: allreduce(x, MPI.SUM)[0])(jnp.int32(rank + 1)))
    expected = size * (size + 1) // 2
    check = f"jitted allreduce of rank + 1 over {size} ranks: {total} (expected {expected})"
    if total != expected:
        _report([*lines, ("PROBLEM", check)], rank)
        return 1
    _report([*lines, ("check", check), ("status", "OK: autoshard.mpi is usable")], rank)
    return 0


if __name__ == "__main__":
    sys.exit(diagnose())
