"""Shared models for the pipeline tests: an MLP and a small GPT with tied embeddings."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import autoshard


class Block(nn.Module):
    dim: int = 16

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=2)(h, mask=nn.make_causal_mask(
            jnp.ones(x.shape[:2])))
        x = x + h
        h = nn.Dense(2 * self.dim)(nn.LayerNorm()(x))
        return x + nn.Dense(self.dim)(nn.gelu(h))


class GPT(nn.Module):
    """Token embedding shared by the input and the output projection (tied)."""

    vocab: int = 32
    dim: int = 16
    layers: int = 2

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(self.vocab, self.dim)
        x = embed(tokens)
        for _ in range(self.layers):
            autoshard.mark_pipeline_boundary()
            x = Block(self.dim)(x)
        return embed.attend(nn.LayerNorm()(x))


def mlp_params(seed=0, widths=(8, 16, 16, 16, 4)):
    rng = np.random.default_rng(seed)
    return {f"w{i}": jnp.asarray(rng.normal(size=(a, b)).astype(np.float32) / np.sqrt(a))
            for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True))}


def mlp_loss(p, x, y, *, markers=True):
    h = x
    n = len(p)
    for i in range(n):
        h = h @ p[f"w{i}"]
        if i < n - 1:
            h = jnp.tanh(h)
            if markers:
                autoshard.mark_pipeline_boundary()
    return jnp.mean((h - y) ** 2)


def mlp_batch(seed=0, batch=32):
    rng = np.random.default_rng(seed + 1)
    return (jnp.asarray(rng.normal(size=(batch, 8)).astype(np.float32)),
            jnp.asarray(rng.normal(size=(batch, 4)).astype(np.float32)))


def sgd_step(loss_fn, grad=None):
    grad = grad or autoshard.grad

    def step(p, batch):
        g = grad(loss_fn)(p, *batch)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)
    return step


def assert_trees_close(a, b, rtol=1e-4, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def gpt_lm_step(state, tokens):
    """A language-model step of the GPT above: next-token cross entropy, gradients through
    ``autoshard.grad`` (its marker splits accumulation from the update)."""
    import optax

    def loss(p):
        logits = state.apply_fn(p, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return state.apply_gradients(grads=autoshard.grad(loss)(state.params))
