"""Tables of JAX primitives by what they do, and FLOP counts, read by every pass: the planner's
rules, the per-device evaluator, gradient accumulation, the aux analysis and the pipeline's
layer split.

A pass that needs a set of primitives takes it from here (or builds it from these), so that
two passes never disagree on what, say, an elementwise op is.
"""

from __future__ import annotations

import math

from ._walk import sub_jaxprs

UNARY = frozenset("""
neg sign floor ceil round is_finite exp exp2 log log1p expm1 tanh logistic sin cos tan asin acos
atan sinh cosh asinh acosh atanh sqrt rsqrt cbrt abs not erf erfc erf_inv lgamma digamma imag
real conj integer_pow square reduce_precision convert_element_type copy copy_p population_count
clz bessel_i0e bessel_i1e stop_gradient
""".split())
BINARY = frozenset("""
add sub mul div rem pow max min atan2 nextafter and or xor eq ne lt le gt ge shift_left
shift_right_logical shift_right_arithmetic add_any select_n clamp complex igamma igammac
random_gamma_grad polygamma zeta threefry2x32
""".split())
ELEMENTWISE = UNARY | BINARY
"""Output element i depends only on element i of each (broadcast) operand."""

ADDS = frozenset({"add", "add_any"})
"""Sums of two values (``add_any`` is what transposition emits)."""

VALUE_PRESERVING = frozenset({"convert_element_type", "copy", "copy_p", "pipeline_marker",
                              "sharding_constraint", "optimization_barrier", "reduce_precision"})
"""The operand's value, up to dtype or rounding, placement or markers."""

LAYOUT = frozenset({"reshape", "squeeze", "expand_dims", "transpose", "broadcast_in_dim"})
"""The operand's elements rearranged (or repeated), none computed."""

KIND_PRESERVING = VALUE_PRESERVING | LAYOUT
"""A mean stays a mean, a sum a sum, through these (the aux analysis, ``combine``)."""

LINEAR = LAYOUT | ADDS | VALUE_PRESERVING | frozenset({"mul", "div", "neg", "sub", "jit", "pjit"})
"""Linear in a summed operand: a sum over devices can be taken after them (``grad_accum``)."""

RANDOM = frozenset({"random_bits", "random_split", "random_fold_in", "random_wrap"})
"""Draw random numbers, or make the keys they draw from."""

KEY_USERS = frozenset({"random_bits", "random_split", "random_fold_in"})
"""Read a key's bits (each micro-batch folds its index into the keys they read)."""



# FLOPs ------------------------------------------------------------------------------------------
def dot_flops(lhs_shape, out_shape, params) -> float:
    """FLOPs of one dot_general: two per multiply-add."""
    (lc, _), _ = params["dimension_numbers"]
    return 2.0 * math.prod(out_shape) * math.prod(lhs_shape[d] for d in lc)


def conv_flops(lhs_shape, rhs_shape, out_shape, params) -> float:
    """FLOPs of one conv_general_dilated: two per multiply-add."""
    dn = params["dimension_numbers"]
    kernel = math.prod(rhs_shape[d] for d in dn.rhs_spec[2:])
    groups = params.get("feature_group_count", 1)
    return 2.0 * math.prod(out_shape) * (lhs_shape[dn.lhs_spec[1]] // groups) * kernel


def eqn_flops(eqn) -> float:
    """A rough FLOP count of one equation: a product's (``dot_flops``, ``conv_flops``), one per
    output element otherwise, or the sum over the equations inside it where that is more."""
    out_shapes = [getattr(v.aval, "shape", ()) for v in eqn.outvars]
    name = eqn.primitive.name
    if name == "dot_general":
        return dot_flops(eqn.invars[0].aval.shape, out_shapes[0], eqn.params)
    if name == "conv_general_dilated":
        return conv_flops(eqn.invars[0].aval.shape, eqn.invars[1].aval.shape, out_shapes[0],
                          eqn.params)
    inner = sum(eqn_flops(e) for sub in sub_jaxprs(eqn) for e in sub.eqns)
    return float(max(sum(math.prod(s) for s in out_shapes), inner))


__all__ = ["ADDS", "BINARY", "ELEMENTWISE", "KEY_USERS", "KIND_PRESERVING", "LAYOUT", "LINEAR",
           "RANDOM", "UNARY", "VALUE_PRESERVING", "conv_flops", "dot_flops", "eqn_flops"]
