"""Planning for a described cluster: Cluster, autoshard.plan, saved plans applied later."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import autoshard
from autoshard import Cluster, ShardingPlan, ShardParallel


def loss_fn(params, batch):
    x, y = batch
    h = jax.nn.relu(x @ params["w1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def train_step(params, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


def shapes(batch=32, hidden=256):
    f32 = jnp.float32
    params = {"w1": jax.ShapeDtypeStruct((64, hidden), f32),
              "w2": jax.ShapeDtypeStruct((hidden, 64), f32)}
    data = (jax.ShapeDtypeStruct((batch, 64), f32), jax.ShapeDtypeStruct((batch, 64), f32))
    return params, data


def real(tree, seed=0):
    keys = iter(jax.random.split(jax.random.key(seed), 8))
    return jax.tree.map(lambda s: jax.random.normal(next(keys), s.shape, s.dtype), tree)


QUIET = autoshard.AutoShardingOption(show_progress=False)


# Cluster -----------------------------------------------------------------------------------------
def test_a100_preset_and_axes_priced_by_the_links_they_use():
    c = Cluster.a100_80gb(4)
    assert c.num_devices == 32 and c.memory_bytes == 80 * 2**30
    assert c.flop_s == pytest.approx(1 / (312e12 * c.flops_efficiency))
    # (4, 8): axis 1 is one host's 8 GPUs (NVLink), axis 0 joins the hosts (InfiniBand).
    alpha, beta = c.mesh_costs((4, 8))
    assert beta == (1 / 23e9, 1 / 230e9) and alpha[0] > alpha[1]
    # (2, 16): a 16-wide axis straddles two hosts and is priced by its slowest hop.
    assert c.axis_crosses_hosts((2, 16)) == (True, True)
    assert Cluster.a100_80gb(1).axis_crosses_hosts((2, 4)) == (False, False)


def test_measured_numbers_replace_preset_fields_and_bad_values_name_the_field():
    measured = dataclasses.replace(Cluster.a100_80gb(2), inter_host_bandwidth=20e9)
    assert measured.mesh_costs((2, 8))[1][0] == 1 / 20e9
    assert Cluster.from_dict(measured.to_dict()) == measured
    with pytest.raises(ValueError, match=r"Cluster.inter_host_bandwidth \(0\) must be a positive"):
        Cluster(num_hosts=1, devices_per_host=8, peak_flops=1e14, inter_host_bandwidth=0)
    with pytest.raises(ValueError, match=r"flops_efficiency \(1.5\) must be in \(0, 1\]"):
        Cluster(num_hosts=1, devices_per_host=8, peak_flops=1e14, flops_efficiency=1.5)


def test_from_devices_describes_the_devices_at_hand():
    c = Cluster.from_devices(jax.devices())
    assert c.num_devices == len(jax.devices()) and c.num_hosts == 1


def test_mesh_that_does_not_match_the_cluster_is_an_error():
    with pytest.raises(ValueError, match=r"mesh shape \(2, 2\) holds 4 devices but the cluster"):
        Cluster.a100_80gb(1).mesh_costs((2, 2))
    option = autoshard.AutoShardingOption(logical_mesh_shape=(2, 2), show_progress=False)
    with pytest.raises(ValueError, match=r"logical_mesh_shape \(2, 2\) has 4 devices but the "
                                         r"method uses 32"):
        autoshard.plan(train_step, *shapes(), cluster=Cluster.a100_80gb(4),
                       method=ShardParallel(auto_sharding_option=option))


# autoshard.plan ----------------------------------------------------------------------------------
def test_plan_for_a_cluster_you_do_not_have_explains_time_and_memory():
    plan = autoshard.plan(train_step, *shapes(batch=256), cluster=Cluster.a100_80gb(4),
                          method=ShardParallel(auto_sharding_option=QUIET))
    assert int(np.prod(plan.mesh_shape)) == 32 and plan.fingerprint.num_devices == 32
    text = plan.explain()
    for part in ("estimated step time", "compute", "communication", "TFLOP/s per device",
                 "A100 80GB, 4 x 8", "estimated peak memory per device"):
        assert part in text
    o = plan.objective
    # 2 forward dots, 3 backward (no gradient for the data x): 2 * 256 * 64 * 256 FLOPs each.
    assert o.flops == pytest.approx(5 * 2 * 256 * 64 * 256)
    # On 4 nodes no mesh mirrors another on links no slower: (2, 16) puts its 16-wide axis on
    # all 8 NICs of each node (200 GB/s), (16, 2) on 4 (100 GB/s) but its 2-wide axis on
    # NVLink; both are considered (solved, or pruned by their bound).
    assert not any("links no slower" in why for _, why in o.meshes_pruned)
    assert {(2, 16), (16, 2)} <= {tuple(s) for s, _ in o.meshes_tried + o.meshes_pruned}
    # On one node (4, 2) costs what (2, 4) costs: the mirror is not solved, and says so.
    one_node = autoshard.plan(train_step, *shapes(batch=256), cluster=Cluster.a100_80gb(1),
                              method=ShardParallel(auto_sharding_option=QUIET)).objective
    assert ((4, 2), "mesh (2, 4) has the same axes on links no slower") in one_node.meshes_pruned


def test_compute_term_uses_the_devices_flops():
    base = Cluster(num_hosts=1, devices_per_host=8, peak_flops=1e12, memory_bandwidth=1e11)
    fast = dataclasses.replace(base, peak_flops=2e12, memory_bandwidth=2e11)
    option = autoshard.AutoShardingOption(logical_mesh_shape=(8,), show_progress=False)
    method = ShardParallel(auto_sharding_option=option)
    slow_plan = autoshard.plan(train_step, *shapes(batch=256), cluster=base, method=method)
    fast_plan = autoshard.plan(train_step, *shapes(batch=256), cluster=fast, method=method)
    assert fast_plan.objective.compute_s == pytest.approx(slow_plan.objective.compute_s / 2)


def test_plan_saves_and_loads_as_json(tmp_path):
    plan = autoshard.plan(train_step, *shapes(), cluster=Cluster.a100_80gb(2),
                          method=ShardParallel(auto_sharding_option=QUIET))
    plan.save(tmp_path / "plan.json")
    assert ShardingPlan.load(tmp_path / "plan.json") == plan
    data = plan.to_dict()
    data["format"] = "something else"
    with pytest.raises(ValueError, match="format 'something else'"):
        ShardingPlan.from_dict(data)


def test_saved_plan_runs_without_replanning_and_matches_jit(tmp_path, monkeypatch):
    plan = autoshard.plan(train_step, *shapes(), cluster=Cluster.from_devices(jax.devices()),
                          method=ShardParallel(auto_sharding_option=QUIET))
    plan.save(tmp_path / "plan.json")
    loaded = ShardingPlan.load(tmp_path / "plan.json")

    def no_planning(*args, **kwargs):
        raise AssertionError("a saved plan must not be re-planned")
    monkeypatch.setattr(autoshard.sharding, "plan_auto", no_planning)
    step = autoshard.parallelize(train_step, method=ShardParallel(plan=loaded))
    params, batch = real(shapes())
    new, loss = step(params, batch)
    want_new, want_loss = jax.jit(train_step)(params, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(new["w1"], want_new["w1"], rtol=1e-5, atol=1e-6)
    assert step.get_last_executable().plan.mesh_shape == loaded.mesh_shape


def test_plan_applied_to_another_program_names_what_differs():
    plan = autoshard.plan(train_step, *shapes(batch=32),
                          cluster=Cluster.from_devices(jax.devices()),
                          method=ShardParallel(auto_sharding_option=QUIET))
    step = autoshard.parallelize(train_step, method=ShardParallel(plan=plan))
    with pytest.raises(ValueError, match=r"made for another program: input arg1\[0\] was "
                                         r"float32\[32,64\] in the plan, arg1\[0\] is "
                                         r"float32\[64,64\] now.*re-plan"):
        step.get_executable(*shapes(batch=64))


def test_plan_applied_to_another_device_count_names_both():
    plan = autoshard.plan(train_step, *shapes(), cluster=Cluster.a100_80gb(2),
                          method=ShardParallel(auto_sharding_option=QUIET))
    step = autoshard.parallelize(train_step, method=ShardParallel(plan=plan))
    with pytest.raises(ValueError, match=r"plan is for 16 devices \(A100 80GB, 2 x 8.*\) but "
                                         r"the method has 8.*Cluster.from_devices"):
        step.get_executable(*shapes())


def test_model_that_fits_no_split_names_the_estimate_and_largest_arrays():
    tiny = Cluster(num_hosts=1, devices_per_host=8, peak_flops=1e14, memory_bytes=1000)
    with pytest.raises(ValueError, match=r"No plan fits memory_budget_per_device \(1,000 B\).*"
                                         r"smallest estimate found is [\d,]+ B per device.*largest arrays: "
                                         r"arg0\['w[12]'\].*use about \d+ devices or more.*pipeline"):
        autoshard.plan(train_step, *shapes(), cluster=tiny,
                       method=ShardParallel(auto_sharding_option=QUIET))


def test_plan_rejects_methods_it_does_not_cover():
    with pytest.raises(TypeError, match="plans ShardParallel or PipeshardParallel"):
        autoshard.plan(train_step, *shapes(), method=autoshard.DataParallel())
    with pytest.raises(ValueError, match="plan or manual_sharding_option, not both"):
        ShardParallel(plan=autoshard.plan(train_step, *shapes()),
                      manual_sharding_option=autoshard.ManualShardingOption(("x",)))


# Pricing a hand-written plan -----------------------------------------------------------------
def megatron_method(in_axis_resources, shape=(2, 4), **manual):
    return ShardParallel(
        manual_sharding_option=autoshard.ManualShardingOption(
            ("data", "model"), in_axis_resources=in_axis_resources, **manual),
        auto_sharding_option=dataclasses.replace(QUIET, logical_mesh_shape=shape))


MEGATRON = ({"w1": P(None, "model"), "w2": P("model", None)}, P("data", None))


def test_hand_written_plan_is_priced_by_the_same_model_and_runs():
    cluster = Cluster.a100_80gb(1)
    priced = autoshard.plan(train_step, *shapes(), cluster=cluster,
                            method=megatron_method(MEGATRON))
    assert priced.method == "ShardParallel(manual, priced)"
    specs = dict(zip((leaf.path for leaf in priced.inputs), priced.in_specs, strict=True))
    assert specs["arg0['w1']"] == P(None, "model") and specs["arg0['w2']"] == P("model")
    assert specs["arg1[0]"] == P("data")
    # The automatic plan on the same mesh searches a superset: it is never rated slower.
    auto = autoshard.plan(train_step, *shapes(), cluster=cluster, method=ShardParallel(
        auto_sharding_option=dataclasses.replace(QUIET, logical_mesh_shape=(2, 4))))
    assert auto.objective.total_s <= priced.objective.total_s * (1 + 1e-9)
    # Everything arriving replicated: the planner must slice and reshard around it, and the
    # price says so.
    replicated = autoshard.plan(train_step, *shapes(), cluster=cluster,
                                method=megatron_method(P()))
    assert all(s == P() for s in replicated.in_specs)
    # An input the option leaves unset is priced replicated, as the manual plan runs it.
    partial = autoshard.plan(train_step, *shapes(), cluster=cluster, method=megatron_method(
        ({"w1": P(None, "model"), "w2": None}, P("data", None))))
    assert partial.in_specs[:2] == (P(None, "model"), P())
    assert replicated.objective.total_s > 1.05 * priced.objective.total_s
    assert (replicated.objective.peak_bytes_per_device
            > priced.objective.peak_bytes_per_device)
    # The priced plan is a plan: it runs on 8 devices and matches jax.jit.
    priced = dataclasses.replace(priced, fingerprint=dataclasses.replace(
        priced.fingerprint, devices_per_host=None))
    step = autoshard.parallelize(train_step, method=ShardParallel(plan=priced))
    params, batch = real(shapes())
    new, loss = step(params, batch)
    want_new, want_loss = jax.jit(train_step)(params, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(new["w2"], want_new["w2"], rtol=1e-5, atol=1e-6)
    assert step.get_last_executable().plan.in_specs[0] == P(None, "model")


def test_pricing_a_hand_written_plan_names_what_is_missing_or_wrong():
    cluster = Cluster.a100_80gb(1)
    with pytest.raises(ValueError, match=r"logical_mesh_shape is \(4, 4\); give one size per "
                                         r"axis with a product of 8"):
        autoshard.plan(train_step, *shapes(), cluster=cluster,
                       method=megatron_method(MEGATRON, shape=(4, 4)))
    with pytest.raises(ValueError, match=r"out_axis_resources .* is not priced"):
        autoshard.plan(train_step, *shapes(), cluster=cluster,
                       method=megatron_method(MEGATRON, out_axis_resources=P()))
    with pytest.raises(ValueError, match=r"in_axis_resources for arg0\['w1'\]: spec .* names "
                                         r"mesh axis 'tensor'"):
        autoshard.plan(train_step, *shapes(), cluster=cluster, method=megatron_method(
            ({"w1": P(None, "tensor"), "w2": P()}, P())))


# Pipelines on a described cluster ------------------------------------------------------------
def pipeline_args(batch=32, widths=(8, 256, 256, 256, 4)):
    f32 = jnp.float32
    params = {f"w{i}": jax.ShapeDtypeStruct((a, b), f32)
              for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True))}
    data = (jax.ShapeDtypeStruct((batch, widths[0]), f32),
            jax.ShapeDtypeStruct((batch, widths[-1]), f32))
    return params, data


def pipeline_step(markers=True):
    """SGD on a tanh MLP; a pipeline boundary after every hidden layer (``markers``)."""
    def loss(p, x, y):
        for i in range(len(p)):
            x = x @ p[f"w{i}"]
            if i < len(p) - 1:
                x = jnp.tanh(x)
                if markers:
                    autoshard.mark_pipeline_boundary()
        return jnp.mean((x - y) ** 2)

    def step(p, batch):
        g = autoshard.grad(loss)(p, *batch)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)
    return step


DATA_PARALLEL = dataclasses.replace(QUIET, force_data_parallel=True)


def pipeshard(**kw):
    kw.setdefault("layer_option", "manual")
    kw.setdefault("default_auto_sharding_option", QUIET)
    return autoshard.PipeshardParallel(num_micro_batches=4, **kw)


def test_pipeline_step_time_is_the_replayed_schedule_of_its_stage_times():
    from autoshard.pipeline import get_schedule, simulate

    cluster = Cluster.a100_80gb(2, devices_per_host=2)
    est = autoshard.plan(pipeline_step(), *pipeline_args(), cluster=cluster,
                         method=pipeshard(stage_option=autoshard.UniformStageOption(num_stages=2)))
    assert [s.layers for s in est.stages] == [(0, 1), (2, 3)]
    assert [(s.devices, s.physical_shape) for s in est.stages] == [((0, 2), (1, 2)),
                                                                   ((2, 2), (1, 2))]
    costs = {(k, s.stage): t + s.send_s[k] for s in est.stages for k, t in s.task_s.items()
             if k != "apply"}
    sim = simulate(get_schedule("1f1b", num_stages=2, num_micro_batches=4), costs)
    apply_s = max(s.task_s["apply"] + s.send_s["apply"] for s in est.stages)
    assert est.step_s == pytest.approx(sim.makespan + apply_s, rel=1e-12)
    assert est.bubble_fraction == pytest.approx(sim.bubble_fraction) and sim.bubble_fraction > 0
    # Each task's time is its plan's objective, planned on its sub-mesh's own cluster.
    for s in est.stages:
        plans = dict(s.plans)
        assert s.task_s["F"] == plans[f"F{s.stage}"].objective.total_s
        assert s.task_s["B"] == plans[f"B{s.stage}"].objective.total_s
        assert all("2 devices (1 hosts x 2)" in p.cluster for p in plans.values())
    # Stage 0's activations go to the other host: one inter-host copy per F, its bytes per device.
    f0 = est.stages[0]
    assert f0.send_bytes["F"] > 0 and f0.send_s["F"] == pytest.approx(
        cluster.inter_host_latency_s + f0.send_bytes["F"] / cluster.inter_host_bandwidth)
    text = est.explain()
    for needle in ("stage 1: layers [2, 3] on devices 2..3", "bubble", "F0: mesh", "B1: mesh",
                   "rank 1:", "GiB per device"):
        assert needle in text


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_priced_pipeline_tasks_are_the_plans_the_runtime_compiles(schedule):
    # Priced for the 8 CPU devices at hand, then built for real: every task's plan (its
    # input specs, pinned to the layouts the runtime gives them, and its objective) agrees.
    method = pipeshard(pipeline_schedule=schedule, stage_option=autoshard.UniformStageOption(
        num_stages=2, submesh_logical_shape=(4,)))
    args = pipeline_args()
    est = autoshard.plan(pipeline_step(), *args, method=method,
                         cluster=Cluster.from_devices(jax.devices()))
    step = autoshard.parallelize(pipeline_step(), method=method)
    executable = step.get_executable(*real(args))
    compiled = {t.task.name: t.plan for t in [*executable.tasks.values(), *executable.apply]}
    priced = {name: plan for s in est.stages for name, plan in s.plans}
    assert set(priced) == set(compiled) and len(priced) == (8 if schedule == "zero_bubble" else 6)
    # A backward task whose rows arrive split over batch axes runs per device over them; its
    # plan (priced and compiled alike) leaves its gradient reductions to the once-per-step
    # reduce task, which the pricing charges to the stage's apply time.
    compared = set(priced)
    reduced = [name for name, plan in compiled.items() if name.startswith("B") and any(
        "reduce task" in n for n in plan.notes)]
    assert reduced, sorted(compiled)
    assert all(est.stages[s].task_s["apply"] > 0 for s in range(2))
    for name in sorted(compared):
        plan = priced[name]
        assert plan.in_specs == compiled[name].in_specs, name
        assert plan.objective.total_s == pytest.approx(compiled[name].objective.total_s), name


def test_pipeline_layers_clustered_automatically_without_markers():
    est = autoshard.plan(pipeline_step(markers=False), *pipeline_args(),
                         cluster=Cluster.a100_80gb(1, devices_per_host=4),
                         method=pipeshard(layer_option=autoshard.AutoLayerOption(layer_num=2)))
    assert est.num_layers == 2 and len(est.stages) == 2
    assert [s.devices for s in est.stages] == [(0, 2), (2, 2)]
    assert est.step_s > est.makespan_s > 0 and est.flops > 0


def test_model_over_one_stages_memory_gets_more_stages_from_the_stage_search():
    # Data parallel keeps every weight and gradient whole on each device: the whole model needs
    # ~2.0 MB per device, half of it ~1.3 MB. On a link this fast, with one micro-batch, the
    # search keeps one stage on both devices (a pipeline would only serialise the layers);
    # under a 1.5 MiB budget it must cut the model into stages.
    def cluster(memory_bytes):
        return Cluster(num_hosts=1, devices_per_host=2, peak_flops=1e12,
                       intra_host_bandwidth=1e13, intra_host_latency_s=0.0,
                       memory_bytes=memory_bytes)

    def method(stage_option):
        return dataclasses.replace(pipeshard(stage_option=stage_option,
                                             default_auto_sharding_option=DATA_PARALLEL),
                                   num_micro_batches=1)
    unbounded = autoshard.plan(pipeline_step(), *pipeline_args(), cluster=cluster(None),
                               method=method(autoshard.AutoStageOption()))
    assert [(s.layers, s.devices) for s in unbounded.stages] == [((0, 1, 2, 3), (0, 2))]
    assert unbounded.peak_bytes_per_device > 3 * 2**19
    with pytest.raises(ValueError, match=r"Stage 0 does not fit in memory.*more stages"):
        autoshard.plan(pipeline_step(), *pipeline_args(), cluster=cluster(3 * 2**19),
                       method=method(autoshard.UniformStageOption(num_stages=1)))
    for mode in ("individual", "composition"):
        est = autoshard.plan(pipeline_step(), *pipeline_args(), cluster=cluster(3 * 2**19),
                             method=method(autoshard.AutoStageOption(layer_profile_mode=mode)))
        assert len(est.stages) == 2 and [s.devices for s in est.stages] == [(0, 1), (1, 1)]
        assert all(s.memory_bytes <= 3 * 2**19 for s in est.stages)
        assert est.step_s > unbounded.step_s  # memory, not speed, made the cut


def test_pipeline_options_the_pricing_cannot_honour_are_clear_errors():
    args = pipeline_args()
    cluster = Cluster.a100_80gb(2, devices_per_host=4)
    straddle = autoshard.ManualStageOption([[0], [1, 2], [3]], [(1, 2), (1, 4), (1, 2)],
                                           [(2,), (4,), (2,)], [{}, {}, {}])
    with pytest.raises(ValueError, match="starting at device 2 straddles hosts of 4 devices"):
        autoshard.plan(pipeline_step(), *args, cluster=cluster,
                       method=pipeshard(stage_option=straddle))
    short = autoshard.ManualStageOption([[0, 1], [2, 3]], [(1, 4), (1, 2)], [(4,), (2,)],
                                        [{}, {}])
    with pytest.raises(ValueError, match="use 6 devices in all but the cluster has 8"):
        autoshard.plan(pipeline_step(), *args, cluster=cluster,
                       method=pipeshard(stage_option=short))
    with pytest.raises(ValueError, match=r"virtual_stages=2 needs a stage count divisible"):
        autoshard.plan(pipeline_step(), *args, cluster=cluster,
                       method=pipeshard(pipeline_schedule="interleaved_1f1b",
                                        stage_option=autoshard.UniformStageOption(1)))
    with pytest.raises(ValueError, match=r"manually_specified_submeshes entry \(1, 8\)"):
        autoshard.plan(pipeline_step(), *args, cluster=cluster, method=pipeshard(
            stage_option=autoshard.AutoStageOption(submesh_physical_shape_space="manual",
                                                   manually_specified_submeshes=[(1, 8)])))
