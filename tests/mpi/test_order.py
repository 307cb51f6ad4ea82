"""MPI calls run in program order, tokens threaded or not, and XLA cannot undo that order.

The chain that orders the calls must be data all the way through the compiled program: XLA's
CPU pipeline removes optimization barriers before it schedules, so a chain that passed
through a barrier over a constant would leave a call free to move (a shard_map's call was
once scheduled after a later allgather that way). The compiled program is read back: every
MPI call but the first must consume a token another call (or a loop, branch or region
holding calls) produced.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from mpi4py import MPI

from autoshard import mpi

_DEF = re.compile(r"^\s*(?:ROOT )?(%[\w.\-]+) = .*? ([a-z][\w\-]*)\(", re.M)
_MPI_CALL = re.compile(r"custom-call\((%[\w.\-]+).*custom_call_target=\"autoshard_mpi_(\w+)\"")


def _token_sources(compiled_text):
    """For each MPI call of a compiled program: (operation, opcode defining its token operand)."""
    opcodes = {m.group(1): m.group(2) for m in _DEF.finditer(compiled_text)}
    return [(m.group(2), opcodes[m.group(1)]) for m in _MPI_CALL.finditer(compiled_text)]


def _assert_one_chain(fn, *args, num_calls):
    sources = _token_sources(jax.jit(fn).lower(*args).compile().as_text())
    assert len(sources) == num_calls, sources
    # Only the first call of the program starts the chain from a constant.
    assert [op for op, opcode in sources if opcode == "constant"].__len__() == 1, sources


def _mixed(x):
    # No tokens threaded, no data dependencies between the calls: program order only.
    a, _ = mpi.allreduce(x, MPI.SUM)
    loop = jax.lax.fori_loop(0, 2, lambda i, c: mpi.bcast(c, 0)[0], x + 1)
    # The same branch on every rank (a is the same everywhere).
    branch = jax.lax.cond(a[0] >= 0, lambda v: mpi.allreduce(v, MPI.MAX)[0], lambda v: v * 2, x)
    nested = jax.jit(lambda v: mpi.allgather(v * 2)[0])(x)
    mpi.barrier()
    return a, loop, branch, nested


def _check_mixed(out, rank, size):
    a, loop, branch, nested = out
    np.testing.assert_allclose(a, np.full(a.shape, sum(range(size))))
    np.testing.assert_allclose(loop, 1.0)
    np.testing.assert_allclose(branch, np.full(branch.shape, size - 1.0))
    np.testing.assert_allclose(nested, np.stack([np.full(a.shape, 2.0 * r) for r in range(size)]))


def test_loops_branches_and_nested_jits_chained_by_data(rank, size):
    x = jnp.full((4,), float(rank))
    _assert_one_chain(_mixed, x, num_calls=5)
    text = jax.jit(_mixed).lower(x).as_text()
    assert "func.call" not in text and "optimization_barrier" not in text
    _check_mixed(jax.jit(_mixed)(x), rank, size)


def test_multi_device_chained_by_data(rank, size):
    # The case where XLA once dropped a barrier: a jit over several local devices.
    mesh = jax.sharding.Mesh(np.array(jax.local_devices()[:4]), ("d",))
    x = jax.device_put(jnp.full((4,), float(rank)), NamedSharding(mesh, PartitionSpec("d")))
    _assert_one_chain(_mixed, x, num_calls=5)  # once per process, not once per device
    _check_mixed(jax.jit(_mixed)(x), rank, size)


def test_user_shard_map_chained_by_data(rank, size):
    # The shard_map's call must stay between the allreduce before it and the allgather after.
    mesh = jax.sharding.Mesh(np.array(jax.local_devices()[:4]), ("d",))

    def f(x):
        a, _ = mpi.allreduce(x, MPI.SUM)
        per_device = jax.shard_map(
            lambda v: mpi.allreduce(v, MPI.SUM)[0] * 2,
            mesh=mesh,
            in_specs=PartitionSpec("d"),
            out_specs=PartitionSpec("d"),
        )(a)
        b, _ = mpi.allgather(x)
        return per_device, b

    x = jnp.full((4,), float(rank))
    _assert_one_chain(f, x, num_calls=3)
    per_device, b = jax.jit(f)(x)
    np.testing.assert_allclose(per_device, 2.0 * size * sum(range(size)))
    np.testing.assert_allclose(b, [[r] * 4 for r in range(size)])


def test_calls_in_a_loop_condition_and_a_branch_in_the_body(rank, size):
    def f(x):
        start, _ = mpi.allreduce(x, MPI.MIN)  # 0 on every rank

        def cond(c):
            return mpi.allreduce(c[0], MPI.SUM)[0] < 4 * size

        def body(c):
            v, i = c
            v = jax.lax.cond(i % 2 == 0, lambda u: mpi.bcast(u + 1, 0)[0], lambda u: u + 1, v)
            return v, i + 1

        return jax.lax.while_loop(cond, body, (start, 0))

    x = jnp.asarray(float(rank))
    _assert_one_chain(f, x, num_calls=3)
    v, i = jax.jit(f)(x)
    assert (float(v), int(i)) == (4.0, 4)  # 1, 2, 3, 4 on every rank: sum 4 * size stops it


def test_sends_arrive_in_program_order(rank, size):
    # Each rank sends 1, 2 (a loop), 3 (a branch), 4 (a nested jit) to the next rank and then
    # receives four messages. MPI keeps messages between two ranks with one tag in send
    # order, so the receiver sees 1, 2, 3, 4 only if the sender ran its sends in program order.
    if size < 2:
        pytest.skip("needs two ranks")
    dest, source = (rank + 1) % size, (rank - 1) % size

    def f(x):
        jax.lax.fori_loop(0, 2, lambda i, c: (mpi.send(c, dest), c + 1)[1], x)
        jax.lax.cond(x[0] > 0, lambda v: mpi.send(v + 2, dest), lambda v: mpi.send(v, dest), x)
        jax.jit(lambda v: mpi.send(v + 3, dest))(x)
        return [mpi.recv(x, source)[0] for _ in range(4)]  # 8-byte sends complete eagerly

    received = jax.jit(f)(jnp.ones(2))
    np.testing.assert_array_equal(np.stack(received)[:, 0], [1.0, 2.0, 3.0, 4.0])
