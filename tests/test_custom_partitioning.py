"""autoshard.custom_partitioning under jit (both rule forms, both partitioners), grad, vmap."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.custom_partitioning import BATCHING, ArrayMapping, SdyShardingRule
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import autoshard

GATHER_OR_SLICE = re.compile(r"(dynamic-slice|all-gather)")
RNG = np.random.default_rng(0)


def hlo(jitted, *args) -> str:
    return jitted.lower(*args).compile().as_text()


def mesh_1d():
    return Mesh(np.array(jax.devices()), ("x",))


def mesh_2d():
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))


# -- the FFT of jax.experimental.custom_partitioning's docstring -----------------------------------
def supported_sharding(sharding, shape):
    """Keep the sharding of the leading dims, replicate the last (the FFT dim)."""
    rank = len(shape.shape)
    kept = min(len(sharding.spec), rank - 1)
    names = tuple(sharding.spec[:kept]) + (None,) * (rank - kept)
    return NamedSharding(sharding.mesh, P(*names))


def fft_partition(mesh, arg_shapes, result_shape):
    arg_sharding = supported_sharding(arg_shapes[0].sharding, arg_shapes[0])
    return mesh, jnp.fft.fft, arg_sharding, (arg_sharding,)


def fft_infer(mesh, arg_shapes, result_shape):
    return supported_sharding(arg_shapes[0].sharding, arg_shapes[0])


FFT_FORMS = {
    "string_rule": dict(infer_sharding_from_operands=fft_infer, sharding_rule="...i -> ...i"),
    "string_rule_only": dict(sharding_rule="... i -> ... i", need_replication_factors=("i",)),
    "sdy_rule": dict(infer_sharding_from_operands=fft_infer, sharding_rule=SdyShardingRule(
        operand_mappings=(ArrayMapping(BATCHING, "i"),),
        result_mappings=(ArrayMapping(BATCHING, "i"),))),
    "legacy_infer": dict(infer_sharding_from_operands=fft_infer),
}


def make_fft(form: str):
    @autoshard.custom_partitioning
    def my_fft(x):
        return jnp.fft.fft(x)

    my_fft.def_partition(partition=fft_partition, **FFT_FORMS[form])
    return my_fft


@pytest.mark.parametrize("form", sorted(FFT_FORMS))
def test_fft_2d_keeps_rows_split(form, partitioner):
    my_fft = make_fft(form)
    sharding = NamedSharding(mesh_1d(), P("x"))
    x = jnp.asarray(RNG.normal(size=(64, 32)), jnp.complex64)
    jitted = jax.jit(my_fft, in_shardings=sharding, out_shardings=sharding)
    assert GATHER_OR_SLICE.search(hlo(jitted, x)) is None
    np.testing.assert_allclose(jitted(x), jnp.fft.fft(x), rtol=1e-4, atol=1e-3)
    # Inside a larger program the output stays split: XLA propagates through the rule.
    chained = jax.jit(lambda v: jnp.abs(my_fft(v * 2)) + 1, in_shardings=sharding)
    assert GATHER_OR_SLICE.search(hlo(chained, x)) is None
    assert chained(x).sharding.spec == P("x")
    np.testing.assert_allclose(chained(x), jnp.abs(jnp.fft.fft(x * 2)) + 1, rtol=1e-4, atol=1e-3)


def test_plain_fft_gathers():
    sharding = NamedSharding(mesh_1d(), P("x"))
    x = jnp.asarray(RNG.normal(size=(64, 32)), jnp.complex64)
    jitted = jax.jit(jnp.fft.fft, in_shardings=sharding, out_shardings=sharding)
    assert GATHER_OR_SLICE.search(hlo(jitted, x)) is not None


@pytest.mark.parametrize("form", ["string_rule", "legacy_infer"])
def test_fft_1d_gathers_its_only_dim(form):
    # The FFT dim itself must be whole: a 1-D input is gathered, and the result equals fft.
    my_fft = make_fft(form)
    sharding = NamedSharding(mesh_1d(), P("x"))
    x = jnp.asarray(RNG.normal(size=(256,)), jnp.complex64)
    jitted = jax.jit(my_fft, in_shardings=sharding, out_shardings=sharding)
    assert GATHER_OR_SLICE.search(hlo(jitted, x)) is not None
    np.testing.assert_allclose(jitted(x), jnp.fft.fft(x), rtol=1e-4, atol=1e-2)


def test_eager_call_runs_the_function():
    x = jnp.asarray(RNG.normal(size=(4, 8)), jnp.complex64)
    np.testing.assert_allclose(make_fft("string_rule")(x), jnp.fft.fft(x), rtol=1e-5, atol=1e-4)


# -- a matmul whose partition all-reduces partial sums, with a static argument ---------------------
SEEN_STATIC = []


def matmul_partition(scale, mesh, arg_shapes, result_shape):
    SEEN_STATIC.append(scale)
    x_spec = tuple(arg_shapes[0].sharding.spec) + (None,) * 2
    m_axis, k_axis = x_spec[0], x_spec[1]
    n_axis = (tuple(arg_shapes[1].sharding.spec) + (None,) * 2)[1]
    if n_axis is not None and n_axis in (m_axis, k_axis):
        n_axis = None

    def lower_fn(x, w):
        y = scale * (x @ w)
        return jax.lax.psum(y, k_axis) if k_axis is not None else y

    return (mesh, lower_fn, NamedSharding(mesh, P(m_axis, n_axis)),
            (NamedSharding(mesh, P(m_axis, k_axis)), NamedSharding(mesh, P(k_axis, n_axis))))


def make_matmul():
    def matmul(x, w, scale):
        return scale * (x @ w)

    matmul = autoshard.custom_partitioning(matmul, static_argnums=(2,))
    matmul.def_partition(matmul_partition, sharding_rule="m k, k n -> m n",
                         reduction_factors=("k",))
    return matmul


def test_matmul_psum_with_static_arg():
    matmul = autoshard.custom_partitioning(lambda x, w, scale: scale * (x @ w),
                                           static_argnums=(2,))
    matmul.def_partition(matmul_partition, sharding_rule="m k, k n -> m n",
                         reduction_factors=("k",))
    mesh = mesh_2d()
    x = jnp.asarray(RNG.normal(size=(16, 32)), jnp.float32)
    w = jnp.asarray(RNG.normal(size=(32, 8)), jnp.float32)
    jitted = jax.jit(lambda x, w: matmul(x, w, 0.5),
                     in_shardings=(NamedSharding(mesh, P("a", "b")), NamedSharding(mesh, P("b"))))
    SEEN_STATIC.clear()
    text = hlo(jitted, x, w)
    assert SEEN_STATIC and set(SEEN_STATIC) == {0.5}
    assert "all-reduce" in text and "all-gather" not in text
    np.testing.assert_allclose(jitted(x, w), 0.5 * (x @ w), rtol=1e-4, atol=1e-4)


def test_static_arg_must_not_be_a_tracer():
    matmul = autoshard.custom_partitioning(lambda x, w, scale: scale * (x @ w),
                                           static_argnums=(2,))
    matmul.def_partition(matmul_partition, sharding_rule="m k, k n -> m n",
                         reduction_factors=("k",))
    with pytest.raises(TypeError, match=r"argument 2 .* is static \(static_argnums=\(2,\)\)"):
        jax.jit(matmul)(jnp.ones((2, 2)), jnp.ones((2, 2)), 1.0)


# -- a reshape-like rule: compound factor, need-replication factor ---------------------------------
def heads_partition(mesh, arg_shapes, result_shape):
    b_axis, hd_axis = (tuple(arg_shapes[0].sharding.spec) + (None,) * 2)[:2]

    def lower_fn(x):  # x: per-shard (b, h*d) -> (b, h, d), softmax over the whole d
        return jax.nn.softmax(x.reshape(x.shape[0], -1, 8), axis=-1)

    return (mesh, lower_fn, NamedSharding(mesh, P(b_axis, hd_axis, None)),
            (NamedSharding(mesh, P(b_axis, hd_axis)),))


def split_heads_reference(x):
    return jax.nn.softmax(x.reshape(x.shape[0], 4, 8), axis=-1)


def test_compound_rule_splits_heads_not_head_dim():
    split_heads = autoshard.custom_partitioning(split_heads_reference)
    split_heads.def_partition(heads_partition, sharding_rule="b (h d) -> b h d",
                              need_replication_factors=("d",))
    mesh = mesh_2d()
    x = jnp.asarray(RNG.normal(size=(6, 32)), jnp.float32)
    jitted = jax.jit(split_heads, in_shardings=NamedSharding(mesh, P(None, "b")),
                     out_shardings=NamedSharding(mesh, P(None, "b")))
    assert GATHER_OR_SLICE.search(hlo(jitted, x)) is None
    np.testing.assert_allclose(jitted(x), split_heads_reference(x), rtol=1e-5, atol=1e-6)


# -- differentiation -------------------------------------------------------------------------------
def test_grad_through_custom_partitioned_layer():
    matmul = make_matmul()

    def fwd(x, w, scale):
        return matmul(x, w, scale), (x, w)

    def bwd(scale, res, g):  # the backward is custom-partitioned too
        x, w = res
        return matmul(g, w.T, scale), matmul(x.T, g, scale)

    matmul.def_vjp(fwd, bwd)

    def loss(w, x, op):
        return jnp.sum(jnp.tanh(op(x, w, 0.5)) ** 2)

    mesh = mesh_2d()
    x = jnp.asarray(RNG.normal(size=(16, 32)), jnp.float32)
    w = jnp.asarray(RNG.normal(size=(32, 8)), jnp.float32)
    shardings = (NamedSharding(mesh, P("b")), NamedSharding(mesh, P("a", "b")))
    got = jax.jit(jax.grad(lambda w, x: loss(w, x, matmul)), in_shardings=shardings)(w, x)
    want = jax.jit(jax.grad(lambda w, x: loss(w, x, lambda x, w, s: s * (x @ w))))(w, x)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    both = jax.grad(lambda x, w: loss(w, x, matmul), argnums=(0, 1))(x, w)
    assert both[0].shape == x.shape and both[1].shape == w.shape


def test_grad_without_backward_says_how_to_give_one():
    my_fft = make_fft("string_rule")
    x = jnp.ones((4, 8), jnp.float32)
    with pytest.raises(TypeError, match=r"'my_fft', which has no backward.*my_fft\.def_vjp"):
        jax.grad(lambda x: jnp.abs(my_fft(x)).sum())(x)


def test_grad_and_vmap_compose():
    def partition(mesh, arg_shapes, result_shape):
        s = arg_shapes[0].sharding
        return mesh, lambda x: jnp.sin(x) * 2, s, (s,)

    op = autoshard.custom_partitioning(lambda x: jnp.sin(x) * 2)
    op.def_partition(partition, sharding_rule="... i -> ... i")
    op.def_vjp(lambda x: (op(x), x), lambda x, g: (2 * jnp.cos(x) * g,))
    x = jnp.asarray(RNG.normal(size=(4, 8, 16)), jnp.float32)
    want = 2 * jnp.cos(x)
    np.testing.assert_allclose(jax.vmap(jax.grad(lambda v: op(v).sum()))(x), want, rtol=1e-5)
    np.testing.assert_allclose(jax.grad(lambda v: jax.vmap(op)(v).sum())(x), want, rtol=1e-5)


# -- batching --------------------------------------------------------------------------------------
def test_vmap_joins_the_batching_dims():
    my_fft = make_fft("string_rule")
    x = jnp.asarray(RNG.normal(size=(8, 4, 16)), jnp.complex64)
    np.testing.assert_allclose(jax.vmap(my_fft)(x), jnp.fft.fft(x), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(jax.vmap(my_fft, in_axes=2, out_axes=2)(x),
                               jnp.fft.fft(jnp.moveaxis(x, 2, 0)).transpose(1, 2, 0),
                               rtol=1e-4, atol=1e-3)
    sharding = NamedSharding(mesh_1d(), P("x"))
    jitted = jax.jit(jax.vmap(my_fft), in_shardings=sharding, out_shardings=sharding)
    assert GATHER_OR_SLICE.search(hlo(jitted, x)) is None
    np.testing.assert_allclose(jitted(x), jnp.fft.fft(x), rtol=1e-4, atol=1e-3)


def test_vmap_broadcasts_unbatched_operands():
    def add_partition(mesh, arg_shapes, result_shape):
        s = arg_shapes[0].sharding
        return mesh, jnp.add, s, (s, s)

    add = autoshard.custom_partitioning(jnp.add)
    add.def_partition(add_partition, sharding_rule="... i, ... i -> ... i")
    x = jnp.arange(24.0).reshape(3, 8)
    y = jnp.arange(8.0)
    np.testing.assert_allclose(jax.vmap(add, in_axes=(0, None))(x, y), x + y)


def test_vmap_without_batching_factor_is_an_error():
    matmul = make_matmul()
    x = jnp.ones((3, 4, 4))
    with pytest.raises(ValueError, match=r"vmap of custom_partitioning .* start with '\.\.\.'.*"
                                         r"'m k, k n -> m n'"):
        jax.vmap(lambda x: matmul(x, x, 1.0))(x)


# -- errors ----------------------------------------------------------------------------------------
def test_wrong_per_shard_shape_names_op_and_shapes():
    def partition(mesh, arg_shapes, result_shape):
        s = arg_shapes[0].sharding
        return mesh, lambda x: jnp.tile(x, (8, 1)), s, (s,)  # a global-shaped result

    bad_op = autoshard.custom_partitioning(lambda x: x + 1)
    bad_op.__name__ = "bad_op"
    bad_op.def_partition(partition, sharding_rule="i j -> i j")
    sharding = NamedSharding(mesh_1d(), P("x"))
    with pytest.raises(ValueError, match=r"^Mismatch in result shapes\. custom_partitioning "
                                         r"'bad_op': lower_fn returned per-shard results "
                                         r"\[float32\[16,4\]\].*global results \[float32\[16,4\]\] "
                                         r"per-shard results \[float32\[2,4\]\]"):
        jax.jit(bad_op, in_shardings=sharding, out_shardings=sharding)(jnp.ones((16, 4)))


@pytest.mark.parametrize("rule, pos, why", [
    ("i j -> i #", 9, "unexpected character '#'"),
    ("i (j k -> i j k", 2, r"'\(' is never closed"),
    ("i j, 2k -> i", 5, "must start with a letter"),
    ("i j i j", 7, "no '->'"),
])
def test_rule_that_does_not_parse_points_at_the_character(rule, pos, why):
    op = autoshard.custom_partitioning(lambda x: x)
    with pytest.raises(ValueError, match=why) as err:
        op.def_partition(fft_partition, sharding_rule=rule)
    lines = str(err.value).splitlines()
    assert f"at position {pos}" in lines[0]
    assert lines[1] == f"  {rule}" and lines[2] == "  " + " " * pos + "^"


def test_rule_with_wrong_rank_names_the_operand():
    op = autoshard.custom_partitioning(lambda x: x)
    op.def_partition(fft_partition, sharding_rule="i -> i")
    with pytest.raises(ValueError, match=r"'<lambda>'.*gives operand 0 1 dims, but it has "
                                         r"shape \(4, 8\)"):
        jax.jit(op)(jnp.ones((4, 8)))
