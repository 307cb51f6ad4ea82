"""Large buffers go onto transparent huge pages, as NumPy's do (PreferHugePages in _ffi.cc).

MPI's shared-memory transfers of large messages are 1.5-2x slower over XLA's 4 KiB pages
than over the huge pages NumPy asks for (benchmarks/mpi.py at 16 MiB), so the handlers
advise every buffer of 4 MiB and more, and collapse a buffer that comes back (a loop carry)
into huge pages once. Advice only: results are unchanged.
"""

import os
import pathlib
import platform
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

from autoshard import mpi
from autoshard.mpi._native import lib

_THP = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _collapse_supported():
    """MADV_COLLAPSE: Linux 6.1 and later, with transparent huge pages not disabled."""
    if platform.system() != "Linux" or not _THP.exists() or "[never]" in _THP.read_text():
        return False
    major, minor = (int(p) for p in platform.release().split(".")[:2])
    return (major, minor) >= (6, 1)


def _huge_kib(address):
    """AnonHugePages (KiB) of the mapping that holds ``address`` in this process."""
    lines = pathlib.Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            start, end = (int(v, 16) for v in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(not _collapse_supported(), reason="needs Linux >= 6.1 with THP enabled")
def test_loop_carry_collapsed_into_huge_pages_results_unchanged(rank, size):
    n = (8 << 20) // 4  # 8 MiB: at least three whole 2 MiB pages inside the buffer
    loop = jax.jit(
        lambda c: jax.lax.fori_loop(0, 2, lambda i, c: mpi.bcast(c + 1, 0)[0], c), donate_argnums=0
    )
    state = jnp.full(n, float(rank))
    before = lib.autoshard_mpi_num_collapsed()
    for _ in range(3):  # the carry comes back: advised on the first call, collapsed after
        state = jax.block_until_ready(loop(state))
    assert lib.autoshard_mpi_num_collapsed() > before
    # The middle of the buffer (its unaligned ends stay on small pages, in mappings of their own).
    assert _huge_kib(state.unsafe_buffer_pointer() + (4 << 20)) >= 2048
    np.testing.assert_array_equal(state, np.full(n, 6.0))  # root 0: 0 + 1 per bcast, 6 bcasts


def _mapping(address):
    """(start, end, AnonHugePages KiB, name) of the mapping that holds ``address``."""
    start = end = None
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and all(c in "0123456789abcdef-" for c in fields[0]):
            lo, hi = (int(v, 16) for v in fields[0].split("-"))
            start, end = (lo, hi) if lo <= address < hi else (None, None)
            name = fields[5] if len(fields) > 5 else ""
        elif start is not None and line.startswith("AnonHugePages:"):
            return start, end, int(fields[1]), name
    return None


@pytest.mark.skipif(not _collapse_supported(), reason="needs Linux >= 6.1 with THP enabled")
def test_buffer_ends_collapsed_where_the_mapping_holds_their_2mib_page(rank, size):
    # XLA places buffers side by side, so the 2 MiB page where one carry ends and the next
    # begins lies whole in one mapping; left on small pages it slowed 16 MiB sendrecv 1.1-1.2x.
    # In place, with no temporary. Ends on the heap are not checked: glibc trims and regrows
    # its top as other buffers come and go, which splits huge pages there again.
    huge, n = 2 << 20, (8 << 20) // 4
    loop = jax.jit(
        lambda c: jax.lax.fori_loop(
            0, 2, lambda i, c: (mpi.bcast(c[0], 0)[0], mpi.bcast(c[1], 1 % size)[0]), c
        ),
        donate_argnums=0,
    )
    state = (jnp.full(n, float(rank + 1)), jnp.full(n, float(rank + 1)))
    for _ in range(3):
        state = jax.block_until_ready(loop(state))
    checked = 0
    for buf in state:
        begin, end = buf.unsafe_buffer_pointer(), buf.unsafe_buffer_pointer() + 4 * n
        ends = [a - a % huge for a in (begin, end) if a % huge]
        for page in ends:
            mapping = _mapping(page)
            whole = mapping and mapping[0] <= page and page + huge <= mapping[1]
            if whole and mapping[3] != "[heap]":
                checked += 1
                assert mapping[2] >= 2048, (hex(page), mapping)
    np.testing.assert_array_equal(state[0], np.full(n, 1.0))  # root 0's value
    np.testing.assert_array_equal(state[1], np.full(n, float(1 % size + 1)))
    if not checked:
        pytest.skip("no buffer end fell in a 2 MiB page held whole by one mapping off the heap")


def test_small_buffers_left_alone(rank, size):
    before = lib.autoshard_mpi_num_collapsed()
    f = jax.jit(lambda v: mpi.allreduce(v, MPI.SUM)[0])
    x = jnp.ones((1 << 20) // 4)  # 1 MiB: below the 4 MiB threshold
    for _ in range(3):
        x = jax.block_until_ready(f(x)) / size
    assert lib.autoshard_mpi_num_collapsed() == before


OPT_OUT = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from autoshard import mpi
    from autoshard.mpi._native import MPI, lib
    f = jax.jit(lambda c: mpi.allreduce(c, MPI.SUM)[0], donate_argnums=0)
    x = jnp.ones((8 << 20) // 4)
    for _ in range(3):
        x = jax.block_until_ready(f(x))
    assert lib.autoshard_mpi_num_collapsed() == 0
    print("OK")
""")


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="runs its own single-rank interpreter")
@pytest.mark.parametrize("value", ["0", "maybe"])
def test_opt_out_and_validation(value):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    env.update(JAX_PLATFORMS="cpu", AUTOSHARD_MPI_HUGE_PAGES=value)
    proc = subprocess.run(
        [sys.executable, "-c", OPT_OUT], capture_output=True, text=True, timeout=240, env=env
    )
    if value == "0":
        assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stdout + proc.stderr
    else:
        assert proc.returncode != 0
        assert "AUTOSHARD_MPI_HUGE_PAGES ('maybe') must be 1 or 0" in proc.stderr, proc.stderr
        assert "unset it for the default (1)" in proc.stderr, proc.stderr
