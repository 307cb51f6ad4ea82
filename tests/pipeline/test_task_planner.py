"""One planning call for a pipeline task (``pipeline.tasks.plan_task``), made by the runtime and
by the pricing alike (issue 23): pinned inputs first, one fallback rule, the sub-mesh's costs."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from autoshard.pipeline import tasks
from autoshard.sharding import AutoShardingOption

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
