"""autoshard works without MPI; autoshard.mpi then says exactly what is missing."""

import subprocess
import sys

CODE = """
import sys
sys.modules["mpi4py"] = None  # as if mpi4py were not installed
import jax.numpy as jnp
import autoshard
f = autoshard.parallelize(lambda x: x * 2, batch_argnums=(0,), method=autoshard.DataParallel())
assert float(f(jnp.ones(8)).sum()) == 16.0
try:
    from autoshard import mpi  # noqa: F401
except ImportError as e:
    print("ImportError:", e)
"""


def test_autoshard_imports_and_runs_without_mpi():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                         timeout=120, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8",
                                           "JAX_PLATFORMS": "cpu", "PATH": ""})
    assert out.returncode == 0, out.stderr
    assert "ImportError: autoshard.mpi needs mpi4py" in out.stdout
    assert "make native" in out.stdout
