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

Partial values that will be summed go together: ``run`` first traces the equations once to
learn which partial values some rule sums (a probe, discarded), then, at the first sum, sums
every such value already computed in the same ``psum``. BatchNorm's mean and mean of squares
(and the backward's pair) then cost one reduction, not two in a row: in a micro-batch loop a
reduction's latency is paid once per micro-batch.

Rules cover what a per-device training step runs: elementwise ops, layout changes, dots and
convolutions (grouped, depthwise, and the weight-gradient convolutions whose contraction over
the rows is partial), pooling windows and their transposes, reductions, cumulative ops, sorts
and top-k within a row, gathers and scatters by row indices, and dynamic slices.
The kinds live in ``_local_kinds``; the rules for loops, for windows and convolutions, and for
indexing in the mixins ``_local_loops``, ``_local_windows`` and ``_local_index``.
"""

from __future__ import annotations

import copy
import math

import jax
import jax.numpy as jnp
from jax import lax

from ._compat import bind_eqn
from ._local_index import IndexRules
from ._local_kinds import P, R, is_split, one_split, split
from ._local_loops import LoopRules
from ._local_windows import WindowRules, bind_conv
from ._prims import ELEMENTWISE
from ._walk import INLINE_CALLS, Walker

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


class LocalEval(LoopRules, WindowRules, IndexRules, Walker):
    """Evaluates equations on local values with kinds, over the manual ``axes`` of ``size``.

    A walked value is an ``(array, kind)`` pair; calls are inlined (their bodies keep kinds),
    identities and loops are bound (a loop's operands are made replicated first).
    """

    forward_identities = False

    bundle_sums = True
    """Sum the partial values a run will sum together, at the first of those sums."""

    def __init__(self, axes: tuple[str, ...], size: int, key_hook=None):
        self.axes = axes
        self.size = size
        self.key_hook = key_hook
        self.gathered: set[str] = set()
        self._fresh_sums()

    def _fresh_sums(self, will_sum=frozenset(), probing=False):
        # Tables keyed by id of a traced value hold the value too (its id stays its own).
        self._will_sum = will_sum   # vars whose partial value some rule sums (from the probe)
        self._probing = probing     # recording ``_summed_vars`` instead of bundling
        self._partials: dict[int, tuple] = {}  # id -> (partial value, its var)
        self._summed_vars: set = set()
        self._fed_by: dict = {}  # var of a partial value -> var of the one partial it is from
        self._pending: dict[int, tuple] = {}   # id -> (partial value, var), to be summed
        self._summed: dict[int, tuple] = {}    # id -> (partial value, its sum)

    # Conversions between kinds ---------------------------------------------------------------
    def to_r(self, x, kind):
        if kind == R:
            return x
        if kind == P:
            return self._sum(x)
        return lax.all_gather(x, self.axes, axis=kind[1], tiled=True)

    @staticmethod
    def _held(table: dict, x):
        """What ``table`` (keyed by id of a traced value) holds for ``x`` itself, or None."""
        entry = table.get(id(x))
        return entry[1] if entry is not None and entry[0] is x else None

    def _sum(self, x):
        """psum of the partial ``x``, with every pending partial value that will be summed."""
        done = self._held(self._summed, x)
        if done is not None:
            return done
        if self._probing and self._held(self._partials, x) is not None:
            self._summed_vars.add(self._held(self._partials, x))
        group = [x]
        if self._held(self._pending, x) is not None:
            group += [y for y, _ in self._pending.values() if y is not x]
            self._pending.clear()
        sums = lax.psum(tuple(group), self.axes)
        for y, total in zip(group, sums, strict=True):
            self._summed[id(y)] = (y, total)
        return sums[0]

    def _summed_of(self, x, kind):
        """(value, kind) of ``x`` taking a sum already made into account."""
        done = self._held(self._summed, x) if kind == P else None
        return (x, kind) if done is None else (done, R)

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
        """An evaluator for a loop body: the same rules and hooks, its own ``gathered``; sums
        inside the body are not bundled (the body is a trace of its own)."""
        sub = copy.copy(self)
        sub.gathered = set()
        sub.bundle_sums = False
        sub._fresh_sums()
        return sub

    # Walking ---------------------------------------------------------------------------------
    def run(self, eqns, env: dict, kinds: dict):
        """Evaluate ``eqns``: ``env`` maps vars to local arrays, ``kinds`` to their kinds (R
        when absent); both receive the outputs."""
        self._fresh_sums(self._probe(eqns, env, kinds))
        self._run(eqns, env, kinds)
        self._fresh_sums()

    def _run(self, eqns, env: dict, kinds: dict):
        pairs = {v: (x, kinds.get(v, R)) for v, x in env.items()}
        self.run_eqns(eqns, pairs)
        for v, (x, k) in pairs.items():
            env[v], kinds[v] = self._summed_of(x, k)

    def _probe(self, eqns, env: dict, kinds: dict) -> frozenset:
        """The vars whose partial value some rule sums when ``eqns`` run on these kinds,
        found by tracing them once on the side (the trace is discarded)."""
        if not (self.bundle_sums and self.axes):
            return frozenset()
        probe = copy.copy(self)
        probe.gathered = set()
        probe._fresh_sums(probing=True)
        jax.make_jaxpr(lambda: probe._run(eqns, dict(env), dict(kinds)) or [])()
        # A summed partial value computed from one no bigger partial value (BatchNorm's
        # variance from the mean of squares) is summed as that value, which then goes with
        # the other sums of its group: same bytes, one reduction fewer in a row.
        wanted, todo = set(), list(probe._summed_vars)
        while todo:
            var = todo.pop()
            if var not in wanted:
                wanted.add(var)
                if var in probe._fed_by:
                    todo.append(probe._fed_by[var])
        return frozenset(wanted)

    def lookup(self, env: dict, atom):
        return self._summed_of(*super().lookup(env, atom))

    def literal(self, lit):
        return (lit.val, R)

    def constant(self, var, value, path):
        return (value, R)

    def equation(self, e, ins, path):
        xs, ks = [x for x, _ in ins], [k for _, k in ins]
        if self.key_hook is not None:
            xs = self.key_hook(e, xs)
        outs, out_kinds = self.eqn(e, xs, ks)
        for var, x, k in zip(e.outvars, outs, out_kinds, strict=True):
            if k != P:
                continue
            if self._probing:
                self._partials[id(x)] = (x, var)
                self._note_source(var, xs, ks)
            elif var in self._will_sum:
                self._pending[id(x)] = (x, var)
        return list(zip(outs, out_kinds, strict=True))

    def _note_source(self, var, xs, ks):
        """In the probe: ``var``'s partial value comes from exactly one partial operand no
        bigger than it (the others replicated)."""
        froms = [self._held(self._partials, x) for x, k in zip(xs, ks, strict=True) if k == P]
        if len(froms) == 1 and froms[0] is not None and (
                math.prod(froms[0].aval.shape) <= math.prod(var.aval.shape)):
            self._fed_by[var] = froms[0]

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
        kind = one_split(ks)
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


def _after_removing(d: int, axes) -> tuple:
    """The split of dim ``d`` once the dims ``axes`` (not ``d``) are reduced away."""
    return split(d - sum(1 for a in axes if a < d))
