"""With abort_on_uncaught_exception() (opt-in), a crash on one rank ends the whole job instead
of leaving the others waiting."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from mpi4py import MPI

SCRIPT = textwrap.dedent("""
    import jax.numpy as jnp
    from mpi4py import MPI
    from autoshard import mpi
    mpi.abort_on_uncaught_exception()
    if MPI.COMM_WORLD.Get_rank() == 1:
        raise RuntimeError("rank 1 crashed on purpose")
    mpi.allreduce(jnp.ones(2), MPI.SUM)  # would wait forever for rank 1
""")


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="launches its own mpirun")
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
def test_crash_aborts_job(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    proc = subprocess.run(
        ["mpirun", "--oversubscribe", "--allow-run-as-root", "-np", "2", sys.executable, str(script)],
        capture_output=True, text=True, timeout=90, env=env)
    assert proc.returncode != 0
    assert "rank 1 crashed on purpose" in proc.stderr + proc.stdout
