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


def adam_step(loss_fn, eps=1e-8):
    tx = optax.adam(1e-2, eps=eps)

    def step(state, batch):
        p, opt = state
        g = autoshard.grad(loss_fn)(p, *batch)
        updates, opt = tx.update(g, opt, p)
        return optax.apply_updates(p, updates), opt

    return step, tx


def _equal_to_jit(step, method, state, batch, num_steps=3):
    """``step`` under ``method`` and under ``jax.jit``, ``num_steps`` times from ``state``:
    the states agree; the pipeline's last executable."""
    f = autoshard.parallelize(step, method=method)
    ref = jax.jit(step)
    got, want = state, state
    for _ in range(num_steps):
        got, want = f(got, batch), ref(want, batch)
    assert_trees_close(got, want)
    return f.get_last_executable()


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
    ex = _equal_to_jit(step, method, state, batch)

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


def _check_once_per_step(ex, grad_bytes, num_reduce):
    """No gradient-sized reduction in any B task; each reduce task's collectives exactly as
    predicted; nothing unpredicted in the pipeline."""
    for (kind, _), t in ex.tasks.items():
        if kind != "B":
            continue
        assert t.batch_axes, t.note
        big = [c for c in _collectives(t.compiled.as_text(), t.mesh)
               if c.kind in REDUCTIONS and c.num_bytes >= grad_bytes]
        assert not big, (t.task.name, big)
    assert len(ex.reduce_tasks) == num_reduce
    for r in ex.reduce_tasks:
        found: dict = {}
        for c in _collectives(r.compiled.as_text(), r.mesh):
            found[(c.kind, c.axes)] = found.get((c.kind, c.axes), 0) + c.num_bytes * c.count
        assert found == r.predicted, (r.task.name, found, r.predicted)
    audit = ex.audit()
    assert audit.unpredicted == ()
    assert audit.bytes_ratio() == pytest.approx(1.0, rel=0.10), audit.explain()


def test_stage_split_over_data_and_model_axes_reduces_gradients_once_per_step():
    """Rows over x0, weights over x1 (tensor parallel), each task planned by the planner: the
    B tasks run per device over x0 and auto over x1, keeping their gradients partial over x0;
    the reduce task all-reduces each over x0 once per step."""
    from jax.sharding import PartitionSpec as P

    step, tx = adam_step(mlp_loss, eps=1e-3)
    params = mlp_params(widths=(8, 64, 64, 64, 4))
    state, batch = (params, tx.init(params)), mlp_batch(batch=16)
    stage = ManualStageOption([[0, 1], [2, 3]], [(1, 4), (1, 4)], [(2, 2), (2, 2)], [{}, {}])
    inputs = [
        [P("x0"), P(None, "x1"), P("x1", None)],
        [P("x0"), P(None, "x1"), P("x1", None), P("x0")],
    ]
    f = autoshard.parallelize(step, method=PipeshardParallel(
        num_micro_batches=4, layer_option="manual", stage_option=stage, blocking=True,
        stage_input_shardings=inputs))
    ref = jax.jit(step)
    got, want = state, state
    for _ in range(3):
        got, want = f(got, batch), ref(want, batch)
    assert_trees_close(got, want)
    ex = f.get_last_executable()
    for s in (0, 1):
        b = ex.tasks[("B", s)]
        assert b.batch_axes == ("x0",) and b.plan is not None, b.note
        # its plan keeps the model axis's collectives and none over the batch axis
        assert all("x0" not in c.axes for c in b.plan.collectives)
    # weights over x1 only: no B task holds a 64 x 32 gradient shard reduced over anything
    _check_once_per_step(ex, 64 * 32 * 4, num_reduce=2)
    for r in ex.reduce_tasks:
        assert set(r.predicted) == {("all-reduce", ("x0",))}
    assert "B1: runs per device over the batch axes ('x0',)" in ex.plan.explain()


def test_tied_embedding_gpt_reduces_gradients_once_per_step():
    """The embedding's backward is a scatter-add of batch-split updates: a partial sum over
    the batch, so B0 runs per device too (no gather, no per-micro-batch reduction)."""
    from flax.training.train_state import TrainState
    from pipeline_models import GPT, gpt_lm_step

    model = GPT(layers=1)
    tokens = jax.numpy.asarray(np.random.default_rng(0).integers(0, 32, size=(16, 9)), "int32")
    params = model.init(jax.random.key(0), tokens[:, :-1])
    tx = optax.adam(1e-2, eps=1e-3)
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    step = gpt_lm_step

    f = autoshard.parallelize(step, method=PipeshardParallel(
        num_micro_batches=2, layer_option="manual", blocking=True,
        stage_option=ManualStageOption([[0], [1]], [(1, 4), (1, 4)], [(4,), (4,)], [{}, {}])))
    ref = jax.jit(step)
    got, want = state, state
    for _ in range(3):
        got, want = f(got, tokens), ref(want, tokens)
    assert_trees_close(got.params, want.params)
    ex = f.get_last_executable()
    assert "reduced per micro-batch" not in ex.plan.explain()
    _check_once_per_step(ex, 32 * 16 * 4, num_reduce=2)


def test_sub_meshes_of_other_sizes_reduce_gradients_once_per_step():
    """Stages on 4 and 2 devices: no layout carries over device for device between them, so
    the cotangent reaching B0 arrives unknown. It is moved into the layout B0's plan takes it
    in, and B0 still runs per device over its batch axis (it reduced its gradients per
    micro-batch before, and the stage search priced such stages so); the priced plan says
    the same, and the numerics equal jax.jit over three Adam steps."""
    step, tx = adam_step(mlp_loss, eps=1e-3)
    params = mlp_params()
    state, batch = (params, tx.init(params)), mlp_batch()
    method = PipeshardParallel(
        devices=jax.devices()[:6], num_micro_batches=4, layer_option="manual", blocking=True,
        stage_option=ManualStageOption([[0, 1], [2, 3]], [(1, 4), (1, 2)], [(4,), (2,)],
                                       [{}, {}]))
    ex = _equal_to_jit(step, method, state, batch)
    assert [ex.tasks[("B", s)].batch_axes for s in (0, 1)] == [("x",), ("x",)], [
        ex.tasks[("B", s)].note for s in (0, 1)]
    _check_once_per_step(ex, min(int(np.prod(w.shape)) * 4 for w in params.values()),
                         num_reduce=2)
    est = autoshard.plan(step, *state_and_batch_shapes(state, batch),
                         cluster=autoshard.Cluster.from_devices(jax.devices()[:6]),
                         method=method)
    assert all(s.reduce_bytes > 0 for s in est.stages), est.explain()
    assert "reduced per micro-batch" not in est.explain()


def state_and_batch_shapes(state, batch):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (state, batch))


def test_the_stage_search_prices_a_stage_backward_as_the_pipeline_runs_it(monkeypatch):
    """A candidate stage of the stage DP (``_Pricer.plan_stage_on``) is priced as the runtime
    runs it: its backward per device over the batch axis, its gradients reduced once per
    step. The DP charged that all-reduce once per micro-batch, and ranked AutoParallel's
    stage counts from it (a 1T layer on 48 GPUs rated 2.8x slower than priced in full)."""
    from autoshard.pipeline import method as method_module
    from autoshard.pipeline import price
    from autoshard.pipeline.build import cut_program
    from autoshard.pipeline.placement import shape_cluster
    from autoshard.pipeline.reduce import reduce_seconds
    from autoshard.pipeline.tasks import task_costs
    from models import marked_mlp_args, marked_mlp_step

    # priced only, never run: many rows per weight, so each stage is data parallel
    params, batch = marked_mlp_args((64, 256, 256, 256, 64), rows=65536)
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (params, batch))
    cluster = autoshard.Cluster.a100_80gb(num_hosts=2, devices_per_host=4)
    method = PipeshardParallel(
        num_micro_batches=8, layer_option="manual",
        default_auto_sharding_option=autoshard.AutoShardingOption(show_progress=False),
        stage_option=ManualStageOption([[0, 1], [2, 3]], [(1, 4), (1, 4)], [(4,), (4,)],
                                       [{}, {}]))
    seen = {}
    real = method_module.price_pipeline

    def capture(m, program, cl, **kw):
        seen["program"] = program
        return real(m, program, cl, **kw)
    monkeypatch.setattr(method_module, "price_pipeline", capture)
    est = autoshard.plan(marked_mlp_step, *shapes, cluster=cluster, method=method)
    assert est.stages[0].reduce_s > 0, est.explain()  # the runtime reduces once per step

    program = seen["program"]
    pricer = price._Pricer(method, program, cut_program(program, method), cluster)
    part, s = pricer.cut.span(2, 4, program.batch_invars, False)
    sub = shape_cluster(cluster, (1, 4))
    alone = pricer.plan_stage_on(part, s, sub, {}, (4,))
    # the backward as planned alone reduces its two weight gradients over x per micro-batch
    f = pricer.plan_task(part, part.forward[s], sub, (4,), {})
    b = pricer.plan_task(part, part.backward[s], sub, (4,), {}, axis_names=f.axis_names)
    per_mb = [c for c in b.collectives if c.kind in REDUCTIONS and "x" in c.axes]
    assert per_mb, b.collectives
    assert alone.times["B"] == pytest.approx(
        b.objective.total_s - sum(c.cost_s for c in per_mb), rel=1e-9)
    # ... and the stage pays one all-reduce of those gradients per step instead
    n = len(b.inputs) - 2
    costs = task_costs((4,), pricer.option((4,), {}), sub)
    once = reduce_seconds(costs, ("x",), [(leaf.bytes_per_device({"x": 1}), ("x",))
                                          for leaf in b.inputs[n:]])
    assert alone.times["apply"] == pytest.approx(once, rel=1e-9) and once > 0


def test_identical_stages_check_their_per_device_backward_once(monkeypatch):
    """Whether a backward run per device communicates is read off its trace; stages of
    identical layers in the same layouts share that check (the walk's cache), as they share
    their plans: Table 1's 1T row prices 33-stage pipelines, and tracing every stage's check
    was a tenth of its planning. The priced pipeline is the same either way."""
    from autoshard.pipeline import per_device as module
    step, tx = adam_step(mlp_loss)
    params = mlp_params(widths=(8, 16, 16, 16, 16, 16, 4))
    state = (params, tx.init(params))
    method = PipeshardParallel(
        num_micro_batches=4, layer_option="manual", pipeline_schedule="1f1b",
        stage_option=ManualStageOption([[0, 1], [2], [3], [4, 5]], [(1, 2)] * 4, [(2,)] * 4,
                                       [{}] * 4))
    cluster = autoshard.Cluster.a100_80gb(num_hosts=1, devices_per_host=8)
    traced = []
    real = module.all_eqns
    monkeypatch.setattr(module, "all_eqns", lambda jaxpr: traced.append(1) or real(jaxpr))
    est = autoshard.plan(step, state, mlp_batch(), method=method, cluster=cluster)
    per_device = [n for n in est.notes if n.startswith("B") and "runs per device" in n]
    assert len(per_device) == 4, est.notes     # every stage's backward runs per device
    assert len(traced) == 3                    # stages 1 and 2: the same layer, layouts
    monkeypatch.setattr(module, "once", lambda cache, key, compute: compute())
    traced.clear()
    again = autoshard.plan(step, state, mlp_batch(), method=method, cluster=cluster)
    assert len(traced) == 4 and again.step_s == est.step_s
