"""Independent reductions that later work reads share one latency (XLA merges them).

A batch norm over the data axis reduces its mean and its mean of squares, neither of which
depends on the other: XLA's all-reduce combiner sends them as one collective, so the plan pays
the axis's latency once for the pair (``build._combine_sibling_reductions``).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np

import autoshard
from autoshard.sharding import cost


def step(w, x):
    def loss(w):
        mean = jnp.mean(x, 0)
        mean_sq = jnp.mean(x * x, 0)
        h = (x - mean) * jax.lax.rsqrt(mean_sq - mean * mean + 1e-5)
        return jnp.mean(jnp.tanh(h @ w) ** 2)
    value, grad = autoshard.value_and_grad(loss)(w)
    return w - 0.1 * grad, value


def data_parallel():
    option = autoshard.AutoShardingOption(force_data_parallel=True, logical_mesh_shape=(8,),
                                          show_progress=False)
    return autoshard.ShardParallel(auto_sharding_option=option)


def args():
    keys = jax.random.split(jax.random.key(0), 2)
    return (jax.random.normal(keys[0], (16, 16)) * 0.3,
            jax.random.normal(keys[1], (64, 16)) + 0.5)


def test_the_two_statistics_pay_one_latency_and_compile_to_one_all_reduce():
    w, x = args()
    plan = autoshard.plan(step, w, x, method=data_parallel())
    stats = [c for c in plan.collectives
             if c.kind == "all-reduce" and "reduce_sum[64x16]" in c.where]
    # the forward's two statistics (one entry, count 2, 16 floats) and a scalar sum of the
    # backward pass (count 1): the pair pays one ring pass's latency, not two
    pair = [c for c in stats if c.count == 2]
    single = [c for c in stats if c.count == 1]
    assert len(pair) == 1 and single, plan.explain()
    assert (pair[0].num_bytes, single[0].num_bytes) == (64, 4)
    latency = single[0].cost_s - 4 * 2 * 7 / 8 * cost.DEFAULT_BETA_S_PER_BYTE
    assert latency > 1e-6, plan.explain()
    assert pair[0].cost_s < 1.01 * latency + 2 * 64 * 2 * 7 / 8 * cost.DEFAULT_BETA_S_PER_BYTE, (
        plan.explain())
    # the premise: XLA compiles the two statistics' all-reduces into one
    f = autoshard.parallelize(step, method=data_parallel())
    text = f.get_executable(w, x).compiled.as_text()
    merged = [line for line in text.splitlines()
              if re.search(r"= \(f32\[16\]\S*, f32\[16\]\S*\) all-reduce\(", line)]
    assert merged, "XLA did not merge the two statistics' all-reduces"
    new_w, value = f(w, x)
    want_w, want = jax.jit(step)(w, x)
    np.testing.assert_allclose(value, want, rtol=1e-5)
    np.testing.assert_allclose(new_w, want_w, rtol=1e-4, atol=1e-6)
