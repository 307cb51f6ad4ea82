"""End to end: planned programs equal a single-device jit over 3 training steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import block, gpt_loss, init_block, init_gpt, init_moe, moe, mse, sgd_step
from _util import assert_close, plan_fn, run_plan
from jax.sharding import PartitionSpec as P

import autoshard
from autoshard.sharding import AutoShardingOption
from models import copy_tree, make_case, make_state, train_step

QUIET = AutoShardingOption(show_progress=False)


def _three_steps(step, state, batch, method):
    ref = jax.jit(step)
    parallel = autoshard.parallelize(step, method=method)
    s1, s2 = state, copy_tree(state)
    for _ in range(3):
        s1, l1 = parallel(s1, batch)
        s2, l2 = ref(s2, batch)
        np.testing.assert_allclose(np.asarray(l1), np.asarray(l2), rtol=1e-4, atol=1e-5)
    assert_close(s1.params, s2.params, rtol=1e-4, atol=1e-5)
    return parallel


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_flax_model_matches_single_device(kind):
    model, x, y = make_case(kind)
    state = make_state(model, x)
    parallel = _three_steps(train_step, state, (x, y),
                            autoshard.ShardParallel(auto_sharding_option=QUIET))
    ex = parallel.get_last_executable()
    assert ex.auto_sharding_objective == pytest.approx(ex.plan.objective.total_s)
    assert "expected collectives" in ex.plan.explain()


def test_gpt_with_adam_matches_single_device():
    params = init_gpt(0, vocab=64, dim=32, heads=4, layers=2, scan=True)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 64, size=(8, 16)).astype(np.int32))
    tx = optax.adam(1e-2, eps=1e-3)
    loss_fn = gpt_loss(scan=True)

    def step(state, batch):
        params, opt = state
        loss, grads = autoshard.value_and_grad(loss_fn)(params, *batch)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), loss

    state = (params, tx.init(params))
    ref = jax.jit(step)
    parallel = autoshard.parallelize(step, method=autoshard.ShardParallel(
        auto_sharding_option=AutoShardingOption(show_progress=False, logical_mesh_shape=(8,))))
    s1, s2 = state, copy_tree(state)
    for _ in range(3):
        s1, l1 = parallel(s1, (tokens, tokens))
        s2, l2 = ref(s2, (tokens, tokens))
        np.testing.assert_allclose(np.asarray(l1), np.asarray(l2), rtol=1e-4, atol=1e-5)
    assert_close(s1, s2, rtol=1e-4, atol=1e-5)


def test_moe_top2_matches_single_device():
    params = init_moe(0, dim=32, hidden=64, experts=8)
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(8, 16, 32)).astype(np.float32))
    step = sgd_step(mse(moe))
    leaves = len(jax.tree.leaves(params))
    closed, plan = plan_fn(step, (params, x, x), batch=[0] * leaves + [1, 1],
                           aliases=[(i, i) for i in range(leaves)], logical_mesh_shape=(8,))
    state, s_ref = (params, x, x), (params, x, x)
    for _ in range(3):
        new = run_plan(closed, plan, state)[:leaves]
        new_params = jax.tree.unflatten(jax.tree.structure(params), new)
        ref_params, _ = jax.jit(step)(*s_ref)
        assert_close(new_params, ref_params, rtol=1e-4, atol=1e-5)
        state, s_ref = (new_params, x, x), (ref_params, x, x)


def test_transformer_block_2d_mesh_matches_single_device():
    rng = np.random.default_rng(0)
    params = init_block(rng, 32, 4)
    x = jnp.asarray(rng.normal(size=(8, 8, 32)).astype(np.float32))
    step = sgd_step(mse(block))
    leaves = len(jax.tree.leaves(params))
    closed, plan = plan_fn(step, (params, x, x), batch=[0] * leaves + [1, 1],
                           aliases=[(i, i) for i in range(leaves)], logical_mesh_shape=(2, 4))
    assert_close(run_plan(closed, plan, (params, x, x)), jax.jit(step)(params, x, x),
                 rtol=1e-4, atol=1e-5)


def test_user_mesh_axis_names_are_kept():
    from jax.sharding import AxisType, Mesh
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"),
                axis_types=(AxisType.Auto,) * 2)
    model, x, y = make_case("mlp")
    state = make_state(model, x)
    parallel = autoshard.parallelize(train_step, method=autoshard.ShardParallel(
        devices=mesh, auto_sharding_option=QUIET))
    parallel(state, (x, y))
    plan = parallel.get_last_executable().plan
    assert plan.axis_names == ("data", "model") and plan.mesh_shape == (2, 4)
    assert all(set(str(s)) for s in plan.in_specs)
    assert P("x") not in plan.in_specs


def test_pipeline_markers_are_identities_for_the_planner():
    rng = np.random.default_rng(3)
    w1 = jnp.asarray(rng.normal(size=(32, 64)).astype(np.float32) / 6)
    w2 = jnp.asarray(rng.normal(size=(64, 32)).astype(np.float32) / 8)
    x = jnp.asarray(rng.normal(size=(16, 32)).astype(np.float32))

    def loss_fn(params, x):
        h = jnp.tanh(x @ params[0])
        autoshard.mark_pipeline_boundary()
        return jnp.mean((h @ params[1]) ** 2)

    def step(params, x):
        loss, grads = autoshard.value_and_grad(loss_fn)(params, x)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    parallel = autoshard.parallelize(step, method=autoshard.ShardParallel(
        auto_sharding_option=QUIET))
    closed = parallel.get_executable((w1, w2), x)
    assert closed.plan.objective is not None
    out = parallel((w1, w2), x)
    assert_close(out, jax.jit(step)((w1, w2), x))
