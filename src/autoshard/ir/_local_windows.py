"""Per-device rules of ``_local.LocalEval`` for windows and convolutions: pooling
(``reduce_window*``) and its transposes (``select_and_scatter_add``, ``select_and_gather_add``),
``conv_general_dilated`` (grouped, depthwise, and the weight-gradient convolutions whose
contraction over the rows is partial), and ``bind_conv``, which binds a convolution in the
dim order XLA:CPU runs fast inside loops."""

from __future__ import annotations

from jax import lax

from ._compat import bind_eqn
from ._local_kinds import P, R, is_split, one_split, split


class WindowRules:
    """Rules mixed into ``LocalEval``: each returns (output(s), kind(s)) or None."""

    def _reduce_window_sum(self, e, ins, ks):
        if ks[0] == P:
            return bind_eqn(e, ins)[0], P
        return self._windowed(e, ins, ks, len(ins))

    def _reduce_window_max(self, e, ins, ks):
        return self._windowed(e, ins, ks, len(ins))

    _reduce_window_min = _reduce_window_max

    def _reduce_window(self, e, ins, ks):
        """The general form: operands, then their initial values (scalars)."""
        return self._windowed(e, ins, ks, len(ins) // 2)

    def _select_and_scatter_add(self, e, ins, ks):
        """The transpose of max pooling: (cotangent, pooled input) -> input's cotangent."""
        if ks[0] == P and ks[1] == R:
            return bind_eqn(e, ins)[0], P
        return self._windowed(e, ins, ks, 2)

    def _select_and_gather_add(self, e, ins, ks):
        """The JVP of max pooling: (tangent, input) -> the tangent at each window's max."""
        return self._select_and_scatter_add(e, ins, ks)

    def _windowed(self, e, ins, ks, num_arrays: int):
        """A window op whose window is one element wide along the rows: per device."""
        kind = one_split(ks[:num_arrays])
        if kind is None or P in ks or any(k != R for k in ks[num_arrays:]):
            return None
        d, p = kind[1], e.params
        trivial = (p["window_dimensions"][d] == 1 and p["window_strides"][d] == 1
                   and tuple(p["padding"][d]) == (0, 0)
                   and p.get("base_dilation", (1,) * (d + 1))[d] == 1)
        if not trivial:
            return None
        ins = [self.to_split(x, k, d) if i < num_arrays else x
               for i, (x, k) in enumerate(zip(ins, ks, strict=True))]
        outs = bind_eqn(e, ins)
        return (outs if e.primitive.multiple_results else outs[0]), kind

    def _conv_general_dilated(self, e, ins, ks):
        """Rows on the batch dim of the input stay per device; rows on the contracted feature
        dims of both operands (the kernel's gradient) give a partial sum."""
        lhs_spec, rhs_spec, out_spec = e.params["dimension_numbers"]
        groups, batch_groups = e.params["feature_group_count"], e.params["batch_group_count"]
        (lhs, rhs), (kl, kr) = ins, ks
        if P in ks:  # bilinear: one partial operand times a replicated one
            if kl == kr or is_split(kl) or is_split(kr):
                return None
            return bind_conv(e, ins), P
        if kl == split(lhs_spec[0]) and kr == R and batch_groups == 1:
            return bind_conv(e, ins), split(out_spec[0])
        rows_l, rows_r = split(lhs_spec[1]), split(rhs_spec[1])
        if groups == 1 and kl in (R, rows_l) and kr in (R, rows_r):
            new = [self.to_split(lhs, kl, lhs_spec[1]), self.to_split(rhs, kr, rhs_spec[1])]
            return bind_conv(e, new), P
        return None


def bind_conv(e, ins):
    """A ``conv_general_dilated`` equation bound in the canonical dim order (batch, spatial...,
    feature; kernel spatial..., in, out) between explicit transposes. Inside a ``while`` body
    XLA:CPU leaves other orders (a kernel gradient's rows-as-features) to a slow naive loop,
    ~30x slower than the same convolution outside a loop."""
    lhs, rhs = ins
    lhs_spec, rhs_spec, out_spec = e.params["dimension_numbers"]
    nd = len(lhs_spec) - 2
    spatial = tuple(range(1, nd + 1))
    canon = lax.ConvDimensionNumbers(lhs_spec=(0, nd + 1) + spatial,
                                     rhs_spec=(nd + 1, nd) + tuple(range(nd)),
                                     out_spec=(0, nd + 1) + spatial)
    if e.params["dimension_numbers"] == canon:
        return bind_eqn(e, ins)[0]
    lhs = lax.transpose(lhs, (lhs_spec[0],) + tuple(lhs_spec[2:]) + (lhs_spec[1],))
    rhs = lax.transpose(rhs, tuple(rhs_spec[2:]) + (rhs_spec[1], rhs_spec[0]))
    out = e.primitive.bind(lhs, rhs, **dict(e.params, dimension_numbers=canon))
    back = [0] * (nd + 2)  # canonical dim of each of the equation's output dims
    back[out_spec[0]], back[out_spec[1]] = 0, nd + 1
    for i, d in enumerate(out_spec[2:]):
        back[d] = 1 + i
    return lax.transpose(out, tuple(back))
