"""The memory estimate's fusion rules against XLA's buffer assignment (issue 25, ViT).

The families ViT compiled to 0.911x its estimate: the estimate held every piece of each
tanh-GELU that autodiff keeps for the backward pass (the bias add, ``0.044715 x^3``, the
tanh, ``1 - t``, ``0.5 (1 + t)`` and ``x * 0.5 (1 + t)``). XLA's buffer assignment of that
step keeps three per block: the matrix product's result, the tanh and ``x * 0.5 (1 + t)``;
the cheap pieces with at most one full-size operand are computed again inside the backward's
kernels (``fusion.recomputed``). The same dump showed two buffers the estimate missed, which
the over-counted GELU had hidden: transposed copies of the (dim, heads, head_dim) kernels for
the backward's products, made at the step's first reads (``xla_buffers.dot_layout_copies``), and a
LayerNorm's per-row ``rsqrt`` written out at full size for the scale gradient's reduction
(``xla_buffers.broadcast_buffers``). The families ViT's default plan now compiles to 0.983x its
estimate, LLaMA's to 0.991x (1.025x before).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _util import compiled_vs_estimated

import autoshard
from autoshard.sharding.build import build_problem
from autoshard.sharding.graph import build_graph
from autoshard.sharding.memory import _transients, liveness, materialized
from autoshard.sharding.xla_buffers import dot_layout_copies

TOLERANCE = 1.10
"""Compiled memory within this factor of the estimate, either way (the issue's target)."""


def _problem(fn, *args, mesh=(8,)):
    closed = jax.make_jaxpr(fn)(*args)
    names = [f"a{i}" for i in range(len(closed.jaxpr.invars))]
    g = build_graph(closed, names, [f"o{i}" for i in range(len(closed.jaxpr.outvars))])
    return build_problem(g, mesh, autoshard.AutoShardingOption(show_progress=False),
                         batch_invars=[False] * len(names), aliases=(), warned=set())


def gelu_mlp(w1, b1, w2, x):
    return jnp.sum(jnp.square(jax.nn.gelu(x @ w1 + b1, approximate=True) @ w2))


# The rules -------------------------------------------------------------------------------------
def test_gelu_keeps_the_tanh_and_the_product_a_matrix_product_reads():
    args = (jnp.ones((32, 64)), jnp.ones((64,)), jnp.ones((64, 32)), jnp.ones((16, 32)))
    prob = _problem(jax.grad(gelu_mlp, argnums=(0, 2)), *args)
    g = prob.graph
    kept = materialized(prob)
    (tanh,) = [n for n in g.nodes if n.kind == "tanh"]
    forward = [n for n in g.nodes if n.id < tanh.id + 8 and n.outputs
               and g.values[n.outputs[0]].shape == (16, 64) and n.kind != "dot_general"]
    written = sorted(n.kind for n in forward if kept[n.outputs[0]])
    assert written == ["mul", "tanh"]   # the old model: add, mul, mul, mul, sub, tanh
    (mul,) = [n for n in forward if n.kind == "mul" and kept[n.outputs[0]]]
    assert mul.id > tanh.id and any(g.nodes[c].kind == "dot_general"
                                    for c, _ in g.consumers()[mul.id])
    (bias_add,) = [n for n in forward if n.kind == "add" and n.operands[0] is not None
                   and g.nodes[g.values[n.operands[0]].producer].kind == "dot_general"]
    assert not kept[bias_add.outputs[0]]   # computed again from the product's result,
    ends = {v: last for v, _, last in liveness(prob)}
    assert ends[bias_add.operands[0]] > tanh.id + 4   # which is held for the backward


def test_multi_head_kernels_are_copied_from_their_first_read_to_the_backward():
    def attn_proj(wq, wo, x):
        q = jnp.einsum("bsd,dhk->bshk", x, wq)
        return jnp.sum(jnp.einsum("bshk,hkd->bsd", jnp.tanh(q), wo))

    args = (jnp.ones((64, 4, 16)), jnp.ones((4, 16, 64)), jnp.ones((8, 16, 64)))
    prob = _problem(jax.grad(attn_proj, argnums=(0, 1, 2)), *args)
    g = prob.graph
    copies = dot_layout_copies(g)
    # the input-gradient products read each kernel with (heads, head_dim) contracted: one
    # transposed copy each; the forward products and the weight gradients need none
    assert sorted(g.values[g.nodes[n].operands[p]].shape for n, p in copies) == [
        (4, 16, 64), (64, 4, 16)]
    spans = {(first, last) for first, last, _, _ in _transients(prob)}
    for n, p in copies:
        u = g.nodes[n].operands[p]
        first = min(node.id for node in g.nodes if u in node.operands)
        assert n > first + 3 and (first, n) in spans


# A whole ViT-like step against memory_analysis() -----------------------------------------------
def _layer_norm(x, scale, bias):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-6) * scale + bias


def _block(p, x):
    h = _layer_norm(x, p["ln1_s"], p["ln1_b"])
    q = jnp.einsum("bsd,dhk->bshk", h, p["wq"]) + p["bq"]
    k = jnp.einsum("bsd,dhk->bshk", h, p["wk"]) + p["bk"]
    v = jnp.einsum("bsd,dhk->bshk", h, p["wv"]) + p["bv"]
    a = jax.nn.softmax(jnp.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(q.shape[-1]), axis=-1)
    x = x + jnp.einsum("bhqs,bshk->bqhk", a, v).reshape(x.shape) @ p["wo"] + p["bo"]
    h = _layer_norm(x, p["ln2_s"], p["ln2_b"])
    h = jax.nn.gelu(h @ p["w1"] + p["b1"], approximate=True)
    return x + h @ p["w2"] + p["b2"]


def _vit_loss(params, x, labels):
    for p in params["blocks"]:
        x = _block(p, x)
    logits = x.mean(1) @ params["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _vit_case(dim=64, heads=4, hidden=256, layers=2, batch=16, seq=32, classes=16):
    rng = np.random.default_rng(0)

    def n(*shape):
        return jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[0]), jnp.float32)

    hd = dim // heads
    blocks = [{"ln1_s": jnp.ones(dim), "ln1_b": jnp.zeros(dim), "ln2_s": jnp.ones(dim),
               "ln2_b": jnp.zeros(dim), "wq": n(dim, heads, hd), "wk": n(dim, heads, hd),
               "wv": n(dim, heads, hd), "bq": jnp.zeros((heads, hd)),
               "bk": jnp.zeros((heads, hd)), "bv": jnp.zeros((heads, hd)),
               "wo": n(dim, dim), "bo": jnp.zeros(dim), "w1": n(dim, hidden),
               "b1": jnp.zeros(hidden), "w2": n(hidden, dim), "b2": jnp.zeros(dim)}
              for _ in range(layers)]
    params = {"blocks": blocks, "head": n(dim, classes)}
    x = jnp.asarray(rng.normal(size=(batch, seq, dim)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, classes, size=(batch,)), jnp.int32)
    tx = optax.adamw(1e-3, weight_decay=0.01)

    def step(state, x, labels):
        params, opt = state
        value, grads = jax.value_and_grad(_vit_loss)(params, x, labels)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), value

    return step, (params, tx.init(params)), (x, labels)


def test_vit_step_estimate_within_tolerance_of_memory_analysis():
    # 0.981 (2,322,120 B compiled, 2,367,500 B estimated); the old model: 0.872 (2,664,460 B),
    # with four blocks and a batch of 32: 0.987, old 0.814
    step, state, batch = _vit_case()
    compiled, estimated, a = compiled_vs_estimated(step, state, batch)
    assert 1 / TOLERANCE <= compiled / estimated <= TOLERANCE, a.explain()
