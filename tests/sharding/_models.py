"""Plain-JAX models of the planner tests: MLP, transformer block/GPT (unrolled or scanned), MoE."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def mlp(params, x):
    return jnp.maximum(x @ params[0], 0) @ params[1]


def sgd_step(loss_fn):
    """(params, *batch) -> (new params, loss) with plain SGD."""
    def step(params, *batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss
    return step


def mse(model):
    return lambda params, x, y: jnp.mean((model(params, x) - y) ** 2)


def layer_norm(x, scale):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale


def block(p, x):
    """Pre-LN transformer block with causal attention; p holds one layer's parameters."""
    h = layer_norm(x, p["ln1"])
    q = jnp.einsum("bsd,dhk->bshk", h, p["wq"])
    k = jnp.einsum("bsd,dhk->bshk", h, p["wk"])
    v = jnp.einsum("bsd,dhk->bshk", h, p["wv"])
    s = jnp.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(q.shape[-1])
    n = x.shape[1]
    s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -1e9)
    a = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhqs,bshk->bqhk", a, v)
    x = x + jnp.einsum("bqhk,hkd->bqd", o, p["wo"])
    h = layer_norm(x, p["ln2"])
    h = jax.nn.gelu(h @ p["w1"])
    return x + h @ p["w2"]


def init_block(rng, dim, heads, layers=None):
    lead = () if layers is None else (layers,)
    hd = dim // heads

    def normal(*shape):
        return jnp.asarray(rng.normal(size=lead + shape).astype(np.float32) / np.sqrt(shape[0]))

    return {"ln1": jnp.ones(lead + (dim,)), "ln2": jnp.ones(lead + (dim,)),
            "wq": normal(dim, heads, hd), "wk": normal(dim, heads, hd),
            "wv": normal(dim, heads, hd), "wo": normal(heads, hd, dim),
            "w1": normal(dim, 4 * dim), "w2": normal(4 * dim, dim)}


def gpt(params, tokens, *, scan: bool):
    x = params["embed"][tokens]
    if scan:
        x, _ = jax.lax.scan(lambda c, p: (block(p, c), None), x, params["layers"])
    else:
        for p in params["layers"]:
            x = block(p, x)
    x = layer_norm(x, params["ln_f"])
    return x @ params["embed"].T


def init_gpt(seed, *, vocab, dim, heads, layers, scan: bool):
    rng = np.random.default_rng(seed)
    embed = jnp.asarray(rng.normal(size=(vocab, dim)).astype(np.float32) * 0.02)
    if scan:
        stack = init_block(rng, dim, heads, layers)
    else:
        stack = [init_block(rng, dim, heads) for _ in range(layers)]
    return {"embed": embed, "layers": stack, "ln_f": jnp.ones((dim,))}


def gpt_loss(scan: bool):
    def loss(params, tokens, targets):
        logits = gpt(params, tokens, scan=scan)
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()
    return loss


def moe(params, x):
    """Top-2 gated mixture of experts; expert weights carry a leading expert dim."""
    logits = x @ params["gate"]                          # (b, s, e)
    weights, index = jax.lax.top_k(logits, 2)            # (b, s, 2)
    weights = jax.nn.softmax(weights, axis=-1)
    num_experts = params["gate"].shape[1]
    combine = (jax.nn.one_hot(index, num_experts) * weights[..., None]).sum(2)  # (b, s, e)
    dispatch = jnp.einsum("bse,bsd->ebsd", (combine > 0).astype(x.dtype), x)
    h = jax.nn.relu(jnp.einsum("ebsd,edf->ebsf", dispatch, params["w_in"]))
    out = jnp.einsum("ebsf,efd->ebsd", h, params["w_out"])
    return x + jnp.einsum("ebsd,bse->bsd", out, combine)


def init_moe(seed, *, dim, hidden, experts):
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape).astype(np.float32) / np.sqrt(shape[-2]))

    return {"gate": normal(dim, experts), "w_in": normal(experts, dim, hidden),
            "w_out": normal(experts, hidden, dim)}
