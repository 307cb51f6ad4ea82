"""Pins are keyed by sites (equation path + output), which survive a re-trace; one walk."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import assert_close, compile_plan, plan_fn

from autoshard.sharding.apply import PlanMismatch
from autoshard.sharding.graph import build_graph
from autoshard.sharding.plan import ShardingPlan


def _mlp(params, x):
    @jax.jit          # an inlined call: its equations get nested paths
    def block(h, w):
        return jax.nn.relu(h @ w)

    def layer(h, w):
        return block(h, w), None

    h, _ = jax.lax.scan(layer, x @ params["w_in"], params["ws"])
    return jnp.mean((h @ params["w_out"]) ** 2)


def _args():
    rng = np.random.default_rng(0)
    params = {"w_in": jnp.asarray(rng.normal(size=(32, 64)), jnp.float32),
              "ws": jnp.asarray(rng.normal(size=(3, 64, 64)) * 0.1, jnp.float32),
              "w_out": jnp.asarray(rng.normal(size=(64, 8)), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(64, 32)), jnp.float32)
    return params, x


def test_sites_name_nested_equations_and_are_the_same_on_every_trace():
    args = _args()
    g1 = build_graph(jax.make_jaxpr(jax.grad(_mlp))(*args), [""] * 4, [""] * 3)
    g2 = build_graph(jax.make_jaxpr(lambda *a: jax.grad(_mlp)(*a))(*args), [""] * 4, [""] * 3)
    assert g1.sites == g2.sites and g1.sites
    nested = [s for s in g1.sites.values() if s.count("/") >= 2]
    assert nested, "equations inside the scan body's jit call have nested paths"
    assert any(":xs" in s for s in g1.sites.values())  # scanned slices have their own sites


def test_a_saved_plan_applies_to_a_fresh_trace_of_its_program(tmp_path):
    args = _args()
    step = jax.grad(_mlp)
    closed, plan = plan_fn(step, args, batch=[False, False, False, True])
    assert all(isinstance(key, str) and ":" in key for key, _ in plan.intermediates)
    plan.save(tmp_path / "plan.json")
    loaded = ShardingPlan.load(tmp_path / "plan.json")
    assert loaded.intermediates == plan.intermediates
    assert loaded.operand_specs == plan.operand_specs
    again = jax.make_jaxpr(lambda *a: step(*a))(*args)   # a new trace, new jaxpr objects
    assert again is not closed
    fresh = compile_plan(again, loaded)
    original = compile_plan(closed, plan)
    flat = jax.tree.leaves(args)
    assert_close(fresh(*flat), jax.jit(step)(*args))
    assert (fresh.lower(*flat).compile().as_text().count("all-reduce(")
            == original.lower(*flat).compile().as_text().count("all-reduce("))


def test_a_plan_for_another_program_is_an_error_naming_a_site():
    args = _args()
    _, plan = plan_fn(jax.grad(_mlp), args, batch=[False, False, False, True])

    def other(params, x):            # same inputs, fewer equations
        return jnp.sum(x @ params["w_in"])

    closed = jax.make_jaxpr(jax.grad(other))(*args)
    with pytest.raises(PlanMismatch, match=r"made for another program") as err:
        compile_plan(closed, plan).lower(*jax.tree.leaves(args))
    assert ":" in str(err.value)   # names a site
