"""autoshard.mpi.notoken: mpi4jax 0.9's token-free API, ported from mpi4jax 0.9.1's own tests.

Each test names the upstream tests (mpi4jax tests/...) whose behaviour it checks; the whole
upstream suite runs unmodified through benchmarks/upstream_mpi4jax.py. Runs at 1, 2 and 3
ranks (`make test-mpi`).
"""

import inspect
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.sparse.linalg import cg
from mpi4py import MPI

import autoshard.mpi.notoken as mpi4jax
from autoshard.mpi import _config
from autoshard.mpi._native import lib

MODES = ["eager", "jit"]


def run(mode, fn, *args):
    return jax.jit(fn)(*args) if mode == "jit" else fn(*args)


def block(rank, shape=(3, 2)):
    return jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) + 10 * rank


# mpi4jax 0.9.1's public functions (mpi4jax/__init__.py, __all__) with their parameters:
# (name, kind, default); "-" for no default. NOTSET is token='s default.
SIGNATURES = {
    "allgather": [("x", "POSITIONAL_OR_KEYWORD", "-"), ("comm", "KEYWORD_ONLY", None),
                  ("token", "KEYWORD_ONLY", "NOTSET")],
    "allreduce": [("x", "POSITIONAL_OR_KEYWORD", "-"), ("op", "POSITIONAL_OR_KEYWORD", "-"),
                  ("comm", "KEYWORD_ONLY", None), ("token", "KEYWORD_ONLY", "NOTSET")],
    "alltoall": [("x", "POSITIONAL_OR_KEYWORD", "-"), ("comm", "KEYWORD_ONLY", None),
                 ("token", "KEYWORD_ONLY", "NOTSET")],
    "barrier": [("comm", "KEYWORD_ONLY", None), ("token", "KEYWORD_ONLY", "NOTSET")],
    "bcast": [("x", "POSITIONAL_OR_KEYWORD", "-"), ("root", "POSITIONAL_OR_KEYWORD", "-"),
              ("comm", "KEYWORD_ONLY", None), ("token", "KEYWORD_ONLY", "NOTSET")],
    "gather": [("x", "POSITIONAL_OR_KEYWORD", "-"), ("root", "POSITIONAL_OR_KEYWORD", "-"),
               ("comm", "KEYWORD_ONLY", None), ("token", "KEYWORD_ONLY", "NOTSET")],
    "recv": [("x", "POSITIONAL_OR_KEYWORD", "-"),
             ("source", "POSITIONAL_OR_KEYWORD", MPI.ANY_SOURCE),
             ("tag", "KEYWORD_ONLY", MPI.ANY_TAG), ("comm", "KEYWORD_ONLY", None),
             ("status", "KEYWORD_ONLY", None), ("token", "KEYWORD_ONLY", "NOTSET")],
    "reduce": [("x", "POSITIONAL_OR_KEYWORD", "-"), ("op", "POSITIONAL_OR_KEYWORD", "-"),
               ("root", "POSITIONAL_OR_KEYWORD", "-"), ("comm", "KEYWORD_ONLY", None),
               ("token", "KEYWORD_ONLY", "NOTSET")],
    "scan": [("x", "POSITIONAL_OR_KEYWORD", "-"), ("op", "POSITIONAL_OR_KEYWORD", "-"),
             ("comm", "KEYWORD_ONLY", None), ("token", "KEYWORD_ONLY", "NOTSET")],
    "scatter": [("x", "POSITIONAL_OR_KEYWORD", "-"), ("root", "POSITIONAL_OR_KEYWORD", "-"),
                ("comm", "KEYWORD_ONLY", None), ("token", "KEYWORD_ONLY", "NOTSET")],
    "send": [("x", "POSITIONAL_OR_KEYWORD", "-"), ("dest", "POSITIONAL_OR_KEYWORD", "-"),
             ("tag", "KEYWORD_ONLY", 0), ("comm", "KEYWORD_ONLY", None),
             ("token", "KEYWORD_ONLY", "NOTSET")],
    "sendrecv": [("sendbuf", "POSITIONAL_OR_KEYWORD", "-"),
                 ("recvbuf", "POSITIONAL_OR_KEYWORD", "-"),
                 ("source", "POSITIONAL_OR_KEYWORD", "-"), ("dest", "POSITIONAL_OR_KEYWORD", "-"),
                 ("sendtag", "KEYWORD_ONLY", 0), ("recvtag", "KEYWORD_ONLY", MPI.ANY_TAG),
                 ("comm", "KEYWORD_ONLY", None), ("status", "KEYWORD_ONLY", None),
                 ("token", "KEYWORD_ONLY", "NOTSET")],
}


def test_public_api_matches_mpi4jax_0_9():
    """mpi4jax/__init__.py's __all__, tests/test_has_cuda.py, tests/test_has_sycl.py."""
    assert set(SIGNATURES) | {"has_cuda_support", "has_sycl_support"} <= set(mpi4jax.__all__)
    for name, expected in SIGNATURES.items():
        params = inspect.signature(getattr(mpi4jax, name)).parameters.values()
        got = [(p.name, p.kind.name,
                "-" if p.default is p.empty else "NOTSET" if p.default is mpi4jax.NOTSET
                else p.default) for p in params]
        assert got == expected, name
    # Only CPU handlers are built: no GPU and no SYCL support, as bools.
    assert mpi4jax.has_cuda_support() is False
    assert mpi4jax.has_sycl_support() is False


@pytest.mark.parametrize("mode", MODES)
def test_collectives_return_the_result_alone(mode, rank, size):
    """tests/collective_ops/test_{allreduce,reduce,scan,bcast,gather,scatter,allgather,alltoall}.py:
    the array and _jit variants (results, not (result, token) pairs; non-roots get x back)."""
    x = block(rank)
    blocks = np.stack([np.asarray(block(r)) for r in range(size)])

    y = run(mode, lambda v: mpi4jax.allreduce(v, op=MPI.SUM), x)
    np.testing.assert_array_equal(y, blocks.sum(0))

    y = run(mode, lambda v: mpi4jax.reduce(v, op=MPI.MAX, root=0), x)
    np.testing.assert_array_equal(y, blocks.max(0) if rank == 0 else x)

    y = run(mode, lambda v: mpi4jax.scan(v, op=MPI.SUM), x)
    np.testing.assert_array_equal(y, blocks[: rank + 1].sum(0))

    y = run(mode, lambda v: mpi4jax.bcast(v, root=size - 1), x)
    np.testing.assert_array_equal(y, blocks[size - 1])

    y = run(mode, lambda v: mpi4jax.gather(v, root=0), x)
    np.testing.assert_array_equal(y, blocks if rank == 0 else x)

    y = run(mode, lambda v: mpi4jax.allgather(v), x)
    np.testing.assert_array_equal(y, blocks)

    # Rank i sends 100 * i + j to rank j.
    rows = jnp.stack([jnp.full((2,), 100.0 * rank + j) for j in range(size)])
    y = run(mode, lambda v: mpi4jax.alltoall(v), rows)
    np.testing.assert_array_equal(y, [[100.0 * i + rank] * 2 for i in range(size)])

    # The root passes (nproc, ...); the others a template of one row.
    x = jnp.asarray(blocks) if rank == 0 else jnp.zeros((3, 2), jnp.float32)
    y = run(mode, lambda v: mpi4jax.scatter(v, root=0), x)
    np.testing.assert_array_equal(y, blocks[rank])


@pytest.mark.parametrize("mode", MODES)
def test_python_scalars(mode, rank, size):
    """The *_scalar and *_scalar_jit tests of allreduce, reduce, scan, bcast, gather, allgather."""
    assert run(mode, lambda v: mpi4jax.allreduce(v, op=MPI.SUM), 1) == size
    assert run(mode, lambda v: mpi4jax.scan(v, op=MPI.SUM), rank) == sum(range(rank + 1))
    assert run(mode, lambda v: mpi4jax.bcast(v, root=0), 1 if rank == 0 else 0) == 1
    np.testing.assert_array_equal(run(mode, mpi4jax.allgather, rank), np.arange(size))
    gathered = run(mode, lambda v: mpi4jax.gather(v, root=0), rank)
    np.testing.assert_array_equal(gathered, np.arange(size) if rank == 0 else rank)
    reduced = run(mode, lambda v: mpi4jax.reduce(v, op=MPI.SUM, root=0), rank)
    assert reduced == (sum(range(size)) if rank == 0 else rank)


@pytest.mark.parametrize("mode", MODES)
def test_point_to_point_and_send_barrier_return_value(mode, rank, size):
    """tests/collective_ops/test_send_and_recv.py (test_send_recv, _jit, _status, _status_jit)
    and test_barrier.py: send and barrier return [] as in mpi4jax; recv fills the status."""
    nxt, prev = (rank + 1) % size, (rank - 1) % size

    def step(v):
        sent = mpi4jax.send(v, nxt, tag=rank)
        got = mpi4jax.recv(v, source=prev, tag=prev, status=status)
        synced = mpi4jax.barrier()
        return got, sent, synced

    status = MPI.Status()
    got, sent, synced = run(mode, step, block(rank))
    np.testing.assert_array_equal(got, block(prev))
    assert sent == [] and synced == []
    assert status.Get_source() == prev and status.Get_tag() == prev


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() < 2, reason="needs 2 ranks")
def test_recv_before_send_keeps_program_order(rank, size):
    """tests/collective_ops/test_send_and_recv.py::test_send_recv_deadlock: rank 0 sends then
    receives, rank 1 receives then sends, in one jit; without program order this deadlocks."""
    mpi4jax.barrier()  # the default communicator's creation is collective: every rank takes part
    if rank > 1:
        return

    @jax.jit
    def exchange(v):
        if rank == 0:
            mpi4jax.send(v, 1)
            return mpi4jax.recv(v, 1)
        got = mpi4jax.recv(v, 0)
        mpi4jax.send(v, 0)
        return got

    np.testing.assert_array_equal(exchange(jnp.full(10, float(rank))), np.full(10, 1.0 - rank))


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() < 2, reason="needs 2 ranks")
@pytest.mark.parametrize("loop", ["unrolled", "fori_loop", "scan"])
def test_ping_pong_without_tokens(loop, rank, size):
    """The issue's ordering patterns without tokens: 100 rounds of ping-pong between ranks 0 and
    1 (each adds 1 before passing the ball back), unrolled, in fori_loop and in lax.scan."""
    mpi4jax.barrier()  # the default communicator's creation is collective: every rank takes part
    if rank > 1:
        return
    rounds = 100

    def one_round(ball):
        if rank == 0:
            mpi4jax.send(ball + 1, 1, tag=5)
            return mpi4jax.recv(ball, 1, tag=6)
        ball = mpi4jax.recv(ball, 0, tag=5) + 1
        mpi4jax.send(ball, 0, tag=6)
        return ball

    def play(ball):
        if loop == "fori_loop":
            return jax.lax.fori_loop(0, rounds, lambda _, b: one_round(b), ball)
        if loop == "scan":
            return jax.lax.scan(lambda b, _: (one_round(b), None), ball, None, length=rounds)[0]
        for _ in range(rounds):
            ball = one_round(ball)
        return ball

    assert jax.jit(play)(jnp.float32(0)) == 2 * rounds


@pytest.mark.parametrize("mode", MODES)
def test_sendrecv_vmap_and_status(mode, rank, size):
    """tests/collective_ops/test_sendrecv.py: test_sendrecv, _jit, _status, _status_jit, _vmap."""
    nxt, prev = (rank + 1) % size, (rank - 1) % size
    status = MPI.Status()
    y = run(mode, lambda v: mpi4jax.sendrecv(v, v, source=prev, dest=nxt, status=status),
            block(rank))
    np.testing.assert_array_equal(y, block(prev))
    assert status.Get_source() == prev
    batched = jax.vmap(lambda a, b: mpi4jax.sendrecv(a, b, source=prev, dest=nxt))
    np.testing.assert_array_equal(run(mode, batched, block(rank), block(rank)), block(prev))


def test_sendrecv_grad_jacrev_and_jacfwd(rank, size):
    """tests/collective_ops/test_sendrecv.py: test_sendrecv_grad, _grad_2, _jacrev, and the
    accepted difference test_sendrecv_jacfwd (mpi4jax raises RuntimeError under jacfwd).

    Across ranks the program is one function F of all ranks' inputs; reverse mode on rank r
    gives row r of J^T c (the gradient of the sum of every rank's output with respect to x_r),
    forward mode gives row r of J t (how rank r's output moves when every rank moves its
    input by t). mpi4jax refuses the second because its value belongs to the inputs of
    another rank; here it is computed, and checked to be the adjoint of reverse mode.
    """
    nxt, prev = (rank + 1) % size, (rank - 1) % size
    x = jnp.ones((3, 2)) * (rank + 1)

    def f(v):
        return (mpi4jax.sendrecv(v, v, source=prev, dest=nxt) * (rank + 1)).sum()

    # Reverse: x on this rank reaches rank nxt, which scales it by nxt + 1.
    np.testing.assert_array_equal(jax.grad(f)(x), np.full((3, 2), nxt + 1.0))
    np.testing.assert_array_equal(jax.jacrev(f)(x), np.full((3, 2), nxt + 1.0))
    # Forward: this rank's output is its received block (prev's input) scaled by rank + 1.
    np.testing.assert_array_equal(jax.jacfwd(f)(x), np.full((3, 2), rank + 1.0))
    np.testing.assert_array_equal(jax.jit(jax.jacfwd(f))(x), np.full((3, 2), rank + 1.0))

    # Adjointness over all ranks: sum_r c_r (J t)_r == sum_r <t_r, (J^T c)_r>.
    t = jax.random.normal(jax.random.key(rank), (3, 2))
    c = jnp.float32(rank + 2)
    _, jt = jax.jvp(f, (x,), (t,))
    (jtc,) = jax.vjp(f, x)[1](c)
    forward = mpi4jax.allreduce(c * jt, op=MPI.SUM)
    backward = mpi4jax.allreduce(jnp.vdot(t, jtc), op=MPI.SUM)
    np.testing.assert_allclose(forward, backward, rtol=1e-5)

    def g(v):
        v = mpi4jax.sendrecv(v, v, source=prev, dest=nxt) * (rank + 1) * 5
        return (mpi4jax.sendrecv(v, v, source=prev, dest=nxt) * (rank + 1) ** 2).sum()

    # Two hops: rank nxt scales by 5 (nxt + 1), the rank after it by (its rank + 1) ** 2.
    second = (nxt + 1) % size
    np.testing.assert_array_equal(jax.grad(g)(x),
                                  np.full((3, 2), 5.0 * (nxt + 1) * (second + 1) ** 2))


def test_allreduce_transforms(size):
    """tests/collective_ops/test_allreduce.py: _vmap, _vmap_jit, _transpose(_jit), _transpose2,
    _grad, _jvp, _vjp, _chained(_jit)."""
    x = jnp.arange(6.0).reshape(3, 2)

    def total(v):
        return mpi4jax.allreduce(v, op=MPI.SUM)

    np.testing.assert_array_equal(jax.vmap(total)(x), x * size)
    np.testing.assert_array_equal(jax.jit(jax.vmap(total))(x), x * size)
    # The transpose is the identity: the result counts once, not once per rank.
    (t,) = jax.linear_transpose(total, x)(x)
    np.testing.assert_array_equal(t, x)
    (tt,) = jax.jit(jax.linear_transpose(lambda c: jax.linear_transpose(total, x)(c)[0], x))(x)
    np.testing.assert_array_equal(tt, x * size)
    value, grad = jax.jit(jax.value_and_grad(lambda v: total(v).sum()))(x)
    assert value == x.sum() * size
    np.testing.assert_array_equal(grad, np.ones((3, 2)))
    y, dy = jax.jvp(total, (x,), (jnp.ones_like(x),))
    np.testing.assert_array_equal(y, x * size)
    np.testing.assert_array_equal(dy, np.full((3, 2), size))
    assert jax.jit(jax.grad(lambda s: total(s) + total(s)))(0.0) == 2.0


def test_custom_vjp_and_cg(size):
    """tests/collective_ops/test_allreduce.py::test_custom_vjp and tests/test_jax_transforms.py:
    allreduce inside a custom_vjp rule and as the operator of jax.scipy's cg."""

    @jax.custom_vjp
    def f(x, y):
        return mpi4jax.allreduce((jnp.sin(x) * y).sum(), op=MPI.SUM)

    def f_fwd(x, y):
        return f(x, y), (jnp.cos(x), jnp.sin(x), y)

    def f_bwd(res, g):
        g = mpi4jax.allreduce(g, op=MPI.SUM)
        cos_x, sin_x, y = res
        return cos_x * g * y, sin_x * g

    f.defvjp(f_fwd, f_bwd)
    x, y = jnp.ones(3), jnp.ones(3) * 2
    np.testing.assert_allclose(jax.jit(f)(x, y), size * 2 * np.sin(1.0) * 3, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.grad(f))(x, y), np.full(3, size * 2 * np.cos(1.0)),
                               rtol=1e-6)

    b = jax.random.normal(jax.random.key(1), (8,))
    operator = jax.tree_util.Partial(lambda v: mpi4jax.allreduce(v, op=MPI.SUM))
    solution, _ = jax.jit(cg)(operator, b)
    np.testing.assert_allclose(size * solution, b, rtol=1e-5, atol=1e-6)


def test_halo_exchange_matches_single_process(rank, size):
    """tests/test_examples.py (examples/shallow_water.py's pattern): a periodic 1-D domain split
    over the ranks, each step exchanging one-cell halos with sendrecv inside a jitted loop,
    equals the same diffusion computed on the whole domain in one process."""
    n_local, steps = 4, 5
    whole = np.sin(np.arange(n_local * size, dtype=np.float32))
    nxt, prev = (rank + 1) % size, (rank - 1) % size

    @jax.jit
    def solve(u):
        def step(_, u):
            west = mpi4jax.sendrecv(u[-1:], u[:1], source=prev, dest=nxt)
            east = mpi4jax.sendrecv(u[:1], u[-1:], source=nxt, dest=prev)
            padded = jnp.concatenate([west, u, east])
            return u + 0.25 * (padded[:-2] - 2 * u + padded[2:])
        return jax.lax.fori_loop(0, steps, step, u)

    expected = whole
    for _ in range(steps):
        expected = expected + 0.25 * (np.roll(expected, 1) - 2 * expected + np.roll(expected, -1))
    local = solve(jnp.asarray(whole[rank * n_local:(rank + 1) * n_local]))
    np.testing.assert_allclose(local, expected[rank * n_local:(rank + 1) * n_local], rtol=1e-5)


def test_token_is_refused():
    """mpi4jax 0.8+ raises for token=; the message names the fix."""
    with pytest.raises(RuntimeError, match=r"allreduce: token= is not accepted .* `y = allreduce"
                                           r"\(x, \.\.\.\)` .* autoshard.mpi"):
        mpi4jax.allreduce(jnp.ones(2), op=MPI.SUM, token=jax.lax.create_token())
    with pytest.raises(RuntimeError, match="barrier: token= is not accepted"):
        mpi4jax.barrier(token=None)


def test_errors_use_mpi4jax_wording(rank, size):
    """tests/collective_ops/test_alltoall.py::test_alltoall_wrong_size and
    test_scatter.py::test_scatter_wrong_size: mpi4jax's words, then our values and fix."""
    with pytest.raises(ValueError, match=rf"must have shape \(nproc, \.\.\.\) .*\({size}, \.\.\.\)"
                                         rf", got \({size + 1},\)"):
        mpi4jax.alltoall(jnp.ones(size + 1))
    if rank == 0:
        with pytest.raises(ValueError, match=rf"Scatter input must have shape \(nproc, \.\.\.\) "
                                             rf".*got \({size + 1},\)"):
            mpi4jax.scatter(jnp.ones(size + 1), root=0)


def test_bad_destination_fails_before_anything_runs(rank, size):
    """tests/collective_ops/test_common.py::test_abort_on_error: mpi4jax's MPI_Send fails at run
    time and aborts the job ("r0 | MPI_Send returned error code ..."); here the jit fails while
    tracing, no MPI call is made, and the message carries mpi4jax's words as well."""
    before = lib.autoshard_mpi_num_calls()
    with pytest.raises(ValueError, match=rf"dest must be a rank of the communicator, 0 <= dest < "
                                         rf"{size}, got 100\. .*'r{rank} \| MPI_Send returned "
                                         rf"error code {MPI.ERR_RANK}'"):
        jax.jit(lambda v: mpi4jax.send(v, dest=100))(jnp.ones(10))
    with pytest.raises(ValueError, match=r"'r\d+ \| MPI_Sendrecv returned error code"):
        mpi4jax.sendrecv(jnp.ones(2), jnp.ones(2), source=0, dest=-1)
    assert lib.autoshard_mpi_num_calls() == before


def test_set_logging(capfd, rank):
    """tests/collective_ops/test_common.py::test_debug_logging (whose import of
    mpi4jax._src.xla_bridge does not apply): set_logging(True) logs each MPI call on entry
    and exit, set_logging(False) stops it; the log is autoshard's, on stderr."""
    if mpi4jax.get_logging():
        pytest.skip("the log is on from the environment (AUTOSHARD_MPI_DEBUG or MPI4JAX_DEBUG)")
    capfd.readouterr()
    try:
        mpi4jax.set_logging(True)
        assert mpi4jax.get_logging() is True
        jax.block_until_ready(jax.jit(lambda v: mpi4jax.allreduce(v, op=MPI.SUM))(jnp.ones((3, 2))))
        err = capfd.readouterr().err
        assert re.search(rf"^r{rank} \| allreduce 24 B \(comm \d+, device \d+\) \.\.\.$", err, re.M)
        assert re.search(rf"^r{rank} \| allreduce 24 B done in [\d.]+ us$", err, re.M)
    finally:
        mpi4jax.set_logging(False)
    assert mpi4jax.get_logging() is False
    jax.block_until_ready(jax.jit(lambda v: mpi4jax.allreduce(v, op=MPI.SUM))(jnp.ones((3, 2))))
    assert f"r{rank} |" not in capfd.readouterr().err
    with pytest.raises(TypeError, match="set_logging takes True or False, got str 'yes'"):
        mpi4jax.set_logging("yes")


@pytest.mark.parametrize("name", ["AUTOSHARD_MPI_DEBUG", "MPI4JAX_DEBUG"])
def test_debug_environment_variables(monkeypatch, name):
    """tests/collective_ops/test_common.py::test_set_logging_from_envvar: MPI4JAX_DEBUG=1 and
    AUTOSHARD_MPI_DEBUG=1 both turn the log on at import; 0 leaves it off."""
    for other in ("AUTOSHARD_MPI_DEBUG", "MPI4JAX_DEBUG"):
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, "1")
    assert _config.debug() is True
    monkeypatch.setenv(name, "0")
    assert _config.debug() is False


DEBUG_AT_IMPORT = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from mpi4py import MPI
    import autoshard.mpi.notoken as mpi4jax
    assert mpi4jax.get_logging()
    jax.block_until_ready(jax.jit(lambda v: mpi4jax.allreduce(v, op=MPI.SUM))(jnp.ones(4)))
    print("OK")
""")


@pytest.mark.skipif(MPI.COMM_WORLD.Get_rank() > 0, reason="one subprocess, from rank 0")
def test_mpi4jax_debug_at_import():
    """MPI4JAX_DEBUG=1 in the environment: the log is on from import (a fresh process)."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))},
           "JAX_PLATFORMS": "cpu", "MPI4JAX_DEBUG": "1"}
    env.pop("AUTOSHARD_MPI_DEBUG", None)
    proc = subprocess.run([sys.executable, "-c", DEBUG_AT_IMPORT], capture_output=True,
                          text=True, timeout=240, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout + proc.stderr
    assert "r0 | allreduce 16 B (comm 1, device 0) ..." in proc.stderr.splitlines()
