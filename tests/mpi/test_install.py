"""The installed path: an sdist builds a wheel holding the native extension, and the installed
package finds it (`python -m autoshard.mpi` diagnoses and runs an allreduce)."""

import os
import pathlib
import re
import subprocess
import sys
import zipfile

import pytest
from mpi4py import MPI

ROOT = pathlib.Path(__file__).parents[2]


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    return {**env, "JAX_PLATFORMS": "cpu", **extra}


def _run(*command, **kwargs):
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, **kwargs)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="builds and installs once")
@pytest.mark.timeout(600)
def test_sdist_builds_wheel_with_extension_and_installed_package_works(tmp_path):
    pytest.importorskip("wheel", reason="`make native` installs wheel and setuptools>=77")
    _run(sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist"), cwd=ROOT,
         env=_clean_env())
    (sdist,) = (tmp_path / "dist").glob("autoshard-*.tar.gz")
    # No build isolation: the build sees this environment's jaxlib and MPI (pip install . with
    # isolation fetches jaxlib, a build requirement, the same way).
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "wheels"), str(sdist), env=_clean_env())
    (wheel,) = (tmp_path / "wheels").glob("autoshard-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "autoshard/mpi/_ffi.so" in names and "autoshard/mpi/_ffi.cc" in names
    record = zipfile.ZipFile(wheel).read("autoshard/mpi/_build.txt").decode()
    assert record.startswith("built with "), record

    target = tmp_path / "site"
    _run(sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
         str(wheel), env=_clean_env())
    proc = _run(sys.executable, "-m", "autoshard.mpi", cwd=tmp_path,
                env=_clean_env(PYTHONPATH=str(target)))
    assert f"{target}/autoshard/mpi/_ffi.so (present)" in proc.stdout, proc.stdout
    assert "MPI library" in proc.stdout and re.search(r"rank / size +0 / 1 on ", proc.stdout)
    assert "OK: autoshard.mpi is usable" in proc.stdout


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="checks the build hook once")
def test_build_without_mpi_compiler_succeeds_and_records_why(tmp_path):
    # Importing setup.py runs setup(); --version makes that a no-op.
    code = ("import pathlib, sys; sys.argv = ['setup.py', '--version']; import setup; "
            f"print(setup.build(pathlib.Path({str(tmp_path)!r}) / '_ffi.so'))")
    env = _clean_env(MPICXX="/nonexistent/mpicxx", PYTHONPATH=str(ROOT))
    proc = _run(sys.executable, "-c", code, cwd=ROOT, env=env)
    assert "not built: $MPICXX='/nonexistent/mpicxx' is not an executable" in proc.stdout
    assert not (tmp_path / "_ffi.so").exists()
