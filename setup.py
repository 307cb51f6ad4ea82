"""Builds autoshard.mpi's native extension (``autoshard/mpi/_ffi.so``) at install time.

Everything else is declared in pyproject.toml. ``pip install .`` (and installing the sdist)
compiles ``src/autoshard/mpi/_ffi.cc`` with the MPI compiler wrapper against jaxlib's XLA FFI
headers (``jax.ffi.include_dir()``; jaxlib is a build requirement). The wrapper is, in order:
``$MPICXX``, ``$MPICC``, ``mpicxx`` / ``mpic++`` / ``mpiCC`` on PATH, or the one mpi4py was
built with. Without MPI the install still succeeds: the reason is written to
``autoshard/mpi/_build.txt`` and ``import autoshard.mpi`` reports it, with the fix.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shlex
import shutil
import subprocess

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCE = "src/autoshard/mpi/_ffi.cc"
# XLA's FFI headers are third-party (-isystem: their warnings are not ours). Our own code builds
# warning-free under -Wall -Wextra, and a missing return is an error. Open MPI's C++ bindings
# are unused.
FLAGS = ["-O2", "-std=c++17", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror=return-type",
         "-DOMPI_SKIP_MPICXX=1", "-DMPICH_SKIP_MPICXX=1"]
CXX_WRAPPERS = ("mpicxx", "mpic++", "mpiCC")


def find_mpi_compiler() -> tuple[list[str] | None, str]:
    """The MPI C++ compiler command and where it came from, or (None, what was tried)."""
    for variable in ("MPICXX", "MPICC"):
        value = os.environ.get(variable)
        if value:
            command = shlex.split(value)
            if shutil.which(command[0]) is None:
                return None, f"${variable}={value!r} is not an executable"
            if variable == "MPICC":  # a C wrapper: compile as C++, link the C++ runtime
                command += ["-x", "c++"]
            return command, f"${variable}"
    for name in CXX_WRAPPERS:
        path = shutil.which(name)
        if path:
            return [path], "PATH"
    try:
        import mpi4py  # noqa: PLC0415 -- optional, present when building without isolation

        config = mpi4py.get_config()
    except Exception:  # noqa: BLE001 -- mpi4py absent or unconfigured
        config = {}
    for key in ("mpicxx", "mpicc"):
        if config.get(key) and shutil.which(shlex.split(config[key])[0]):
            command = shlex.split(config[key]) + (["-x", "c++"] if key == "mpicc" else [])
            return command, "mpi4py's build configuration"
    return None, ("no MPI compiler wrapper found (tried $MPICXX, $MPICC, "
                  f"{', '.join(CXX_WRAPPERS)} on PATH and mpi4py's build configuration)")


def jax_include_dir() -> str | None:
    """jaxlib's header directory (what ``jax.ffi.include_dir()`` returns), without importing."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        return None
    include = pathlib.Path(list(spec.submodule_search_locations)[0]) / "include"
    return str(include) if (include / "xla" / "ffi" / "api" / "ffi.h").exists() else None


def build(output: pathlib.Path) -> str:
    """Compiles the extension to ``output``; returns the status line for _build.txt."""
    compiler, origin = find_mpi_compiler()
    if compiler is None:
        return f"not built: {origin}"
    include = jax_include_dir()
    if include is None:
        return "not built: jaxlib's XLA FFI headers (jax.ffi.include_dir()) were not found"
    output.parent.mkdir(parents=True, exist_ok=True)
    command = [*compiler, *FLAGS, "-isystem", include, SOURCE, "-o", str(output)]
    if compiler[-2:] == ["-x", "c++"]:
        command += ["-lstdc++"]
    print("autoshard.mpi: " + shlex.join(command), flush=True)
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        output.unlink(missing_ok=True)
        error = (proc.stderr or proc.stdout).strip().splitlines()
        return (f"not built: {shlex.join(compiler)} (from {origin}) failed with exit code "
                f"{proc.returncode}: {' / '.join(error[-3:])}")
    return f"built with {shlex.join(compiler)} (from {origin}) against {include}"


class BuildMPIExtension(build_ext):
    """Builds _ffi.so with the MPI wrapper instead of the Python C compiler (it is not a Python
    module: autoshard.mpi loads it with ctypes). A failure leaves the install intact."""

    def get_ext_filename(self, fullname: str) -> str:
        return os.path.join(*fullname.split(".")) + ".so"

    def run(self) -> None:
        # In-place and editable builds put the extension beside the sources afterwards
        # (setuptools copies it); the build record must go there too.
        self._beside_sources = bool(self.inplace or getattr(self, "editable_mode", False))
        super().run()

    def copy_extensions_to_source(self) -> None:
        # In-place and editable builds copy each built extension beside the sources; one that
        # was not built (no MPI) is skipped, so that the install still succeeds.
        built = [e for e in self.extensions if e.name in getattr(self, "_built", ())]
        self.extensions, every = built, self.extensions
        try:
            super().copy_extensions_to_source()
        finally:
            self.extensions = every

    def build_extension(self, ext: Extension) -> None:
        output = pathlib.Path(self.get_ext_fullpath(ext.name))
        status = build(output)
        print(f"autoshard.mpi: native extension {status}", flush=True)
        if output.exists():
            self._built = {*getattr(self, "_built", ()), ext.name}
        records = [output.with_name("_build.txt")]
        if self._beside_sources:
            package = ".".join(ext.name.split(".")[:-1])
            package_dir = self.get_finalized_command("build_py").get_package_dir(package)
            records.append(pathlib.Path(package_dir) / "_build.txt")
        for record in records:
            record.parent.mkdir(parents=True, exist_ok=True)  # absent when nothing was built
            record.write_text(status + "\n")


setup(
    ext_modules=[Extension("autoshard.mpi._ffi", sources=[SOURCE])],
    cmdclass={"build_ext": BuildMPIExtension},
)
