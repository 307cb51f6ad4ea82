"""The pipeline-marker primitive: identity under every transformation, rules as specified."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
from autoshard.markers import mark_gradient, pipeline_marker, pipeline_p


def layer(x, w):
    (x,) = pipeline_marker(x, name="l0", mark_type="start")
    y = jnp.tanh(x @ w)
    (y,) = pipeline_marker(y, name="l0", mark_type="end")
    return jnp.sum(y**2)


def plain(x, w):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


X = jnp.arange(12.0).reshape(3, 4) / 10
W = jnp.ones((4, 2)) / 3


def marker_types(jaxpr):
    return [e.params["mark_type"] for e in jaxpr.eqns if e.primitive is pipeline_p]


def test_identity_eager_and_jit():
    out = pipeline_marker(X, W, name="a", mark_type="boundary")
    assert all(o is v or np.array_equal(o, v) for o, v in zip(out, (X, W), strict=True))
    np.testing.assert_array_equal(jax.jit(layer)(X, W), plain(X, W))


def test_lowering_is_pure_identity():
    text = jax.jit(layer).lower(X, W).as_text()
    assert "custom_call" not in text
    assert "pipeline" not in text


def test_grad_matches_unmarked():
    g = jax.grad(layer, argnums=(0, 1))(X, W)
    ref = jax.grad(plain, argnums=(0, 1))(X, W)
    for a, b in zip(g, ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_jvp_marks_tangents_with_jvp_types():
    jaxpr = jax.make_jaxpr(lambda x, t: jax.jvp(lambda x: layer(x, W), (x,), (t,)))(X, X)
    assert marker_types(jaxpr.jaxpr) == ["start", "jvp_start", "end", "jvp_end"]


def test_transpose_swaps_start_and_end():
    jaxpr = jax.make_jaxpr(jax.grad(layer))(X, W)
    # forward start/end, then the backward: the tangent end becomes a start and vice versa
    assert marker_types(jaxpr.jaxpr) == ["start", "end", "start", "end"]


def test_zero_tangents_are_skipped():
    def f(x, c):
        a, b = pipeline_marker(x, c, name="m", mark_type="start")
        return jnp.sum(a * b)
    jaxpr = jax.make_jaxpr(lambda x: jax.jvp(lambda x: f(x, W[:3, :1]), (x,), (x,)))(X[:, :1])
    jvp_eqns = [e for e in jaxpr.jaxpr.eqns
                if e.primitive is pipeline_p and e.params["mark_type"] == "jvp_start"]
    assert len(jvp_eqns) == 1 and len(jvp_eqns[0].invars) == 1


def test_vmap():
    xs = jnp.stack([X, 2 * X])
    got = jax.vmap(layer, in_axes=(0, None))(xs, W)
    want = jax.vmap(plain, in_axes=(0, None))(xs, W)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    got_g = jax.vmap(jax.grad(layer), in_axes=(0, None))(xs, W)
    np.testing.assert_allclose(got_g, jax.vmap(jax.grad(plain), in_axes=(0, None))(xs, W),
                               rtol=1e-6)


def test_checkpoint_and_nested():
    f = jax.jit(jax.grad(jax.checkpoint(lambda x: layer(jax.jit(lambda y: y * 2)(x), W))))
    np.testing.assert_allclose(f(X), jax.grad(lambda x: plain(2 * x, W))(X), rtol=1e-6)
    hess = jax.hessian(lambda x: layer(x, W))(X[:1])
    np.testing.assert_allclose(hess, jax.hessian(lambda x: plain(x, W))(X[:1]), rtol=1e-5)


def test_grad_through_pipeline_boundary_unchanged():
    def f(x):
        y = jnp.sin(x @ W)
        autoshard.mark_pipeline_boundary()
        return jnp.sum(y**2)
    np.testing.assert_allclose(jax.grad(f)(X), jax.grad(lambda x: jnp.sum(jnp.sin(x @ W) ** 2))(X),
                               rtol=1e-6)
    assert marker_types(jax.make_jaxpr(f)(X).jaxpr) == ["boundary"]


def test_autoshard_grad_marks_gradients_and_aux():
    def loss(w):
        return plain(X, w), {"n": jnp.float32(3.0)}
    jaxpr = jax.make_jaxpr(autoshard.value_and_grad(loss, has_aux=True))(W)
    grads = [e for e in jaxpr.jaxpr.eqns
             if e.primitive is pipeline_p and e.params["mark_type"] == "grad"]
    assert len(grads) == 1 and len(grads[0].invars) == 3  # value, aux leaf, gradient
    (v, aux), g = autoshard.value_and_grad(loss, has_aux=True)(W)
    np.testing.assert_allclose(g, jax.grad(lambda w: plain(X, w))(W), rtol=1e-6)
    np.testing.assert_allclose(autoshard.grad(lambda w: plain(X, w))(W), g, rtol=1e-6)
    assert float(aux["n"]) == 3.0


def test_mark_gradient_keeps_non_array_leaves():
    tree = {"a": jnp.ones(2), "b": 3, "c": None}
    out = mark_gradient(tree)
    assert out["b"] == 3 and out["c"] is None


def test_bad_mark_type():
    with pytest.raises(ValueError, match="mark_type \\('middle'\\) must be one of"):
        pipeline_marker(X, name="a", mark_type="middle")
