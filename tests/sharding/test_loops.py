"""Loops: scan over stacked layers, while and cond; carries keep one spec across iterations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import gpt_loss, init_gpt, sgd_step
from _util import assert_close, plan_fn, run_plan
from jax.sharding import PartitionSpec as P

BIG = ("w1", "w2", "wk", "wo", "wq", "wv")


def _plan_gpt(scan: bool, layers: int = 12):
    params = init_gpt(0, vocab=64, dim=256, heads=8, layers=layers, scan=scan)
    tokens = jnp.zeros((8, 32), jnp.int32)
    leaves = len(jax.tree.leaves(params))
    closed, plan = plan_fn(sgd_step(gpt_loss(scan)), (params, tokens, tokens),
                           batch=[0] * leaves + [1, 1], aliases=[(i, i) for i in range(leaves)],
                           logical_mesh_shape=(8,))
    specs = jax.tree.unflatten(jax.tree.structure(params), plan.in_specs[:leaves])
    return plan, specs


def test_scanned_and_unrolled_transformer_get_equivalent_plans():
    scan_plan, scan_specs = _plan_gpt(scan=True)
    unrolled_plan, unrolled_specs = _plan_gpt(scan=False)
    for name in BIG:
        stacked = scan_specs["layers"][name]
        assert stacked[0] is None  # never split across layers
        per_layer = P(*stacked[1:])
        for layer in unrolled_specs["layers"]:
            assert layer[name] == per_layer, (name, layer[name], per_layer)
    # Megatron inside every layer.
    assert scan_specs["layers"]["w1"] == P(None, None, "x")
    assert scan_specs["layers"]["w2"] == P(None, "x")
    a, b = scan_plan.objective.total_s, unrolled_plan.objective.total_s
    # The scan reshards a stacked array once where the unrolled program pays a latency per layer.
    assert abs(a - b) / b < 0.15, (a, b)


def test_scan_carry_keeps_one_spec_and_matches_single_device():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(4, 64, 64)).astype(np.float32) / 8)
    x = jnp.asarray(rng.normal(size=(16, 64)).astype(np.float32))

    def f(w, x):
        def body(h, wi):
            h = jnp.tanh(h @ wi)
            return h, h.sum()
        h, sums = jax.lax.scan(body, x, w)
        return h, sums

    closed, plan = plan_fn(f, (w, x), batch=[0, 1])
    assert_close(run_plan(closed, plan, (w, x)), jax.jit(f)(w, x))
    grad = jax.grad(lambda w, x: f(w, x)[0].sum())
    closed, plan = plan_fn(grad, (w, x), batch=[0, 1])
    assert_close(run_plan(closed, plan, (w, x)), [jax.jit(grad)(w, x)])


def test_while_and_cond_match_single_device():
    x = jnp.arange(64.0).reshape(8, 8) / 64

    def f(x):
        def body(c):
            i, h = c
            return i + 1, jnp.sin(h @ h.T)
        _, h = jax.lax.while_loop(lambda c: c[0] < 3, body, (0, x))
        return jax.lax.cond(h.sum() > 0, lambda a: a * 2, lambda a: a - 1, h)

    closed, plan = plan_fn(f, (x,), batch=[1])
    assert_close(run_plan(closed, plan, (x,)), [jax.jit(f)(x)])


def test_remat_custom_jvp_and_nested_jit_are_inlined():
    @jax.custom_jvp
    def softplus(x):
        return jnp.log1p(jnp.exp(x))

    softplus.defjvp(lambda p, t: (softplus(p[0]), t[0] * jax.nn.sigmoid(p[0])))

    @jax.checkpoint
    def layer(w, x):
        return softplus(jax.jit(lambda a, b: a @ b)(x, w))

    w = jnp.ones((32, 32)) / 32
    x = jnp.linspace(-1, 1, 16 * 32).reshape(16, 32)
    grad = jax.grad(lambda w, x: layer(w, x).sum())
    closed, plan = plan_fn(grad, (w, x), batch=[0, 1])
    assert_close(run_plan(closed, plan, (w, x)), [jax.jit(grad)(w, x)])


@pytest.mark.slow
def test_unrolled_gpt_numerics_12_layers():
    params = init_gpt(0, vocab=64, dim=32, heads=4, layers=12, scan=False)
    tokens = jnp.zeros((8, 16), jnp.int32)
    step = sgd_step(gpt_loss(False))
    leaves = len(jax.tree.leaves(params))
    closed, plan = plan_fn(step, (params, tokens, tokens), batch=[0] * leaves + [1, 1],
                           aliases=[(i, i) for i in range(leaves)])
    assert_close(run_plan(closed, plan, (params, tokens, tokens)),
                 jax.jit(step)(params, tokens, tokens), rtol=1e-3, atol=1e-4)
