"""A user's with_sharding_constraint inside the step is kept by the automatic planner."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import autoshard


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def _auto(devices):
    return autoshard.ShardParallel(devices=devices, auto_sharding_option=autoshard.
                                   AutoShardingOption(show_progress=False))


@pytest.mark.parametrize("spec", [P(None, "d"), P("d")])
def test_user_constraint_becomes_the_plan(spec):
    mesh = _mesh((8,), ("d",))

    def step(w, x):
        h = jax.lax.with_sharding_constraint(x @ w, NamedSharding(mesh, spec))
        return jnp.tanh(h)

    w, x = jnp.ones((32, 64)) / 8, jnp.ones((64, 32))
    f = autoshard.parallelize(step, method=_auto(mesh))
    np.testing.assert_allclose(f(w, x), jax.jit(step)(w, x), rtol=1e-6)
    plan = f.get_last_executable().plan
    assert plan.out_specs[0] == spec
    assert (spec in {s for _, s in plan.intermediates}) or plan.out_specs[0] == spec


def test_constraint_on_another_mesh_is_noted_not_applied():
    other = _mesh((2, 4), ("a", "b"))

    def step(w, x):
        return jax.lax.with_sharding_constraint(x @ w, NamedSharding(other, P("a", "b")))

    w, x = jnp.ones((32, 64)) / 8, jnp.ones((64, 32))
    f = autoshard.parallelize(step, method=_auto(_mesh((8,), ("d",))))
    np.testing.assert_allclose(f(w, x), jax.jit(step)(w, x), rtol=1e-6)
    notes = " ".join(f.get_last_executable().plan.notes)
    assert "sharding constraints on another mesh" in notes


@pytest.mark.parametrize("kind", ["transformer", "cnn"])
def test_force_data_parallel_compiles_to_data_parallels_collectives(kind):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent))
    from autoshard.sharding import hlo
    from models import make_case, make_state, train_step

    model, x, y = make_case(kind, batch=32)
    state = make_state(model, x)
    found = {}
    for name, method in (("force", autoshard.ShardParallel(
            auto_sharding_option=autoshard.AutoShardingOption(
                show_progress=False, force_data_parallel=True))),
            ("dp", autoshard.DataParallel())):
        ex = autoshard.parallelize(train_step, method=method).get_executable(state, (x, y))
        cs = hlo.collectives(ex.get_hlo_text(), ex.plan.axis_names, ex.plan.mesh_shape)
        found[name] = sorted((c.kind, c.num_bytes * c.count) for c in cs)
        assert {c.kind for c in cs} == {"all-reduce"}
    assert sum(b for _, b in found["force"]) == sum(b for _, b in found["dp"])
