"""``AutoParallel``'s stage search plans little (issue 26 item 8: a small model's first call).

A miniature of the repeated-layer models it meets (an embedding layer, identical blocks, a
head; Adam; a pipeline boundary after each) on 8 devices of one described host. The planner
calls are counted: the stage spans are planned once per distinct layer and usable sub-mesh
(no sub-mesh of all 8 devices: a pipeline of 2 or more stages never has one), F and B only
(the apply tasks' memory cannot decide a memory test here); and the stage DP's layouts equal
those of ``price._Pricer``, which plans every span, its apply tasks included, with and without
a memory budget that makes some apply tasks count.
"""

import pytest
from pipeline_models import BlockLM

import autoshard
from autoshard import Cluster
from autoshard.pipeline import auto, price, spans, tasks
from autoshard.pipeline.build import cut_program

NUM_BLOCKS = 3
MODEL = BlockLM(hidden=16, vocab=32, rows=16, num_blocks=NUM_BLOCKS)
step, shapes = MODEL.step, MODEL.shapes
QUIET = autoshard.AutoShardingOption(show_progress=False)
CLUSTER = Cluster.a100_80gb(num_hosts=1, devices_per_host=8)


@pytest.fixture
def counted(monkeypatch):
    """Every planner call of the pricing: (phase, task jaxpr, devices)."""
    calls, phase = [], ["other"]
    real = tasks.plan_auto

    def plan_auto(closed, **kw):
        calls.append((phase[0], str(closed), kw["num_devices"]))
        return real(closed, **kw)
    monkeypatch.setattr(tasks, "plan_auto", plan_auto)
    measure = spans.SpanPricer.measure_spans

    def measure_spans(self, *args):
        phase[0] = "spans"
        try:
            return measure(self, *args)
        finally:
            phase[0] = "other"
    monkeypatch.setattr(spans.SpanPricer, "measure_spans", measure_spans)
    return calls


def method(**kw):
    return autoshard.AutoParallel(num_micro_batches=2, layer_option="manual",
                                  default_auto_sharding_option=QUIET, **kw)


def test_spans_are_planned_once_per_distinct_layer_and_usable_sub_mesh(counted):
    est = autoshard.plan(step, *shapes(), cluster=CLUSTER, method=method(),
                         batch_argnums=(2, 3))
    spans = [c for c in counted if c[0] == "spans"]
    # 3 distinct layers (embedding, block, head) x sub-meshes of 1, 2 and 4 devices (not 8)
    # x (F, B); the apply tasks (a few KB) cannot reach 80 GB and are not planned
    assert sorted({n for _, _, n in spans}) == [1, 2, 4]
    assert len(spans) == len(set(spans)) == 3 * 3 * 2
    assert [c.num_stages for c in est.candidates] == list(range(1, NUM_BLOCKS + 3))
    assert "spans planned: 15 of 20" in est.explain()
    assert "apply tasks planned: 0 of 15" in est.explain()


def test_every_span_and_sub_mesh_is_planned_side_by_side(monkeypatch):
    """The stage search hands every (span, sub-mesh) pair to one ``concurrently`` call
    (5 layers x sub-meshes of 1, 2 and 4 devices), larger sub-meshes first, repeated blocks
    after the distinct layers, then the apply tasks (none here) to a second: before, one call
    per span left a single solve running for most of Table 1's 76.1B stage search, and in span
    order GPT-3 175B's 64-host sub-mesh, started last, ran alone for its search's last 50 s."""
    batches = []
    real = spans.concurrently

    def concurrently(calls):
        batches.append([(c.args[2], c.args[3].num_devices) for c in calls])
        return real(calls)
    monkeypatch.setattr(spans, "concurrently", concurrently)
    autoshard.plan(step, *shapes(), cluster=CLUSTER, method=method(), batch_argnums=(2, 3))
    first, apply = batches
    assert len(first) == 15
    assert sorted(first) == sorted(((x, x + 1), n) for x in range(NUM_BLOCKS + 2)
                                   for n in (1, 2, 4))
    # the first span on each sub-mesh (it searches the sub-mesh's logical mesh, which the
    # others there wait for), largest first; then the other distinct layers' spans, largest
    # sub-mesh first; then the repeated blocks' (blocks are layers 1-3), which wait for the
    # first block's plans
    assert first[:3] == [((0, 1), 4), ((0, 1), 2), ((0, 1), 1)]
    assert first[3:9] == [((1, 2), 4), ((4, 5), 4), ((1, 2), 2), ((4, 5), 2), ((1, 2), 1),
                          ((4, 5), 1)]
    assert [span for span, _ in first[9:]] == [(2, 3)] * 3 + [(3, 4)] * 3
    assert apply == []


class _Traced(Exception):
    pass


def _program(monkeypatch):
    """The traced step as ``autoshard.plan`` hands it to ``AutoParallel``."""
    got = {}

    def capture(m, program, cluster):
        got["program"] = program
        raise _Traced
    with monkeypatch.context() as patch:
        patch.setattr(auto, "choose", capture)
        with pytest.raises(_Traced):
            autoshard.plan(step, *shapes(), cluster=CLUSTER, method=method(),
                           batch_argnums=(2, 3))
    return got["program"]


def _layouts(pricer_type, option, program):
    m = method(stage_option=option)
    search = m.pipeline(option)
    cut = cut_program(program, search)
    pricer = pricer_type(search, program, cut, CLUSTER)
    return [pricer.stage_layout(option, cut.num_layers, 2, num_stages=s)
            for s in range(2, cut.num_layers + 1)], pricer


@pytest.mark.parametrize("mode, budget", [
    ("individual", None), ("individual", 1_280_000),
    pytest.param("composition", 500_000, marks=pytest.mark.slow)])  # ~45 s: every span
def test_the_stage_dp_finds_what_planning_every_span_finds(mode, budget, monkeypatch):
    option = autoshard.AutoStageOption(
        submesh_physical_shape_space="manual",
        manually_specified_submeshes=[(1, 2), (1, 4), (1, 8)][mode == "composition":],
        layer_profile_mode=mode, memory_budget_per_device=budget)
    program = _program(monkeypatch)
    mine, pricer = _layouts(spans.SpanPricer, option, program)
    full, _ = _layouts(price._Pricer, option, program)
    assert mine == full
    stats = pricer.span_stats
    assert stats["pruned"] > 0
    if budget is not None:  # the budget makes some spans' apply tasks count, not all
        assert stats["apply_planned"] > 0 and stats["apply_skipped"] > 0
    else:
        assert stats["apply_planned"] == 0


def test_the_whole_mesh_candidate_shares_a_solver_budget_over_its_meshes(monkeypatch):
    """Each mesh of the whole-mesh plan gets ``budget / (2 * meshes)`` seconds (its LP bound
    and its ILP) unless the option sets ``solver_time_limit_s``; the plan is the fastest."""
    from autoshard import sharding
    from autoshard.sharding.planner import mesh_candidates

    big = Cluster.a100_80gb(num_hosts=64)  # 512 GPUs: 1-D, 2-D and 3-D meshes
    meshes = mesh_candidates(512, autoshard.AutoShardingOption(), None, 8)
    assert any(len(m) == 3 for m in meshes)
    option = auto.whole_mesh_option(QUIET, big, 600.0)
    assert option.solver_time_limit_s == pytest.approx(600.0 / (2 * len(meshes)))
    assert option.memory_tradeoff == 0.0 and option.solver_node_limit == QUIET.solver_node_limit
    assert option.solver_mip_gap == auto.WHOLE_MESH_MIP_GAP != QUIET.solver_mip_gap
    mine = autoshard.AutoShardingOption(solver_time_limit_s=900.0, memory_tradeoff=0.2,
                                        solver_mip_gap=0.01)
    assert auto.whole_mesh_option(mine, big, 600.0) == mine
    assert auto.whole_mesh_option(QUIET, big, None).solver_time_limit_s == 600.0

    seen = []
    real = sharding.plan_auto

    def plan_auto(closed, **kw):
        if kw["num_devices"] == 8:
            seen.append(kw["option"].solver_time_limit_s)
        return real(closed, **kw)
    monkeypatch.setattr(sharding, "plan_auto", plan_auto)
    est = autoshard.plan(step, *shapes(), cluster=CLUSTER, batch_argnums=(2, 3),
                         method=method(whole_mesh_solver_budget_s=30.0, max_num_stages=2))
    three = len(mesh_candidates(8, QUIET, None, 8))  # (8,), (2, 4), (4, 2)
    assert seen and set(seen) == {30.0 / (2 * three)}
    assert f"stopped after {30.0 / (2 * three):.3g} s" in est.explain()
    with pytest.raises(ValueError, match=r"whole_mesh_solver_budget_s \(0\) must be positive"):
        autoshard.AutoParallel(whole_mesh_solver_budget_s=0)


def test_a_whole_mesh_plan_over_the_memory_is_no_candidate(monkeypatch):
    """A whole-mesh plan whose estimate exceeds the devices' memory (the planner's estimate of
    the step can exceed its ILP's budget) is dropped, as a pipeline over it is."""
    import dataclasses

    real = auto.plan_program

    def over(method, program, cluster, **kw):
        plan = real(method, program, cluster, **kw)
        o = dataclasses.replace(plan.objective, peak_bytes_per_device=cluster.memory_bytes + 1)
        return dataclasses.replace(plan, objective=o)
    monkeypatch.setattr(auto, "plan_program", over)
    est = autoshard.plan(step, *shapes(), cluster=CLUSTER, method=method(max_num_stages=2),
                         batch_argnums=(2, 3))
    whole = est.candidates[0]
    assert not whole.fits and "is over the cluster's 80 GiB" in whole.dropped
    assert est.num_stages == 2 and "dropped: its estimated memory" in est.explain()
