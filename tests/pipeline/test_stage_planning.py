"""Stages planned by the intra-operator planner on their sub-meshes; dropout; interleaving.

Every test runs with ``blocking=True`` (see test_pipeshard.py).
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from pipeline_models import assert_trees_close, mlp_batch, mlp_loss, mlp_params, sgd_step

import autoshard
from autoshard.ir import _compat
from autoshard.pipeline import ManualStageOption, PipeshardParallel, UniformStageOption


def run_steps(step, method, args, num_steps=3):
    f = autoshard.parallelize(step, method=method)
    ref = jax.jit(step)
    got, want = args[0], args[0]
    for _ in range(num_steps):
        got, want = f(got, *args[1:]), ref(want, *args[1:])
    return got, want, f.get_last_executable()


def test_two_stages_on_2x2_sub_meshes_are_planned_and_match():
    """Each stage on a (2, 2) sub-mesh, planned by plan_auto; the batch forced onto axis 0."""
    stage = ManualStageOption([[0, 1], [2, 3]], [(1, 4), (1, 4)], [(2, 2), (2, 2)],
                              [{"force_batch_dim_to_mesh_dim": 0}, {}])
    method = PipeshardParallel(num_micro_batches=2, layer_option="manual", stage_option=stage,
                               blocking=True)
    params = mlp_params(widths=(8, 32, 32, 32, 4))
    got, want, ex = run_steps(sgd_step(mlp_loss), method, (params, mlp_batch()))
    assert_trees_close(got, want)
    assert ex.plan.submesh_shapes == ((2, 2), (2, 2))
    plans = ex.task_plans
    assert {"F0", "F1"} <= set(plans)
    assert all(p.mesh_shape == (2, 2) for p in plans.values())
    # the planner splits the rows over both axes: the backward tasks run per device and keep
    # their gradients partial (test_partial_grads.py); otherwise they are planned
    for s in (0, 1):
        b = ex.tasks[("B", s)]
        assert b.plan is not None or b.batch_axes == ("x0", "x1"), b.note
    x_sharding = ex.in_shardings[len(params)]
    assert "x0" in np.atleast_1d(x_sharding.spec[0])  # force_batch_dim_to_mesh_dim honoured
    assert "planned by the intra-operator planner" in ex.plan.explain()


def test_default_auto_sharding_option_reaches_every_stage():
    method = PipeshardParallel(
        num_micro_batches=2, layer_option="manual", blocking=True,
        stage_option=UniformStageOption(num_stages=2),
        default_auto_sharding_option=autoshard.AutoShardingOption(force_data_parallel=True))
    got, want, ex = run_steps(sgd_step(mlp_loss), method, (mlp_params(), mlp_batch()), 2)
    assert_trees_close(got, want)
    params = ex.in_shardings[:4]
    assert all(sh.is_fully_replicated for sh in params)
    assert ex.in_shardings[4].spec == P("x")                   # the batch rows split
    assert {"F0", "F1"} <= set(ex.task_plans)
    assert all(ex.tasks[("B", s)].batch_axes == ("x",) for s in (0, 1))  # per device
    with pytest.raises(ValueError, match="not AutoShardingOption fields"):
        autoshard.parallelize(sgd_step(mlp_loss), method=PipeshardParallel(
            layer_option="manual", stage_option=ManualStageOption(
                [[0, 1], [2, 3]], [(1, 4), (1, 4)], [(4,), (4,)], [{"no_such": 1}, {}])))(
            mlp_params(), mlp_batch())


def dropout_loss(p, x, y, key):
    h = jnp.tanh(x @ p["w0"])
    autoshard.mark_pipeline_boundary()
    h = jnp.tanh(h @ p["w1"])
    keep = jax.random.bernoulli(key, 0.5, h.shape)
    h = jnp.where(keep, h / 0.5, 0.0)
    autoshard.mark_pipeline_boundary()
    return jnp.mean((jnp.tanh(h @ p["w2"]) @ p["w3"] - y) ** 2)


def dropout_step(p, batch, key):
    g = autoshard.grad(dropout_loss)(p, *batch, key)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)


def folded_reference(k, fold=True):
    """Micro-batch j = rows j, j + k, ...; its draws use fold_in(key, j) (as the pipeline)."""
    @jax.jit
    def step(p, batch, key):
        x, y = batch
        xs = x.reshape((-1, k) + x.shape[1:])
        ys = y.reshape((-1, k) + y.shape[1:])
        gs = [jax.grad(dropout_loss)(p, xs[:, j], ys[:, j],
                                     jax.random.fold_in(key, j) if fold else key)
              for j in range(k)]
        g = jax.tree.map(lambda *a: sum(a) / k, *gs)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)
    return step


def test_dropout_inside_a_stage_folds_keys_per_micro_batch():
    k = 4
    method = PipeshardParallel(num_micro_batches=k, layer_option="manual", blocking=True,
                               stage_option=UniformStageOption(num_stages=3),
                               devices=jax.devices()[:6])
    f = autoshard.parallelize(dropout_step, method=method)
    params, batch, key = mlp_params(), mlp_batch(), jax.random.key(3)
    got = f(params, batch, key)
    assert f.get_last_executable().tasks[("F", 1)].random
    assert_trees_close(got, f(params, batch, key), rtol=0, atol=0)     # deterministic
    assert_trees_close(got, folded_reference(k)(params, batch, key))
    same_mask = folded_reference(k, fold=False)(params, batch, key)    # masks do differ
    assert not np.allclose(np.asarray(got["w1"]), np.asarray(same_mask["w1"]), rtol=1e-4)


@pytest.mark.parametrize("virtual", [2])
def test_interleaved_1f1b_runs_virtual_stages(virtual):
    method = PipeshardParallel(num_micro_batches=4, layer_option="manual", blocking=True,
                               pipeline_schedule="interleaved_1f1b", virtual_stages=virtual,
                               stage_option=UniformStageOption(num_stages=4))
    got, want, ex = run_steps(sgd_step(mlp_loss), method, (mlp_params(), mlp_batch()))
    assert_trees_close(got, want)
    assert ex.schedule.num_ranks == 2 and ex.schedule.virtual == virtual
    assert ex.plan.stage_devices[0] == ex.plan.stage_devices[2] == (0, 1, 2, 3)
    assert ex.plan.stage_devices[1] == ex.plan.stage_devices[3] == (4, 5, 6, 7)


def test_crossing_values_stay_on_devices_between_sub_meshes_of_other_shapes(monkeypatch):
    """(4,) -> (2, 2) -> 2 devices: resharded on the source, then copied device to device."""
    module, names = _compat.device_put_host_paths()
    calls = []
    for n in names:
        orig = getattr(module, n)
        monkeypatch.setattr(module, n, lambda *a, _o=orig, _n=n, **k: (calls.append(_n),
                                                                       _o(*a, **k))[1])
    stage = ManualStageOption([[0, 1], [2], [3]], [(1, 2), (1, 4), (1, 2)],
                              [(2,), (2, 2), (2,)], [{}, {}, {}])
    method = PipeshardParallel(num_micro_batches=2, layer_option="manual", blocking=True,
                               stage_option=stage)
    f = autoshard.parallelize(sgd_step(mlp_loss), method=method)
    params, batch = f.preshard_dynamic_args(mlp_params(), mlp_batch())
    calls.clear()
    got = f(params, batch)
    assert calls == []
    assert_trees_close(got, jax.jit(sgd_step(mlp_loss))(mlp_params(), mlp_batch()))
    # Between 2 and 4 devices no layout holds the same shards: the audit says which values
    # are resharded before their copy (a cost outside every task's plan).
    audit = f.get_last_executable().audit()
    crossing = {(t.src, t.dst): t.resharded for t in audit.transfers}
    assert set(crossing) == {("F0", "F1"), ("F1", "F2"), ("B2", "B1"), ("B1", "B0")}
    assert any(crossing.values()) and "resharded: " in audit.explain()


def test_stage_input_shardings_round_trip():
    base = dict(num_micro_batches=2, layer_option="manual", blocking=True,
                stage_option=UniformStageOption(num_stages=2))
    step, args = sgd_step(mlp_loss), (mlp_params(), mlp_batch())
    f = autoshard.parallelize(step, method=PipeshardParallel(**base))
    f(*args)
    specs = f.get_last_executable().stage_input_shard_specs
    got, want, ex = run_steps(step, PipeshardParallel(**base, stage_input_shardings=specs),
                              args, 2)
    assert ex.stage_input_shard_specs == specs
    assert_trees_close(got, want)
    replicated = [[P()] * len(s) for s in specs]                  # any specs are honoured
    got, want, ex = run_steps(step, PipeshardParallel(**base, stage_input_shardings=replicated),
                              args, 2)
    assert ex.stage_input_shard_specs == replicated
    assert_trees_close(got, want)
    with pytest.raises(ValueError, match="stage_input_shardings"):
        autoshard.parallelize(step, method=PipeshardParallel(
            **base, stage_input_shardings=[specs[0]]))(*args)


def test_auto_stages_profiled_and_cached_on_disk(tmp_path, monkeypatch):
    from autoshard.pipeline import AutoLayerOption, AutoStageOption
    from autoshard.pipeline.profile import StageProfiler

    option = AutoStageOption(profile=True, profile_cache_dir=str(tmp_path),
                             submesh_physical_shape_space="manual",
                             manually_specified_submeshes=[(1, 2), (1, 4)])
    method = PipeshardParallel(num_micro_batches=2, blocking=True, devices=jax.devices()[:4],
                               layer_option=AutoLayerOption(layer_num=2), stage_option=option)
    step = sgd_step(functools.partial(mlp_loss, markers=False))
    args = (mlp_params(), mlp_batch())
    got, want, ex = run_steps(step, method, args, 2)
    assert_trees_close(got, want)
    cache = json.loads((tmp_path / "stage_profiles.json").read_text())
    assert len(cache) == 3 * 2                    # 3 layer ranges x 2 sub-mesh sizes
    assert all(entry["seconds"] > 0 and entry["bytes"] > 0 for entry in cache.values())
    assert sum(len(d) for d in ex.plan.stage_devices) == 4

    def no_run(*a, **k):
        raise AssertionError("measured again instead of reading the cache")
    monkeypatch.setattr(StageProfiler, "_run", no_run)
    autoshard.clear_executable_cache()
    f = autoshard.parallelize(step, method=method)
    assert_trees_close(f(*args), jax.jit(step)(*args))
