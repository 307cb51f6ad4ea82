"""vmap, grad, control flow, cg, multi-device jit and dead-code safety (ordering: test_order)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from mpi4py import MPI

from autoshard import mpi


def test_vmap(rank, size):
    x = jnp.arange(6.0).reshape(3, 2) + rank
    y = jax.vmap(lambda v: mpi.allreduce(v, MPI.SUM)[0])(x)
    np.testing.assert_allclose(y, sum(np.arange(6.0).reshape(3, 2) + r for r in range(size)))
    y = jax.vmap(lambda v: mpi.bcast(v, 0)[0], in_axes=1, out_axes=1)(x)
    np.testing.assert_allclose(y, np.arange(6.0).reshape(3, 2))
    y = jax.vmap(lambda v: mpi.allgather(v)[0])(x)
    assert y.shape == (3, size, 2)
    np.testing.assert_allclose(y[:, rank], x)
    y = jax.vmap(lambda v: mpi.reduce(v, MPI.SUM, 0)[0])(x)
    assert y.shape == x.shape
    y = jax.vmap(lambda v: mpi.sendrecv(v, v, (rank - 1) % size, (rank + 1) % size)[0])(x)
    np.testing.assert_allclose(y, np.arange(6.0).reshape(3, 2) + (rank - 1) % size)
    token = jax.vmap(lambda v: mpi.barrier())(x)
    assert isinstance(token, mpi.Token)


def test_allreduce_grad_and_jvp(rank, size):
    def f(x):
        return mpi.allreduce(x * x, MPI.SUM)[0].sum()

    x = jnp.arange(3.0) + rank
    np.testing.assert_allclose(jax.grad(f)(x), 2 * x)  # transpose is the identity (as mpi4jax)
    _, t = jax.jvp(lambda x: mpi.allreduce(x, MPI.SUM)[0], (x,), (jnp.ones(3),))
    np.testing.assert_allclose(t, np.full(3, size))
    np.testing.assert_allclose(jax.jit(jax.grad(f))(x), 2 * x)


def test_allreduce_grad_other_op_fails():
    with pytest.raises(NotImplementedError, match="only with MPI.SUM"):
        jax.grad(lambda x: mpi.allreduce(x, MPI.MAX)[0].sum())(jnp.ones(2))


def test_sendrecv_grad(rank, size):
    def f(x):
        y, _ = mpi.sendrecv(x, x, (rank - 1) % size, (rank + 1) % size)
        return (y * (rank + 1)).sum()

    g = jax.jit(jax.grad(f))(jnp.ones(3))
    # x went to rank+1, which multiplied it by rank+2.
    np.testing.assert_allclose(g, np.full(3, (rank + 1) % size + 1))


def test_control_flow(rank, size):
    def body(i, x):
        return mpi.allreduce(x, MPI.SUM)[0] / size

    x = jnp.full((2,), float(rank))
    mean = sum(range(size)) / size
    np.testing.assert_allclose(jax.jit(lambda x: jax.lax.fori_loop(0, 3, body, x))(x), mean)
    ys = jax.jit(lambda x: jax.lax.scan(lambda c, _: (body(0, c), c.sum()), x, None, length=3))(x)
    np.testing.assert_allclose(ys[0], mean)
    w = jax.jit(
        lambda x: jax.lax.while_loop(
            lambda c: c[1] < 3, lambda c: (body(0, c[0]), c[1] + 1), (x, 0)
        )
    )(x)
    np.testing.assert_allclose(w[0], mean)
    c = jax.jit(
        lambda x, p: jax.lax.cond(
            p, lambda v: mpi.allreduce(v, MPI.SUM)[0], lambda v: mpi.allreduce(-v, MPI.SUM)[0], x
        )
    )(x, True)
    np.testing.assert_allclose(c, sum(range(size)))


def test_cg(rank, size):
    # A distributed diagonal system: each rank holds a block; dot products are allreduced.
    d = jnp.arange(1.0, 5.0) + rank
    b = jnp.ones(4)

    def matvec(v):
        return d * v

    def dot(a, c):
        return mpi.allreduce(jnp.vdot(a, c), MPI.SUM)[0]

    def solve(b):
        import jax._src.scipy.sparse.linalg as impl  # noqa: PLC0415
        from jax.scipy.sparse.linalg import cg  # noqa: PLC0415

        old = impl._vdot_real_tree
        impl._vdot_real_tree = lambda a, c: dot(a, c)
        try:
            return cg(matvec, b, tol=1e-10)[0]
        finally:
            impl._vdot_real_tree = old

    x = jax.jit(solve)(b)
    np.testing.assert_allclose(x, 1 / d, rtol=1e-5)


def test_send_and_barrier_not_removed():
    text = jax.jit(lambda x: (mpi.send(x, 0), mpi.barrier(), x)[2]).lower(jnp.ones(2)).as_text()
    assert "autoshard_mpi_send" in text and "autoshard_mpi_barrier" in text


def test_partially_manual_shard_map_fails_clearly():
    mesh = jax.sharding.Mesh(np.array(jax.local_devices()).reshape(2, -1), ("a", "b"))
    f = jax.jit(
        jax.shard_map(
            lambda v: mpi.allreduce(v, MPI.SUM)[0],
            mesh=mesh,
            in_specs=PartitionSpec("a"),
            out_specs=PartitionSpec("a"),
            axis_names={"a"},
        )
    )
    with pytest.raises(NotImplementedError, match=r"leaves mesh axes \['b'\] automatic"):
        f(jnp.ones(4))


def test_unused_control_flow_and_nested_jit_not_removed(rank, size):
    # Every output of the cond, the loop and the nested jit is unused (sends/barriers only).
    peer = (rank + 1) % size

    def f(x):
        jax.lax.cond(x[0] > 0, lambda v: (mpi.barrier(), v)[1], lambda v: v, x)
        jax.lax.fori_loop(0, 2, lambda i, c: (mpi.send(c, peer, tag=5), c)[1], x)
        jax.jit(lambda v: mpi.barrier())(x)
        jax.lax.cond(x[0] > 0, lambda: mpi.barrier(), lambda: mpi.barrier())
        y = jax.lax.fori_loop(0, 2, lambda i, c: mpi.recv(c, (rank - 1) % size, tag=5)[0], x)
        return x, y

    text = jax.jit(f).lower(jnp.ones(2)).as_text()
    assert text.count("autoshard_mpi_barrier") == 4 and "autoshard_mpi_send" in text
    _, y = jax.jit(f)(jnp.full(2, rank + 1.0))  # 8-byte sends complete eagerly
    np.testing.assert_allclose(y, (rank - 1) % size + 1.0)


def test_in_place_in_loops():
    # allreduce and bcast reduce in place on the loop carry; recv/sendrecv need no template copy.
    x = jnp.ones(1024, jnp.float32)
    for f in (lambda c: mpi.allreduce(c, MPI.SUM)[0], lambda c: mpi.bcast(c, 0)[0]):
        loop = jax.jit(
            lambda v, f=f: jax.lax.fori_loop(0, 3, lambda i, c: f(c), v), donate_argnums=0
        )
        text = loop.lower(x).compile().as_text()
        assert "f32[1024]{0} copy(" not in text, text
    text = jax.jit(lambda v: mpi.sendrecv(v, v, 0, 0)[0]).lower(x).compile().as_text()
    assert "f32[1024]{0} copy(" not in text, text
    # A loop carrying a send and a receive buffer receives in place: no copy per iteration.
    pair = jax.jit(
        lambda a, b: jax.lax.fori_loop(
            0, 3, lambda i, c: (c[0], mpi.sendrecv(c[0], c[1], 0, 0)[0]), (a, b)
        ),
        donate_argnums=(0, 1),
    )
    text = pair.lower(x, x).compile().as_text()
    assert "f32[1024]{0} copy(" not in text, text


def test_fast_dispatch():
    f = jax.jit(lambda x: mpi.allreduce(x, MPI.SUM)[0])
    f(jnp.ones(2))
    assert not jax.make_jaxpr(f)(jnp.ones(2)).effects  # no effect: JAX's C++ fast path


def test_multi_device_jit(rank, size):
    # A jit over all local devices of each process (a mesh per process), MPI across processes.
    devices = jax.local_devices()
    assert len(devices) > 1  # tests/conftest.py forces 8 CPU devices
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    x = jax.device_put(
        jnp.arange(len(devices) * 2.0) + rank, NamedSharding(mesh, PartitionSpec("d"))
    )

    def f(x):
        y, token = mpi.allreduce(x * 2, MPI.SUM)
        mpi.barrier(token=token)
        return y, mpi.allgather(x[:2])[0]

    y, g = jax.jit(f)(x)
    np.testing.assert_allclose(y, sum(2 * (np.arange(len(devices) * 2.0) + r) for r in range(size)))
    np.testing.assert_allclose(g, [[r, r + 1.0] for r in range(size)])
    assert not jax.make_jaxpr(f)(x).effects


def test_shard_map_per_device(rank, size):
    # Inside shard_map every device reduces its own shard across ranks (own communicator).
    devices = jax.local_devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    x = jnp.arange(len(devices) * 3.0).reshape(len(devices), 3) * (rank + 1)

    def per_device(block):
        y, _ = mpi.allreduce(block, MPI.SUM)
        z, _ = mpi.sendrecv(y, y, (rank - 1) % size, (rank + 1) % size)
        return z

    f = jax.jit(
        jax.shard_map(
            per_device, mesh=mesh, in_specs=PartitionSpec("d"), out_specs=PartitionSpec("d")
        )
    )
    y = f(jax.device_put(x, NamedSharding(mesh, PartitionSpec("d"))))
    expected = np.arange(len(devices) * 3.0).reshape(len(devices), 3) * sum(
        r + 1 for r in range(size)
    )
    np.testing.assert_allclose(y, expected)
