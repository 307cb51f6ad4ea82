"""Gradient accumulation: k micro-batches give the same step as one full batch."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import autoshard
import hlo
from autoshard.sharding import hlo as sharding_hlo
from models import assert_trees_close, copy_tree, make_case, make_state, train_step

METHODS = {
    "data": autoshard.DataParallel, "zero2": autoshard.Zero2Parallel,
    "zero3": autoshard.Zero3Parallel,
    "manual": lambda num_micro_batches: autoshard.ShardParallel(
        num_micro_batches=num_micro_batches,
        manual_sharding_option=autoshard.ManualShardingOption(
            ("d",), in_axis_resources=(None, P("d")))),
    "auto": lambda num_micro_batches: autoshard.ShardParallel(
        num_micro_batches=num_micro_batches,
        auto_sharding_option=autoshard.AutoShardingOption(show_progress=False))}


@pytest.mark.parametrize("method", ["data", "zero2", "manual", "auto"])
@pytest.mark.parametrize("k", [2, 4])
def test_accumulation_equals_full_batch(method, k):
    model, x, y = make_case("mlp", batch=32)
    state = make_state(model, x)
    f1 = autoshard.parallelize(train_step, method=METHODS[method](num_micro_batches=1))
    fk = autoshard.parallelize(train_step, method=METHODS[method](num_micro_batches=k))
    s1, sk = copy_tree(state), copy_tree(state)
    for _ in range(3):
        s1, l1 = f1(s1, (x, y))
        sk, lk = fk(sk, (x, y))
        np.testing.assert_allclose(lk, l1, rtol=1e-5)
    assert_trees_close(sk.params, s1.params, rtol=1e-4)
    hlo_text = fk.get_last_executable().get_hlo_text()
    assert "while" in hlo_text  # the micro-batch loop is one scan, not k copies


@pytest.mark.parametrize("method", ["data", "zero2", "zero3", "manual", "auto"])
def test_each_device_uses_its_own_rows_and_gradients_are_reduced_once(method):
    batch, k, n = 64, 2, 8
    model, x, y = make_case("mlp", batch=batch)
    state = make_state(model, x)
    make = METHODS[method] if method != "auto" else (
        lambda num_micro_batches: autoshard.ShardParallel(
            num_micro_batches=num_micro_batches, auto_sharding_option=autoshard.
            AutoShardingOption(show_progress=False, force_batch_dim_to_mesh_dim=0)))
    f = autoshard.parallelize(train_step, method=make(num_micro_batches=k))
    ex = f.get_executable(state, (x, y))
    split = ex.get_input_placement_specs()[1][0].spec
    text = ex.get_hlo_text()
    loops = hlo.loop_computations(text)
    assert loops, "no micro-batch loop"
    inside = [(c.kind, c.shape) for c in hlo.collectives(text) if c.in_loop]
    assert len(split) and split[0] is not None, split
    parts = n if method != "auto" else math.prod(
        ex.mesh.shape[a] for a in ((split[0],) if isinstance(split[0], str) else split[0]))
    if method != "auto":
        # No gather of the batch and no gradient reduction inside the loop body ...
        assert inside == [], inside
    else:
        # The planner may split a layer over the other mesh axis (its activations are then
        # reduced inside the loop, as it predicted), but nothing inside the loop runs over the
        # batch axes: no gather of the batch, no per-micro-batch gradient reduction.
        batch_axes = {split[0]} if isinstance(split[0], str) else set(split[0])
        found = sharding_hlo.collectives(text, ex.mesh.axis_names, ex.mesh.devices.shape)
        for c in found:
            if c.in_loop:
                assert c.axes is not None and not batch_axes & set(c.axes), c
        assert ex.audit().divergences() == (), ex.audit().explain()
    # ... a micro-batch's first dot has B / (k * n) rows per device ...
    dots, rows = hlo.dot_shapes(text, loops), batch // (k * parts)
    if method != "auto":
        assert f"f32[{rows},64]" in dots, dots
    else:   # the hidden layer may be split too
        assert any(d.startswith(f"f32[{rows},") for d in dots), dots
        assert not any(d.startswith(f"f32[{batch // k},") for d in dots), dots
    # ... and the gradients are reduced once, after the loop.
    outside = [c.kind for c in hlo.collectives(text) if not c.in_loop]
    assert outside.count("all-reduce") + outside.count("reduce-scatter") >= 1


def test_low_precision_gradients_accumulate_in_float32(tmp_path):
    w = jnp.ones((16, 8), jnp.bfloat16) / 7

    def step(w, x):
        g = autoshard.grad(lambda w: jnp.mean((x @ w).astype(jnp.float32) ** 2))(w)
        return w - 0.1 * g
    x = jnp.asarray(np.random.default_rng(0).normal(size=(64, 16)), jnp.bfloat16)
    f = autoshard.parallelize(step, method=autoshard.DataParallel(num_micro_batches=4))
    f.get_executable(w, x).dump_debug_info(tmp_path)  # before XLA's CPU upcasts bf16
    text = (tmp_path / "before_partitioning.hlo").read_text()
    carried = re.findall(r"= (\(.*?\)) while\(", text)
    # The weights ride along as bf16[16,8]; the gradient accumulator is f32[16,8].
    assert carried and "f32[16,8]" in carried[0], carried
    ref = jax.jit(step)(w.astype(jnp.float32), x.astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(f(w, x), np.float32), ref, rtol=2e-2)


def test_declared_reductions_mean_sum_and_aux_not_divided():
    def step(w, x):
        def loss(w):
            err = x @ w
            return jnp.mean(err ** 2), {"rows": jnp.float32(x.shape[0]), "total": err.sum()}
        (loss_v, aux), g = autoshard.value_and_grad(loss, has_aux=True)(w)
        g_sum = autoshard.mark_gradient(jnp.sum(x, axis=0), reduction="sum")
        return w - 0.1 * g, loss_v, aux, g_sum

    w = jnp.ones((4, 2)) / 3
    x = jnp.asarray(np.random.default_rng(1).normal(size=(32, 4)), jnp.float32)
    with pytest.raises(ValueError, match="gradient markers"):
        autoshard.parallelize(step, method=autoshard.DataParallel(num_micro_batches=4))(w, x)

    def step(w, x):  # noqa: F811  one marker: reductions declared per value
        def loss(w):
            err = x @ w
            return jnp.mean(err ** 2), {"rows": jnp.float32(x.shape[0]), "total": err.sum()}
        (loss_v, aux), g = autoshard.value_and_grad(loss, has_aux=True)(w)
        return w - 0.1 * g, loss_v, aux

    ref_w, ref_l, ref_aux = jax.jit(step)(w, x)
    f = autoshard.parallelize(step, method=autoshard.DataParallel(num_micro_batches=4))
    new_w, loss_v, aux = f(w, x)
    np.testing.assert_allclose(new_w, ref_w, rtol=1e-5)
    np.testing.assert_allclose(loss_v, ref_l, rtol=1e-5)  # the loss is a mean: divided
    assert float(aux["rows"]) == 32.0  # aux is summed: 4 micro-batches of 8 rows
    np.testing.assert_allclose(aux["total"], ref_aux["total"], rtol=1e-4)
    g = autoshard.parallelize(
        lambda w, x: autoshard.grad(lambda w: jnp.sum(x @ w), reduction="sum")(w),
        method=autoshard.DataParallel(num_micro_batches=4))
    np.testing.assert_allclose(g(w, x), jax.grad(lambda w: jnp.sum(x @ w))(w), rtol=1e-5)
    with pytest.raises(ValueError, match="reduction .*'max'.* must be one of"):
        autoshard.grad(lambda w: jnp.sum(w), reduction="max")(w)


@pytest.mark.parametrize("key_kind", ["typed", "raw", "inside"])
def test_micro_batches_draw_different_random_numbers(key_kind):
    k, batch, dim = 4, 32, 16

    def step(w, x, key):
        if key_kind == "inside":
            key = jax.random.key(7)
        def loss(w):
            mask = jax.random.bernoulli(key, 0.5, x.shape).astype(jnp.float32)
            return jnp.sum(mask * x * w), mask
        _, mask = autoshard.grad(loss, has_aux=True)(w)
        return mask
    key = jax.random.PRNGKey(3) if key_kind == "raw" else jax.random.key(3)
    f = autoshard.parallelize(step, method=autoshard.DataParallel(num_micro_batches=k))
    summed = np.asarray(f(jnp.ones(dim), jnp.ones((batch, dim)), key))
    assert summed.shape == (batch // k, dim)
    # The same mask in every micro-batch would make every entry 0 or k.
    assert set(np.unique(summed)) - {0.0, float(k)}, np.unique(summed)


def test_peak_memory_falls_with_micro_batches():
    model, x, y = make_case("mlp", batch=512)
    state = make_state(model, x)
    temp = {}
    for k in (1, 8):
        f = autoshard.parallelize(train_step, method=autoshard.DataParallel(num_micro_batches=k))
        temp[k] = f.get_executable(state, (x, y)).compiled.memory_analysis().temp_size_in_bytes
    assert temp[8] < temp[1], temp


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


def test_unmarked_batch_value_after_marker_is_computed_on_the_whole_batch():
    def step(w, x):
        pred = x @ w
        g = autoshard.grad(lambda w: jnp.sum((x @ w) ** 2), reduction="sum")(w)
        return w - g, pred.sum()
    f = autoshard.parallelize(step, method=autoshard.DataParallel(num_micro_batches=2))
    w, x = jnp.ones((4, 2)), jnp.arange(64.0).reshape(16, 4) / 64
    for got, want in zip(f(w, x), jax.jit(step)(w, x), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5)


def test_transformer_accumulation():
    model, x, y = make_case("transformer", batch=16)
    state = make_state(model, x)
    ref, ref_loss = jax.jit(train_step)(copy_tree(state), (x, y))
    f = autoshard.parallelize(train_step, method=autoshard.DataParallel(num_micro_batches=2))
    new, loss = f(state, (x, y))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_trees_close(new.params, ref.params)


def test_operations_without_a_per_row_rule_are_named_and_still_correct():
    def step(w, x):
        g = autoshard.grad(lambda w: jnp.mean(jnp.sort(x @ w, axis=0)[-1] ** 2))(w)
        return w - 0.1 * g
    w, x = jnp.ones((4, 2)) / 3, jnp.asarray(np.random.default_rng(2).normal(size=(32, 4)),
                                             jnp.float32)
    f = autoshard.parallelize(step, method=autoshard.DataParallel(num_micro_batches=2))
    with pytest.warns(RuntimeWarning, match="gathers a micro-batch's rows .* for .*sort"):
        out = f(w, x)
    ref = (w - 0.1 * (jax.grad(lambda w: jnp.mean(jnp.sort(x[0::2] @ w, axis=0)[-1] ** 2))(w)
                      + jax.grad(lambda w: jnp.mean(jnp.sort(x[1::2] @ w, axis=0)[-1] ** 2))(w))
           / 2)
    np.testing.assert_allclose(out, ref, rtol=1e-5)
