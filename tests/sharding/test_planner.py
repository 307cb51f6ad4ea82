"""plan_auto as a whole: options, meshes, determinism, device-free planning, explain()."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import gpt_loss, init_gpt, mlp, mse, sgd_step
from _util import plan_fn
from jax.sharding import PartitionSpec as P

from autoshard.sharding import AutoShardingOption, plan_auto
from autoshard.sharding.planner import mesh_candidates

MLP_STEP = sgd_step(mse(mlp))


def _mlp_args(batch=8, hidden=256):
    return ((jnp.ones((hidden, 4 * hidden)), jnp.ones((4 * hidden, hidden))),
            jnp.ones((batch, hidden)), jnp.ones((batch, hidden)))


def _plan(args=None, **opt):
    return plan_fn(MLP_STEP, args or _mlp_args(), batch=[0, 0, 1, 1], aliases=[(0, 0), (1, 1)],
                   **opt)[1]


def test_mesh_candidates():
    opt = AutoShardingOption()
    assert mesh_candidates(8, opt) == [(8,), (2, 4), (4, 2)]
    assert mesh_candidates(8, AutoShardingOption(logical_mesh_shape=(2, 4))) == [(2, 4)]
    assert mesh_candidates(6, opt, rank=2) == [(2, 3), (3, 2)]
    assert mesh_candidates(8, AutoShardingOption(force_data_parallel=True)) == [(8,)]
    with pytest.raises(ValueError, match=r"logical_mesh_shape \(3, 2\) holds 6 devices"):
        mesh_candidates(8, AutoShardingOption(logical_mesh_shape=(3, 2)))


def test_automatic_mesh_choice_keeps_the_cheapest():
    plan = _plan()
    assert plan.mesh_shape in [(8,), (2, 4), (4, 2)]
    tried = [n for n in plan.notes if n.startswith("meshes tried")]
    assert tried and str(plan.mesh_shape) in tried[0]


def test_objective_carries_structured_ilp_stats():
    plan = _plan()
    o = plan.objective
    assert o.num_columns > o.num_edge_columns >= 0 and o.num_rows > 0
    assert o.solver_status == "optimal"
    assert [s for s, _ in o.meshes_tried] == [(8,), (2, 4)]
    # On one host both axes cost the same: (4, 2) mirrors (2, 4) and is not solved again.
    assert [s for s, *_ in o.meshes_pruned] == [(4, 2)]
    chosen = dict(o.meshes_tried)[plan.mesh_shape]
    assert chosen == min(dict(o.meshes_tried).values())
    assert f"ILP: {o.num_columns} columns, {o.num_rows} rows" in plan.notes


def test_plan_is_deterministic():
    a, b = _plan(), _plan()
    assert a == b
    assert a.in_specs == b.in_specs and a.out_specs == b.out_specs
    assert a.intermediates == b.intermediates
    assert a.objective.total_s == b.objective.total_s


def test_planning_needs_no_devices_gpt_on_64x8():
    # A GPT layer stack at GPT-3 width, planned for 512 devices this machine does not have.
    params = jax.eval_shape(lambda: init_gpt(0, vocab=512, dim=128, heads=8, layers=2,
                                             scan=True))
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)

    def widen(a):  # scale the model dims up abstractly: no memory is allocated
        return jax.ShapeDtypeStruct(tuple(s * 96 if s in (128, 512) else s for s in a.shape),
                                    a.dtype)

    params = jax.tree.map(widen, params)
    tokens = jax.ShapeDtypeStruct((512, 64), jnp.int32)
    closed = jax.make_jaxpr(sgd_step(gpt_loss(True)))(params, tokens, tokens)
    leaves = len(jax.tree.leaves(params))
    # An 8 GiB budget per device, as on real hardware (the replicated model needs ~16 GB).
    plan = plan_auto(closed, num_devices=512, option=AutoShardingOption(
        logical_mesh_shape=(64, 8), show_progress=False, memory_budget_per_device=8 << 30),
        in_paths=[f"p{i}" for i in range(leaves)] + ["tokens", "targets"],
        out_paths=[f"o{i}" for i in range(leaves + 1)], batch_invars=[0] * leaves + [1, 1],
        aliases=[(i, i) for i in range(leaves)])
    assert plan.mesh_shape == (64, 8) and plan.axis_names == ("x", "y")
    text = plan.explain()
    assert "x=64 x y=8" in text
    assert 0 < plan.objective.peak_bytes_per_device <= 8 << 30
    # Every big matrix is split somewhere: nothing of 12288 x 49152 stays whole.
    for leaf in plan.inputs[:leaves]:
        if np.prod(leaf.shape) > 1e8:
            assert leaf.spec != P(), leaf


def test_explain_lists_parameters_collectives_objective_and_data_parallel():
    plan = _plan(logical_mesh_shape=(8,))
    text = plan.explain()
    for needle in ("in0", "1024x256", "expected collectives", "all-reduce", "over x",
                   "objective:", "communication", "resharding", "compute",
                   "pure data parallel on the same mesh", "estimated peak memory per device"):
        assert needle in text, needle
    assert plan.objective.data_parallel_s > plan.objective.total_s


def test_options_force_batch_axis_and_forbid_replicated_parameters():
    args = _mlp_args(batch=64, hidden=64)
    plan = _plan(args, logical_mesh_shape=(2, 4), force_batch_dim_to_mesh_dim=1)
    assert "y" in str(plan.in_specs[2][0]) and "y" in str(plan.in_specs[3][0])
    big_batch = _mlp_args(batch=4096, hidden=16)
    assert _plan(big_batch, logical_mesh_shape=(8,)).in_specs[:2] == (P(), P())
    plan = _plan(big_batch, logical_mesh_shape=(8,), allow_replicated_parameters=False)
    assert P() not in plan.in_specs[:2]


def test_aliases_share_specs():
    plan = _plan(logical_mesh_shape=(8,))
    assert plan.in_specs[0] == plan.out_specs[0] and plan.in_specs[1] == plan.out_specs[1]


def test_time_limit_uses_an_incumbent_and_says_so():
    params = init_gpt(0, vocab=64, dim=32, heads=4, layers=2, scan=False)
    tokens = jnp.zeros((8, 16), jnp.int32)
    leaves = len(jax.tree.leaves(params))
    with pytest.warns(RuntimeWarning, match=r"stopped at solver_time_limit_s .*another plan "
                                            "on another run.*solver_node_limit"):
        closed, plan = plan_fn(sgd_step(gpt_loss(False)), (params, tokens, tokens),
                               batch=[0] * leaves + [1, 1], logical_mesh_shape=(2, 4),
                               solver_time_limit_s=1e-3)
    assert plan.objective.solver_status.startswith(("time limit", "solver limit"))
    assert "limit" in plan.explain()


def _gpt_plan(**opt):
    params = init_gpt(0, vocab=64, dim=32, heads=4, layers=2, scan=False)
    tokens = jnp.zeros((8, 16), jnp.int32)
    leaves = len(jax.tree.leaves(params))
    return plan_fn(sgd_step(gpt_loss(False)), (params, tokens, tokens),
                   batch=[0] * leaves + [1, 1], logical_mesh_shape=(2, 4), **opt)[1]


@pytest.mark.slow   # ~35 s: five plans of a GPT, two beside four CPU burners
def test_node_limit_stops_deterministically_even_under_cpu_load():
    quiet = _gpt_plan(solver_node_limit=1)
    assert quiet.objective.solver_status.startswith(("optimal", "node limit"))
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(4)]
    try:
        loaded = [_gpt_plan(solver_node_limit=1) for _ in range(2)]
        full = _gpt_plan()
    finally:
        for b in burners:
            b.kill()
    for plan in loaded:
        assert plan == quiet  # same specs, pins, collectives and objective
    assert full == _gpt_plan()
    assert full.objective.total_s <= quiet.objective.total_s * (1 + 1e-9)


def test_force_options_that_cannot_apply_fail_at_construction():
    # An axis of size 1 is accepted as a no-op (as Alpa does), with a warning.
    with pytest.warns(UserWarning, match=r"force_batch_dim_to_mesh_dim \(1\) names an axis of "
                                         r"size 1 in logical_mesh_shape \(8, 1\)"):
        AutoShardingOption(logical_mesh_shape=(8, 1), force_batch_dim_to_mesh_dim=1)
    with pytest.raises(ValueError, match=r"force_batch_dim_to_mesh_dim \(2\) names no axis"):
        AutoShardingOption(logical_mesh_shape=(2, 4), force_batch_dim_to_mesh_dim=2)
    with pytest.raises(ValueError, match=r"solver_node_limit \(0\) must be a positive int"):
        AutoShardingOption(solver_node_limit=0)
    for gap in (1.0, -0.1, "1e-3", True):
        with pytest.raises(ValueError, match=r"solver_mip_gap \(.*\) must be a fraction in "
                                             r"\[0, 1\)"):
            AutoShardingOption(solver_mip_gap=gap)


def test_the_mip_gap_reaches_highs(monkeypatch):
    """``solver_mip_gap`` is HiGHS's ``mip_rel_gap`` for every solve of the plan."""
    from autoshard.sharding import ilp as built
    seen = []
    real = built.build_ilp

    def spy(prob, **kw):
        ilp = real(prob, **kw)
        seen.append(ilp.options["mip_rel_gap"])
        return ilp
    monkeypatch.setattr("autoshard.sharding.planner.build_ilp", spy)
    monkeypatch.setattr("autoshard.sharding.solver.build_ilp", spy)  # build_and_solve's
    _plan(option=AutoShardingOption(show_progress=False, solver_mip_gap=0.02))
    assert seen and set(seen) == {0.02}


def test_progress_bar_can_be_turned_off(capsys):
    _plan(logical_mesh_shape=None, show_progress=False)
    assert "autoshard: planning" not in capsys.readouterr().err
    _plan(option=AutoShardingOption(show_progress=True))
    assert "autoshard: planning" in capsys.readouterr().err


def test_argument_errors():
    closed = jax.make_jaxpr(MLP_STEP)(*_mlp_args())
    base = dict(num_devices=8, option=AutoShardingOption(show_progress=False),
                in_paths=["a", "b", "c", "d"], out_paths=["o", "p", "q"],
                batch_invars=[0, 0, 1, 1])
    with pytest.raises(ValueError, match="in_paths has 2 entries but the jaxpr has 4"):
        plan_auto(closed, **{**base, "in_paths": ["a", "b"]})
    with pytest.raises(ValueError, match=r"aliases entry \(0, 7\) is out of range"):
        plan_auto(closed, **base, aliases=[(0, 7)])
    with pytest.raises(ValueError, match="different shapes"):
        plan_auto(closed, **base, aliases=[(0, 1)])
    with pytest.raises(ValueError, match="mesh_beta"):
        plan_auto(closed, **{**base, "option": AutoShardingOption(
            logical_mesh_shape=(2, 4), mesh_beta=(1e-9,), show_progress=False)})
    with pytest.raises(ValueError, match="logical_mesh_shape"):
        AutoShardingOption(logical_mesh_shape=(0, 8))


def test_collective_options_change_the_plan():
    # Data parallel (many rows, narrow layers): the gradients are reduced.
    dp_args = _mlp_args(batch=1024, hidden=32)
    rs = _plan(dp_args, logical_mesh_shape=(8,), prefer_reduce_scatter=True)
    ar = _plan(dp_args, logical_mesh_shape=(8,))
    # Preferred, not merely allowed: gradients scatter even where an all-reduce would be a
    # little cheaper (one collective instead of two).
    assert "reduce-scatter" in {c.kind for c in rs.collectives}
    assert "reduce-scatter" not in {c.kind for c in ar.collectives}
    assert not [c for c in rs.collectives if c.kind == "all-reduce" and c.num_bytes > 4]
    # Model parallel (few rows): an activation feeding the next layer keeps its all-reduce,
    # as in Alpa (one collective instead of a reduce-scatter and an all-gather).
    args = _mlp_args(batch=64, hidden=128)
    mp = _plan(args, logical_mesh_shape=(8,), prefer_reduce_scatter=True)
    assert {(c.kind, c.num_bytes) for c in mp.collectives} == {("all-reduce", 64 * 128 * 4)}
    no_moves = _plan(args, logical_mesh_shape=(8,), allow_all_gather=False,
                     allow_all_to_all=False)
    assert not [c for c in no_moves.collectives if c.kind in ("all-gather", "all-to-all")]
    no_a2a = _plan(args, logical_mesh_shape=(8,), allow_all_to_all=False)
    assert not [c for c in no_a2a.collectives if c.kind == "all-to-all"]


def test_memory_budget_rows_cover_the_peak():
    # The budget is enforced at sampled program points; the reported peak uses all points.
    args = _mlp_args(batch=8, hidden=256)
    plan = _plan(args, logical_mesh_shape=(8,), memory_budget_per_device=3_000_000)
    assert plan.objective.peak_bytes_per_device <= 3_000_000


def test_memory_budget_that_nothing_fits_names_budget_estimate_and_largest_arrays():
    with pytest.raises(ValueError, match=r"No plan fits memory_budget_per_device \(1,000 B\): "
                                         r"the smallest estimate found is [\d,]+ B per device "
                                         r"\(mesh .*\). The largest arrays: in\d+ \("):
        _plan(memory_budget_per_device=1000)


def test_ilp_cutoff_skips_meshes_that_cannot_win_without_changing_the_plan(monkeypatch):
    from autoshard.sharding import solver
    full = _plan()
    monkeypatch.setattr(solver, "CUTOFF_MIN_COLUMNS", 0)  # the cutoff on this small ILP too
    cut = _plan()
    assert cut.mesh_shape == full.mesh_shape and cut.in_specs == full.in_specs
    assert cut.objective.total_s == full.objective.total_s
    skipped = {s: why for s, why in cut.objective.meshes_pruned if why.startswith("ILP bound")}
    assert skipped, cut.objective.meshes_pruned
    # Large ILPs are solved best-first (lowest LP bound): the winner is solved first here.
    assert cut.objective.meshes_tried[0][0] == cut.mesh_shape
    solved = dict(full.objective.meshes_tried)
    for shape, why in skipped.items():  # each was indeed no better once solved in full
        assert solved[shape] >= full.objective.total_s * (1 - 1e-9), why
        assert "LP relaxation bound" in why


def test_memory_rows_are_added_where_the_plan_goes_over_the_budget(monkeypatch):
    from autoshard.sharding import ilp, memory, solver

    def first_point_only(prob, col0, K, total, num_points=48, points=None, **kw):
        # Sample only the first program point, so the budget rows miss the peak.
        return memory.memory_rows(prob, col0, K, total,
                                  points=np.array([0]) if points is None else points, **kw)
    monkeypatch.setattr(ilp, "memory_rows", first_point_only)  # the rows the ILP is built with
    args, budget = _mlp_args(batch=64, hidden=256), 700_000
    monkeypatch.setattr(solver, "MEMORY_ROUNDS", 0)
    # Without rounds the plan goes over the budget: that is no plan, and the error says by
    # how much (a budget is met or refused, never silently missed).
    with pytest.raises(ValueError, match=r"x the budget, [\d,]+ B over"):
        _plan(args, logical_mesh_shape=(8,), memory_budget_per_device=budget)
    blind = _plan(args, logical_mesh_shape=(8,), memory_tradeoff=0.0)
    assert blind.objective.peak_bytes_per_device > budget
    monkeypatch.setattr(solver, "MEMORY_ROUNDS", 4)
    from autoshard.sharding import highs
    gaps, real_milp = [], highs.milp

    def milp(c, **kw):
        gaps.append(kw["options"].get("mip_rel_gap"))
        return real_milp(c, **kw)
    monkeypatch.setattr(highs, "milp", milp)
    plan = _plan(args, logical_mesh_shape=(8,), memory_budget_per_device=budget)
    assert plan.objective.peak_bytes_per_device <= budget
    assert plan.objective.total_s > blind.objective.total_s  # fitting costs something here
    # the first solve stops at solver_mip_gap, the rounds' at solver.ROUNDS_GAP
    assert len(gaps) >= 2 and gaps[0] == 1e-4, gaps
    assert gaps[1:] == [solver.ROUNDS_GAP] * (len(gaps) - 1), gaps


def test_cutoff_asks_the_relaxation_without_memory_rows_first(monkeypatch):
    """Under a budget the cutoff compares the LP relaxation without the memory rows first (a
    weaker bound, cheaper): a mesh it prunes never has the full relaxation solved; one it does
    not prune gets the memory rows its relaxation goes over (solver.BOUND_ROUNDS), then the
    full relaxation, each a bound no lower."""
    from autoshard.sharding import planner, solver
    built = []
    real = planner.build_ilp

    def keep(prob, **kw):
        built.append((prob, kw))
        return real(prob, **kw)
    monkeypatch.setattr(planner, "build_ilp", keep)
    args, budget = _mlp_args(batch=64, hidden=256), 700_000
    _plan(args, logical_mesh_shape=(8,), memory_budget_per_device=budget)
    prob, kw = built[0]
    assert kw["memory_budget"] == budget
    fresh = real(prob, **kw)
    core, full = solver.lp_bound_s(fresh, memory=False), solver.lp_bound_s(fresh)
    assert fresh.num_core_constraints < len(fresh.constraints)
    assert core < full * (1 - 1e-6)  # the budget binds: the rows raise the bound
    monkeypatch.setattr(solver, "CUTOFF_MIN_COLUMNS", 0)
    pruned = real(prob, **kw)
    sol = solver.solve_ilp(pruned, cutoff_s=core)
    assert sol.bound_s == core and pruned.lp is None and pruned.lp_core[0] == core
    # Between the two: the memory rows the relaxation goes over are added (a bound between
    # the two, at or over the cutoff), the full relaxation is not solved.
    between = real(prob, **kw)
    cutoff = (core + full) / 2
    sol = solver.solve_ilp(between, cutoff_s=cutoff)
    assert cutoff <= sol.bound_s <= full * (1 + 1e-9)
    assert between.lp is None or between.lp[0] == sol.bound_s
    above = real(prob, **kw)  # a cutoff no relaxation reaches: solved, the full bound noted
    sol = solver.solve_ilp(above, cutoff_s=full * 2)
    assert sol.bound_s is None and above.lp[0] == pytest.approx(full, rel=1e-9)
    assert sol.info["lp_bound_s"] == pytest.approx(full, rel=1e-9)
