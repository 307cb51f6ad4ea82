"""The mesh search goes on past a mesh with no plan (issue 26, item 1): one infeasible or
unsolved mesh is skipped and reported in explain(), not the end of the search."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _models import mlp, mse, sgd_step
from _util import plan_fn

from autoshard.sharding import planner

STEP = sgd_step(mse(mlp))
ARGS = ((jnp.ones((64, 256)), jnp.ones((256, 64))), jnp.ones((16, 64)), jnp.ones((16, 64)))


def plan(plan_kw=None, **opt):
    return plan_fn(STEP, ARGS, batch=[0, 0, 1, 1], aliases=[(0, 0), (1, 1)], plan_kw=plan_kw,
                   **opt)[1]


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
    failures = {}  # handed to the caller as data (plan_program skips them in a harder search)
    got = plan(plan_kw={"mesh_failures": failures})
    assert got.mesh_shape in ((2, 4), (4, 2))
    pruned = dict(got.objective.meshes_pruned)
    assert pruned[(8,)] == "no plan: " + str(error).split(";")[0]
    assert failures == {(8,): str(error).split(";")[0]}
    assert "no plan: " in got.explain() and str(error).split(";")[0][:40] in got.explain()


def test_no_mesh_with_a_plan_is_still_an_error(monkeypatch):
    def never(ilp, **kw):
        raise RuntimeError("HiGHS found no plan within solver_time_limit_s (1.0) under "
                           "memory_budget_per_device (1000)")
    monkeypatch.setattr(planner, "solve_ilp", never)
    with pytest.raises(RuntimeError, match="HiGHS found no plan"):
        plan()


def test_several_hosts_add_3d_meshes_to_the_search():
    """Issue 26, item 2: on hosts that do not factor into two good axes (240 hosts), 3-D
    meshes (hosts split two ways, one axis inside a host) are searched too; one host keeps
    its 1-D and 2-D candidates."""
    from autoshard.sharding import AutoShardingOption
    from autoshard.sharding.planner import mesh_candidates

    opt = AutoShardingOption()
    assert mesh_candidates(8, opt) == mesh_candidates(8, opt, devices_per_host=8) == [
        (8,), (2, 4), (4, 2)]
    got = mesh_candidates(48, opt, devices_per_host=8)
    assert [s for s in got if len(s) == 3] == [(2, 3, 8), (3, 2, 8)]
    assert mesh_candidates(48, opt, rank=3, devices_per_host=8) == [(2, 3, 8), (3, 2, 8)]
    assert (15, 16, 8) in mesh_candidates(1920, opt, devices_per_host=8)
    assert mesh_candidates(48, AutoShardingOption(force_data_parallel=True),
                           devices_per_host=8) == [(48,)]


def test_a_described_multi_host_cluster_searches_3d_meshes():
    import autoshard

    shapes = (jax.ShapeDtypeStruct((64, 256), jnp.float32),
              jax.ShapeDtypeStruct((256, 64), jnp.float32))
    data = (jax.ShapeDtypeStruct((48, 64), jnp.float32),
            jax.ShapeDtypeStruct((48, 64), jnp.float32))

    def loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p[0]) @ p[1] - y) ** 2)

    def step(p, batch):
        g = autoshard.grad(loss)(p, *batch)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)
    plan = autoshard.plan(step, shapes, data, cluster=autoshard.Cluster.a100_80gb(6))
    seen = [s for s, _ in plan.objective.meshes_tried] + [
        s for s, _ in plan.objective.meshes_pruned]
    assert {(2, 3, 8), (3, 2, 8)} <= set(seen), seen


def test_a_model_too_large_for_its_devices_says_what_would_fit():
    """Issue 24, bad input: the error names the smallest estimate, the largest arrays, and
    which of more devices, a pipeline, more micro-batches or remat would fit."""
    from autoshard.sharding import AutoShardingOption

    weights = (jnp.ones((512, 1024)), jnp.ones((1024, 512)))   # 4 MiB of parameters
    args = (weights, jnp.ones((16, 512)), jnp.ones((16, 512)))
    with pytest.raises(ValueError) as state:
        plan_fn(STEP, args, batch=[0, 0, 1, 1], aliases=[(0, 0), (1, 1)],
                option=AutoShardingOption(memory_budget_per_device=2**18))
    text = str(state.value)
    assert "No plan fits memory_budget_per_device (262,144 B)" in text
    assert "The largest arrays:" in text and "2,097,152 B" in text
    assert "alone need" in text and "devices or more" in text and "pipeline of at least" in text

    # state that fits, activations that do not: micro-batches and remat are named
    wide = ((jnp.ones((64, 2048)), jnp.ones((2048, 64))), jnp.ones((512, 64)),
            jnp.ones((512, 64)))   # 1 MiB of weights, a 4 MiB hidden activation
    with pytest.raises(ValueError) as acts:
        plan_fn(STEP, wide, batch=[0, 0, 1, 1], aliases=[(0, 0), (1, 1)],
                option=AutoShardingOption(memory_budget_per_device=2**18))
    text = str(acts.value)
    assert "The inputs fit" in text and "num_micro_batches" in text and "remat" in text, text


def _plan_under(cutoff_s):
    from autoshard.sharding import AutoShardingOption
    closed = jax.make_jaxpr(STEP)(*ARGS)
    n_in = len(jax.tree.leaves(ARGS))
    return planner.plan_auto(
        closed, num_devices=8, cutoff_s=cutoff_s,
        option=AutoShardingOption(show_progress=False, memory_tradeoff=0.0),
        in_paths=[f"in{i}" for i in range(n_in)],
        out_paths=[f"out{i}" for i in range(len(closed.jaxpr.outvars))],
        batch_invars=[False, False, True, True], aliases=[(0, 0), (1, 1)])


def test_a_cutoff_above_the_best_plan_changes_nothing_and_below_it_raises_outpriced():
    """``plan_auto(cutoff_s=)`` (AutoParallel's whole-mesh candidate under the fastest
    pipeline's time): meshes are skipped only on exact bounds, so a cutoff above the best
    plan gives the same plan, and one below it raises ``Outpriced`` naming every mesh."""
    free = _plan_under(None)
    best = free.objective.total_s
    same = _plan_under(best * 1.001)
    assert same.mesh_shape == free.mesh_shape
    assert same.objective.total_s == pytest.approx(best, rel=1e-9)
    with pytest.raises(planner.Outpriced, match=r"No mesh has a plan faster than the cutoff, "
                                                r"[0-9.e-]+ s per step") as caught:
        _plan_under(best * 0.999)
    tried = {tuple(m) for m, _ in free.objective.meshes_tried}
    assert tried <= set(caught.value.reasons)
    assert all(">= cutoff" in why for why in caught.value.reasons.values())


def test_a_mesh_its_cheap_bound_rules_out_gets_no_ilp_built(monkeypatch):
    """Under a cutoff, a mesh whose cheapest-strategy bound (``lower_bound_s``) reaches it is
    ruled out before its ILP is built (Table 1's whole-mesh candidates: building the ILPs
    was most of that candidate's planning); the others are built and solved, as before. (The
    two meshes of this step have equal bounds: they are set here, 1 s and 3 s.)"""
    built = []
    real_build = planner.build_ilp

    def build(prob, **kw):
        built.append(tuple(prob.ctx.mesh_shape))
        return real_build(prob, **kw)
    monkeypatch.setattr(planner, "lower_bound_s",
                        lambda prob: 1.0 if tuple(prob.ctx.mesh_shape) == (8,) else 3.0)
    monkeypatch.setattr(planner, "build_ilp", build)
    plan = _plan_under(2.0)
    assert built == [(8,)] and tuple(plan.mesh_shape) == (8,)
    built.clear()
    with pytest.raises(planner.Outpriced) as caught:
        _plan_under(0.5)
    assert built == []
    assert sorted(caught.value.reasons) == [(2, 4), (8,)]
    assert all(why.startswith("cost lower bound") for why in caught.value.reasons.values())


def test_a_mesh_whose_lp_relaxation_ran_out_of_time_is_not_solved_again(monkeypatch):
    """An LP relaxation stopped by ``solver_time_limit_s`` (3-D meshes of a 48-layer step on
    512 GPUs: 131 s for the LP alone) means the branch and bound, which starts from it, finds
    no plan in that time either: the ILP is not started (the greedy fallback, with its
    warning, as when the clock stops a solve without an incumbent)."""
    from autoshard.sharding import highs, solver

    def stopped(ilp, memory=True):
        if memory:
            ilp.lp = (None, solver.LP_STOPPED)
        else:
            ilp.lp_core = (None, solver.LP_STOPPED)
        return None
    monkeypatch.setattr(solver, "CUTOFF_MIN_COLUMNS", 0)
    monkeypatch.setattr(solver, "lp_bound_s", stopped)
    calls = []
    real = highs.milp
    monkeypatch.setattr(highs, "milp", lambda *a, **k: calls.append(1) or real(*a, **k))
    with pytest.warns(RuntimeWarning, match=r"no plan found yet: greedy fallback"):
        plan = _plan_under(1e9)
    assert calls == [] and plan.objective.solver_status.startswith("solver limit: no incumbent")


def _built_ilps():
    """The sharding ILPs the planner builds for this file's step, by mesh."""
    built = {}
    real = planner.build_ilp

    def keep(prob, **kw):
        ilp = built[tuple(prob.ctx.mesh_shape)] = real(prob, **kw)
        return ilp
    planner.build_ilp = keep
    try:
        _plan_under(None)
    finally:
        planner.build_ilp = real
    return built


@pytest.mark.parametrize("mesh_shape", [(8,), (2, 4)])
def test_the_blocks_bound_is_the_lp_relaxation_in_one_block_and_below_it_in_more(
        mesh_shape, monkeypatch):
    """``solver.block_bound_s`` drops the rows joining blocks of variables and solves each
    block's LP: in one block that is the LP relaxation itself, in more a lower bound of it
    (rows dropped only widen the LP)."""
    from autoshard.sharding import solver
    ilp = _built_ilps()[mesh_shape]
    ilp.lp = ilp.lp_core = None
    relaxation = solver.lp_bound_s(ilp, memory=False)
    bounds = {}
    for blocks in (1, 2, 4, 64):
        monkeypatch.setattr(solver, "BLOCKS", blocks)
        ilp.lp_blocks = None
        bounds[blocks] = solver.block_bound_s(ilp)
    assert bounds[1] == pytest.approx(relaxation, rel=1e-6)
    assert all(0.0 <= bounds[b] <= relaxation * (1 + 1e-6) for b in (2, 4, 64)), bounds
    assert bounds[64] < relaxation   # this step's cost is partly in the rows between blocks


def test_a_mesh_its_blocks_bound_rules_out_gets_no_lp_relaxation(monkeypatch):
    """Under a cutoff, a large ILP whose blocks' bound reaches the cutoff is ruled out without
    its LP relaxation (Table 1's whole-mesh 3-D meshes: relaxations that did not finish in
    their time share, blocks' bounds in under a second). Here the thresholds are lowered to
    this small step and the cheap bound set to 0, so the blocks decide."""
    from autoshard.sharding import solver
    monkeypatch.setattr(solver, "CUTOFF_MIN_COLUMNS", 0)
    monkeypatch.setattr(solver, "BLOCK_BOUND_MIN_COLUMNS", 0)
    monkeypatch.setattr(planner, "lower_bound_s", lambda prob: 0.0)
    relaxed = []
    real = solver._relaxed
    monkeypatch.setattr(solver, "_relaxed", lambda *a: relaxed.append(1) or real(*a))
    blocks = min(solver.block_bound_s(ilp) for ilp in _built_ilps().values())
    relaxed.clear()
    with pytest.raises(planner.Outpriced) as caught:
        _plan_under(blocks * 0.999)
    assert relaxed == []
    assert sorted(caught.value.reasons) == [(2, 4), (8,)]
    assert all("split into blocks" in why for why in caught.value.reasons.values())
    # Above the blocks' bound the relaxation is solved as before, and the same plan found.
    assert _plan_under(None).objective.total_s == pytest.approx(
        _plan_under(1e9).objective.total_s, rel=1e-9)
    assert relaxed


def test_a_mesh_whose_relaxation_the_search_solved_is_not_solved_again(monkeypatch):
    """The mesh search solves each large ILP's LP relaxation to order the meshes
    (``solver.cutoff_bound_s``); the ILP's own solve starts with the same LP by the dual
    simplex, so where that relaxation is integral ``solve_ilp`` takes it (and its basis, the
    re-solves' start) without solving it again: the same plan as a solve from nothing, one
    HiGHS call instead of two. A relaxation solved another way (no basis) is solved again."""
    import dataclasses

    from autoshard.sharding import highs, solver
    ilp = _built_ilps()[(2, 4)]
    monkeypatch.setattr(highs, "IPM_MIN_ROWS", 0)   # this small ILP takes the simplex path
    monkeypatch.setattr(highs, "IPM_MAX_COLUMNS_PER_ROW", 1_000)
    calls = []
    real = highs.milp
    monkeypatch.setattr(highs, "milp", lambda *a, **k: calls.append(1) or real(*a, **k))

    def fresh():
        return dataclasses.replace(ilp, lp=None, lp_core=None, lp_blocks=None, lp_basis=None)
    alone = fresh()
    direct = solver.solve_ilp(alone)
    assert len(calls) == 1 and alone.lp_basis is not None
    calls.clear()
    searched = fresh()
    bound = solver.lp_bound_s(searched, memory=False)
    assert len(calls) == 1
    again = solver.solve_ilp(searched)
    assert len(calls) == 1   # the relaxation was the ILP's solution
    assert again.choice == direct.choice and again.status == direct.status == "optimal"
    assert again.objective_s == pytest.approx(direct.objective_s, rel=1e-12)
    assert bound == pytest.approx(direct.objective_s, rel=1e-9)
    assert searched.lp_basis is not None
    calls.clear()
    monkeypatch.setattr(highs, "IPM_MIN_ROWS", 10**9)   # scipy's path: no basis comes back
    other = fresh()
    solver.lp_bound_s(other, memory=False)
    assert (other.lp or other.lp_core)[3] is None
    assert solver.solve_ilp(other).choice == direct.choice and len(calls) == 2
