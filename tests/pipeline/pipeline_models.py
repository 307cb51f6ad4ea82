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


class BlockLM:
    """A 39.1B-like step in miniature for pricing tests: an embedding, ``num_blocks``
    identical residual blocks and a head, a pipeline boundary after the embedding and after
    each block, Adam (1e-3). ``step(p, opt, tokens, targets)``; ``shapes()`` its abstract
    arguments (float32 parameters, ``rows`` int32 tokens)."""

    def __init__(self, hidden: int, vocab: int, rows: int, num_blocks: int):
        import optax

        self.hidden, self.vocab, self.rows, self.num_blocks = hidden, vocab, rows, num_blocks
        self.tx = optax.adam(1e-3)

    @staticmethod
    def norm(x):
        mean = x.mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)

    def loss(self, p, tokens, targets):
        x = p["embed"][tokens]
        autoshard.mark_pipeline_boundary()
        for i in range(self.num_blocks):
            b = p[f"block{i}"]
            x = x + jnp.tanh(self.norm(x) @ b["up"]) @ b["down"]
            autoshard.mark_pipeline_boundary()
        logits = self.norm(x) @ p["head"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[:, None], 1))

    def step(self, p, opt, tokens, targets):
        import optax

        g = autoshard.grad(self.loss)(p, tokens, targets)
        updates, opt = self.tx.update(g, opt, p)
        return optax.apply_updates(p, updates), opt

    def shapes(self):
        f32, h = jnp.float32, self.hidden
        params = {"embed": jax.ShapeDtypeStruct((self.vocab, h), f32),
                  "head": jax.ShapeDtypeStruct((h, self.vocab), f32),
                  **{f"block{i}": {"up": jax.ShapeDtypeStruct((h, 4 * h), f32),
                                   "down": jax.ShapeDtypeStruct((4 * h, h), f32)}
                     for i in range(self.num_blocks)}}
        tokens = jax.ShapeDtypeStruct((self.rows,), jnp.int32)
        return params, jax.eval_shape(self.tx.init, params), tokens, tokens


def marked_train_step(loss_fn, tx):
    """``train_step((params, opt), *batch) -> ((params, opt), loss)``: ``loss_fn``'s gradient
    through the marker (``autoshard.value_and_grad``), then ``tx``'s update."""
    import optax

    def train_step(state, *batch):
        params, opt = state
        loss, grads = autoshard.value_and_grad(loss_fn)(params, *batch)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), loss

    return train_step


def fan_in_normal(rng):
    """``w(*shape)``: a float32 array of normal draws from ``rng`` over sqrt(shape[0])."""
    def w(*shape):
        return jnp.asarray(rng.normal(size=shape).astype(np.float32) / np.sqrt(shape[0]))
    return w


def run_beside_jit(step, method, state, batch, steps):
    """``steps`` steps of ``parallelize(step, method)`` and of ``jax.jit(step)`` from
    ``state`` on ``batch`` (a tuple, batch arguments 1.. of ``step``): (the last executable,
    its final state, jax.jit's, [(loss, jax.jit's loss)] per step)."""
    run = autoshard.parallelize(step, method=method,
                                batch_argnums=tuple(range(1, len(batch) + 1)))
    want_step = jax.jit(step)
    got, want, losses = state, state, []
    for _ in range(steps):
        got, loss = run(got, *batch)
        want, want_loss = want_step(want, *batch)
        losses.append((float(loss), float(want_loss)))
    return run.get_last_executable(), got, want, losses
