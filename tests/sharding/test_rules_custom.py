"""The planner through custom-partitioned operations: strategies from the rule or the callback."""

from __future__ import annotations

import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from _util import assert_close, plan_fn, run_plan
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autoshard
from autoshard.sharding.cost import CostModel
from autoshard.sharding.options import AutoShardingOption
from autoshard.sharding.strategy import RuleContext, strategies_for

RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.normal(size=(64, 32)).astype(np.float32))
W = jnp.asarray(RNG.normal(size=(32, 16)).astype(np.float32))


def _keep_leading(sharding, shape):
    rank = len(shape.shape)
    kept = min(len(sharding.spec), rank - 1)
    return NamedSharding(sharding.mesh, P(*tuple(sharding.spec[:kept]), *(None,) * (rank - kept)))


def _fft_partition(mesh, arg_shapes, result_shape):
    s = _keep_leading(arg_shapes[0].sharding, arg_shapes[0])
    return mesh, jnp.fft.fft, s, (s,)


def _fft_infer(mesh, arg_shapes, result_shape):
    return _keep_leading(arg_shapes[0].sharding, arg_shapes[0])


def make_fft(form):
    my_fft = autoshard.custom_partitioning(lambda x: jnp.fft.fft(x))
    kwargs = {"rule": dict(sharding_rule="... i -> ... i", need_replication_factors=("i",)),
              "infer": dict(infer_sharding_from_operands=_fft_infer), "opaque": {}}[form]
    my_fft.def_partition(_fft_partition, **kwargs)
    return my_fft


def fft_step(op):
    def step(x, w):
        h = (x @ w).astype(jnp.complex64)
        return jnp.abs(op(h)).sum(axis=-1)
    return step


def gathers_into_fft(hlo_text: str) -> bool:
    """The (64, 16) operand of the FFT made whole on every device, which an opaque
    operation forces: all-gathered, or (the product split over its contraction) all-reduced."""
    return re.search(r"\[64,16\]\{1,0\} all-(gather|reduce)\(", hlo_text) is not None


@pytest.mark.parametrize("form", ["rule", "infer"])
def test_parallelize_plans_through_the_operation(form):
    step = fft_step(make_fft(form))
    f = autoshard.parallelize(step, method=autoshard.ShardParallel(), batch_argnums=(0,))
    out = f(X, W)
    text = f.get_last_executable().get_hlo_text()
    assert "all-gather" not in text
    assert_close(out, jax.jit(fft_step(jnp.fft.fft))(X, W), rtol=1e-4, atol=1e-3)


def test_jax_custom_partitioning_is_planned_too():
    from jax.experimental.custom_partitioning import custom_partitioning

    jax_fft = custom_partitioning(lambda x: jnp.fft.fft(x))
    jax_fft.def_partition(_fft_partition, infer_sharding_from_operands=_fft_infer,
                          sharding_rule="... i -> ... i", need_replication_factors=("i",))
    f = autoshard.parallelize(fft_step(jax_fft), method=autoshard.ShardParallel(),
                              batch_argnums=(0,))
    out = f(X, W)
    assert "all-gather" not in f.get_last_executable().get_hlo_text()
    assert_close(out, jax.jit(fft_step(jnp.fft.fft))(X, W), rtol=1e-4, atol=1e-3)


def test_opaque_operation_is_gathered():
    step = fft_step(make_fft("opaque"))
    f = autoshard.parallelize(step, method=autoshard.ShardParallel(), batch_argnums=(0,))
    out = f(X, W)
    assert gathers_into_fft(f.get_last_executable().get_hlo_text())
    assert_close(out, jax.jit(fft_step(jnp.fft.fft))(X, W), rtol=1e-4, atol=1e-3)


def test_parallelize_train_step_with_custom_backward():
    def partition(mesh, arg_shapes, result_shape):
        s = arg_shapes[0].sharding
        return mesh, lambda x: jnp.sin(x) * 2, s, (s,)

    op = autoshard.custom_partitioning(lambda x: jnp.sin(x) * 2)
    op.def_partition(partition, sharding_rule="... i -> ... i")
    op.def_vjp(lambda x: (op(x), x), lambda x, g: (2 * jnp.cos(x) * g,))

    def step(w, x, layer):
        return w - 0.1 * jax.grad(lambda w: jnp.mean(layer(x @ w) ** 2))(w)

    w = jnp.asarray(RNG.normal(size=(16, 16)).astype(np.float32))
    f = autoshard.parallelize(lambda w, x: step(w, x, op), method=autoshard.ShardParallel(),
                              batch_argnums=(1,))
    out = f(w, X[:, :16])
    assert "all-gather" not in f.get_last_executable().get_hlo_text()
    want = jax.jit(lambda w, x: step(w, x, lambda h: jnp.sin(h) * 2))(w, X[:, :16])
    assert_close(out, want, rtol=1e-4, atol=1e-5)


def _matmul_partition(mesh, arg_shapes, result_shape):
    m, k = (tuple(arg_shapes[0].sharding.spec) + (None,) * 2)[:2]
    n = (tuple(arg_shapes[1].sharding.spec) + (None,) * 2)[1]
    n = None if n in (m, k) else n

    def lower_fn(x, w):
        return jax.lax.psum(x @ w, k) if k is not None else x @ w

    return (mesh, lower_fn, NamedSharding(mesh, P(m, n)),
            (NamedSharding(mesh, P(m, k)), NamedSharding(mesh, P(k, n))))


def make_matmul():
    matmul = autoshard.custom_partitioning(lambda x, w: x @ w)
    matmul.def_partition(_matmul_partition, sharding_rule="m k, k n -> m n",
                         reduction_factors=("k",))
    return matmul


def test_plan_with_reduction_factor_runs_and_matches():
    matmul = make_matmul()

    def step(x, w1, w2):
        return jnp.tanh(matmul(jnp.tanh(matmul(x, w1)), w2))

    args = (X, W, jnp.asarray(RNG.normal(size=(16, 8)).astype(np.float32)))
    closed, plan = plan_fn(step, args, batch=[True, False, False])
    assert "no rule" not in " ".join(plan.notes)
    assert_close(run_plan(closed, plan, args), jax.jit(
        lambda x, a, b: jnp.tanh(jnp.tanh(x @ a) @ b))(*args), rtol=1e-4, atol=1e-4)


def _strategies(fn, args, mesh_shape):
    closed = jax.make_jaxpr(fn)(*args)
    eqns = [e for e in _all_eqns(closed.jaxpr) if e.primitive.name == "custom_partitioning"]
    assert len(eqns) == 1
    eqn = eqns[0]
    option = AutoShardingOption(show_progress=False)
    ctx = RuleContext(mesh_shape, CostModel.from_option(mesh_shape, option), option)
    return strategies_for(ctx, "custom_partitioning", [v.aval for v in eqn.invars],
                          [v.aval for v in eqn.outvars], eqn.params)


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _all_eqns(sub)


def test_reduction_factor_split_costs_an_all_reduce():
    found = _strategies(make_matmul(), (X, W), (2, 4))
    k_split = [s for s in found if s.in_specs[0][1]]
    assert k_split and all(s.collectives and s.collectives[0][0] == "all-reduce" for s in k_split)
    assert all(s.in_specs[0][1] == s.in_specs[1][0] for s in found)  # k split alike
    plain = [s for s in found if not s.in_specs[0][1]]
    assert plain and not any(s.collectives for s in plain)


def test_need_replication_and_compound_factors():
    def heads(x):
        return jax.nn.softmax(x.reshape(x.shape[0], 4, 8), axis=-1)

    op = autoshard.custom_partitioning(heads)
    op.def_partition(_fft_partition, sharding_rule="b (h d) -> b h d",
                     need_replication_factors=("d",))
    found = _strategies(op, (jnp.ones((6, 32)),), (2, 4))
    assert found
    for s in found:
        (in_spec,), (out_spec,) = s.in_specs, s.out_specs
        assert out_spec[2] == ()  # d is never split
        assert in_spec[1] == out_spec[1]  # (h d) splits only through its major factor h
        assert in_spec[0] == out_spec[0]
    assert any(s.out_specs[0][1] == (0,) for s in found)  # h=4 splits on the 2-way axis


def test_infer_probed_strategies_keep_fft_dim_whole():
    found = _strategies(make_fft("infer"), (jnp.ones((64, 16), jnp.complex64),), (8,))
    assert {s.in_specs[0] for s in found} == {((), ()), ((0,), ())}
    assert all(s.out_specs == s.in_specs for s in found)
