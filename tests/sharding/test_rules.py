"""Strategies per primitive family: every rule plans and runs, equal to a single-device jit."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import assert_close, plan_fn, run_plan
from jax import lax

from autoshard.sharding.cost import CostModel
from autoshard.sharding.options import AutoShardingOption
from autoshard.sharding.rules import reshape_groups
from autoshard.sharding.spec import candidate_specs
from autoshard.sharding.strategy import RuleContext, strategies_for

RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.normal(size=(16, 8, 24)).astype(np.float32))
M = jnp.asarray(RNG.normal(size=(24, 32)).astype(np.float32))
IMG = jnp.asarray(RNG.normal(size=(8, 6, 6, 4)).astype(np.float32))
KER = jnp.asarray(RNG.normal(size=(3, 3, 4, 8)).astype(np.float32))
TABLE = jnp.asarray(RNG.normal(size=(40, 24)).astype(np.float32))
IDS = jnp.asarray(RNG.integers(0, 40, size=(16, 8)).astype(np.int32))

CASES = {
    "dot_general": (lambda x, m: jnp.einsum("bsd,df->bsf", x, m), (X, M)),
    "dot_contracting_batch": (lambda x: jnp.einsum("bsd,bse->de", x, x), (X,)),
    "conv": (lambda i, k: lax.conv_general_dilated(i, k, (1, 1), "SAME",
                                                   dimension_numbers=("NHWC", "HWIO", "NHWC")),
             (IMG, KER)),
    "conv_grad": (jax.grad(lambda i, k: lax.conv_general_dilated(
        i, k, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")).sum(), (0, 1)),
        (IMG, KER)),
    "elementwise_broadcast": (lambda x, b: jnp.tanh(x) * b + jnp.exp(-x) - 2.0,
                              (X, jnp.arange(24.0))),
    "unary_math": (lambda x: jax.nn.sigmoid(x) + lax.erf(x) + lax.rsqrt(x * x + 1)
                   + jnp.sqrt(jnp.abs(x)) + x ** 3 + jnp.log1p(x * x) + jnp.floor(x), (X,)),
    "reductions": (lambda x: (x.sum(1), x.max(2), x.min(0), jnp.argmax(x, 1), jnp.argmin(x, 2),
                              jnp.cumsum(x, 1), x.prod(0)), (X,)),
    "broadcast_reshape_transpose": (lambda x: (x.reshape(16, 2, 4, 24).transpose(2, 0, 3, 1),
                                               x.reshape(128, 24), x[:, None, :, :],
                                               jnp.broadcast_to(x[:, :1], (16, 8, 24)).squeeze()),
                                    (X,)),
    "slice_pad_concat": (lambda x: (x[:, 2:6], jnp.pad(x, ((0, 0), (1, 2), (0, 0))),
                                    jnp.concatenate([x, x * 2], axis=2), x[::2]), (X,)),
    "dynamic_slice_update": (lambda x, i: (lax.dynamic_slice_in_dim(x, i, 3, axis=1),
                                           lax.dynamic_update_slice_in_dim(x, x[:, :2] * 0, i, 1)),
                             (X, jnp.int32(2))),
    "embedding_gather_and_grad": (jax.value_and_grad(lambda t, i: (t[i] ** 2).sum()),
                                  (TABLE, IDS)),
    "take_along_axis_sort": (lambda x: (jnp.sort(x, axis=2),
                                        jnp.take_along_axis(x, jnp.argsort(x, 1), axis=1)), (X,)),
    "select_convert_iota": (lambda x: (jnp.where(x > 0, x, jnp.arange(24.0)),
                                       x.astype(jnp.bfloat16).astype(jnp.float32),
                                       jax.nn.one_hot(jnp.argmax(x, -1), 5)), (X,)),
    "top_k_softmax": (lambda x: (lax.top_k(x, 3), jax.nn.softmax(x, axis=-1),
                                 jax.nn.gelu(x)), (X,)),
    "scatter_set": (lambda x: x.at[:, 3].set(1.0), (X,)),
    "rev_split": (lambda x: (jnp.flip(x, 1), *jnp.split(x, 2, axis=2)), (X,)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_plans_and_runs(name):
    fn, args = CASES[name]
    batch = [np.ndim(a) > 0 for a in args]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every primitive here has a rule
        closed, plan = plan_fn(fn, args, batch=batch)
    assert_close(run_plan(closed, plan, args), jax.tree.leaves(jax.jit(fn)(*args)))


def test_unknown_primitive_is_replicated_with_one_warning():
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    twice = Primitive("autoshard_test_twice")
    twice.def_impl(lambda x: 2 * x)
    twice.def_abstract_eval(lambda x: x)
    mlir.register_lowering(twice, mlir.lower_fun(lambda x: 2 * x, multiple_results=False))

    def f(x):
        return twice.bind(twice.bind(x)) @ M

    with pytest.warns(UserWarning, match="autoshard_test_twice") as record:
        closed, plan = plan_fn(f, (X,), batch=[True])
    assert len([r for r in record if "autoshard_test_twice" in str(r.message)]) == 1
    assert any("autoshard_test_twice" in n for n in plan.notes)
    assert_close(run_plan(closed, plan, (X,)), [jax.jit(f)(X)])


def _ctx(mesh_shape=(8,), **opt):
    option = AutoShardingOption(show_progress=False, **opt)
    return RuleContext(mesh_shape, CostModel.from_option(mesh_shape, option), option)


def test_dot_strategies_include_contracting_split_with_all_reduce():
    a = jax.ShapeDtypeStruct((16, 64), np.float32)
    b = jax.ShapeDtypeStruct((64, 32), np.float32)
    out = jax.ShapeDtypeStruct((16, 32), np.float32)
    params = {"dimension_numbers": (((1,), (0,)), ((), ()))}
    found = strategies_for(_ctx(), "dot_general", [a, b], [out], params)
    by_inputs = {s.in_specs: s for s in found}
    contracting = by_inputs[(((), (0,)), ((0,), ()))]
    assert contracting.out_specs == (((), ()),)
    assert contracting.collectives == (("all-reduce", (0,), 16 * 32 * 4),)
    assert by_inputs[(((0,), ()), ((), ()))].comm_s == 0  # batch split
    assert by_inputs[(((), ()), ((), (0,)))].comm_s == 0  # column split
    # Every strategy uses the mesh axis: no replicated recomputation of a heavy op.
    assert all(s.in_specs != (((), ()), ((), ())) for s in found)
    rs = strategies_for(_ctx(prefer_reduce_scatter=True), "dot_general", [a, b], [out], params)
    assert any(s.collectives and s.collectives[0][0] == "reduce-scatter" for s in rs)


def test_sums_over_two_axes_offer_one_reduce_scatter_over_both():
    """A weight gradient with the batch split over both axes of (2, 4) (its contracting dim
    on (0, 1)), and a bias gradient summed over the same batch, are offered a reduce-scatter
    over both axes into one dim of the result, priced as one collective over the 8 devices
    (hierarchical: ``CostModel.collective``), beside their all-reduce. Before, only a sum over
    one axis was."""
    mesh_shape = (2, 4)
    ctx = _ctx(mesh_shape, prefer_reduce_scatter=True)
    x = jax.ShapeDtypeStruct((64, 16), np.float32)
    g = jax.ShapeDtypeStruct((64, 32), np.float32)
    out = jax.ShapeDtypeStruct((16, 32), np.float32)
    params = {"dimension_numbers": (((0,), (0,)), ((), ()))}
    found = strategies_for(ctx, "dot_general", [x, g], [out], params)
    both = [s for s in found if s.in_specs == (((0, 1), ()), ((0, 1), ()))]
    whole = 16 * 32 * 4
    assert {s.out_specs for s in both} == {(((), ()),), (((0, 1), ()),), (((), (0, 1)),)}
    for s in both:
        if s.out_specs == (((), ()),):
            assert s.collectives == (("all-reduce", (0, 1), whole),)
        else:
            assert s.collectives == (("reduce-scatter", (0, 1), whole // 8),)
            assert s.comm_s == pytest.approx(ctx.cost.collective("reduce-scatter", (0, 1), whole))
    # a dim of 12 rows cannot be split 8 ways: no reduce-scatter into it
    odd = jax.ShapeDtypeStruct((12, 32), np.float32)
    found = strategies_for(ctx, "dot_general", [jax.ShapeDtypeStruct((64, 12), np.float32), g],
                           [odd], params)
    assert {s.out_specs for s in found if s.in_specs == (((0, 1), ()), ((0, 1), ()))} == {
        (((), ()),), (((), (0, 1)),)}
    bias = strategies_for(ctx, "reduce_sum", [g], [jax.ShapeDtypeStruct((32,), np.float32)],
                          {"axes": (0,)})
    assert [(s.out_specs, s.collectives) for s in bias if s.in_specs == (((0, 1), ()),)] == [
        ((((0, 1),),), (("reduce-scatter", (0, 1), 32 * 4 // 8),)),
        ((((),),), (("all-reduce", (0, 1), 32 * 4),))]
    # without prefer_reduce_scatter (or a user's budget): the all-reduce only
    plain = strategies_for(_ctx(mesh_shape), "dot_general", [x, g], [out], params)
    assert [s.out_specs for s in plain if s.in_specs == (((0, 1), ()), ((0, 1), ()))] == [
        (((), ()),)]


def test_candidate_specs_and_reshape_groups():
    assert candidate_specs((16, 6), (8,)) == [((), ()), ((0,), ())]
    two_d = candidate_specs((8, 4), (2, 4))
    assert ((0, 1), ()) in two_d and ((1,), (0,)) in two_d and ((), (0, 1)) not in two_d
    assert reshape_groups((4, 6), (24,)) == [([0, 1], [0])]
    assert reshape_groups((2, 3, 4), (6, 4)) == [([0, 1], [0]), ([2], [1])]
    assert reshape_groups((4, 1), (4,)) == [([0], [0]), ([1], [])]


def test_pooling_and_its_gradients_keep_pooled_dims_whole():
    x = jax.ShapeDtypeStruct((32, 8, 8, 16), np.float32)
    pooled = jax.ShapeDtypeStruct((32, 4, 4, 16), np.float32)
    params = {"window_dimensions": (1, 2, 2, 1), "window_strides": (1, 2, 2, 1),
              "padding": ((0, 0),) * 4, "base_dilation": (1,) * 4, "window_dilation": (1,) * 4}
    for name, ins, outs in (("reduce_window_max", [x], [pooled]),
                            ("reduce_window_sum", [x], [pooled]),
                            ("select_and_scatter_add", [pooled, x], [x])):
        found = strategies_for(_ctx(), name, ins, outs, params)
        out_specs = {s.out_specs[0] for s in found}
        assert ((0,), (), (), ()) in out_specs and ((), (), (), (0,)) in out_specs, name
        assert all(not s.out_specs[0][1] and not s.out_specs[0][2] for s in found), name
        assert all(s.comm_s == 0 for s in found)


def test_grouped_convolutions_split_whole_groups():
    x = jax.ShapeDtypeStruct((4, 8, 8, 16), np.float32)
    dn = jax.lax.conv_dimension_numbers(x.shape, (3, 3, 4, 32), ("NHWC", "HWIO", "NHWC"))
    out = jax.ShapeDtypeStruct((4, 8, 8, 32), np.float32)
    params = {"dimension_numbers": dn, "batch_group_count": 1}
    grouped = strategies_for(_ctx((4,)), "conv_general_dilated",
                             [x, jax.ShapeDtypeStruct((3, 3, 4, 32), np.float32)], [out],
                             dict(params, feature_group_count=4))
    # 4 groups over 4 devices: in features, kernel out features and out features split alike.
    assert (((), (), (), (0,)), ((), (), (), (0,))) in {s.in_specs for s in grouped}
    too_many = strategies_for(_ctx((8,)), "conv_general_dilated",
                              [x, jax.ShapeDtypeStruct((3, 3, 4, 32), np.float32)], [out],
                              dict(params, feature_group_count=4))
    assert all(not s.in_specs[0][3] for s in too_many)  # 8 pieces do not divide 4 groups
