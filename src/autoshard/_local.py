"""Evaluate a jaxpr on each device's own batch rows, keeping reductions over the batch partial.

Used inside a ``shard_map`` that is manual over the batch axes (gradient accumulation). Every
value has a kind:

* ``R`` replicated: every device holds the whole value;
* ``("S", d)`` split: every device holds its own block of rows along dim ``d``;
* ``P`` partial: the value is the sum over devices of what each device holds.

A reduction over the batch rows (``reduce_sum``, a ``dot_general`` contracting rows) yields a
partial value without communicating; linear operations keep it partial; anything else turns
it replicated with one ``psum``. That is what lets gradients accumulate on each device over
micro-batches and be reduced once after the loop. A rule that cannot take a partial operand
(a nonlinear use of a batch statistic, e.g. BatchNorm's variance) gets it summed first: the
statistic of the whole micro-batch over all devices, a small value, never the rows. An
operation with no rule here gathers its split operands first: correct, only slower
(``LocalEval.gathered`` names them; the loop warns).

Rules cover what a per-device training step runs: elementwise ops, layout changes, dots and
convolutions (grouped, depthwise, and the weight-gradient convolutions whose contraction over
the rows is partial), pooling windows and their transposes, reductions, cumulative ops, sorts
and top-k within a row, gathers and scatters by row indices, and dynamic slices.
"""

from __future__ import annotations

import copy
import math

import jax
import jax.numpy as jnp
from jax import lax

from ._compat import Literal, Var, bind_eqn
from ._walk import INLINE_CALLS, Walker

R = "R"
P = "P"


def split(d: int):
    return ("S", d)


def is_split(kind) -> bool:
    return isinstance(kind, tuple)


ELEMENTWISE = frozenset("""
add add_any sub mul div max min pow neg exp exp2 log log1p expm1 tanh logistic sin cos tan abs sign
sqrt rsqrt cbrt integer_pow square select_n convert_element_type eq ne lt le gt ge and or not
xor erf erf_inv erfc lgamma digamma is_finite floor ceil round nextafter rem atan2 clamp
stop_gradient copy copy_p real imag conj reduce_precision shift_left shift_right_logical
shift_right_arithmetic asin acos atan sinh cosh asinh acosh atanh
""".split())
# Elementwise ops that are linear in the operands at these positions (the others replicated).
LINEAR_IN = {"add": (0, 1), "add_any": (0, 1), "sub": (0, 1), "neg": (0,), "mul": (0, 1), "div": (0,),
             "convert_element_type": (0,), "copy": (0,), "copy_p": (0,),
             "reduce_precision": (0,), "real": (0,), "imag": (0,), "conj": (0,),
             "select_n": "branches"}
DROPPED = {"sharding_constraint"}  # global specs name the manual axes; propagation decides
IDENTITY = {"pipeline_marker", "optimization_barrier"}
AXIS_OPS = {"cumsum": "axis", "cumprod": "axis", "cummax": "axis", "cummin": "axis",
            "cumlogsumexp": "axis", "sort": "dimension", "rev": "dimensions",
            "argmax": "axes", "argmin": "axes", "top_k": "axis"}


class LocalEval(Walker):
    """Evaluates equations on local values with kinds, over the manual ``axes`` of ``size``.

    A walked value is an ``(array, kind)`` pair; calls are inlined (their bodies keep kinds),
    identities and loops are bound (a loop's operands are made replicated first).
    """

    forward_identities = False

    def __init__(self, axes: tuple[str, ...], size: int, key_hook=None):
        self.axes = axes
        self.size = size
        self.key_hook = key_hook
        self.gathered: set[str] = set()

    # Conversions between kinds ---------------------------------------------------------------
    def to_r(self, x, kind):
        if kind == R:
            return x
        if kind == P:
            return lax.psum(x, self.axes)
        return lax.all_gather(x, self.axes, axis=kind[1], tiled=True)

    def to_p(self, x, kind):
        """A replicated value as a partial one: the first device holds it, the others zero."""
        if kind == P:
            return x
        x = self.to_r(x, kind)
        first = lax.axis_index(self.axes) == 0
        return jnp.where(first, x, jnp.zeros_like(x))

    def to_split(self, x, kind, d: int):
        if kind == split(d):
            return x
        x = self.to_r(x, kind)
        rows = x.shape[d] // self.size
        return lax.dynamic_slice_in_dim(x, lax.axis_index(self.axes) * rows, rows, axis=d)

    def to_kind(self, x, kind, target):
        if target == R:
            return self.to_r(x, kind)
        if target == P:
            return self.to_p(x, kind)
        return self.to_split(x, kind, target[1])

    def child(self):
        """An evaluator for a loop body: the same rules and hooks, its own ``gathered``."""
        sub = copy.copy(self)
        sub.gathered = set()
        return sub

    # Walking ---------------------------------------------------------------------------------
    def run(self, eqns, env: dict, kinds: dict):
        """Evaluate ``eqns``: ``env`` maps vars to local arrays, ``kinds`` to their kinds (R
        when absent); both receive the outputs."""
        pairs = {v: (x, kinds.get(v, R)) for v, x in env.items()}
        self.run_eqns(eqns, pairs)
        for v, (x, k) in pairs.items():
            env[v], kinds[v] = x, k

    def literal(self, lit):
        return (lit.val, R)

    def constant(self, var, value, path):
        return (value, R)

    def equation(self, e, ins, path):
        xs, ks = [x for x, _ in ins], [k for _, k in ins]
        if self.key_hook is not None:
            xs = self.key_hook(e, xs)
        outs, out_kinds = self.eqn(e, xs, ks)
        return list(zip(outs, out_kinds, strict=True))

    def eqn(self, e, ins, ks):
        name = e.primitive.name
        if all(k == R for k in ks):
            if name == "conv_general_dilated":
                return [bind_conv(e, ins)], [R]
            return bind_eqn(e, ins), [R] * len(e.outvars)
        if name in IDENTITY:
            return bind_eqn(e, ins), list(ks)
        if name in DROPPED:
            return list(ins), list(ks)
        if name in INLINE_CALLS:   # reached only with the walk's inlining turned off
            return self._fallback(e, ins, ks)
        rule = getattr(self, "_" + name.replace("-", "_"), None)  # "scatter-add" too
        if rule is None and name in ELEMENTWISE:
            rule = self._elementwise
        if rule is None and name in AXIS_OPS:
            rule = self._axis_op
        result = rule(e, ins, ks) if rule is not None else None
        if result is None and P in ks:  # a statistic of the rows, used nonlinearly: sum it
            ins = [self.to_r(x, k) if k == P else x for x, k in zip(ins, ks, strict=True)]
            ks = [R if k == P else k for k in ks]
            if all(k == R for k in ks):
                return bind_eqn(e, ins), [R] * len(e.outvars)
            result = rule(e, ins, ks) if rule is not None else None
        if result is None:
            return self._fallback(e, ins, ks)
        outs, out_kind = result
        outs = outs if e.primitive.multiple_results else [outs]
        kinds = out_kind if isinstance(out_kind, list) else [out_kind] * len(outs)
        return outs, kinds

    def _fallback(self, e, ins, ks):
        if any(is_split(k) for k in ks):
            self.gathered.add(e.primitive.name)
        ins = [self.to_r(x, k) for x, k in zip(ins, ks, strict=True)]
        return bind_eqn(e, ins), [R] * len(e.outvars)

    # Rules: each returns (output(s), kind(s)) or None for "gather and run replicated" ---------
    def _elementwise(self, e, ins, ks):
        name = e.primitive.name
        splits = {k for k in ks if is_split(k)}
        if P in ks:
            linear = LINEAR_IN.get(name)
            positions = range(1, len(ins)) if linear == "branches" else (linear or ())
            if splits or linear is None or any(
                    k == P and i not in positions for i, k in enumerate(ks)):
                return None
            if name in ("mul",) and ks.count(P) > 1:
                return None
            if name in ("add", "add_any", "sub") or linear == "branches":
                if linear == "branches" and ks[0] != R:
                    return None
                ins = [x if i not in positions else self.to_p(x, k)
                       for i, (x, k) in enumerate(zip(ins, ks, strict=True))]
            return bind_eqn(e, ins)[0], P
        if len(splits) != 1:
            return None
        (kind,) = splits
        d, shape = kind[1], e.outvars[0].aval.shape
        # Operands of size 1 along the row dim broadcast (jax allows it); full ones are sliced.
        ins = [self.to_split(x, k, d) if k != kind and getattr(x, "ndim", 0) == len(shape)
               and x.shape[d] == shape[d] else x for x, k in zip(ins, ks, strict=True)]
        return bind_eqn(e, ins)[0], kind

    def _broadcast_in_dim(self, e, ins, ks):
        if ks[0] == P:
            # Kept partial only while no bigger: a statistic broadcast over the rows (the
            # transpose of a mean) is summed first, not as the rows' whole array.
            if math.prod(e.params["shape"]) != math.prod(e.invars[0].aval.shape):
                return None
            return bind_eqn(e, ins)[0], P
        if not is_split(ks[0]) or len(ins) > 1:
            return None
        d = e.params["broadcast_dimensions"][ks[0][1]]
        shape = list(e.params["shape"])
        shape[d] = ins[0].shape[ks[0][1]]
        params = dict(e.params, shape=tuple(shape))
        return lax.broadcast_in_dim_p.bind(ins[0], **params), split(d)

    def _transpose(self, e, ins, ks):
        if ks[0] == P:
            return bind_eqn(e, ins)[0], P
        return bind_eqn(e, ins)[0], split(list(e.params["permutation"]).index(ks[0][1]))

    def _reshape(self, e, ins, ks):
        if ks[0] == P:
            return bind_eqn(e, ins)[0], P
        if len(ins) > 1:
            return None
        x, d, src = ins[0], ks[0][1], e.invars[0].aval.shape
        order = e.params.get("dimensions")
        if order is not None:  # a transpose first
            x, d, src = lax.transpose(x, order), list(order).index(d), [src[i] for i in order]
        dst = tuple(e.params["new_sizes"])
        before = math.prod(src[:d])
        for o in range(len(dst)):
            if math.prod(dst[:o]) != before:
                continue
            merged = dst[o] % src[d] == 0 and any(
                math.prod(src[d:j]) == dst[o] for j in range(d + 1, len(src) + 1))
            splits_major = src[d] % dst[o] == 0 and dst[o] % self.size == 0
            if merged or splits_major:
                local = list(dst)
                local[o] = dst[o] // self.size
                return jnp.reshape(x, local), split(o)
        return None

    def _squeeze(self, e, ins, ks):
        if ks[0] == P:
            return bind_eqn(e, ins)[0], P
        d, dims = ks[0][1], e.params["dimensions"]
        if d in dims:
            return None
        return bind_eqn(e, ins)[0], split(d - sum(1 for x in dims if x < d))

    def _reduce_sum(self, e, ins, ks):
        axes = tuple(e.params["axes"])
        if ks[0] == P:
            return bind_eqn(e, ins)[0], P
        d = ks[0][1]
        out = bind_eqn(e, ins)[0]
        return (out, P) if d in axes else (out, split(d - sum(1 for a in axes if a < d)))

    def _reduce_max(self, e, ins, ks, combine=lax.pmax):
        if ks[0] == P:
            return None
        d, axes = ks[0][1], tuple(e.params["axes"])
        out = bind_eqn(e, ins)[0]
        if d in axes:
            return combine(out, self.axes), R
        return out, split(d - sum(1 for a in axes if a < d))

    def _reduce_min(self, e, ins, ks):
        return self._reduce_max(e, ins, ks, combine=lax.pmin)

    def _axis_op(self, e, ins, ks):
        name, param = e.primitive.name, AXIS_OPS[e.primitive.name]
        along = e.params[param]
        along = set(along) if isinstance(along, tuple | list) else {along}
        if name == "cumsum" and ks[0] == P:
            return bind_eqn(e, ins)[0], P
        kind = _one_split(ks)
        if kind is None or kind[1] in along:
            return None
        d = kind[1]
        # operands made whole inside the step (the indices of an argsort) are sliced to the rows
        outs = bind_eqn(e, [self.to_split(x, k, d) for x, k in zip(ins, ks, strict=True)])
        if name in ("argmax", "argmin"):
            return outs[0], _after_removing(d, along)
        return (outs if e.primitive.multiple_results else outs[0]), kind

    def _reduce_other(self, e, ins, ks):
        """A reduction without a per-device combine: fine along the other dims only."""
        axes = tuple(e.params["axes"])
        if not is_split(ks[0]) or ks[0][1] in axes:
            return None
        return bind_eqn(e, ins)[0], _after_removing(ks[0][1], axes)

    _reduce_prod = _reduce_xor = _reduce_other

    def _reduce_or(self, e, ins, ks, combine=lax.pmax):
        if not is_split(ks[0]) or ks[0][1] not in e.params["axes"]:
            return self._reduce_other(e, ins, ks)
        out = bind_eqn(e, ins)[0]
        return combine(out.astype(jnp.int32), self.axes).astype(out.dtype), R

    def _reduce_and(self, e, ins, ks):
        return self._reduce_or(e, ins, ks, combine=lax.pmin)

    def _split(self, e, ins, ks):
        if ks[0] == P:
            return bind_eqn(e, ins), [P] * len(e.outvars)
        if not is_split(ks[0]) or ks[0][1] == e.params["axis"]:
            return None
        return bind_eqn(e, ins), [ks[0]] * len(e.outvars)

    def _dynamic_slice(self, e, ins, ks):
        x, kx, idx = ins[0], ks[0], ks[1:]
        if any(k != R for k in idx):
            return None
        if kx == P:
            return bind_eqn(e, ins)[0], P
        d = kx[1]
        sizes = list(e.params["slice_sizes"])
        if sizes[d] != e.invars[0].aval.shape[d]:
            return None  # a slice of the rows: its start clamps to 0 only when it takes all
        sizes[d] = x.shape[d]
        return lax.dynamic_slice(x, ins[1:], sizes), kx

    def _dynamic_update_slice(self, e, ins, ks):
        (x, upd), (kx, ku), idx = ins[:2], ks[:2], ks[2:]
        if any(k != R for k in idx):
            return None
        if P in (kx, ku):  # linear in (operand, update) together
            if is_split(kx) or is_split(ku):
                return None
            return bind_eqn(e, [self.to_p(x, kx), self.to_p(upd, ku)] + ins[2:])[0], P
        kind = _one_split((kx, ku))
        if kind is None or e.invars[1].aval.shape[kind[1]] != e.invars[0].aval.shape[kind[1]]:
            return None  # an update of some rows only
        d = kind[1]
        return bind_eqn(e, [self.to_split(x, kx, d), self.to_split(upd, ku, d)] + ins[2:])[0], kind

    def _slice(self, e, ins, ks):
        if ks[0] == P:
            return bind_eqn(e, ins)[0], P
        d = ks[0][1]
        start, limit = e.params["start_indices"], e.params["limit_indices"]
        strides = e.params["strides"] or (1,) * len(start)
        if start[d] != 0 or limit[d] != e.invars[0].aval.shape[d] or strides[d] != 1:
            return None
        lim = list(limit)
        lim[d] = ins[0].shape[d]
        return lax.slice(ins[0], start, lim, e.params["strides"]), ks[0]

    def _concatenate(self, e, ins, ks):
        dim = e.params["dimension"]
        if P in ks:
            if any(is_split(k) for k in ks):
                return None
            return lax.concatenate([self.to_p(x, k) for x, k in zip(ins, ks, strict=True)],
                                   dim), P
        splits = {k for k in ks if is_split(k)}
        if len(splits) != 1 or next(iter(splits))[1] == dim:
            return None
        kind = next(iter(splits))
        return lax.concatenate([self.to_split(x, k, kind[1]) for x, k in zip(
            ins, ks, strict=True)], dim), kind

    def _pad(self, e, ins, ks):
        if ks[0] == P:  # linear in (operand, padding value) together
            return bind_eqn(e, [ins[0], self.to_p(ins[1], ks[1])])[0], P
        if not is_split(ks[0]) or ks[1] != R:
            return None
        d = ks[0][1]
        if tuple(e.params["padding_config"][d]) != (0, 0, 0):
            return None
        return bind_eqn(e, ins)[0], ks[0]

    # Loops ------------------------------------------------------------------------------------
    def _scan(self, e, ins, ks):
        """A scan over a dim other than the rows (time steps of an RNN): the body runs on each
        device's rows."""
        p = e.params
        nc, ncar = p["num_consts"], p["num_carry"]
        consts, init, xs = list(ins[:nc]), ins[nc:nc + ncar], list(ins[nc + ncar:])
        const_kinds, init_kinds, xs_kinds = list(ks[:nc]), ks[nc:nc + ncar], ks[nc + ncar:]
        if split(0) in xs_kinds:
            return self._scan_rows(e, ins, ks)
        x_kinds = [split(k[1] - 1) if is_split(k) else k for k in xs_kinds]

        def run(carry, carry_kinds, x, gathered):
            return self._run_body(p["jaxpr"], consts + list(carry) + list(x),
                                  const_kinds + carry_kinds + x_kinds, gathered)
        x_avals = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in xs]
        carry_kinds = self._stable_carries(
            init, init_kinds, lambda c, kinds, x: run(c, kinds, x, set())[:ncar], x_avals)
        if carry_kinds is None:
            return None
        gathered, ys_kinds = set(), []

        def step(carry, x):
            outs = run(carry, carry_kinds, x, gathered)
            ys_kinds[:] = [k for _, k in outs[ncar:]]
            return ([self.to_kind(v, k, c) for (v, k), c in zip(
                outs[:ncar], carry_kinds, strict=True)], [v for v, _ in outs[ncar:]])
        carry, ys = lax.scan(step, self._converted(init, init_kinds, carry_kinds), xs,
                             length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
        self.gathered |= gathered
        out_kinds = carry_kinds + [split(k[1] + 1) if is_split(k) else k for k in ys_kinds]
        return list(carry) + list(ys), out_kinds

    def _while(self, e, ins, ks):
        """A while loop whose condition reads no rows: the body runs on each device's rows."""
        p = e.params
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cond_consts, body_consts, init = list(ins[:cn]), list(ins[cn:cn + bn]), ins[cn + bn:]
        cond_kinds, body_kinds, init_kinds = list(ks[:cn]), list(ks[cn:cn + bn]), ks[cn + bn:]

        def run(carry, carry_kinds, gathered):
            return self._run_body(p["body_jaxpr"], body_consts + list(carry),
                                  body_kinds + carry_kinds, gathered)

        def test(carry, carry_kinds, gathered):
            return self._run_body(p["cond_jaxpr"], cond_consts + list(carry),
                                  cond_kinds + carry_kinds, gathered)[0]
        carry_kinds = self._stable_carries(init, init_kinds,
                                           lambda c, kinds, _: run(c, kinds, set()))
        if carry_kinds is None:
            return None
        verdict = []
        jax.eval_shape(lambda c: verdict.append(test(self._converted(
            c, init_kinds, carry_kinds), carry_kinds, set())[1]), list(init))
        if verdict != [R]:
            return None  # the condition depends on the rows
        gathered: set[str] = set()

        def body(carry):
            return [self.to_kind(v, k, c) for (v, k), c in zip(
                run(carry, carry_kinds, gathered), carry_kinds, strict=True)]
        out = lax.while_loop(lambda c: test(c, carry_kinds, gathered)[0], body,
                             self._converted(init, init_kinds, carry_kinds))
        self.gathered |= gathered
        return list(out), carry_kinds

    def _cond(self, e, ins, ks):
        """Branches chosen by a whole index: each runs on each device's rows."""
        if ks[0] != R:
            return None
        branches, ops, op_kinds = e.params["branches"], list(ins[1:]), list(ks[1:])
        kinds = None
        for branch in branches:
            found = []
            jax.eval_shape(lambda *a, branch=branch, found=found: found.extend(
                k for _, k in self._run_body(branch, list(a), op_kinds, set())), *ops)
            kinds = found if kinds is None else [_join(a, b) for a, b in zip(
                kinds, found, strict=True)]
        if None in kinds:
            return None
        gathered: set[str] = set()
        fns = [lambda *a, branch=branch: [self.to_kind(v, k, t) for (v, k), t in zip(
            self._run_body(branch, list(a), op_kinds, gathered), kinds, strict=True)]
            for branch in branches]
        outs = lax.switch(ins[0], fns, *ops)
        self.gathered |= gathered
        return list(outs), kinds

    def _stable_carries(self, init, init_kinds, natural, extra_avals=()):
        """Kinds of loop carries that the body keeps: each starts as its initial value's and
        moves to what the body returns when that costs nothing (whole -> split or partial);
        None when a carry would need communication every iteration. ``natural(carry,
        carry_kinds, extra)`` evaluates the body on abstract values."""
        kinds = list(init_kinds)
        for _ in range(len(kinds) + 2):  # each round moves a carry away from R
            returned = []

            def probe(init, extra, kinds=kinds, returned=returned):
                outs = natural(self._converted(init, init_kinds, kinds), kinds, extra)
                returned[:] = [k for _, k in outs]
            jax.eval_shape(probe, list(init), list(extra_avals))
            joined = [_join(c, r) for c, r in zip(kinds, returned, strict=True)]
            if None in joined or joined == kinds:
                return None if None in joined else kinds
            kinds = joined
        return None

    def _converted(self, values, kinds, targets):
        return [self.to_kind(v, k, t) for v, k, t in zip(values, kinds, targets, strict=True)]

    def _scan_rows(self, e, ins, ks):
        """A scan over the rows themselves: ``lax.map`` over the batch, and its transpose, which
        adds a term per row into carries. Each device runs its own rows; a carry holds the
        sum of its rows' terms (partial; the first device also starts from the initial
        value). Every other operand must be whole."""
        p = e.params
        nc, ncar = p["num_consts"], p["num_carry"]
        xs, xs_kinds = ins[nc + ncar:], ks[nc + ncar:]
        if any(k != R for k in ks[:nc + ncar]) or any(k not in (R, split(0)) for k in xs_kinds) or (
                not _accumulators(p["jaxpr"].jaxpr, nc, ncar)):
            return None
        xs = [self.to_split(x, k, 0) for x, k in zip(xs, xs_kinds, strict=True)]
        consts, init = list(ins[:nc]), [self.to_p(x, R) for x in ins[nc:nc + ncar]]
        whole = [R] * len(ins)  # inside, one row of this device: plain evaluation

        def step(carry, x):
            outs = self._run_body(p["jaxpr"], consts + list(carry) + list(x), whole,
                                  self.gathered)
            return [v for v, _ in outs[:ncar]], [v for v, _ in outs[ncar:]]
        carry, ys = lax.scan(step, init, xs, length=xs[0].shape[0], reverse=p["reverse"],
                             unroll=p["unroll"])
        return list(carry) + list(ys), [P] * ncar + [split(0)] * len(ys)

    def _run_body(self, closed, values, kinds, gathered: set):
        """(value, kind) of the outputs of a loop body run by a child evaluator."""
        sub = self.child()
        jaxpr = closed.jaxpr
        env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
        env.update(zip(jaxpr.invars, values, strict=True))
        kind_of = dict(zip(jaxpr.invars, kinds, strict=True))
        sub.run(jaxpr.eqns, env, kind_of)
        gathered |= sub.gathered
        return [(v.val, R) if isinstance(v, Literal) else (env[v], kind_of.get(v, R))
                for v in jaxpr.outvars]

    # Windows (pooling) and convolutions -------------------------------------------------------
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
        kind = _one_split(ks[:num_arrays])
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

    def _dot_general(self, e, ins, ks):
        (lc, rc), (lb, rb) = e.params["dimension_numbers"]
        lhs, rhs = ins
        kl, kr = ks
        if P in ks:
            if P in (kl, kr) and (is_split(kl) or is_split(kr) or kl == kr):
                return None
            return bind_eqn(e, ins)[0], P
        nl, nr = len(e.invars[0].aval.shape), len(e.invars[1].aval.shape)
        free_l = [d for d in range(nl) if d not in lc and d not in lb]
        free_r = [d for d in range(nr) if d not in rc and d not in rb]

        def out_dim(side, d):
            if d in (lb if side == 0 else rb):
                return list(lb if side == 0 else rb).index(d)
            free = free_l if side == 0 else free_r
            return len(lb) + (0 if side == 0 else len(free_l)) + free.index(d)

        def partner(side, d):
            mine, other = ((lc, rc), (lb, rb)) if side == 0 else ((rc, lc), (rb, lb))
            for a, b in zip(*mine, strict=True):
                if a == d:
                    return b, "contract"
            for a, b in zip(*other, strict=True):
                if a == d:
                    return b, "batch"
            return None, "free"

        for side, kind, other_kind in ((0, kl, kr), (1, kr, kl)):
            if not is_split(kind):
                continue
            d = kind[1]
            match, role = partner(side, d)
            if role == "free":
                if other_kind != R:
                    continue
                return bind_eqn(e, [lhs, rhs])[0], split(out_dim(side, d))
            other = self.to_split(rhs if side == 0 else lhs, other_kind, match)
            new = [lhs, other] if side == 0 else [other, rhs]
            out = bind_eqn(e, new)[0]
            return (out, P) if role == "contract" else (out, split(out_dim(side, d)))
        return None

    def _gather(self, e, ins, ks):
        (operand, indices), (ko, ki) = ins, ks
        dn = e.params["dimension_numbers"]
        if ko == P and ki == R:
            return bind_eqn(e, ins)[0], P
        if P in ks:
            return None
        nidx = len(e.invars[1].aval.shape)
        batch_out = [i for i in range(len(e.outvars[0].aval.shape)) if i not in dn.offset_dims]
        if is_split(ko) and ki == R:
            od = ko[1]
            if od in dn.operand_batching_dims:  # indices made whole in the step: slice them
                ki = split(dn.start_indices_batching_dims[
                    list(dn.operand_batching_dims).index(od)])
                indices = self.to_split(indices, R, ki[1])
            else:  # every row's whole slice along the rows: x[:, i]
                return self._gather_along_rows(e, operand, indices, od)
        if not is_split(ki) or ki[1] == nidx - 1:
            return None
        d = ki[1]
        if d in dn.start_indices_batching_dims:  # rows of the operand and of the indices pair
            od = dn.operand_batching_dims[list(dn.start_indices_batching_dims).index(d)]
            if ko not in (R, split(od)):
                return None
            operand = self.to_split(operand, ko, od)
        elif ko != R:
            return None
        return e.primitive.bind(operand, indices, **e.params), split(batch_out[d])

    def _gather_along_rows(self, e, operand, indices, od):
        dn, params = e.params["dimension_numbers"], dict(e.params)
        sizes = list(params["slice_sizes"])
        if od in dn.collapsed_slice_dims or od in dn.start_index_map or (
                sizes[od] != e.invars[0].aval.shape[od]):
            return None
        kept = [i for i in range(len(sizes))
                if i not in dn.collapsed_slice_dims and i not in dn.operand_batching_dims]
        sizes[od] = operand.shape[od]
        params["slice_sizes"] = tuple(sizes)
        return e.primitive.bind(operand, indices, **params), split(
            dn.offset_dims[kept.index(od)])

    def _scatter_rows(self, e, ins, ks):
        """Any scatter into rows split on a dim the indices do not address: per device."""
        (operand, indices, updates), (ko, ki, ku) = ins, ks
        if ki != R or P in (ko, ku):
            return None
        dn = e.params["dimension_numbers"]
        window = [i for i in range(len(e.invars[0].aval.shape))
                  if i not in dn.inserted_window_dims and i not in dn.operand_batching_dims]
        if is_split(ko) and ko[1] in window and ko[1] not in dn.scatter_dims_to_operand_dims:
            od = ko[1]
            ud = dn.update_window_dims[window.index(od)]
        elif is_split(ku) and ku[1] in dn.update_window_dims:
            ud = ku[1]
            od = window[list(dn.update_window_dims).index(ud)]
            if od in dn.scatter_dims_to_operand_dims:
                return None
        else:
            return None
        if e.invars[2].aval.shape[ud] != e.invars[0].aval.shape[od] or (
                ko not in (R, split(od)) or ku not in (R, split(ud))):
            return None
        new = [self.to_split(operand, ko, od), indices, self.to_split(updates, ku, ud)]
        return bind_eqn(e, new)[0], split(od)

    _scatter = _scatter_mul = _scatter_min = _scatter_max = _scatter_rows

    def _scatter_add(self, e, ins, ks):
        operand, indices, updates = ins
        ko, ki, ku = ks
        dn = e.params["dimension_numbers"]
        nidx, nupd = len(e.invars[1].aval.shape), len(e.invars[2].aval.shape)
        scatter_dims = [i for i in range(nupd) if i not in dn.update_window_dims]
        if ki == R and is_split(ku) and ku[1] in scatter_dims:  # indices made whole in the step
            ki = split(scatter_dims.index(ku[1]))
            indices = self.to_split(indices, R, ki[1])
        elif ki == R and (is_split(ko) or is_split(ku)):
            return self._scatter_rows(e, ins, ks)
        if ki == R and ku in (R, P) and ko in (R, P):
            return bind_eqn(e, [self.to_p(operand, ko), indices, self.to_p(updates, ku)])[0], P
        if is_split(ki) and ku == R and ki[1] < nidx - 1:  # each device takes its rows' updates
            ku = split(scatter_dims[ki[1]])
            updates = self.to_split(updates, R, ku[1])
        if not (is_split(ki) and is_split(ku)):
            return None
        if ki[1] == nidx - 1 or scatter_dims[ki[1]] != ku[1]:
            return None
        if _paired(dn.operand_batching_dims, ko[1] if is_split(ko) else -1,
                   dn.scatter_indices_batching_dims, ki[1]) or (
                ko == R and ki[1] in dn.scatter_indices_batching_dims):
            # Row-wise scatter (the transpose of take_along_axis): each row into its own row.
            d = dn.operand_batching_dims[list(dn.scatter_indices_batching_dims).index(ki[1])]
            return bind_eqn(e, [self.to_split(operand, ko, d), indices, updates])[0], split(d)
        if is_split(ko):
            return None
        # Each device adds its own rows' updates into its copy: a partial sum of the result.
        return bind_eqn(e, [self.to_p(operand, ko), indices, updates])[0], P


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


def _join(carried, returned):
    """The kind a loop carry keeps when the body returns ``returned`` for ``carried`` (or two
    branches' outputs share): a whole value gives way (slicing or zeroing it is free), two
    different splits or a split and a partial cannot be kept without communication (None)."""
    if carried == returned or returned == R:
        return carried
    if carried == R:
        return returned
    return None


def _accumulators(jaxpr, num_consts: int, num_carry: int) -> bool:
    """Whether every carry of a scan body only has terms added to it (``c + f(x, consts)``)."""
    carries = jaxpr.invars[num_consts:num_consts + num_carry]
    tainted = set(carries)
    sums = {}
    for e in jaxpr.eqns:
        reads = [v for v in e.invars if isinstance(v, Var) and v in tainted]
        if not reads:
            continue
        if e.primitive.name not in ("add", "add_any") or len(reads) != 1 or (
                reads[0] not in carries):
            return False
        sums[e.outvars[0]] = reads[0]
        tainted.add(e.outvars[0])
    return [sums.get(v) for v in jaxpr.outvars[:num_carry]] == list(carries) and not any(
        v in tainted for v in jaxpr.outvars[num_carry:])


def _one_split(ks):
    """The one split kind among ``ks`` (others replicated), or None."""
    splits = {k for k in ks if is_split(k)}
    if len(splits) != 1 or any(k != R and not is_split(k) for k in ks):
        return None
    return next(iter(splits))


def _after_removing(d: int, axes) -> tuple:
    """The split of dim ``d`` once the dims ``axes`` (not ``d``) are reduced away."""
    return split(d - sum(1 for a in axes if a < d))


def _paired(operand_dims, d_operand: int, index_dims, d_index: int) -> bool:
    """Whether operand dim ``d_operand`` and index dim ``d_index`` are one batching pair."""
    return any(a == d_operand and b == d_index for a, b in zip(
        operand_dims, index_dims, strict=True))
