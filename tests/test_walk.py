"""The one way passes look inside equations (``_walk.sub_jaxprs``, ``all_eqns``, ``any_eqn``)."""

import jax
import jax.numpy as jnp
from jax import lax

from autoshard.ir._jaxpr import draws_random
from autoshard.ir._walk import all_eqns, any_eqn, sub_jaxprs


def nested(x, key):
    def body(c, _):
        noisy = lax.cond(c.sum() > 0, lambda c: c + jax.random.normal(key, c.shape),
                         lambda c: c, c)
        return noisy, None

    def loop(c):
        return lax.while_loop(lambda c: c.sum() < 10.0, lambda c: c + 1.0, c)
    y, _ = lax.scan(body, x, None, length=2)
    return jax.jit(loop)(y)


def test_sub_jaxprs_finds_loop_bodies_conditions_branches_and_calls():
    jaxpr = jax.make_jaxpr(nested)(jnp.ones(3), jax.random.key(0)).jaxpr
    by_name = {e.primitive.name: e for e in jaxpr.eqns}
    assert len(sub_jaxprs(by_name["scan"])) == 1
    (call_body,) = sub_jaxprs(by_name["jit"])
    (loop,) = [e for e in call_body.eqns if e.primitive.name == "while"]
    assert len(sub_jaxprs(loop)) == 2          # condition and body
    (cond,) = [e for e in sub_jaxprs(by_name["scan"])[0].eqns if e.primitive.name == "cond"]
    assert len(sub_jaxprs(cond)) == 2          # two branches
    assert all(sub_jaxprs(e) == [] for e in loop.params["body_jaxpr"].jaxpr.eqns)  # adds


def test_any_eqn_and_draws_random_see_every_depth():
    jaxpr = jax.make_jaxpr(nested)(jnp.ones(3), jax.random.key(0)).jaxpr
    names = {e.primitive.name for e in all_eqns(jaxpr)}
    assert {"scan", "cond", "jit", "while", "random_bits"} <= names
    assert any_eqn(jaxpr, lambda e: e.primitive.name == "random_bits")
    assert not any_eqn(jaxpr, lambda e: e.primitive.name == "dot_general")
    scan = next(e for e in jaxpr.eqns if e.primitive.name == "scan")
    call = next(e for e in jaxpr.eqns if e.primitive.name == "jit")
    assert draws_random(scan) and not draws_random(call)


def test_parameters_are_found_in_one_pass_over_the_program(monkeypatch):
    """Issue 25: finding autoshard.grad's parameters walked the program once per input
    (quadratic in layers: 20.7 s to trace 64 layers); it walks it once."""
    import autoshard
    from autoshard import _program

    calls = []
    real = _program.differentiated_inputs
    monkeypatch.setattr(_program, "differentiated_inputs",
                        lambda jaxpr: calls.append(1) or real(jaxpr))

    def step(params, x):
        def loss(p):
            h = x
            for w in p:
                h = jnp.tanh(h @ w)
            return jnp.mean(h ** 2)
        g = autoshard.grad(loss)(params)
        return [w - 0.1 * d for w, d in zip(params, g, strict=True)]
    params = [jnp.ones((4, 4)) for _ in range(12)]
    ex = autoshard.parallelize(step, method=autoshard.DataParallel()).get_executable(
        params, jnp.ones((8, 4)))
    assert sum(ex.program.param_invars) == 12
    assert len(calls) == 1
