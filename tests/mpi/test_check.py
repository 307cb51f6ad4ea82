"""Ranks that disagree on a call get an error naming every rank's call (issue 21, item 7).

Before, allreduce with different shapes gave MPI_ERR_TRUNCATE on one rank and a wrong array
on the other, and different dtypes gave garbage silently. The check runs before the MPI
call, on every rank, so every rank raises and no rank makes the call (see _check.py).
Each test uses a communicator of its own: the default check runs the first time a process
makes a call with its arguments on a communicator, so earlier tests must not have made it.
"""

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.errors import JaxRuntimeError
from jax.sharding import NamedSharding, PartitionSpec
from mpi4py import MPI

from autoshard import mpi
from autoshard.mpi import _config
from autoshard.mpi._native import CHECK_MODES, lib

MODES = ["eager", "jit"]
# A failed call raises JaxRuntimeError, or ValueError where JAX's C++ dispatch ran it.
FAILED = (JaxRuntimeError, ValueError)


def run(mode, fn, *args):
    return jax.jit(fn)(*args) if mode == "jit" else fn(*args)


@pytest.fixture
def fresh(size):
    """A communicator no earlier test has made a call on (at 2 ranks or more)."""
    if size < 2:
        pytest.skip("a disagreement needs 2 ranks")
    return MPI.COMM_WORLD.Dup()


@pytest.fixture
def every_call():
    """AUTOSHARD_MPI_CHECK=1 for one test (every call checked, point-to-point included)."""
    lib.autoshard_mpi_set_check(CHECK_MODES["every"])
    yield
    lib.autoshard_mpi_set_check(CHECK_MODES[_config.check()])


def _others(rank_pattern):
    """The regex of the ranks other than 0 (``rank 1`` at 2 ranks, ``ranks 1, 2`` at 3)."""
    return rf"ranks? 1(, \d)*: {rank_pattern}"


def _no_call_made(fn):
    """Runs ``fn`` (which must raise) and checks that no MPI call was made."""
    before = lib.autoshard_mpi_num_calls()
    fn()
    assert lib.autoshard_mpi_num_calls() == before


@pytest.mark.parametrize("mode", MODES)
def test_shape_mismatch_is_an_error_on_every_rank(mode, fresh, rank, size):
    x = jnp.ones(3 if rank == 0 else 4)
    match = (r"the ranks disagree on this MPI call \(rank 0: allreduce\(float32\[3\], op=SUM\); "
             + _others(r"allreduce\(float32\[4\], op=SUM\)") + rf"\).*This is rank {rank}\.")

    def call():
        with pytest.raises(FAILED, match=match):
            jax.block_until_ready(run(mode, lambda x: mpi.allreduce(x, MPI.SUM, comm=fresh)[0], x))

    _no_call_made(call)
    # Nothing was left half-done: the communicator still works.
    y, _ = mpi.allreduce(jnp.ones(2), MPI.SUM, comm=fresh)
    np.testing.assert_array_equal(y, [size, size])


def test_dtype_op_root_and_operation_mismatches(fresh, rank):
    cases = [
        (lambda: mpi.allreduce(jnp.ones(3, jnp.float32 if rank == 0 else jnp.int32), MPI.SUM,
                               comm=fresh),
         r"rank 0: allreduce\(float32\[3\], op=SUM\); " + _others(r"allreduce\(int32\[3\], op=SUM\)")),
        (lambda: mpi.scan(jnp.ones(2), MPI.SUM if rank == 0 else MPI.MAX, comm=fresh),
         r"rank 0: scan\(float32\[2\], op=SUM\); " + _others(r"scan\(float32\[2\], op=MAX\)")),
        (lambda: mpi.bcast(jnp.ones(2), 0 if rank == 0 else 1, comm=fresh),
         r"rank 0: bcast\(float32\[2\], root=0\); " + _others(r"bcast\(float32\[2\], root=1\)")),
        (lambda: (mpi.barrier(comm=fresh) if rank == 0 else mpi.allgather(jnp.ones(2), comm=fresh)),
         r"rank 0: barrier\(\); " + _others(r"allgather\(float32\[2\]\)")),
    ]
    for fn, match in cases:
        with pytest.raises(FAILED, match=match):
            jax.block_until_ready(fn())


def test_sharded_and_shard_map_mismatches(fresh, rank):
    # One call per process on the whole sharded array: the whole arrays' shapes are compared.
    mesh = jax.make_mesh((2,), ("d",))
    x = jax.device_put(jnp.ones(4 if rank == 0 else 8), NamedSharding(mesh, PartitionSpec("d")))
    with pytest.raises(FAILED, match=r"rank 0: allreduce\(float32\[4\], op=SUM\)"):
        jax.block_until_ready(jax.jit(lambda x: mpi.allreduce(x, MPI.SUM, comm=fresh)[0])(x))
    # Inside a shard_map each device calls through its own communicator: each device checks.
    f = jax.jit(jax.shard_map(lambda v: mpi.allgather(v, comm=fresh)[0], mesh=mesh,
                              in_specs=PartitionSpec("d"), out_specs=PartitionSpec("d")))
    with pytest.raises(FAILED, match=r"rank 0: allgather\(float32\[2\]\)"):
        jax.block_until_ready(f(x))


def test_legitimately_different_operands_pass(fresh, rank, size):
    """Roots pass other shapes than the other ranks, allgatherv's ranks other row counts."""
    for every in (False, True):
        lib.autoshard_mpi_set_check(CHECK_MODES["every" if every else "first"])
        try:
            piece = jnp.arange(size * 3.0).reshape(size, 3) if rank == 0 else jnp.zeros(3)
            y, _ = mpi.scatter(piece, 0, comm=fresh)
            np.testing.assert_array_equal(y, np.arange(3.0) + 3 * rank)
            y = jax.jit(lambda v: mpi.gather(v, 0, comm=fresh)[0])(jnp.full(3, rank))
            assert y.shape == ((size, 3) if rank == 0 else (3,))
            counts = tuple(r + 1 for r in range(size))
            y, _ = mpi.allgatherv(jnp.full((rank + 1, 2), rank), counts, comm=fresh)
            assert y.shape == (sum(counts), 2)
            n = jnp.ones(size, jnp.int32)
            y, _ = mpi.alltoallv(jnp.ones((size, 2, 3)), n, n, comm=fresh)
            assert y.shape == (size, 2, 3)
        finally:
            lib.autoshard_mpi_set_check(CHECK_MODES[_config.check()])


def test_first_call_checks_once(fresh, rank, size):
    f = jax.jit(lambda x: mpi.allreduce(x, MPI.SUM, comm=fresh)[0])
    before = lib.autoshard_mpi_num_checks()
    for _ in range(3):
        np.testing.assert_array_equal(f(jnp.ones(5)), np.full(5, size))
    assert lib.autoshard_mpi_num_checks() - before == 1  # the first call only
    mpi.allreduce(jnp.ones(5), MPI.SUM, comm=fresh)  # eager, same signature: checked already
    assert lib.autoshard_mpi_num_checks() - before == 1
    f(jnp.ones(6))  # new arguments: checked once more
    assert lib.autoshard_mpi_num_checks() - before == 2


def test_every_call_catches_a_changed_repeat(every_call, fresh, rank, size):
    """A rank whose arguments change while the others repeat a call (a smaller last batch)."""
    f = jax.jit(lambda x: mpi.allreduce(x, MPI.SUM, comm=fresh)[0])
    before = lib.autoshard_mpi_num_checks()
    np.testing.assert_array_equal(f(jnp.ones(3)), np.full(3, size))
    np.testing.assert_array_equal(f(jnp.ones(3)), np.full(3, size))
    assert lib.autoshard_mpi_num_checks() - before == 2
    with pytest.raises(FAILED, match=r"rank 0: allreduce\(float32\[3\], op=SUM\); "
                       + _others(r"allreduce\(float32\[2\], op=SUM\)")):
        jax.block_until_ready(f(jnp.ones(3 if rank == 0 else 2)))


def test_every_call_checks_point_to_point(every_call, fresh, rank, size):
    peer = 1 - rank if rank < 2 else None
    mpi.barrier(comm=fresh)  # a communicator's first use is collective (see _comm.comm_id)
    if rank == 0:
        mpi.send(jnp.ones(4), 1, tag=3, comm=fresh)  # more than rank 1's buffer holds
        mpi.send(jnp.ones(2, jnp.int32), 1, tag=3, comm=fresh)  # another dtype
        mpi.send(jnp.arange(3.0), 1, tag=3, comm=fresh)  # what rank 1 expects
    elif rank == 1:
        with pytest.raises(FAILED, match=r"rank 1 cannot receive what rank 0 sent with "
                           r"tag 3: rank 0 made send\(float32\[4\]\) \(16 bytes\), this rank "
                           r"recv\(float32\[3\]\).*received and dropped"):
            jax.block_until_ready(mpi.recv(jnp.zeros(3), 0, tag=3, comm=fresh)[0])
        with pytest.raises(FAILED, match=r"made send\(int32\[2\]\)"):
            jax.block_until_ready(jax.jit(lambda: mpi.recv(jnp.zeros(2), comm=fresh)[0])())
        y, _ = mpi.recv(jnp.zeros(3), MPI.ANY_SOURCE, tag=MPI.ANY_TAG, comm=fresh)
        np.testing.assert_array_equal(y, np.arange(3.0))
    # A smaller message than the buffer is MPI-legal: no error.
    if peer is not None:
        y, _ = mpi.sendrecv(jnp.ones(2), jnp.zeros(3 if rank == 1 else 2), peer, peer, comm=fresh)
        np.testing.assert_array_equal(y[:2], [1, 1])
        # Another dtype on both sides of a ring: both ranks raise, neither hangs.
        dtype = jnp.float32 if rank == 0 else jnp.int32
        with pytest.raises(FAILED, match=rf"rank {rank} cannot receive what rank {peer}"):
            jax.block_until_ready(mpi.sendrecv(jnp.ones(2, dtype), jnp.ones(2, dtype), peer, peer,
                                               comm=fresh)[0])
    mpi.barrier(comm=fresh)


def test_first_call_wait_warns(fresh, rank, capfd):
    """A rank waiting long in its check says why it may never end (here the other is late)."""
    mpi.barrier(comm=fresh)  # the communicator's first use, collective, is behind us
    lib.autoshard_mpi_set_check_warn_ms(300)
    try:
        if rank != 0:
            time.sleep(1.0)
        y, _ = mpi.allreduce(jnp.ones(7), MPI.SUM, comm=fresh)
        np.testing.assert_array_equal(y, np.full(7, fresh.Get_size()))
    finally:
        lib.autoshard_mpi_set_check_warn_ms(10_000)
    err = capfd.readouterr().err
    if rank == 0:
        assert re.search(r"rank 0 has waited 0\.\d s for the other ranks to check "
                         r"allreduce\(float32\[7\], op=SUM\).*AUTOSHARD_MPI_CHECK=1", err)
    else:
        assert "has waited" not in err


def test_environment_variable(monkeypatch):
    for value, mode in [("", "first"), ("first", "first"), ("1", "every"), ("every", "every"),
                        ("yes", "every"), ("0", "off"), ("off", "off")]:
        monkeypatch.setenv("AUTOSHARD_MPI_CHECK", value)
        assert _config.check() == mode
    monkeypatch.setenv("AUTOSHARD_MPI_CHECK", "sometimes")
    with pytest.raises(ValueError, match=r"AUTOSHARD_MPI_CHECK \('sometimes'\) must be 1"):
        _config.check()
