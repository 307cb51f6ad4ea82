"""autoshard works without MPI; autoshard.mpi and `python -m autoshard.mpi` then say what is missing."""

import os
import subprocess
import sys

ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
       "PATH": ""}

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
                         timeout=120, env=ENV)
    assert out.returncode == 0, out.stderr
    assert "ImportError: autoshard.mpi needs mpi4py" in out.stdout
    assert "pip install 'mpi4py>=4.0'" in out.stdout
    assert "python -m autoshard.mpi" in out.stdout


def _fake_mpi4py(tmp_path, body):
    package = tmp_path / "mpi4py"
    package.mkdir()
    (package / "__init__.py").write_text("__version__ = '0.0'\n")
    (package / "MPI.py").write_text(body)
    return {**ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}


def test_diagnosis_names_missing_libmpi(tmp_path):
    # mpi4py present, but its MPI module cannot load libmpi (as when Open MPI is removed).
    env = _fake_mpi4py(tmp_path, "raise ImportError('libmpi.so.40: cannot open shared object "
                                 "file: No such file or directory')\n")
    out = subprocess.run([sys.executable, "-m", "autoshard.mpi"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "r0 | mpi4py" in out.stdout and "extension" in out.stdout
    assert "PROBLEM" in out.stdout and "needs libmpi (the MPI library)" in out.stdout
    assert "libmpi.so.40" in out.stdout and "apt-get install libopenmpi-dev" in out.stdout
    imported = subprocess.run([sys.executable, "-c", "import autoshard.mpi"], capture_output=True,
                              text=True, timeout=120, env=env)
    assert "ImportError: autoshard.mpi needs libmpi" in imported.stderr


def test_missing_extension_message_names_build_record():
    from autoshard.mpi import _install

    message = _install.missing_extension()
    assert str(_install.LIBRARY) in message and "install-time build reported" in message
    assert "pip install --no-deps --force-reinstall" in message


def test_mpi_tests_skip_cleanly_without_mpi4py(tmp_path):
    """A plain ``pytest`` on a machine without mpi4py skips the MPI tests (pytest 9 no longer
    skips a module that raises a plain ImportError unless told to)."""
    (tmp_path / "no_mpi4py.py").write_text("import sys\nsys.modules['mpi4py'] = None\n")
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    tests = os.path.join(os.path.dirname(__file__), "mpi", "test_validation.py")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no_mpi4py", tests,
                          "-p", "no:cacheprovider"], capture_output=True, text=True, timeout=300,
                         env=env, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode in (0, 5), out.stdout + out.stderr   # 5: nothing collected
    assert "error" not in out.stdout.lower(), out.stdout
    assert "skipped" in out.stdout, out.stdout
