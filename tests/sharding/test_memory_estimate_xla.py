"""The memory estimate against XLA's buffer assignment (``compiled.memory_analysis()``).

Three buffers the liveness model (``sharding/memory.py``) missed or counted twice, each read
from XLA's buffer-assignment dump of the families benchmark's LLaMA step:

* a parameter gathered for a backward-only consumer is gathered at the start of the step
  (XLA schedules the gather as soon as its operand exists) and held until that consumer;
* a scan's stacked outputs are loop buffers, written slice by slice from the first iteration
  (the weight gradients of a scanned backward pass);
* a scatter into zeros (the gradient of a gather) and an elementwise op whose operand dies
  there write into their operand's buffer.

Then whole tiny steps with AdamW on 8 CPU devices: an MLP, an attention block with its
softmax, and a scan over remat'ed blocks: the estimate within ``TOLERANCE`` of the compiled
memory (arguments + outputs + temporaries - aliased) either way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import block, gpt_loss, init_gpt, layer_norm, mlp, mse
from _util import compiled_vs_estimated

import autoshard
from autoshard.sharding.build import build_problem
from autoshard.sharding.graph import build_graph
from autoshard.sharding.memory import liveness, reshard_bytes
from autoshard.sharding.spec import shards

TOLERANCE = 1.10
"""Compiled memory within this factor of the estimate, either way (the issue's target)."""


def _problem(fn, *args, mesh=(8,), batch=None):
    closed = jax.make_jaxpr(fn)(*args)
    names = [f"a{i}" for i in range(len(closed.jaxpr.invars))]
    g = build_graph(closed, names, [f"o{i}" for i in range(len(closed.jaxpr.outvars))])
    return build_problem(g, mesh, autoshard.AutoShardingOption(show_progress=False),
                         batch_invars=batch or [False] * len(names), aliases=(), warned=set())


def _span(prob, value_id):
    (span,) = [(a, b) for v, a, b in liveness(prob) if v == value_id]
    return span


# The liveness rules --------------------------------------------------------------------------
def test_scan_stacked_output_lives_from_the_loop_start():
    def fn(w, x):
        def body(c, row):
            h = jnp.tanh(row @ w)
            return c + h, h * 2.0
        return jax.lax.scan(body, jnp.zeros((8, 16)), x)

    prob = _problem(fn, jnp.ones((16, 16)), jnp.ones((4, 8, 16)))
    g = prob.graph
    (ys,) = [n for n in g.nodes if n.kind == "ys"]
    (xs_node, _), = g.loop_ends.items()
    first, _ = _span(prob, ys.outputs[0])
    assert first == xs_node < ys.id   # the old model started it after the loop (at ys.id)


def test_scatter_into_zeros_writes_into_the_zeros():
    def fn(idx, upd):
        grad = jnp.zeros((64, 32)).at[idx].add(upd)
        return grad * 3.0

    prob = _problem(fn, jnp.arange(16, dtype=jnp.int32), jnp.ones((16, 32)))
    g = prob.graph
    (scatter,) = [n for n in g.nodes if n.kind in ("scatter-add", "scatter_add")]
    zeros = scatter.operands[0]
    _, last = _span(prob, zeros)
    assert last < scatter.id   # one buffer: the old model held both at the scatter


def test_parameter_copy_for_a_late_consumer_is_made_at_the_start():
    # w is read by the first dot in its own spec and by the last in another: XLA gathers it
    # as soon as it can (read from its schedule: all-gather then copy before the forward
    # pass) and holds the copy until the last dot.
    def fn(w, x):
        h = jnp.tanh(x @ w)
        for _ in range(4):
            h = jnp.tanh(h * 1.5 + 1.0)
        return jnp.einsum("bd,ed->be", h, w)   # reads w itself, in another spec

    prob = _problem(fn, jnp.ones((64, 64)), jnp.ones((32, 64)), mesh=(8,),
                    batch=[False, True])
    g = prob.graph
    w_node = g.nodes[g.inputs[0]]
    w = w_node.outputs[0]
    readers = [n for n in g.nodes if w in n.operands]
    first_reader, last = readers[0], readers[-1]
    choice = {prob.var(n.id): 0 for n in g.nodes}
    sharded = [k for k, s in enumerate(prob.strategies[w_node.id])
               if shards(s.out_specs[0], prob.ctx.mesh_shape) == 8]
    whole = [k for k, s in enumerate(prob.strategies[last.id])
             if s.in_specs and last.operands.index(w) < len(s.in_specs)
             and shards(s.in_specs[last.operands.index(w)], prob.ctx.mesh_shape) == 1]
    assert sharded and whole
    choice[prob.var(w_node.id)] = sharded[0]
    choice[prob.var(last.id)] = whole[0]
    for n in readers[:-1]:   # the earlier readers take w as it is (no copy for them)
        spec = prob.strategies[w_node.id][sharded[0]].out_specs[0]
        fits = [k for k, s in enumerate(prob.strategies[n.id])
                if s.in_specs and s.in_specs[n.operands.index(w)] == spec]
        if fits and prob.var(n.id) != prob.var(last.id):
            choice[prob.var(n.id)] = fits[0]
    copies = reshard_bytes(prob, choice)
    full = 64 * 64 * 4
    assert copies[last.id] >= full
    assert copies[first_reader.id] >= full   # the old model: 0 until the last dot


# Whole steps against memory_analysis() -------------------------------------------------------
def _adam(loss):
    tx = optax.adamw(1e-2, weight_decay=0.01)

    def step(state, *batch):
        params, opt = state
        value, grads = jax.value_and_grad(loss)(params, *batch)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), value

    return step, tx


def _remat_scan_loss(params, tokens, targets):
    x = params["embed"][tokens]
    layer = jax.checkpoint(lambda c, p: block(p, c))
    x, _ = jax.lax.scan(lambda c, p: (layer(c, p), None), x, params["layers"])
    logp = jax.nn.log_softmax(layer_norm(x, params["ln_f"]) @ params["embed"].T)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def _case(kind):
    rng = np.random.default_rng(0)
    if kind == "mlp":
        params = [jnp.asarray(rng.normal(size=(256, 512)) * 0.05, jnp.float32),
                  jnp.asarray(rng.normal(size=(512, 256)) * 0.05, jnp.float32)]
        x = jnp.asarray(rng.normal(size=(64, 256)), jnp.float32)
        step, tx = _adam(mse(mlp))
        return step, (params, tx.init(params)), (x, x)
    params = init_gpt(0, vocab=256, dim=64, heads=4, layers=2, scan=kind == "remat_scan")
    tokens = jnp.asarray(rng.integers(0, 256, size=(16, 32)), jnp.int32)
    step, tx = _adam(_remat_scan_loss if kind == "remat_scan" else gpt_loss(False))
    return step, (params, tx.init(params)), (tokens, tokens)


@pytest.mark.parametrize("kind", ["mlp", "attention", "remat_scan"])
def test_estimate_within_tolerance_of_memory_analysis(kind):
    # remat_scan: compiled/estimate 1.23 before the stacked outputs were counted from the
    # loop's start (the scanned backward's weight gradients); 1.05 after.
    step, state, batch = _case(kind)
    compiled, estimated, a = compiled_vs_estimated(step, state, batch)
    assert 1 / TOLERANCE <= compiled / estimated <= TOLERANCE, a.explain()
