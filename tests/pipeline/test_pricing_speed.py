"""Pricing a pipeline plans each distinct task once (issue 26, item 8).

A 39.1B-like step in miniature (an embedding layer, identical transformer-like blocks, a head;
Adam; a pipeline boundary after each) is priced on a small described cluster by the stage
search (``AutoStageOption``) and by ``AutoParallel``. Every call of the planner is counted:
no task is planned twice on the same sub-mesh with the same options and input layouts (the
identical middle layers once per sub-mesh), and the estimates equal those of the pricing with
every cache turned off.
"""

from collections import Counter

import pytest
from pipeline_models import BlockLM

import autoshard
from autoshard import Cluster
from autoshard.pipeline import method as method_mod
from autoshard.pipeline import price, tasks

NUM_BLOCKS = 4
LM = BlockLM(hidden=32, vocab=64, rows=16, num_blocks=NUM_BLOCKS)
QUIET = autoshard.AutoShardingOption(show_progress=False)
loss, step, shapes = LM.loss, LM.step, LM.shapes

CLUSTER = Cluster.a100_80gb(num_hosts=2, devices_per_host=2)
STAGES = autoshard.AutoStageOption(submesh_physical_shape_space="manual",
                                   manually_specified_submeshes=[(1, 2), (2, 2)],
                                   layer_profile_mode="individual")


class _NoCache(dict):
    """A cache that keeps nothing: every task planned again."""

    def __setitem__(self, key, value):
        pass

    def setdefault(self, key, default=None):
        return _NoCache()


@pytest.fixture
def counted(monkeypatch):
    """The key of every planner call of the pricing (all a plan depends on)."""
    calls = []
    real = tasks.plan_auto

    def plan_auto(closed, **kw):
        calls.append((str(closed), kw["num_devices"], repr(kw["option"]),
                      repr(kw["fixed_in_specs"]), tuple(kw["axis_names"] or ()),
                      kw["cluster"], tuple(kw["batch_invars"]), tuple(kw["aliases"])))
        return real(closed, **kw)
    monkeypatch.setattr(tasks, "plan_auto", plan_auto)
    return calls


def uncached(monkeypatch):
    real = price._Pricer.__init__

    def init(self, *args, **kw):
        real(self, *args, **kw)
        self.cache = _NoCache()
    monkeypatch.setattr(price._Pricer, "__init__", init)
    monkeypatch.setattr(tasks, "_cached", lambda cache, key, planned: planned)


def plan(method):
    return autoshard.plan(step, *shapes(), cluster=CLUSTER, method=method,
                          batch_argnums=(2, 3))


def test_the_stage_search_plans_each_distinct_task_once(counted, monkeypatch):
    method = autoshard.PipeshardParallel(num_micro_batches=2, layer_option="manual",
                                         default_auto_sharding_option=QUIET,
                                         stage_option=STAGES)
    est = plan(method)
    once = list(counted)
    assert len(once) == len(set(once)), "a task planned twice with the same key"
    counted.clear()
    uncached(monkeypatch)
    again = plan(method)
    # without the caches the identical blocks are planned once per block on each sub-mesh
    assert max(Counter(counted).values()) >= NUM_BLOCKS
    assert len(counted) > len(once) + NUM_BLOCKS  # the caches saved planner calls ...
    assert again.explain() == est.explain()  # ... and changed nothing
    assert again.step_s == est.step_s


def test_auto_parallel_plans_each_distinct_task_once(counted, monkeypatch):
    method = autoshard.AutoParallel(num_micro_batches=2, layer_option="manual",
                                    default_auto_sharding_option=QUIET, stage_option=STAGES,
                                    num_priced=2)
    est = plan(method)
    once = list(counted)
    assert len(once) == len(set(once)), "a task planned twice with the same key"
    counted.clear()
    uncached(monkeypatch)
    again = plan(method)
    assert len(counted) > len(once)
    assert [(c.num_stages, c.step_s, c.memory_bytes, c.split, c.dropped)
            for c in again.candidates] == [(c.num_stages, c.step_s, c.memory_bytes, c.split,
                                            c.dropped) for c in est.candidates]
    assert again.estimate.explain() == est.estimate.explain()


def test_pricing_skips_the_data_parallel_comparison(monkeypatch):
    """Priced task plans skip ``plan_auto``'s pure data-parallel comparison (no task plan's
    ``explain()`` shows it there); every estimate is what it is with the comparison made."""
    from autoshard.sharding import planner
    calls = []
    real_dp = planner._data_parallel_objective
    monkeypatch.setattr(planner, "_data_parallel_objective",
                        lambda *a: calls.append(1) or real_dp(*a))
    method = autoshard.PipeshardParallel(num_micro_batches=2, layer_option="manual",
                                         default_auto_sharding_option=QUIET,
                                         stage_option=STAGES)
    est = plan(method)
    assert calls == []
    real = tasks.plan_auto
    monkeypatch.setattr(tasks, "plan_auto",
                        lambda closed, **kw: real(closed, **{**kw, "compare_data_parallel": True}))
    compared = plan(method)
    assert calls == []   # the comparison is solved when first read (explain() reads it)
    assert compared.explain() == est.explain() and compared.step_s == est.step_s
    for mine, theirs in zip(est.stages, compared.stages, strict=True):
        for (name, p), (_, q) in zip(mine.plans, theirs.plans, strict=True):
            assert p.objective.data_parallel_s is None and q.objective.data_parallel_s is not None
            assert p.in_specs == q.in_specs and p.objective.total_s == q.objective.total_s, name
    assert len(calls) > 0


def test_the_stage_search_chooses_one_logical_mesh_per_sub_mesh(monkeypatch):
    """A stage runs on one logical mesh, so the search prices every span of a sub-mesh on the
    mesh the most common layer's forward chooses there: one mesh search per sub-mesh (it was
    one per distinct layer and sub-mesh, plus one per stage when the chosen layout was priced:
    39.1B's search spent most of its 466 s there), and the layout found is priced on the
    meshes the search priced it on."""
    calls = []
    real = tasks.plan_auto

    def plan_auto(closed, **kw):
        got = real(closed, **kw)
        calls.append((kw["num_devices"], kw["option"].logical_mesh_shape, got.mesh_shape))
        return got
    monkeypatch.setattr(tasks, "plan_auto", plan_auto)
    est = plan(autoshard.PipeshardParallel(num_micro_batches=2, layer_option="manual",
                                           default_auto_sharding_option=QUIET,
                                           stage_option=STAGES))
    searched = [(n, chosen) for n, fixed, chosen in calls if fixed is None]
    assert sorted(n for n, _ in searched) == [2, 4]  # the two sub-meshes, once each
    chosen = dict(searched)
    planned_on = {(n, tuple(fixed)) for n, fixed, _ in calls if fixed is not None}
    assert planned_on == {(n, tuple(chosen[n])) for n in chosen}  # every other plan on them
    for stage in est.stages:
        assert tuple(stage.mesh_shape) == tuple(chosen[stage.devices[1]])



def _manual(stages, sizes):
    """A pipeline of ``stages`` (layer ids per stage) on sub-meshes of ``sizes`` devices of
    one host each (1-D meshes), in order over ``CLUSTER``'s 4 devices."""
    from autoshard.pipeline import ManualStageOption
    return autoshard.PipeshardParallel(
        num_micro_batches=2, layer_option="manual", default_auto_sharding_option=QUIET,
        stage_option=ManualStageOption(stages, [(1, n) for n in sizes], [(n,) for n in sizes],
                                       [{}] * len(stages)))


class _Traced(Exception):
    pass


def _program(monkeypatch):
    """The traced step as ``autoshard.plan`` hands it to a method's pricing."""
    got = {}

    def capture(method, program, cluster, **kw):
        got["program"] = program
        raise _Traced
    with monkeypatch.context() as patch:
        patch.setattr(method_mod, "price_pipeline", capture)
        with pytest.raises(_Traced):
            plan(_manual([[0, 1, 2], [3, 4, 5]], [2, 2]))
    return got["program"]


def test_pipelines_priced_with_one_cache_share_their_identical_tasks(counted, monkeypatch):
    """The candidates of a search are priced with one cache (``price_pipeline(cache=)``):
    a task two of them plan alike (the same jaxpr, sub-mesh, options and input layouts) is
    planned once, the walk's plans included. GPT-3 175B's 4-, 5- and 6-stage candidates
    share their 2-layer stages' tasks, which each candidate's walk planned again. Here two
    layouts share their first stage (the embedding and two blocks) and its apply tasks."""
    program = _program(monkeypatch)
    a = _manual([[0, 1, 2], [3, 4, 5]], [2, 2])
    b = _manual([[0, 1, 2], [3], [4, 5]], [2, 1, 1])
    counted.clear()
    cache: dict = {}
    shared = [price.price_pipeline(m, program, CLUSTER, cache=cache) for m in (a, b)]
    keys = list(counted)
    assert len(keys) == len(set(keys)), "a task planned twice with the same key"
    counted.clear()
    alone = [price.price_pipeline(m, program, CLUSTER) for m in (a, b)]
    # each layout on a cache of its own plans the shared stage's tasks again
    assert len(counted) > len(keys) and len(set(counted)) == len(set(keys))
    for x, y in zip(shared, alone, strict=True):
        assert x.step_s == y.step_s and x.explain() == y.explain()
