"""JAX 0.10.2's custom_partitioning contract, ported: each test names the upstream test it covers.

Upstream files: ``tests/custom_partitioning_test.py`` (class ``CustomPartitionerTest``),
``tests/shard_map_test.py`` (``CustomPartitionerTest.test_custom_partitioning``). The ports are
written here from what those tests check; ``benchmarks/upstream_jax_cp.py`` runs the originals.
Every op is defined twice, with ``autoshard.custom_partitioning`` and with JAX's own class, and
the two results are compared with each other and with a plain ``jax.jit`` run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import custom_partitioning as jax_cp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import autoshard
from autoshard._cp_errors import reraise_callback_error

CLASSES = {"autoshard": autoshard.custom_partitioning, "jax": jax_cp.custom_partitioning}


def mesh_2d(names=("x", "y")) -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(4, 2), names)


def ints(shape, seed):
    return np.asarray(np.random.default_rng(seed).integers(0, 9, shape), np.float32)


# -- static_argnums ------------------------------------------------------------------------------
def make_row_matmul(cls, seen):
    """``x @ y`` with x split on rows ('x') and y on its contraction dim ('y').

    The static argument ``scale`` is the third parameter with a default; ``partition`` slices the
    columns of x that match its block of y and all-reduces over 'y'.
    """

    def partition(scale, mesh, arg_shapes, result_shape):
        seen.append(scale)
        x_sharding, y_sharding = (a.sharding for a in arg_shapes)
        k_axis = y_sharding.spec[0]
        block = arg_shapes[1].shape[0] // mesh.shape[k_axis]

        def lower_fn(x, y):
            i = jax.lax.axis_index(k_axis)
            cols = jax.lax.dynamic_slice_in_dim(x, i * block, block, axis=1)
            return jax.lax.psum(scale * (cols @ y), k_axis)

        return mesh, lower_fn, result_shape.sharding, (x_sharding, y_sharding)

    def infer(scale, mesh, arg_shapes, result_shape):
        return NamedSharding(mesh, P(arg_shapes[0].sharding.spec[0], None))

    def matmul(x, y, scale=3.0):
        return scale * (x @ y)

    op = cls(matmul, static_argnums=(2,))
    op.def_partition(partition, infer_sharding_from_operands=infer,
                     sharding_rule="m k, k n -> m n", reduction_factors=("k",))
    return op


@pytest.mark.parametrize("impl", sorted(CLASSES))
def test_static_argument_left_to_its_default(impl, partitioner):
    """Covers custom_partitioning_test.py::test_custom_partitioner (static_argnums=(2,) naming a
    parameter with a default that the call leaves out)."""
    seen = []
    op = make_row_matmul(CLASSES[impl], seen)
    mesh = mesh_2d()
    x, y = ints((16, 8), 0), ints((8, 4), 1)
    xs = jax.device_put(x, NamedSharding(mesh, P("x")))
    ys = jax.device_put(y, NamedSharding(mesh, P("y")))
    expected = jax.jit(lambda a, b: 3.0 * (a @ b))(x, y)
    jitted = jax.jit(op, out_shardings=NamedSharding(mesh, P("x")))
    got = jitted(xs, ys)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(op(x, y), expected)  # eager: the function itself
    assert seen and set(seen) == {3.0}
    assert got.sharding.spec == P("x") and got.addressable_data(0).shape == (4, 4)
    # Passed by keyword, the static argument still goes to the callbacks, not into the program.
    seen.clear()
    np.testing.assert_array_equal(jax.jit(lambda a, b: op(a, b, scale=0.5))(xs, ys),
                                  expected / 6)
    assert set(seen) == {0.5}


def test_static_arguments_reach_callbacks_in_the_order_given():
    """JAX hands the static values to the callbacks as ``static_argnums`` lists them (not sorted);
    custom_partitioning_test.py::test_custom_partition_with_sharding_rule_callback relies on it."""
    got = {}
    for impl, cls in CLASSES.items():
        seen = []

        def partition(first, second, mesh, arg_shapes, result_shape, seen=seen):
            seen.append((first, second))
            s = arg_shapes[0].sharding
            return mesh, lambda x: x * 2, s, (s,)

        op = cls(lambda x, a, b: x * 2, static_argnums=(2, 1))
        op.def_partition(partition, sharding_rule="i -> i")
        s = NamedSharding(mesh_2d(), P("x"))
        out = jax.jit(lambda v, op=op: op(v, "a", "b"), in_shardings=s)(jnp.arange(8.0))
        np.testing.assert_array_equal(out, jnp.arange(8.0) * 2)
        got[impl] = set(seen)
    assert got["autoshard"] == got["jax"] == {("b", "a")}


def test_static_argnum_past_the_arguments_says_so():
    op = autoshard.custom_partitioning(lambda x, y: x + y, static_argnums=(2,))
    op.def_partition(lambda *a: None, sharding_rule="i, i -> i")
    with pytest.raises(ValueError, match=r"static_argnums \(\(2,\)\) names argument 2, but "
                                         r"<lambda> got 2 arguments \(with its defaults"):
        op(jnp.ones(4), jnp.ones(4))


def test_traced_static_argument_is_an_unexpected_tracer():
    """JAX raises UnexpectedTracerError for a tracer in a static position."""
    op = autoshard.custom_partitioning(lambda x, s: x * s, static_argnums=(1,))
    op.def_partition(lambda *a: None, sharding_rule="i -> i")
    with pytest.raises(jax.errors.UnexpectedTracerError, match=r"argument 1 .* is static"):
        jax.jit(op)(jnp.ones(4), 2.0)


def batched_matmul(cls):
    """Rank-4 ``x @ y`` whose rule comes from a callback that sees the (default) static args."""

    def partition(a0, a1, mesh, arg_shapes, result_shape):
        assert (a0, a1) == (1, 2)
        x_s, y_s = (s.sharding for s in arg_shapes)
        rank = len(arg_shapes[0].shape)
        k_axis = y_s.spec[rank - 2]
        block = arg_shapes[1].shape[rank - 2] // mesh.shape[k_axis]

        def lower_fn(x, y):
            i = jax.lax.axis_index(k_axis)
            cols = jax.lax.dynamic_slice_in_dim(x, i * block, block, axis=rank - 1)
            return jax.lax.psum(cols @ y, k_axis)

        return mesh, lower_fn, result_shape.sharding, (x_s, y_s)

    def rule(a0, a1, mesh, operand_types, result_types):
        assert (a0, a1) == (1, 2)
        lead = " ".join(f"b{i}" for i in range(len(operand_types[0].shape) - 2))
        return f"{lead} i j, {lead} j k -> {lead} i k", {"reduction_factors": ("j",)}

    def f(x, y, a0=1, a1=2):
        return x @ y

    op = cls(f, static_argnums=(2, 3))
    op.def_partition(partition, sharding_rule=rule)
    return op


@pytest.mark.parametrize("impl", sorted(CLASSES))
def test_rule_callback_with_default_static_args(impl):
    """Covers custom_partitioning_test.py::test_custom_partition_with_sharding_rule_callback."""
    op = batched_matmul(CLASSES[impl])
    mesh = mesh_2d()
    x = jax.device_put(ints((2, 1, 8, 4), 2), NamedSharding(mesh, P(None, None, "x")))
    y = jax.device_put(ints((2, 1, 4, 8), 3), NamedSharding(mesh, P(None, None, "y")))
    got = jax.jit(op)(x, y)
    np.testing.assert_array_equal(got, jax.jit(jnp.matmul)(x, y))
    assert got.sharding == NamedSharding(mesh, P(None, None, "x"))
    assert got.addressable_data(0).shape == (2, 1, 2, 8)


# -- "Mismatch in result shapes." ----------------------------------------------------------------
def replicated_result_partition(mesh, arg_shapes, result_shape):
    """Claims a replicated result, but lower_fn returns the operand's column block."""
    m = arg_shapes[0].sharding.mesh
    return mesh, lambda x: x, NamedSharding(m, P(None)), (NamedSharding(m, P(None, "x")),)


def test_wrong_per_shard_result_is_jax_mismatch_error(partitioner):
    """Covers custom_partitioning_test.py::test_custom_partitioner_invalid_sharding; the error is
    a ValueError at the jax.jit call (JAX's own class raises a JaxRuntimeError: INTERNAL)."""
    op = autoshard.custom_partitioning(lambda x: x)
    op.def_partition(replicated_result_partition,
                     infer_sharding_from_operands=lambda m, a, r: NamedSharding(m, P("x")),
                     sharding_rule="i j -> i j")
    mesh = mesh_2d()
    x = jax.device_put(ints((16, 8), 4), NamedSharding(mesh, P(None, "x")))
    jitted = jax.jit(op, out_shardings=NamedSharding(mesh, P("x")))
    with pytest.raises(ValueError, match=r"^Mismatch in result shapes\. custom_partitioning "
                                         r"'<lambda>': lower_fn returned per-shard results "
                                         r"\[float32\[16,2\]\], but the result shardings "
                                         r"\[P\(None,\)\] that partition returned make the global "
                                         r"results \[float32\[16,8\]\] per-shard results "
                                         r"\[float32\[16,8\]\]\. lower_fn runs on one shard") as err:
        jitted(x)
    assert isinstance(err.value.__cause__, jax.errors.JaxRuntimeError)
    # JAX's own class fails with the same words, wrapped in XLA's error.
    ref = jax_cp.custom_partitioning(lambda x: x)
    ref.def_partition(replicated_result_partition,
                      infer_sharding_from_operands=lambda m, a, r: NamedSharding(m, P("x")),
                      sharding_rule="i j -> i j")
    with pytest.raises(jax.errors.JaxRuntimeError, match="Mismatch in result shapes."):
        jax.jit(ref, out_shardings=NamedSharding(mesh, P("x")))(x)


def test_exception_in_partition_reaches_the_caller_as_itself():
    class UserError(Exception):
        pass

    def partition(mesh, arg_shapes, result_shape):
        raise UserError("partition refuses this sharding")

    op = autoshard.custom_partitioning(lambda x: x + 1)
    op.def_partition(partition, sharding_rule="i -> i")
    s = NamedSharding(mesh_2d(), P("x"))
    with pytest.raises(UserError, match="partition refuses this sharding"):
        jax.jit(op, in_shardings=s, out_shardings=s)(jnp.arange(8.0))
    # Other compilation errors pass through the handler untouched.
    assert reraise_callback_error(RuntimeError("INTERNAL: something else")) is None


# -- a fully manual shard_map: the local block, no rule -----------------------------------------
@pytest.mark.parametrize("impl", sorted(CLASSES))
def test_inside_manual_shard_map_runs_fun_on_the_local_block(impl):
    """Covers shard_map_test.py::CustomPartitionerTest.test_custom_partitioning: 'i -> i' on a
    rank-2 local block is accepted, partition is never asked, fun runs on the block."""
    calls = []

    def partition(mesh, arg_shapes, result_shape):
        calls.append(arg_shapes)
        s = arg_shapes[0].sharding
        return mesh, lambda x: x, s, (s,)

    op = CLASSES[impl](lambda x: x * 2 + jnp.sum(x))  # the sum is over the local block
    op.def_partition(partition, infer_sharding_from_operands=lambda m, a, r: a[0].sharding,
                     propagate_user_sharding=lambda m, u: u.sharding, sharding_rule="i -> i")
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("z", "x", "y"))
    spec = P("z", ("x", "y"))
    a = jax.device_put(ints((8, 8), 5), NamedSharding(mesh, spec))
    out = jax.jit(jax.shard_map(op, mesh=mesh, check_vma=False, in_specs=(spec,),
                                out_specs=spec))(a)
    assert out.addressable_data(0).shape == (4, 2)
    blocks = np.asarray(a).reshape(2, 4, 4, 2).transpose(0, 2, 1, 3)
    expected = (blocks * 2 + blocks.sum(axis=(2, 3), keepdims=True)).transpose(0, 2, 1, 3)
    np.testing.assert_array_equal(out, expected.reshape(8, 8))
    assert calls == []


def test_rule_still_checked_outside_shard_map():
    op = autoshard.custom_partitioning(lambda x: x)
    op.def_partition(lambda *a: None, sharding_rule="i -> i")
    with pytest.raises(ValueError, match=r"gives operand 0 1 dims, but it has shape \(4, 2\)"):
        jax.jit(op)(jnp.ones((4, 2)))


# -- the legacy rule-less form (the accepted difference) -----------------------------------------
def test_rule_less_callbacks_still_work_under_shardy():
    """The opposite of custom_partitioning_test.py::test_custom_partition_shardy_migration, which
    expects NotImplementedError: autoshard derives the rule from infer_sharding_from_operands."""
    assert jax.config.jax_use_shardy_partitioner

    def partition(mesh, arg_shapes, result_shape):
        s = arg_shapes[0].sharding
        return mesh, lambda x: x * 3, s, (s,)

    op = autoshard.custom_partitioning(lambda x: x * 3)
    op.def_partition(partition, infer_sharding_from_operands=lambda m, a, r: a[0].sharding,
                     propagate_user_sharding=lambda m, u: u.sharding)
    mesh = mesh_2d()
    x = jax.device_put(ints((8, 16), 6), NamedSharding(mesh, P(None, "x")))
    got = jax.jit(op)(x)
    np.testing.assert_array_equal(got, np.asarray(x) * 3)
    assert got.sharding.spec == P(None, "x") and got.addressable_data(0).shape == (8, 4)
    ref = jax_cp.custom_partitioning(lambda x: x * 3)
    ref.def_partition(partition, infer_sharding_from_operands=lambda m, a, r: a[0].sharding)
    with pytest.raises(NotImplementedError, match="provide sharding_rule to migrate to Shardy"):
        jax.jit(ref)(x)
