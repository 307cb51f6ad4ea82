"""Gradient accumulation: k micro-batches give the same step as one full batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
from models import assert_trees_close, copy_tree, make_case, make_state, train_step


@pytest.mark.parametrize("method", ["data", "zero2", "manual", "auto"])
@pytest.mark.parametrize("k", [2, 4])
def test_accumulation_equals_full_batch(method, k):
    model, x, y = make_case("mlp", batch=32)
    state = make_state(model, x)
    make = {"data": autoshard.DataParallel, "zero2": autoshard.Zero2Parallel,
            "manual": lambda num_micro_batches: autoshard.ShardParallel(
                num_micro_batches=num_micro_batches,
                manual_sharding_option=autoshard.ManualShardingOption(("d",))),
            "auto": lambda num_micro_batches: autoshard.ShardParallel(
                num_micro_batches=num_micro_batches,
                auto_sharding_option=autoshard.AutoShardingOption(show_progress=False))}[method]
    f1 = autoshard.parallelize(train_step, method=make(num_micro_batches=1))
    fk = autoshard.parallelize(train_step, method=make(num_micro_batches=k))
    s1, sk = copy_tree(state), copy_tree(state)
    for _ in range(2):
        s1, l1 = f1(s1, (x, y))
        sk, lk = fk(sk, (x, y))
        np.testing.assert_allclose(lk, l1, rtol=1e-5)
    assert_trees_close(sk.params, s1.params, rtol=1e-4)
    hlo = fk.get_last_executable().get_hlo_text()
    assert "while" in hlo  # the micro-batch loop is one scan, not k copies


def test_batch_independent_work_is_hoisted_out_of_the_loop():
    def step(w, x):
        big = jnp.tile(w, (1, 3))  # does not depend on the batch: runs once
        g = autoshard.grad(lambda v: jnp.mean((x @ v @ big) ** 2))(w)
        return w - 0.01 * g
    f = autoshard.parallelize(step, method=autoshard.DataParallel(num_micro_batches=2))
    w, x = jnp.ones((4, 4)) / 10, jnp.ones((16, 4))
    ref = step(w, x)
    np.testing.assert_allclose(f(jnp.array(w), x), ref, rtol=1e-5)
    closed = f.get_last_executable().program.full_jaxpr()
    scan = next(e for e in closed.jaxpr.eqns if e.primitive.name == "scan")
    body_prims = {e.primitive.name for e in scan.params["jaxpr"].jaxpr.eqns}
    assert "tile" not in body_prims and "concatenate" not in body_prims


def test_missing_gradient_marker_is_an_error():
    def step(w, x):
        g = jax.grad(lambda w: jnp.sum(x @ w))(w)
        return w - g
    f = autoshard.parallelize(step, method=autoshard.DataParallel(num_micro_batches=2))
    with pytest.raises(ValueError, match="needs a gradient marker .* autoshard.grad"):
        f(jnp.ones((4, 2)), jnp.ones((16, 4)))


def test_unmarked_batch_value_after_marker_is_an_error():
    def step(w, x):
        pred = x @ w
        g = autoshard.grad(lambda w: jnp.sum((x @ w) ** 2))(w)
        return w - g, pred.sum()
    f = autoshard.parallelize(step, method=autoshard.DataParallel(num_micro_batches=2))
    with pytest.raises(ValueError, match="used after it without passing through the marker"):
        f(jnp.ones((4, 2)), jnp.ones((16, 4)))


def test_transformer_accumulation():
    model, x, y = make_case("transformer", batch=16)
    state = make_state(model, x)
    ref, ref_loss = jax.jit(train_step)(copy_tree(state), (x, y))
    f = autoshard.parallelize(train_step, method=autoshard.DataParallel(num_micro_batches=2))
    new, loss = f(state, (x, y))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_trees_close(new.params, ref.params)
