"""``AutoParallel`` (issue 24): the method that chooses one stage or a pipeline itself, on a
described cluster (``autoshard.plan``) and on the devices at hand (``parallelize``)."""

import dataclasses
import re

import jax
import numpy as np
import pytest

import autoshard
from autoshard import Cluster
from autoshard.pipeline.auto import whole_mesh_option
from autoshard.sharding import AutoShardingOption
from models import assert_priced_plans_are_compiled, marked_mlp_args, marked_mlp_step

QUIET = AutoShardingOption(show_progress=False)


step = marked_mlp_step


def args(widths=(64, 512, 512, 512, 64), rows=16):
    """A deep MLP: large weights, small activations (a cut between stages moves little)."""
    return marked_mlp_args(widths, rows, scale=0.05)


def method(**kw):
    return autoshard.AutoParallel(layer_option="manual", default_auto_sharding_option=QUIET,
                                  **{"num_micro_batches": 4, **kw})


def slow_two_hosts(cluster):
    """``cluster``'s 8 devices as 2 hosts of 4 joined by a 1 MB/s link."""
    return dataclasses.replace(cluster, num_hosts=2, devices_per_host=4,
                               inter_host_bandwidth=1e6)


def test_a_slow_link_between_two_hosts_makes_it_choose_a_pipeline():
    cluster = slow_two_hosts(Cluster.a100_80gb(num_hosts=2, devices_per_host=4))
    est = autoshard.plan(step, *args(), method=method(), cluster=cluster)
    whole = est.candidates[0]
    # The pipelines are priced first; the whole mesh's planner bounds show none of its plans
    # can beat the fastest, so no mesh of it is solved to the end.
    assert whole.num_stages == 1 and not whole.fits
    assert "no plan on the whole mesh can beat the fastest pipeline's" in whole.dropped
    assert est.num_stages >= 2
    # The bound was right: the whole-mesh plan found without it is slower.
    alone = autoshard.plan(step, *args(), cluster=cluster, method=autoshard.ShardParallel(
        num_micro_batches=4, auto_sharding_option=whole_mesh_option(QUIET, cluster)))
    assert alone.objective.total_s > est.step_s
    assert isinstance(est.method, autoshard.PipeshardParallel)
    assert est.step_s == est.estimate.step_s == min(c.step_s for c in est.candidates)
    for stage in est.estimate.stages:  # no stage straddles the slow link
        first, n = stage.devices
        assert first // 4 == (first + n - 1) // 4, stage.devices
    text = est.explain()
    assert [c.num_stages for c in est.candidates] == [1, 2, 3, 4]
    for c in est.candidates[1:]:  # every pipeline named with its time and memory
        assert re.search(rf"{c.num_stages} stages?.*step {c.step_s:.4g} s, memory", text)
    assert ("1 stage: ShardParallel on the whole mesh, 4 micro-batches: not priced; dropped: "
            "no plan") in text
    assert f"chosen: {est.num_stages} stages, the fastest of 3 that fit memory" in text
    assert "PipeshardParallel(ManualStageOption" in text


def test_one_stage_where_no_pipeline_is_faster():
    cluster = Cluster.a100_80gb(num_hosts=1, devices_per_host=8)
    est = autoshard.plan(step, *args(), method=method(num_micro_batches=1), cluster=cluster)
    assert est.num_stages == 1
    assert isinstance(est.method, autoshard.ShardParallel)
    assert est.method.plan is est.estimate
    pipelines = [c for c in est.candidates if c.num_stages > 1 and c.fits]
    assert pipelines and all(c.step_s > est.step_s for c in pipelines)
    assert "chosen: 1 stage, the fastest" in est.explain()


def _steps(run, params, batch, n=3):
    for _ in range(n):
        params = run(params, batch)
    return params


@pytest.mark.parametrize("pipeline", [False, True])
def test_parallelize_runs_the_choice_as_a_single_device_jit_does(pipeline):
    params, batch = args(widths=(8, 64, 64, 64, 4))
    m = method()
    if pipeline:  # the choice made for these devices described as two slow-linked hosts
        est = autoshard.plan(step, params, batch, method=m,
                             cluster=slow_two_hosts(Cluster.from_devices(jax.devices())))
        assert est.num_stages >= 2
        m = method(plan=est)
    run = autoshard.parallelize(step, method=m)
    got, want = _steps(run, params, batch), _steps(jax.jit(step), params, batch)
    for k in params:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)
    assert hasattr(run.get_last_executable(), "task_plans") == pipeline


def test_priced_task_plans_are_the_ones_the_runtime_compiles():
    params, batch = args(widths=(8, 64, 64, 64, 4))
    est = autoshard.plan(step, params, batch, method=method(),
                         cluster=slow_two_hosts(Cluster.from_devices(jax.devices())))
    run = autoshard.parallelize(step, method=method(plan=est))
    run(params, batch)
    ran = run.get_last_executable().task_plans
    assert_priced_plans_are_compiled(est.estimate.stages, ran)


def test_a_cluster_too_small_names_the_smallest_memory_and_what_would_fit():
    tiny = Cluster(num_hosts=2, devices_per_host=4, peak_flops=1e14, memory_bytes=20_000)
    with pytest.raises(ValueError) as info:
        autoshard.plan(step, *args(), method=method(), cluster=tiny)
    text = str(info.value)
    assert re.search(r"AutoParallel found no plan within the memory of .* \(20,000 B per "
                     r"device\): the smallest estimate found is [\d,]+ B per device", text)
    smallest = int(re.search(r"smallest estimate found is ([\d,]+) B", text)[1].replace(",", ""))
    each = [int(x.replace(",", "")) for x in re.findall(r"stages?: ([\d,]+) B", text)]
    assert len(each) == 4 and smallest == min(each) > 20_000
    assert re.search(r"largest arrays: arg0\['w[12]'\]", text)
    # and why each was dropped within the limit, candidates with one reason named together
    assert re.search(r"Within the limit: 1 stage\(s\): .*; 2, 3, 4 stage\(s\): no layout", text)
    assert re.search(r"use about \d+ devices or more, or a pipeline of at least \d+ stages", text)


def test_micro_batch_counts_are_searched_and_the_choice_runs_with_its_count():
    cluster = slow_two_hosts(Cluster.a100_80gb(num_hosts=2, devices_per_host=4))
    est = autoshard.plan(step, *args(), cluster=cluster,
                         method=method(num_micro_batches=2, micro_batch_counts=(8, 4)))
    counts = {(c.num_stages, c.num_micro_batches) for c in est.candidates}
    # the whole mesh at num_micro_batches; every stage count at 2, 4 and 8
    assert counts == {(1, 2)} | {(s, k) for s in (2, 3, 4) for k in (2, 4, 8)}
    for k in (2, 4, 8):  # each count's pipelines are the ones searched with that count alone
        alone = autoshard.plan(step, *args(), cluster=cluster,
                               method=method(num_micro_batches=k))
        mine = {c.num_stages: c.step_s for c in est.candidates
                if c.num_micro_batches == k and c.num_stages > 1}
        assert mine == {c.num_stages: c.step_s for c in alone.candidates if c.num_stages > 1}
    best = min((c for c in est.candidates if c.fits), key=lambda c: c.step_s)
    assert est.chosen is best and est.method.num_micro_batches == best.num_micro_batches
    # more micro-batches, a smaller bubble: the fastest pipeline uses the most of them here
    assert best.num_micro_batches == 8
    assert f"{best.num_stages} stages, 8 micro-batches (" in est.explain()


def test_a_searched_micro_batch_count_runs_as_a_single_device_jit_does():
    params, batch = args(widths=(8, 64, 64, 64, 4))
    m = method(num_micro_batches=2, micro_batch_counts=(4,))
    est = autoshard.plan(step, params, batch, method=m,
                         cluster=slow_two_hosts(Cluster.from_devices(jax.devices())))
    assert est.num_stages >= 2 and est.method.num_micro_batches == 4
    run = autoshard.parallelize(step, method=dataclasses.replace(m, plan=est))
    got, want = _steps(run, params, batch), _steps(jax.jit(step), params, batch)
    for k in params:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)
    assert run.get_last_executable().k == 4  # the step ran 4 micro-batches


def test_bad_options_name_the_fix():
    with pytest.raises(ValueError, match=r"micro_batch_counts \(\(4, 0\)\) must be a non-empty"):
        autoshard.AutoParallel(micro_batch_counts=(4, 0))
    with pytest.raises(ValueError, match=r"num_micro_batches \(3\) must divide the batch size "
                                         r"\(16\) of .*AutoParallel's micro-batch counts "
                                         r"\(1, 3\)\)\. Choose counts that divide 16"):
        autoshard.plan(step, *args(), method=method(num_micro_batches=1, micro_batch_counts=(3,)),
                       cluster=Cluster.a100_80gb(num_hosts=1, devices_per_host=8))
    with pytest.raises(ValueError, match=r"pipeline_schedule \('interleaved_1f1b'\) must be"):
        autoshard.AutoParallel(pipeline_schedule="interleaved_1f1b")
    with pytest.raises(ValueError, match=r"max_num_stages \(0\) must be a positive int"):
        autoshard.AutoParallel(max_num_stages=0)
    with pytest.raises(TypeError, match="must be the AutoEstimate"):
        autoshard.AutoParallel(plan="plan.json")


def test_the_stage_dp_for_a_fixed_stage_count_and_placeable_sub_meshes():
    """``stage_dp(num_stages=s, placeable=...)`` equals enumerating every cut into ``s``
    stages whose sub-meshes lie inside a host of 4 devices or cover whole hosts."""
    import itertools
    import math

    from autoshard.pipeline.stages import stage_dp

    rng = np.random.default_rng(0)
    num_layers, num_devices, sizes, k = 5, 8, [1, 2, 4, 8], 3
    table = rng.uniform(1, 10, (num_layers, num_layers + 1, len(sizes)))

    def cost(i, j, c):
        return table[i, j, c] * (j - i) / sizes[c] ** 0.5

    def placeable(n, first):
        return n <= 4 and first // 4 == (first + n - 1) // 4 or n % 4 == 0 and first % 4 == 0
    for s in range(1, num_layers + 1):
        best = math.inf
        for cuts in itertools.combinations(range(1, num_layers), s - 1):
            bounds = (0, *cuts, num_layers)
            for cs in itertools.product(range(len(sizes)), repeat=s):
                firsts = np.cumsum([0] + [sizes[c] for c in cs])
                if firsts[-1] != num_devices or not all(
                        placeable(sizes[c], f) for c, f in zip(cs, firsts, strict=False)):
                    continue
                times = [cost(bounds[t], bounds[t + 1], c) for t, c in enumerate(cs)]
                best = min(best, sum(times) + (k - 1) * max(times))
        got, stages = stage_dp(num_layers, num_devices, sizes, cost, k, num_stages=s,
                               placeable=placeable)
        assert got == pytest.approx(best), s
        assert len(stages) == (s if np.isfinite(best) else 0)


def test_the_stage_search_options_are_an_auto_stage_option():
    with pytest.raises(TypeError, match=r"stage_option \('auto'\) must be an "
                                        r"autoshard.AutoStageOption"):
        autoshard.AutoParallel(stage_option="auto")
    with pytest.raises(ValueError, match=r"profile=True\) is not supported"):
        autoshard.AutoParallel(stage_option=autoshard.AutoStageOption(profile=True))
    # a search restricted to one-host sub-meshes of 4 devices: both stages on one each
    est = autoshard.plan(step, *args(), method=method(stage_option=autoshard.AutoStageOption(
        submesh_physical_shape_space="manual", manually_specified_submeshes=[(1, 4)])),
        cluster=slow_two_hosts(Cluster.a100_80gb(num_hosts=2, devices_per_host=4)))
    assert [c.num_stages for c in est.candidates] == [1, 2, 3, 4]
    assert [c.fits for c in est.candidates] == [False, True, False, False]  # 1: outpriced
    assert "no layout" in est.candidates[2].dropped
    assert [s.devices for s in est.estimate.stages] == [(0, 4), (4, 4)]
