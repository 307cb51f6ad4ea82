"""The mesh search goes on past a mesh with no plan (issue 26, item 1): one infeasible or
unsolved mesh is skipped and reported in explain(), not the end of the search."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from _models import mlp, mse, sgd_step
from _util import plan_fn

from autoshard.sharding import planner

STEP = sgd_step(mse(mlp))
ARGS = ((jnp.ones((64, 256)), jnp.ones((256, 64))), jnp.ones((16, 64)), jnp.ones((16, 64)))


def plan(**opt):
    return plan_fn(STEP, ARGS, batch=[0, 0, 1, 1], aliases=[(0, 0), (1, 1)], **opt)[1]


@pytest.mark.parametrize("error", [
    RuntimeError("HiGHS found no plan within solver_time_limit_s (600.0) under "
                 "memory_budget_per_device (1000); raise solver_node_limit or "
                 "solver_time_limit_s."),
    ValueError("The sharding ILP is infeasible: no plan fits memory_budget_per_device"),
], ids=["unsolved", "infeasible"])
def test_a_mesh_without_a_plan_is_skipped_and_reported(monkeypatch, error):
    free = plan()
    assert free.mesh_shape == (8,), free.mesh_shape   # the 1-D mesh wins when it can run
    real = planner.solve_ilp

    def failing_on_1d(ilp, **kw):
        if ilp.prob.ctx.mesh_shape == (8,):
            raise error
        return real(ilp, **kw)
    monkeypatch.setattr(planner, "solve_ilp", failing_on_1d)
    got = plan()
    assert got.mesh_shape in ((2, 4), (4, 2))
    pruned = dict(got.objective.meshes_pruned)
    assert pruned[(8,)] == "no plan: " + str(error).split(";")[0]
    assert "no plan: " in got.explain() and str(error).split(";")[0][:40] in got.explain()


def test_no_mesh_with_a_plan_is_still_an_error(monkeypatch):
    def never(ilp, **kw):
        raise RuntimeError("HiGHS found no plan within solver_time_limit_s (1.0) under "
                           "memory_budget_per_device (1000)")
    monkeypatch.setattr(planner, "solve_ilp", never)
    with pytest.raises(RuntimeError, match="HiGHS found no plan"):
        plan()
