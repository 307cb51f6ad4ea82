"""One planning call for a pipeline task (``pipeline.tasks.plan_task``) and one walk over a
step's tasks (``plan_tasks``), made by the runtime and by the pricing alike (issue 23): pinned
inputs first, one fallback rule, the sub-mesh's costs, identical plans for every schedule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import autoshard
from autoshard.pipeline import tasks
from autoshard.sharding import AutoShardingOption
from models import assert_priced_plans_are_compiled, marked_mlp_args, marked_mlp_step

OPTION = AutoShardingOption(logical_mesh_shape=(4,), show_progress=False)


def task():
    return jax.make_jaxpr(lambda w, x: jnp.tanh(x @ w))(jnp.ones((16, 16)), jnp.ones((8, 16)))


def plan(fixed, notes, **kw):
    return tasks.plan_task(task(), "F0", num_devices=4, option=OPTION, batch=[False, True],
                           aliases=[], fixed=fixed, axis_names=("x",), notes=notes, **kw)


def test_pinned_inputs_are_planned_around():
    notes = []
    got = plan([P(None, "x"), P("x")], notes)
    assert got.in_specs[0] == P(None, "x") and got.in_specs[1] == P("x")
    assert notes == []


@pytest.mark.parametrize("message", [
    "No plan fits memory_budget_per_device (1,000 B): ...", "fixed_in_specs contradict ..."])
def test_a_pinned_plan_that_fails_falls_back_to_an_unpinned_one(monkeypatch, message):
    real, calls = tasks.plan_auto, []

    def failing_when_pinned(closed, **kw):
        calls.append(kw["fixed_in_specs"])
        if kw["fixed_in_specs"] is not None:
            raise ValueError(message)
        return real(closed, **kw)
    monkeypatch.setattr(tasks, "plan_auto", failing_when_pinned)
    notes = []
    got = plan([P(None, "x"), None], notes)
    assert calls == [[P(None, "x"), None], None] and got.in_specs is not None
    assert notes == [f"F0: planned without its producers' layouts ({message}); its inputs "
                     "are resharded inside the task"]


def test_an_unpinned_failure_reaches_the_caller(monkeypatch):
    def never(closed, **kw):
        raise ValueError("No plan fits memory_budget_per_device (1,000 B)")
    monkeypatch.setattr(tasks, "plan_auto", never)
    with pytest.raises(ValueError, match="No plan fits memory_budget_per_device"):
        plan([P(None, "x"), None], [])


def test_a_sub_mesh_is_costed_as_its_devices():
    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
    cluster = tasks.mesh_cluster(mesh)
    assert cluster.num_devices == 4 and cluster.devices_per_host == 4


# The runtime and the pricing plan every task alike ---------------------------------------------
@pytest.mark.parametrize("schedule, budget", [
    ("gpipe", None), ("1f1b", None), ("zero_bubble", None), ("interleaved_1f1b", None),
    ("1f1b", 9_000)])
def test_pricing_and_the_runtime_plan_every_task_alike(schedule, budget):
    """``autoshard.plan`` on the devices at hand prices the task plans the runtime compiles:
    the same tasks, each with the same input and output layouts and the same objective, for
    every schedule (interleaved: 4 model stages on 2 sub-meshes) and under a memory budget."""
    interleaved = schedule == "interleaved_1f1b"
    method = autoshard.PipeshardParallel(
        num_micro_batches=2, layer_option="manual", pipeline_schedule=schedule,
        stage_option=autoshard.UniformStageOption(num_stages=4 if interleaved else 2,
                                                  submesh_logical_shape=(2, 2)),
        default_auto_sharding_option=AutoShardingOption(
            show_progress=False, memory_budget_per_device=budget),
        **({"virtual_stages": 2} if interleaved else {}))
    params, batch = marked_mlp_args((8, 32, 32, 32, 4))
    run = autoshard.parallelize(marked_mlp_step, method=method)
    new = run(params, batch)
    ran = run.get_last_executable().task_plans
    want = jax.jit(marked_mlp_step)(params, batch)
    for k in params:
        np.testing.assert_allclose(new[k], want[k], rtol=1e-5, atol=1e-6)
    est = autoshard.plan(marked_mlp_step, params, batch, method=method,
                         cluster=autoshard.Cluster.from_devices(jax.devices()))
    stages = range(4 if interleaved else 2)
    backward = ("Ba", "Bw") if schedule == "zero_bubble" else ("B",)
    assert {f"{k}{s}" for s in stages for k in ("F", *backward)} < set(ran)
    assert any(name.startswith("apply") for name in ran)
    assert_priced_plans_are_compiled(est.stages, ran)
    if budget is not None:
        for name, plan in ran.items():
            assert plan.objective.peak_bytes_per_device <= budget, name
