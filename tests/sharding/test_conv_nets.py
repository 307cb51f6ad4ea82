"""Conv nets with pooling and grouped/depthwise convolutions plan with rules, not replication."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

import autoshard


class PoolNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = nn.relu(nn.Conv(16, (3, 3), feature_group_count=16)(x))  # depthwise
        x = nn.relu(nn.Conv(32, (3, 3), feature_group_count=4)(x))   # grouped
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        return nn.Dense(8)(x.reshape(x.shape[0], -1))


def step(state, batch):
    x, y = batch
    loss, g = autoshard.value_and_grad(
        lambda p: jnp.mean((state.apply_fn(p, x) - y) ** 2))(state.params)
    return state.apply_gradients(grads=g), loss


def test_pooling_net_plans_without_unknown_primitives_and_trains_like_jit():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(32, 16, 16, 3)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(32, 8)), jnp.float32)
    model = PoolNet()
    params = model.init(jax.random.key(0), x)
    make = lambda: TrainState.create(  # noqa: E731
        apply_fn=model.apply, params=jax.tree.map(jnp.copy, params), tx=optax.adam(1e-3))
    f = autoshard.parallelize(step, method=autoshard.ShardParallel(
        auto_sharding_option=autoshard.AutoShardingOption(show_progress=False)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "no sharding rule for primitive ..." would fail here
        ex = f.get_executable(make(), (x, y))
    assert not any("no rule" in n for n in ex.plan.notes)
    s1, s2 = make(), make()
    for _ in range(3):
        s1, l1 = f(s1, (x, y))
        s2, l2 = jax.jit(step)(s2, (x, y))
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
