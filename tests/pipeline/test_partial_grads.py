"""Gradient accumulation in the pipeline: each backward task keeps its weight gradients as
per-device partial sums over the stage's batch axes (no all-reduce per micro-batch); one
reduction per gradient per step runs in the stage's reduce task before the apply tasks.

Every test runs with ``blocking=True`` (see test_pipeshard.py).
"""

import jax
import numpy as np
import optax
import pytest
from pipeline_models import assert_trees_close, mlp_batch, mlp_loss, mlp_params

import autoshard
from autoshard.pipeline import ManualStageOption, PipeshardParallel
from autoshard.sharding import hlo

REDUCTIONS = ("all-reduce", "reduce-scatter")


def adam_step(loss_fn):
    tx = optax.adam(1e-2)

    def step(state, batch):
        p, opt = state
        g = autoshard.grad(loss_fn)(p, *batch)
        updates, opt = tx.update(g, opt, p)
        return optax.apply_updates(p, updates), opt

    return step, tx


def _collectives(text, mesh):
    return hlo.collectives(text, tuple(mesh.axis_names), tuple(mesh.devices.shape))


@pytest.mark.parametrize("shape", [(2, 2), (4,)])
def test_backward_tasks_keep_gradients_partial_and_reduce_once_per_step(shape):
    step, tx = adam_step(mlp_loss)
    params = mlp_params()
    state = (params, tx.init(params))
    batch = mlp_batch()
    method = PipeshardParallel(
        num_micro_batches=4,
        layer_option="manual",
        stage_option=ManualStageOption([[0, 1], [2, 3]], [shape, shape], [shape, shape], [{}, {}]),
        pipeline_schedule="1f1b",
        blocking=True,
    )
    f = autoshard.parallelize(step, method=method)
    ref = jax.jit(step)
    got, want = state, state
    for _ in range(3):
        got, want = f(got, batch), ref(want, batch)
    assert_trees_close(got, want)

    ex = f.get_last_executable()
    grad_bytes = min(int(np.prod(w.shape)) * 4 for w in params.values())
    backward = [t for (kind, _), t in ex.tasks.items() if kind == "B"]
    assert len(backward) == 2
    for t in backward:
        assert t.batch_axes, t.note  # the rows arrive split over the batch axes
        big = [
            c
            for c in _collectives(t.compiled.as_text(), t.mesh)
            if c.kind in REDUCTIONS and c.num_bytes >= grad_bytes
        ]
        assert not big, (t.task.name, big)
    # each stage reduces its two weight gradients once per step, in its reduce task, over the
    # batch axes (XLA may combine them into one tuple all-reduce: one per leaf group)
    assert len(ex.reduce_tasks) == 2
    for r in ex.reduce_tasks:
        found = _collectives(r.compiled.as_text(), r.mesh)
        assert found and all(c.kind in REDUCTIONS and c.count == 1 for c in found), found
        assert sum(c.shape.count("f32[") for c in found) == 2, found
        assert {c.axes for c in found} == {tuple(r.mesh.axis_names)}
    audit = ex.audit()
    assert audit.unpredicted == ()
    reduces = [t for t in audit.tasks if t.name.startswith("reduce")]
    assert [t.runs for t in reduces] == [1, 1]
    for t in reduces:  # the reduce task predicts its reductions exactly
        assert t.audit.has_prediction
        assert t.audit.predicted_bytes == t.audit.compiled_bytes > 0
    assert audit.within(0.10)


def test_stage_that_also_splits_over_a_model_axis_keeps_its_planned_backward():
    """Rows over x0, weights over x1 (tensor parallel): the planner keeps the B tasks' model
    layouts, so their gradients are reduced per micro-batch, and the plan says so."""
    from jax.sharding import PartitionSpec as P
    from pipeline_models import sgd_step

    stage = ManualStageOption([[0, 1], [2, 3]], [(1, 4), (1, 4)], [(2, 2), (2, 2)], [{}, {}])
    inputs = [
        [P("x0"), P(None, "x1"), P("x1", None)],
        [P("x0"), P(None, "x1"), P("x1", None), P("x0")],
    ]
    f = autoshard.parallelize(
        sgd_step(mlp_loss),
        method=PipeshardParallel(
            num_micro_batches=2,
            layer_option="manual",
            stage_option=stage,
            blocking=True,
            stage_input_shardings=inputs,
        ),
    )
    params, batch = mlp_params(widths=(8, 64, 64, 64, 4)), mlp_batch(batch=16)
    got = f(params, batch)
    assert_trees_close(got, jax.jit(sgd_step(mlp_loss))(params, batch))
    ex = f.get_last_executable()
    for s in (0, 1):
        b = ex.tasks[("B", s)]
        assert not b.batch_axes and b.plan is not None
        assert "reduced per micro-batch" in b.note and "['x1']" in b.note
    assert ex.reduce_tasks == []
    assert "B1: accumulated values reduced per micro-batch" in ex.plan.explain()
