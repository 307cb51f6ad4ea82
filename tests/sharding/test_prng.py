"""PRNG keys (typed and raw uint32) flow through the automatic planner."""

import jax
import jax.extend.random
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard


def _auto():
    return autoshard.ShardParallel(
        auto_sharding_option=autoshard.AutoShardingOption(show_progress=False))


@pytest.mark.parametrize("kind", ["typed", "raw", "unwrap", "threefry"])
def test_random_steps_plan_and_match_jit(kind):
    def step(w, x, key):
        if kind == "raw":
            key = jax.random.PRNGKey(5)
        if kind == "unwrap":
            key = jax.random.wrap_key_data(jax.random.key_data(key) + 1)
        if kind == "threefry":
            bits = jax.extend.random.threefry_2x32(jnp.array([1, 2], jnp.uint32),
                                            jnp.arange(x.size, dtype=jnp.uint32))
            mask = (bits.reshape(x.shape) % 2).astype(x.dtype)
        else:
            key, sub = jax.random.split(key)
            mask = jax.random.bernoulli(sub, 0.5, x.shape).astype(x.dtype)

        def loss(w):
            return jnp.mean((mask * x) @ w)
        g = autoshard.grad(loss)(w)
        return w - 0.1 * g, mask.sum()

    w, x = jnp.ones((32, 16)) / 4, jnp.ones((64, 32))
    key = jax.random.key(0)
    f = autoshard.parallelize(step, method=_auto())
    out = f(w, x, key)
    ref = jax.jit(step)(w, x, key)
    np.testing.assert_allclose(out[0], ref[0], rtol=1e-5)
    np.testing.assert_allclose(out[1], ref[1])
    ex = f.get_last_executable()
    assert "key" in str(ex.plan.inputs[2].dtype)
    assert ex.plan.inputs[2].bytes_per_device(ex.plan.mesh_sizes) == 8
