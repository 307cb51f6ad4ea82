"""Under a cutoff the planner builds an ILP's memory rows only for a mesh it solves.

AutoParallel's whole-mesh candidate plans under the fastest pipeline's time (``cutoff_s``);
on Table 1's rows most of its meshes are ruled out by bounds that read no memory row (the
blocks' bound, the relaxation without them), and building those rows (``copy_bounds``,
``memory_rows``) was most of that candidate's ``build_ilp`` time. ``ilp.with_memory`` adds
them to an ILP built without a budget; the planner does so (``solver.with_rows``) only where
those bounds do not reach the cutoff (``solver.ruled_out_without_rows``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import mlp, mse, sgd_step
from _util import plan_fn

from autoshard.sharding import AutoShardingOption, planner, solver
from autoshard.sharding import ilp as ilp_mod
from autoshard.sharding.build import build_problem
from autoshard.sharding.graph import build_graph
from autoshard.sharding.ilp import build_ilp, with_memory

STEP = sgd_step(mse(mlp))
ARGS = ((jnp.ones((256, 1024)), jnp.ones((1024, 256))), jnp.ones((64, 256)),
        jnp.ones((64, 256)))
BATCH = [False, False, True, True]
BUDGET = 700_000


def _problem(mesh):
    closed = jax.make_jaxpr(STEP)(*ARGS)
    g = build_graph(closed, [f"in{i}" for i in range(4)],
                    [f"out{i}" for i in range(len(closed.jaxpr.outvars))])
    g.memo["aliases"] = ((0, 0), (1, 1))
    return build_problem(g, mesh, AutoShardingOption(show_progress=False),
                         batch_invars=BATCH, aliases=((0, 0), (1, 1)), warned=set(),
                         scatter_gradients=True)


@pytest.mark.parametrize("mesh", [(8,), (2, 4)])
def test_rows_added_later_make_the_same_ilp_as_rows_built_with_it(mesh):
    prob = _problem(mesh)
    kw = dict(time_limit_s=30.0, node_limit=None)
    at_once = build_ilp(prob, memory_budget=BUDGET, **kw)
    core = build_ilp(prob, memory_budget=None, **kw)
    later = with_memory(core, BUDGET)
    assert core.total < later.total == at_once.total   # the copy columns come last
    assert later.num_core_constraints == at_once.num_core_constraints == len(core.constraints)
    assert later.memory_budget == BUDGET and later.copies[1] == core.total
    for name in ("c", "integrality"):
        np.testing.assert_array_equal(getattr(later, name), getattr(at_once, name))
    for a, b in zip(later.bounds, at_once.bounds, strict=True):
        np.testing.assert_array_equal(a, b)
    assert len(later.constraints) == len(at_once.constraints) > len(core.constraints)
    for x, y in zip(later.constraints, at_once.constraints, strict=True):
        assert x.A.shape == y.A.shape
        assert (x.A != y.A).nnz == 0
        np.testing.assert_array_equal(x.lb, y.lb)
        np.testing.assert_array_equal(x.ub, y.ub)
    assert later.info == at_once.info
    # the core's relaxation is this ILP's relaxation without memory rows: it carries over
    bound = solver.lp_bound_s(core)
    moved = with_memory(core, BUDGET)
    assert moved.lp is None and moved.lp_core[0] == bound
    assert len(moved.lp_core[2]) == moved.total
    with pytest.raises(ValueError, match="with_memory takes an ILP built without a memory "
                                         "budget"):
        with_memory(at_once, BUDGET)


def _plan(cutoff_s=None, **opt):
    return plan_fn(STEP, ARGS, batch=BATCH, aliases=[(0, 0), (1, 1)],
                   plan_kw={"cutoff_s": cutoff_s},
                   **{"memory_budget_per_device": BUDGET, "memory_tradeoff": 0.0, **opt})[1]


def test_under_a_cutoff_only_the_solved_meshes_get_memory_rows(monkeypatch):
    monkeypatch.setattr(solver, "CUTOFF_MIN_COLUMNS", 0)  # the cutoff on this small ILP too
    added = []
    real = ilp_mod.with_memory

    def record(core, budget):
        added.append(tuple(core.prob.ctx.mesh_shape))
        return real(core, budget)
    monkeypatch.setattr(solver, "with_memory", record)
    free = _plan()
    assert added == []   # no cutoff: every ILP is built with its rows
    best = free.objective.total_s
    same = _plan(best * 1.001)
    assert same.mesh_shape == free.mesh_shape and same.in_specs == free.in_specs
    assert same.objective.total_s == pytest.approx(best, rel=1e-12)
    assert same.objective.peak_bytes_per_device <= BUDGET
    assert tuple(same.mesh_shape) in added   # the mesh solved got its rows
    added.clear()
    with pytest.raises(planner.Outpriced):
        _plan(best * 1e-3)   # every mesh's bound without memory rows is far above this
    assert added == []


def test_the_rows_are_added_only_where_no_bound_without_them_rules_the_mesh_out(monkeypatch):
    monkeypatch.setattr(solver, "CUTOFF_MIN_COLUMNS", 0)
    prob = _problem((8,))
    kw = dict(time_limit_s=30.0, node_limit=None)
    core = build_ilp(prob, memory_budget=None, **kw)
    bound = solver.lp_bound_s(core)   # the relaxation without memory rows
    sol = solver.ruled_out_without_rows(core, BUDGET, bound * 0.999)
    assert sol.bound_s == bound and sol.status == "LP relaxation bound" and not sol.choice
    assert core.memory_budget is None   # no rows built for it
    # above the bound: not ruled out; with its rows added, the solve is the one of the ILP
    # built whole
    assert solver.ruled_out_without_rows(core, BUDGET, bound * 1e3) is None
    full = solver.with_rows(core, BUDGET)
    assert full.memory_budget == BUDGET and full.total > core.total
    sol = solver.solve_ilp(full, cutoff_s=bound * 1e3)
    whole = solver.solve_ilp(build_ilp(prob, memory_budget=BUDGET, **kw), cutoff_s=bound * 1e3)
    assert sol.choice == whole.choice and sol.objective_s == whole.objective_s
    assert sol.bound_s is None and sol.info["lp_bound_s"] >= bound
    # an ILP with its rows, or no budget: nothing to rule out here, nothing to add
    assert solver.ruled_out_without_rows(full, BUDGET, bound * 0.999) is None
    assert solver.with_rows(full, BUDGET) is full and solver.with_rows(core, None) is core
