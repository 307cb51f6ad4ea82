"""The shallow-water example gives the single-process result on 2 and 4 ranks."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI

ARGS = ["-m", "autoshard.examples.shallow_water", "--size", "24", "--steps", "60"]


def _env():
    # A fresh job: no inherited MPI singleton state, one device and one thread per rank.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    env["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    return env


def _run(tmp_path, num_ranks):
    out = tmp_path / f"h{num_ranks}.npy"
    command = [sys.executable, *ARGS, "--out", str(out)]
    if num_ranks > 1:
        command = ["mpirun", "--oversubscribe", "--allow-run-as-root", "-np", str(num_ranks),
                   *command]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=100, env=_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"on {num_ranks} ranks" in proc.stdout
    assert "max difference from the undecomposed run 0.0e+00" in proc.stdout
    return np.load(out)


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="launches its own mpirun (runs once)")
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
@pytest.mark.timeout(300)
def test_shallow_water_matches_single_process(tmp_path):
    single = _run(tmp_path, 1)
    assert single.shape == (24, 24) and np.abs(single).max() > 0.1
    for num_ranks in (2, 4):
        np.testing.assert_array_equal(_run(tmp_path, num_ranks), single)
