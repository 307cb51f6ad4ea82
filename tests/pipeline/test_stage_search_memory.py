"""The stage search prices every task of a candidate stage, its apply (optimizer) tasks
included (issue 26, item 5): it used to return a layout whose apply task then had no plan
within the memory ("Stage 0 does not fit in memory: its task apply0.0 ...")."""

import jax
import jax.numpy as jnp
import optax
import pytest

import autoshard
from autoshard import Cluster

WIDTHS = (8, 256, 256, 256, 4)
TX = optax.adam(1e-3)


def loss(p, x, y):
    for i in range(len(p)):
        x = x @ p[f"w{i}"]
        if i < len(p) - 1:
            x = jnp.tanh(x)
            autoshard.mark_pipeline_boundary()
    return jnp.mean((x - y) ** 2)


def step(p, opt, batch):
    g = autoshard.grad(loss)(p, *batch)
    updates, opt = TX.update(g, opt, p)
    return optax.apply_updates(p, updates), opt


def shapes():
    params = {f"w{i}": jax.ShapeDtypeStruct((a, b), jnp.float32)
              for i, (a, b) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:], strict=True))}
    data = (jax.ShapeDtypeStruct((32, WIDTHS[0]), jnp.float32),
            jax.ShapeDtypeStruct((32, WIDTHS[-1]), jnp.float32))
    return params, jax.eval_shape(TX.init, params), data


def plan(memory_bytes):
    cluster = Cluster(num_hosts=1, devices_per_host=2, peak_flops=1e12,
                      intra_host_bandwidth=1e13, intra_host_latency_s=0.0,
                      memory_bytes=memory_bytes)
    method = autoshard.PipeshardParallel(
        num_micro_batches=1, layer_option="manual", stage_option=autoshard.AutoStageOption(),
        default_auto_sharding_option=autoshard.AutoShardingOption(
            force_data_parallel=True, show_progress=False))
    return autoshard.plan(step, *shapes(), cluster=cluster, method=method)


def test_stage_search_cuts_where_the_optimizer_state_does_not_fit():
    whole = plan(None)   # one stage on both devices: Adam's state whole on each (~3.3 MiB)
    assert [(s.layers, s.devices) for s in whole.stages] == [((0, 1, 2, 3), (0, 2))]
    budget = 3 * 2**20
    assert whole.stages[0].memory_bytes > budget
    cut = plan(budget)
    assert len(cut.stages) == 2 and all(s.memory_bytes <= budget for s in cut.stages)
    applies = [name for s in cut.stages for name, _ in s.plans if name.startswith("apply")]
    assert applies, "the apply tasks are priced"


def test_no_layout_within_the_memory_is_the_searchs_error_not_an_apply_tasks():
    with pytest.raises(ValueError, match=r"AutoStageOption found no stage layout"):
        plan(2 * 2**20)
