"""Stages share the work (issue 21 item 5): automatic layers balance FLOPs even where one
matmul outweighs the rest, explain() reports the imbalance, a nearly idle stage warns."""

import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
from autoshard.pipeline import ManualStageOption, PipeshardParallel, UniformStageOption
from autoshard.pipeline.layers import least_max_layer

IDLE = r"holds .* of the step's work"


def mlp_step(p, x):
    def loss(p):
        h = jax.nn.relu(x @ p["w1"])
        h = jax.nn.relu(h @ p["w2"])
        return jnp.mean((h @ p["w3"]) ** 2)
    g = autoshard.grad(loss)(p)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)


def mlp_shapes(d, h):
    s = jax.ShapeDtypeStruct
    return ({"w1": s((d, h), jnp.float32), "w2": s((h, h), jnp.float32),
             "w3": s((h, 8), jnp.float32)}, s((256, d), jnp.float32))


def _plan(step, shapes, **kw):
    method = PipeshardParallel(num_micro_batches=4, **kw)
    return autoshard.plan(step, *shapes, method=method,
                          cluster=autoshard.Cluster.from_devices(jax.devices()))


@pytest.mark.parametrize("d,h", [(512, 512), (1024, 4096), (256, 1024), (1024, 1024)])
def test_default_layers_leave_no_stage_empty(d, h):  # repro D of issue 21
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est = _plan(mlp_step, mlp_shapes(d, h), stage_option=UniformStageOption(num_stages=2))
    assert not [w for w in caught if "step's work" in str(w.message)]
    # every stage computes: its forward and backward take time, and its share of the FLOPs
    # is at least 1/(4 * stages)
    assert all(s.task_s["F"] > 0 and s.task_s["B"] > 0 for s in est.stages)
    share = [f / sum(est.stage_flops) for f in est.stage_flops]
    assert len(share) == 2 and min(share) >= 1 / 8
    # the first layer holds the first matmul (the second outweighs both others at these
    # widths: the cut right after the first is the most balanced one)
    assert est.stages[0].plans[0][1].objective.flops >= 2 * 64 * d * h
    text = est.explain()
    assert "stage work (F+B FLOPs per micro-batch): stage 0" in text
    assert f"imbalance max/mean {max(share) * 2:.2f}" in text
    assert f"F+B time imbalance max/mean {est.stage_imbalance:.2f}" in text


def idle_first_stage_step(p, x):
    def loss(p):
        h = x * 2.0
        autoshard.mark_pipeline_boundary()
        h = jnp.tanh(h @ p["w1"])
        return jnp.mean((h @ p["w2"]) ** 2)
    g = autoshard.grad(loss)(p)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)


def test_nearly_idle_stage_warns_with_the_fix():
    s = jax.ShapeDtypeStruct
    shapes = ({"w1": s((64, 256), jnp.float32), "w2": s((256, 64), jnp.float32)},
              s((64, 64), jnp.float32))
    match = (r"Pipeline stage 0 \(layers \[0\]\) holds 0\.\d% of the step's work \(F\+B FLOPs "
             r"per micro-batch\), under 1/\(4\*2\) = 12\.5%(.|\n)*mark_pipeline_boundary\(\) "
             r"calls(.|\n)*AutoLayerOption\(layer_num=2\)")
    with pytest.warns(UserWarning, match=match):
        est = _plan(idle_first_stage_step, shapes, layer_option="manual",
                    stage_option=UniformStageOption(num_stages=2))
    assert est.stage_flops[0] / sum(est.stage_flops) < 0.01
    # the same warning when the pipeline is built on the devices, and explain() shows it
    params = {"w1": jnp.ones((64, 256)) * 0.01, "w2": jnp.ones((256, 64)) * 0.01}
    method = PipeshardParallel(num_micro_batches=2, layer_option="manual", blocking=True,
                               stage_option=UniformStageOption(num_stages=2))
    f = autoshard.parallelize(idle_first_stage_step, method=method)
    with pytest.warns(UserWarning, match=match):
        ex = f.get_executable(params, jnp.ones((64, 64)))
    assert "stage 0 2.05e+03 (0.0%)" in ex.plan.explain()
    assert "imbalance max/mean 2.00" in ex.plan.explain()
    # balanced by hand instead: no warning
    balanced = ManualStageOption(forward_stage_layer_ids=[[0, 1]],
                                 submesh_physical_shapes=[(1, 8)],
                                 submesh_logical_shapes=[(8,)],
                                 submesh_autosharding_option_dicts=[{}])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=IDLE)
        _plan(idle_first_stage_step, shapes, layer_option="manual", stage_option=balanced)


def test_dominant_matmul_warns_that_no_cut_balances_better():
    # the second matmul holds over 99% of the work: automatic layers cannot balance 2 stages
    with pytest.warns(UserWarning, match=r"Pipeline stage \d \(layers \[\d\]\) holds 0\.\d% "
                      r"(.|\n)*use fewer stages \(no cut of the forward balances them better"):
        est = _plan(mlp_step, mlp_shapes(8, 2048), stage_option=UniformStageOption(num_stages=2))
    assert all(s.task_s["F"] > 0 for s in est.stages)  # still no empty stage


def test_least_max_layer_is_the_best_cut():
    rng = np.random.default_rng(0)
    for _ in range(50):
        n, layers = int(rng.integers(2, 9)), int(rng.integers(1, 5))
        flops = [float(x) for x in rng.integers(0, 100, size=n) ** 2]
        prefix = [0.0] + list(itertools.accumulate(flops))
        layers = min(layers, n)
        best = min(max(prefix[b] - prefix[a]
                       for a, b in zip((0, *cuts), (*cuts, n), strict=True))
                   for cuts in itertools.combinations(range(1, n), layers - 1))
        assert least_max_layer(prefix, layers) == pytest.approx(best, rel=1e-8)
