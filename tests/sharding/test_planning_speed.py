"""Planning time, asserted as work counted (solves, ILP columns), not as seconds.

The planner's time is its HiGHS solves (the root LP dominates each): on the suite's 2-D GPT
each of the 12,900-column ILP's solves takes about 1.3 CPU s. These tests pin how many the
planner runs, so a change that adds one shows up here rather than in a benchmark.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import pytest

import autoshard
from autoshard.sharding import highs, pareto, reshard_memo

BENCH = Path(__file__).parent.parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def case():
    sys.path.insert(0, str(BENCH))
    import families_models as fm

    return fm.make_case("llama", "tiny")


def _plan(case):
    state = case.state_shapes()
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), case.batch)
    opt = autoshard.AutoShardingOption(show_progress=False, logical_mesh_shape=(2, 4))
    return autoshard.plan(case.step, state, batch,
                          method=autoshard.ShardParallel(auto_sharding_option=opt))


def _count_solves(monkeypatch) -> dict[str, int]:
    """Wrap ``highs.milp`` (every caller imports it at call time): HiGHS solves per
    calling function."""
    counts: dict[str, int] = {}
    real = highs.milp

    def milp(*args, **kwargs):
        caller = sys._getframe(1).f_code.co_name
        counts[caller] = counts.get(caller, 0) + 1
        return real(*args, **kwargs)

    monkeypatch.setattr(highs, "milp", milp)
    return counts


def test_trade_off_table_costs_one_solve(case, monkeypatch):
    # Weighing only the chosen plan's peak point, the least-peak plan peaked at another point,
    # so a second solve ran: 5 solves of the 2-D ILP for the same table. Weighing the points
    # near the peak (and stopping at a plan well below it) takes one.
    counts = _count_solves(monkeypatch)
    plan = _plan(case)
    # The planner's own: the chosen mesh's ILP, least_memory's weighted solve and the
    # least-peak search the default chooses among (pareto.expert_choice); the table reuses
    # it. The (tiny) pure data-parallel ILP explain() compares with is solved when first
    # read, not while planning.
    assert counts.get("solve_ilp") == 1 and counts.get("least_memory") == 1, counts
    assert counts.get("least_peak") == 1
    plan.explain()
    assert counts.get("solve_ilp") == 2
    rows = plan.objective.trade_off
    assert counts.get("least_peak") == 1 < pareto.ROUNDS
    assert plan.objective.trade_off is rows and counts["least_peak"] == 1   # found once
    smallest = min(rows, key=lambda r: r.memory)
    # The one solve still finds the plan of much less memory the table is for (0.63x here).
    assert smallest.memory < 0.7 * rows[0].memory and smallest.bytes > rows[0].bytes


def test_repeated_layers_price_their_edges_once(monkeypatch):
    # Each unrolled layer's nodes have strategy lists of their own (equal specs): their
    # per-axis resharding terms are memoised by content, so a deeper stack prices no new
    # edge, and the data-parallel ILP beside the plan reuses the plan's terms.
    import families_models as fm

    calls = {"priced": 0}
    real = reshard_memo._axis_terms

    def priced(*args, **kwargs):
        calls["priced"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(reshard_memo, "_axis_terms", priced)
    counts = []
    for layers in (2, 4):
        memo = reshard_memo._Memo(reshard_memo.MEMO_MAX_BYTES)
        monkeypatch.setattr(reshard_memo, "MEMO", memo)
        calls["priced"] = 0
        _plan(fm.make_case("llama", "tiny", layers=layers))
        distinct = sum(len(t.terms) for t in reshard_memo.MEMO.tables.values())
        assert calls["priced"] == distinct   # each distinct edge priced once
        counts.append(calls["priced"])
    assert counts[0] == counts[1] > 0, counts   # before: 686 and 834 pricings, 266 distinct


def test_near_peak_points_are_the_plateau():
    import numpy as np

    live = np.array([1.0, 9.6, 10.0, 9.9, 3.0, 10.0, 9.0])
    assert pareto._near_peak(live) == [1, 2, 3, 5]   # within 5% of the peak
    many = np.full(40, 7.0)
    assert len(pareto._near_peak(many)) == pareto.MAX_POINTS


def test_tied_layers_add_no_merged_reduction_columns_and_price_their_edges_once(monkeypatch):
    # Repeated layers tie their variables (repeats.tie_repeated): their merged reductions'
    # latency columns (one per layer before: 1,232 at 32 decoder layers for 136 distinct
    # member sets) and their edges' costs (18,153 edges priced one by one at 32 layers) are
    # the same per layer, so a deeper stack adds neither. Priced at their summed runs, the
    # edges' terms are the ones each edge priced alone adds up to.
    import numpy as np

    sys.path.insert(0, str(BENCH))
    import families_models as fm
    from autoshard.sharding import ilp as ilp_module
    from autoshard.sharding import planner
    built = []
    real = planner.build_ilp

    def spy(prob, **kwargs):
        built.append(real(prob, **kwargs))
        return built[-1]
    monkeypatch.setattr(planner, "build_ilp", spy)
    infos = []
    for layers in (8, 12):   # every layer tied from 8 on (407 variables at 8 and 12)
        built.clear()
        _plan(fm.make_case("llama", "tiny", layers=layers))
        core = built[0]
        infos.append(core.info)
        prob, g = core.prob, core.prob.graph
        one_by_one = ilp_module._Edges(prob)
        unary = np.zeros(len(core.unary))
        num_edges = 0
        for node in g.nodes:
            for p, u in enumerate(node.operands):
                if u is not None:
                    num_edges += 1
                    ilp_module._add_edge(prob, one_by_one, node, p, u, unary, core.col0,
                                         node.mult)
        infos[-1] = dict(core.info, edges=num_edges)
        def summed(edges):   # the pairs' per-axis terms, per (pair, term)
            out: dict = {}
            for terms in edges.fallback.values():
                for key, gathers, moves in terms:
                    acc = out.setdefault(key, [0.0, 0.0])
                    acc[0] = acc[0] + gathers
                    acc[1] = acc[1] + moves
            return out
        mine, theirs = summed(one_by_one), summed(core.edges)
        assert mine.keys() == theirs.keys() and mine
        for key, (gathers, moves) in mine.items():
            np.testing.assert_allclose(theirs[key][0], gathers, rtol=1e-12)
            np.testing.assert_allclose(theirs[key][1], moves, rtol=1e-12)
        assert one_by_one.pairs.keys() == core.edges.pairs.keys()
        for key, mat in one_by_one.pairs.items():
            np.testing.assert_allclose(core.edges.pairs[key], mat, rtol=1e-12)
        assert sorted(one_by_one.forbidden) == sorted(set(core.edges.forbidden))
    assert infos[0]["merged_columns"] == infos[1]["merged_columns"] > 0, infos
    added = infos[1]["priced_edges"] - infos[0]["priced_edges"]
    assert 0 <= added <= 0.1 * (infos[1]["edges"] - infos[0]["edges"]), infos
