"""Tiny Flax models and train steps shared by the tests."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

import autoshard


class MLP(nn.Module):
    hidden: int = 64
    out: int = 8

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(self.out)(x)


class DenseStack(nn.Module):
    """Dense layers of ``widths`` with ReLU between them (Alpa's n-layer MLP tests)."""
    widths: tuple[int, ...]

    @nn.compact
    def __call__(self, x):
        for w in self.widths[:-1]:
            x = nn.relu(nn.Dense(w)(x))
        return nn.Dense(self.widths[-1])(x)


def dense_adam_step(widths, batch_size, features):
    """``(step, state, batch)``: a ``DenseStack`` on a regression batch, Adam (1e-2) through
    flax's ``TrainState``; ``step(state, batch)`` returns the new state."""
    model = DenseStack(tuple(widths))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(batch_size, features)), jnp.float32)
    y = jnp.asarray(np.random.default_rng(1).normal(size=(batch_size, widths[-1])), jnp.float32)
    state = TrainState.create(apply_fn=model.apply, params=model.init(jax.random.PRNGKey(0), x),
                              tx=optax.adam(1e-2))

    def step(state, batch):
        def loss(p):
            return jnp.mean((state.apply_fn(p, batch["x"]) - batch["y"]) ** 2)
        return state.apply_gradients(grads=jax.grad(loss)(state.params))

    return step, state, {"x": x, "y": y}


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        x = nn.relu(nn.Conv(16, (3, 3), strides=2)(x))
        x = x.mean(axis=(1, 2))
        return nn.Dense(8)(x)


class Block(nn.Module):
    dim: int = 32
    heads: int = 4

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h)
        x = x + h
        h = nn.LayerNorm()(x)
        h = nn.Dense(4 * self.dim)(h)
        h = nn.Dense(self.dim)(nn.gelu(h))
        return x + h


class Transformer(nn.Module):
    dim: int = 32
    vocab: int = 64
    layers: int = 2

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.dim)(tokens)
        for _ in range(self.layers):
            x = Block(self.dim)(x)
        return nn.Dense(8)(nn.LayerNorm()(x).mean(axis=1))


def make_case(kind: str, batch: int = 16, seed: int = 0):
    """(model, example inputs, targets) for 'mlp', 'cnn' or 'transformer'."""
    rng = np.random.default_rng(seed)
    if kind == "mlp":
        model, x = MLP(), rng.normal(size=(batch, 16)).astype(np.float32)
    elif kind == "cnn":
        model, x = CNN(), rng.normal(size=(batch, 8, 8, 3)).astype(np.float32)
    elif kind == "transformer":
        model, x = Transformer(), rng.integers(0, 64, size=(batch, 8)).astype(np.int32)
    else:
        raise ValueError(kind)
    y = rng.normal(size=(batch, 8)).astype(np.float32)
    return model, jnp.asarray(x), jnp.asarray(y)


def make_state(model, x, lr=1e-2):
    params = model.init(jax.random.key(0), x)
    # eps well above float32 noise: with Adam's default 1e-8, a gradient entry near zero is
    # normalised to +-1 and its summation-order noise becomes a visible update difference.
    return TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(lr, eps=1e-3))


def train_step(state, batch):
    x, y = batch

    def loss_fn(params):
        pred = state.apply_fn(params, x)
        return jnp.mean((pred - y) ** 2)

    loss, grads = autoshard.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def copy_tree(tree):
    return jax.tree.map(lambda a: jnp.array(a, copy=True), tree)


def assert_trees_close(a, b, rtol=1e-4, atol=1e-5):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def marked_mlp_step(p, batch):
    """SGD on a tanh MLP with a pipeline boundary after every hidden layer (one layer each)."""
    def loss(p):
        x = batch["x"]
        for i in range(len(p)):
            x = x @ p[f"w{i}"]
            if i < len(p) - 1:
                x = jnp.tanh(x)
                autoshard.mark_pipeline_boundary()
        return jnp.mean((x - batch["y"]) ** 2)
    g = autoshard.grad(loss)(p)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)


def marked_mlp_args(widths, rows=16, scale=0.3):
    """Parameters ``w0, w1, ...`` of ``widths`` and a batch of ``rows`` for marked_mlp_step."""
    keys = jax.random.split(jax.random.key(0), len(widths))
    params = {f"w{i}": jax.random.normal(keys[i], (a, b)) * scale
              for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True))}
    batch = {"x": jax.random.normal(keys[-1], (rows, widths[0])),
             "y": jnp.ones((rows, widths[-1]))}
    return params, batch


def assert_priced_plans_are_compiled(priced_stages, ran) -> None:
    """Every task the pipeline runtime compiled (``ran``: task name -> plan) was priced
    (``priced_stages``: an estimate's stages) with the same mesh, layouts and objective."""
    import pytest

    priced = {name: p for stage in priced_stages for name, p in stage.plans}
    assert sorted(priced) == sorted(ran)
    for name, plan in ran.items():
        got = priced[name]
        assert got.mesh_shape == plan.mesh_shape, name
        assert got.in_specs == plan.in_specs and got.out_specs == plan.out_specs, name
        assert got.objective.total_s == pytest.approx(plan.objective.total_s), name
