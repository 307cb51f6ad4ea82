"""ZeRO-2 under pure data parallel: ``force_data_parallel`` with ``prefer_reduce_scatter``.

Covers Alpa's ``test_moe.py::test_moe_lm_data_parallel_reduce_scatter`` (and the
``force_data_parallel`` branch of its ``prefer_reduce_scatter`` checks): the step runs data
parallel, the weight gradients are reduce-scattered, the optimizer state is held in shards and
the new parameters are all-gathered; nothing else is gathered and nothing is all-to-all'd.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import autoshard
from autoshard.sharding import hlo
from models import dense_adam_step as train_step


def zero2_option(**kw):
    return autoshard.AutoShardingOption(
        force_data_parallel=True, prefer_reduce_scatter=True, mesh_alpha=(1.0, 1.0),
        mesh_beta=(1.0, 1.0), memory_tradeoff=0.0, show_progress=False, **kw)


def compile_step(step, state, batch, shape, opt):
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(shape), ("x", "y"))
    f = autoshard.parallelize(step, method=autoshard.ShardParallel(
        devices=mesh, auto_sharding_option=opt))
    return f, f.get_executable(state, batch)


@pytest.mark.parametrize("shape", [(4, 1), (1, 4)])
def test_zero2_under_data_parallel_shards_the_update_only(shape):
    """Params stay replicated; each kernel's and bias's gradient is reduce-scattered
    (planned: the bias sums' reduce-scatters merge with the kernels', build.
    _prefer_reduce_scatter) so their Adam moments are held in quarters, and the four updated
    parameters come back in one all-gather (one buffer, 8,448 bytes). The compiled step has
    one reduce-scatter of the four gradients beside that all-gather
    (``partial_run.PartialSums.flush``), no other gather, no all-to-all, no all-reduce but
    the loss's scalar; the step equals jax.jit's. Before, the
    plan all-reduced every gradient and kept the state whole (no all-gather)."""
    step, state, batch = train_step((32, 32), 256, 32)
    f, ex = compile_step(step, state, batch, shape, zero2_option())
    plan = ex.plan
    assert all(leaf.spec == P() for leaf in plan.inputs if ".params" in leaf.path)
    moments = [leaf for leaf in plan.inputs if (".mu" in leaf.path or ".nu" in leaf.path)]
    assert len(moments) == 8
    assert all(leaf.bytes_per_device(plan.mesh_sizes) == (32 * 32 if "kernel" in leaf.path
                                                          else 32) for leaf in moments)
    scattered = sorted(c.where.split("[")[0] for c in plan.collectives
                       if c.kind == "reduce-scatter" for _ in range(int(c.count)))
    assert scattered == ["dot_general"] * 2 + ["reduce_sum"] * 2
    found = hlo.collectives(ex.get_hlo_text())
    assert [c.kind for c in found if c.kind != "all-reduce" or c.num_bytes > 4] == [
        "reduce-scatter", "all-gather"]
    assert [c.num_bytes for c in found if c.kind == "reduce-scatter"] == [(32 * 32 + 32) * 2]
    assert [c.num_bytes for c in found if c.kind == "all-gather"] == [2 * (32 * 32 + 32) * 4]
    expected = jax.jit(step)(state, batch)
    actual = f(state, batch)
    for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_zero2_under_data_parallel_gathers_no_activation():
    """A wide layer on a small batch: gathering its input and output cotangent (8x16 and
    8x512 floats) costs less than reducing its 16x512 weight gradient, so a plan free to
    all-gather anything would gather activations and run the weight gradient unsplit. Under
    force_data_parallel only the updated parameters are gathered: the one compiled
    all-gather holds the two updated kernels and biases and nothing else (a plan that
    gathered the 8x16 input moved 512-byte all-gathers besides)."""
    step, state, batch = train_step((512, 16), 8, 16)
    f, ex = compile_step(step, state, batch, (4, 1), zero2_option())
    found = hlo.collectives(ex.get_hlo_text())
    assert [c.num_bytes for c in found if c.kind == "all-gather"] == [
        (2 * 16 * 512 + 512 + 16) * 4]
    assert ex.plan.inputs[-1].spec == P("x") and ex.plan.inputs[-2].spec == P("x")
    assert {c.kind for c in ex.plan.collectives} >= {"reduce-scatter", "all-gather"}
    expected = jax.jit(step)(state, batch)
    actual = f(state, batch)
    for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_data_parallel_without_prefer_reduce_scatter_is_unchanged():
    """force_data_parallel alone: one combined all-reduce, nothing gathered, state whole."""
    step, state, batch = train_step((32, 32), 256, 32)
    opt = autoshard.AutoShardingOption(force_data_parallel=True, mesh_alpha=(1.0, 1.0),
                                       mesh_beta=(1.0, 1.0), memory_tradeoff=0.0,
                                       show_progress=False)
    _, ex = compile_step(step, state, batch, (4, 1), opt)
    assert all(leaf.spec == P() for leaf in ex.plan.inputs[:-2])
    assert [c.kind for c in hlo.collectives(ex.get_hlo_text())] == ["all-reduce"]
