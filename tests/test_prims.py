"""FLOPs are counted one way (``_prims``) for the planner's rules and the pipeline's layers."""

import jax
import jax.numpy as jnp
from jax import lax

from autoshard.ir._prims import eqn_flops


def conv_eqn(lhs_shape, rhs_shape, dims):
    def f(x, w):
        return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dims)
    jaxpr = jax.make_jaxpr(f)(jnp.ones(lhs_shape), jnp.ones(rhs_shape)).jaxpr
    return next(e for e in jaxpr.eqns if e.primitive.name == "conv_general_dilated")


def test_a_convolution_counts_the_same_flops_in_every_layout():
    n, h, w, cin, cout, k = 2, 8, 8, 3, 16, 3
    want = 2.0 * n * h * w * cout * cin * k * k
    flax_style = conv_eqn((n, h, w, cin), (k, k, cin, cout), ("NHWC", "HWIO", "NHWC"))
    torch_style = conv_eqn((n, cin, h, w), (cout, cin, k, k), ("NCHW", "OIHW", "NCHW"))
    assert eqn_flops(flax_style) == eqn_flops(torch_style) == want


def test_flops_of_a_call_are_those_inside_it():
    f = jax.jit(lambda a, b: jnp.tanh(a @ b))
    jaxpr = jax.make_jaxpr(lambda a, b: f(a, b))(jnp.ones((4, 8)), jnp.ones((8, 5))).jaxpr
    (call,) = jaxpr.eqns
    assert eqn_flops(call) == 2.0 * 4 * 5 * 8 + 4 * 5
