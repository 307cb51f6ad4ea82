"""Pipelines whose update after the gradient reads the batch (flax's metrics pattern), issue 21
item 4: the update sees the whole batch and the aux logits joined in row order, as jax.jit.

Every test runs with ``blocking=True`` (see test_pipeshard.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pipeline_models import assert_trees_close

import autoshard
from autoshard.pipeline import PipeshardParallel, UniformStageOption

COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")


def _params_batch(seed=0):
    rng = np.random.default_rng(seed)
    params = {"w1": jnp.asarray(rng.normal(size=(16, 32)) * 0.3, jnp.float32),
              "w2": jnp.asarray(rng.normal(size=(32, 4)) * 0.3, jnp.float32)}
    batch = {"x": jnp.asarray(rng.normal(size=(32, 16)), jnp.float32),
             "y": jnp.asarray(rng.normal(size=(32, 4)), jnp.float32)}
    return params, batch


def _method(k):
    return PipeshardParallel(num_micro_batches=k, layer_option="manual",
                             stage_option=UniformStageOption(num_stages=2), blocking=True)


def metrics_step(params, batch):  # repro C of issue 21
    def loss_fn(p):
        h = jnp.tanh(batch["x"] @ p["w1"])
        autoshard.mark_pipeline_boundary()
        logits = h @ p["w2"]
        return jnp.mean((logits - batch["y"]) ** 2), logits
    (loss, logits), g = autoshard.value_and_grad(loss_fn, has_aux=True)(params)
    acc = jnp.mean(jnp.argmax(logits, -1) == jnp.argmax(batch["y"], -1))
    return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), loss, acc


def per_row_step(params, batch):
    """Per-row results after the gradient: wrong rows in the join would show."""
    def loss_fn(p):
        h = jnp.tanh(batch["x"] @ p["w1"])
        autoshard.mark_pipeline_boundary()
        logits = h @ p["w2"]
        return jnp.mean((logits - batch["y"]) ** 2), logits
    (loss, logits), g = autoshard.value_and_grad(loss_fn, has_aux=True)(params)
    hits = jnp.argmax(logits, -1) == jnp.argmax(batch["y"], -1)
    return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), loss, hits, logits - batch["y"]


def row_aux_step(params, batch):
    """Per-row aux (logits, and logits transposed: rows on dim 1) read after the gradient
    without the batch, and returned."""
    def loss_fn(p):
        h = jnp.tanh(batch["x"] @ p["w1"])
        autoshard.mark_pipeline_boundary()
        logits = h @ p["w2"]
        return jnp.mean((logits - batch["y"]) ** 2), (logits, logits.T)
    (loss, (logits, by_class)), g = autoshard.value_and_grad(loss_fn, has_aux=True)(params)
    spread = jnp.mean(jnp.abs(logits - jnp.mean(logits, axis=0)))
    return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), loss, spread, by_class[:, ::3]


def batch_only_step(params, batch):
    """The update reads the batch but no aux; ``batch["w"]`` is read after the gradient only,
    ``decay`` is computed from the parameters before the gradient and read after it."""
    decay = 1e-3 * jnp.sum(params["w1"] ** 2)

    def loss_fn(p):
        h = jnp.tanh(batch["x"] @ p["w1"])
        autoshard.mark_pipeline_boundary()
        return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)
    loss, g = autoshard.value_and_grad(loss_fn)(params)
    scale = jnp.mean(batch["y"]) + jnp.mean(batch["x"][:, 0]) + jnp.sum(batch["w"] * 0.01)
    return jax.tree.map(lambda a, b: a * (scale - decay) - 0.1 * b, params, g), loss, scale


def leaking_step(params, batch):
    """A value computed from the batch before the gradient, read after it (no aux)."""
    rows = jnp.sum(batch["x"], axis=1)

    def loss_fn(p):
        h = jnp.tanh(batch["x"] @ p["w1"])
        autoshard.mark_pipeline_boundary()
        return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)
    loss, g = autoshard.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), loss, jnp.max(rows)


def _run(step, k, num_steps=3, **extra):
    params, batch = _params_batch()
    batch = {**batch, **extra}
    f = autoshard.parallelize(step, method=_method(k))
    ref = jax.jit(step)
    got, want = params, params
    for _ in range(num_steps):
        got_out, want_out = f(got, batch), ref(want, batch)
        assert_trees_close(got_out[1:], want_out[1:], rtol=1e-5)
        got, want = got_out[0], want_out[0]
    assert_trees_close(got, want, rtol=1e-5)
    return f.get_last_executable()


@pytest.mark.parametrize("k", [1, 4])
def test_metrics_from_aux_logits_and_labels_match_jit(k):
    ex = _run(metrics_step, k)
    part = ex.part
    assert list(part.whole_inputs.values()) == [3]  # batch["y"], whole
    if k == 1:
        assert part.joined == {}  # one micro-batch: the accumulated logits are the logits
        return
    # the aux logits: the micro-batches' values joined, not summed, where they were made
    (joined, src), = part.joined.items()
    assert joined.aval.shape == (32, 4) and src.aval.shape == (8, 4)
    assert part.home[joined] == 1 and src not in [v for t in ex.tasks.values()
                                                  for v in t.accumulated]
    readers = [t for t in ex.apply if joined in t.invars]
    assert [t.stage for t in readers] == [1]
    # each device joins its own rows: the join communicates nothing
    (_, _, join, sh), = ex.joins
    assert not any(c in join.as_text() for c in COLLECTIVES)
    # the joined logits stay split over the stage's devices (rows or classes: the planner
    # prices both alike here), never gathered
    assert any(axis is not None for axis in sh.spec)
    assert "imbalance max/mean" in ex.plan.explain()


def test_per_row_results_keep_the_batch_row_order():
    _run(per_row_step, 4)


def test_per_row_aux_without_the_batch_joined_along_its_row_dim():
    ex = _run(row_aux_step, 4)
    assert ex.part.whole_inputs == {}
    assert sorted(w.aval.shape for w in ex.part.joined) == [(4, 32), (32, 4)]
    assert not any(c in join.as_text() for _, _, join, _ in ex.joins for c in COLLECTIVES)


@pytest.mark.parametrize("k", [1, 4])
def test_update_reading_only_the_batch_matches_jit(k):
    ex = _run(batch_only_step, k, w=jnp.arange(32.0))
    # leaves: w1, w2, then the batch's w, x, y: all three read whole by the update
    assert sorted(ex.part.whole_inputs.values()) == [2, 3, 4] and ex.part.joined == {}


@pytest.mark.parametrize("k", [1, 4])
def test_value_from_the_batch_read_after_the_gradient(k):
    # k=1: the value itself; k=4: computed again from the whole batch for the update
    _run(leaking_step, k)


def test_random_value_from_the_batch_read_after_the_gradient_is_an_error():
    def step(params, batch):
        noisy = batch["x"] + 0.1 * jax.random.normal(jax.random.key(0), batch["x"].shape)

        def loss_fn(p):
            h = jnp.tanh(noisy @ p["w1"])
            autoshard.mark_pipeline_boundary()
            return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)
        loss, g = autoshard.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), loss, jnp.max(noisy)
    params, batch = _params_batch()
    f = autoshard.parallelize(step, method=_method(4))
    with pytest.raises(ValueError, match=r"reads a float32\[32,\d+\] value computed from the "
                       r"batch by \w+ at \S*test_after_grad.py:\d+:\d+ \(\S*step\) "
                       r"before the marker(.|\n)*draws random numbers(.|\n)*"
                       r"Return it as the aux of autoshard.value_and_grad"):
        f(params, batch)


def test_plan_prices_the_update_on_the_whole_batch_as_it_runs():
    params, batch = _params_batch()
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (params, batch))
    # the sub-meshes' logical shape given: unset, the runtime runs a 1-D sub-mesh and the
    # pricing lets the stage's first plan choose (see pipeline/price.py)
    method = PipeshardParallel(num_micro_batches=4, layer_option="manual", blocking=True,
                               stage_option=UniformStageOption(num_stages=2,
                                                               submesh_logical_shape=(4,)))
    est = autoshard.plan(metrics_step, *shapes, method=method,
                         cluster=autoshard.Cluster.from_devices(jax.devices()))
    priced = {name: plan for s in est.stages for name, plan in s.plans}
    ex = autoshard.parallelize(metrics_step, method=method).get_executable(params, batch)
    compiled = {t.task.name: t.plan for t in [*ex.tasks.values(), *ex.apply]}
    # the metrics run in the last stage's apply task, on the joined logits and the whole
    # labels, taken in the layouts the runtime gives them: priced as compiled
    assert set(priced) == set(compiled) and "apply1.0" in priced
    assert priced["apply1.0"].in_specs == compiled["apply1.0"].in_specs
    assert priced["apply1.0"].objective.total_s == pytest.approx(
        compiled["apply1.0"].objective.total_s)
    assert "imbalance max/mean" in est.explain()
