"""How micro-batches combine the values a gradient marker tags: the rule behind ``"auto"``.

An accumulated step (``num_micro_batches=k``) must return what the same step returns on the
whole batch. Gradients declare their reduction (``"mean"`` for the gradient of a mean loss).
An aux value of ``autoshard.value_and_grad`` declared ``"auto"`` (the default) is classified
from the traced program, once, before anything runs:

* **mean-type floats** (a reduction over the rows scaled by a constant, e.g. ``jnp.mean``,
  optax's mean losses, sums and differences of such values and of batch-independent ones):
  averaged over micro-batches. Exact: the micro-batches have equal size.
* **sums** (``jnp.sum`` over rows, counts): summed. **Integer** values (``jnp.sum`` of a
  boolean, token counts) are sums, accumulated in their own dtype, exactly.
* **shape-derived constants** (``count = logits.shape[0]``, a Python number): compared with
  the step traced on the whole batch: equal there, they are taken as they are; ``k`` times
  larger there, they are summed; anything else is an error.
* **batch-independent values** (a parameter norm): taken as they are.
* **running statistics** (BatchNorm's ``batch_stats``: a nonlinear function of micro-batch
  means, such as a variance, that the step stores back into an input it replaces): the mean
  over micro-batches of each micro-batch's statistic, which is what the model computes per
  micro-batch. The running mean is exact; the running variance is the average of the
  micro-batches' variances (it leaves out the variance of their means).
* anything else (``exp`` of a mean loss, a maximum over rows) cannot be rebuilt from
  micro-batch values: an error names the value, its source line and the fix (declare its
  reduction, or compute it after the gradient from values that combine).

An explicit ``aux_reduction="mean"`` or ``"sum"`` (or a pytree of them) is taken as given. The
rule is applied to the traced program itself (the marker's ``reductions``), so every method
that accumulates (ShardParallel, DataParallel, ZeRO, pipelines) combines alike.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from .ir._compat import Literal, Var, source_line
from .ir._jaxpr import dependents, grad_marker_index
from .ir._prims import KIND_PRESERVING
from .ir._walk import INLINE_CALLS, body_of

MEAN, SUM, SAME, STAT, OTHER = "mean", "sum", "same", "statistic", "other"
ROWS = "rows"
"""A marked value with one entry per row (aux logits): the micro-batches' values joined in row
order for the update after the gradient, which then runs on the whole batch (``after_grad``)."""



def resolve(closed, *, batch_invars, num_micro_batches: int, aliases=(), whole_batch=None,
            out_paths=()):
    """``closed`` with every ``"auto"`` reduction of its gradient marker replaced by the one
    its value needs (``"mean"`` or ``"sum"``); ``whole_batch()`` gives the step traced on the
    whole batch (called only when a marked value is a constant). Raises ValueError for a
    value no reduction reconstructs."""
    if num_micro_batches > 1 and any(isinstance(v, Literal) for v in closed.jaxpr.outvars):
        closed = _whole_batch_literals(closed, whole_batch())
    jaxpr = closed.jaxpr
    cut = grad_marker_index(jaxpr)
    if cut is None:
        return closed
    marker = jaxpr.eqns[cut]
    declared = tuple(marker.params.get("reductions") or ("mean",) * len(marker.invars))
    if "auto" not in declared:
        return closed
    k = num_micro_batches
    pre = jaxpr.eqns[:cut]
    batch_vars = {v for v, b in zip(jaxpr.invars, batch_invars, strict=True) if b}
    kinds = _Kinds(pre, batch_vars)
    stored = _stored_in_state(jaxpr, cut, aliases)
    whole = None
    resolved = []
    for i, (v, r) in enumerate(zip(marker.invars, declared, strict=True)):
        if r != "auto":
            resolved.append(r)
            continue
        if k == 1:
            resolved.append(MEAN)
            continue
        if _is_constant(v, jaxpr):
            whole = whole if whole is not None else whole_batch()
            kind = _constant_kind(v, i, closed, whole, cut, k)
        else:
            kind = kinds.of(v)
        if is_rows(kind):  # joined in row order for the update after the gradient
            resolved.append(ROWS)
            continue
        dtype = v.aval.dtype
        if kind in (MEAN, STAT) and not jnp.issubdtype(dtype, jnp.inexact):
            kind = OTHER
        if kind == OTHER and jnp.issubdtype(dtype, jnp.integer):
            kind = SUM  # an integer computed from the rows: a count
        if kind == STAT and i not in stored:
            kind = OTHER
        if kind == OTHER:
            raise ValueError(_cannot(v, i, marker, kinds, out_paths, jaxpr, cut))
        resolved.append(SUM if kind == SUM else MEAN)
    new_marker = marker.replace(params={**marker.params, "reductions": tuple(resolved)})
    eqns = list(jaxpr.eqns)
    eqns[cut] = new_marker
    return closed.replace(jaxpr=jaxpr.replace(eqns=eqns))


def _whole_batch_literals(closed, whole):
    """Outputs that are constants of the traced step (``count = logits.shape[0]``, never
    marked: not arrays) take their value from the step traced on the whole batch."""
    outs = list(closed.jaxpr.outvars)
    for n, (v, w) in enumerate(zip(outs, whole.jaxpr.outvars, strict=True)):
        if isinstance(v, Literal) and isinstance(w, Literal):
            outs[n] = w
    return closed.replace(jaxpr=closed.jaxpr.replace(outvars=outs))


def _is_constant(v, jaxpr) -> bool:
    return isinstance(v, Literal) or v in set(jaxpr.constvars)


def _constant_kind(v, i, closed, whole, cut, k) -> str:
    """A marked constant of one micro-batch's step against the same value on the whole batch:
    equal (taken as it is) or ``k`` times larger (a count of rows: summed)."""
    here = _constant_value(closed, v)
    w_cut = grad_marker_index(whole.jaxpr)
    there_v = whole.jaxpr.eqns[w_cut].invars[i] if w_cut is not None else None
    if there_v is None or not _is_constant(there_v, whole.jaxpr):
        return OTHER
    there = _constant_value(whole, there_v)
    if jnp.array_equal(jnp.asarray(here), jnp.asarray(there)):
        return SAME
    if jnp.allclose(jnp.asarray(here) * k, jnp.asarray(there)):
        return SUM
    return OTHER


def _constant_value(closed, v):
    if isinstance(v, Literal):
        return v.val
    return closed.consts[list(closed.jaxpr.constvars).index(v)]


class _Kinds:
    """What kind of value each variable before the marker is, from the ops that made it: a
    batch-independent value (``SAME``), per-row values with the rows along dim ``d``
    (``("rows", d)``; ``d`` None where it was lost), a sum or a mean over the rows, a
    statistic (a nonlinear function of means) or something else."""

    def __init__(self, pre, batch_vars, seeds=None):
        self.per_batch = dependents(pre, set(batch_vars))
        self.producer = {o: e for e in pre for o in e.outvars}
        self.memo: dict = dict(seeds or {})

    def of(self, v):
        if isinstance(v, Literal) or v not in self.per_batch:
            return SAME
        if v in self.memo:
            return self.memo[v]
        e = self.producer.get(v)
        kind = rows(0) if e is None else self._eqn(e, v)
        self.memo[v] = kind
        return kind

    def _eqn(self, e, v):
        name, p = e.primitive.name, e.params
        ins = [self.of(u) for u in e.invars]
        out_rank = len(getattr(v.aval, "shape", ()))
        row_in = [(k[1], u) for k, u in zip(ins, e.invars, strict=True) if is_rows(k)]
        if name in INLINE_CALLS:
            return _inside(e, e.outvars.index(v), ins)
        if name in ("reduce_sum", "reduce_max", "reduce_min", "argmax", "argmin",
                    "reduce_prod", "reduce_and", "reduce_or"):
            axes = tuple(p.get("axes", ()))
            if is_rows(ins[0]):
                d = ins[0][1]
                if d is None:
                    return OTHER
                if d in axes:
                    return SUM if name == "reduce_sum" else OTHER
                return rows(d - sum(a < d for a in axes))
            if name == "reduce_sum" and ins[0] in (SUM, MEAN):
                return ins[0]
            return _nonlinear(ins)
        if name == "dot_general" and row_in:
            (lc, rc), (lb, rb) = p["dimension_numbers"]
            lhs_rank = len(e.invars[0].aval.shape)
            rhs_rank = len(e.invars[1].aval.shape)
            for side, k in enumerate(ins):
                if not is_rows(k) or k[1] is None:
                    continue
                d, con, bat = k[1], (lc, rc)[side], (lb, rb)[side]
                if d in con:
                    return SUM
                if d in bat:
                    return rows(list(bat).index(d))
                lhs_free = [x for x in range(lhs_rank) if x not in lc and x not in lb]
                rhs_free = [x for x in range(rhs_rank) if x not in rc and x not in rb]
                free = (lhs_free, rhs_free)[side]
                offset = len(lb) + (0 if side == 0 else len(lhs_free))
                return rows(offset + free.index(d))
            return rows(None)
        if row_in:
            d, u = row_in[0]
            return rows(_moved(name, p, d, u.aval.shape, v.aval.shape, out_rank))
        if name in KIND_PRESERVING or name == "neg":
            return ins[0]
        if name in ("div", "mul"):
            a, b = ins
            if name == "div" and b == SAME or name == "mul" and SAME in (a, b):
                other = a if name == "div" or b == SAME else b
                if other in (SUM, MEAN):
                    return MEAN
                if other == STAT:
                    return STAT
            return _nonlinear(ins)
        if name in ("add", "sub", "add_any"):
            a, b = ins
            if a == b:
                return a
            if SAME in (a, b):
                other = b if a == SAME else a
                if other in (MEAN, STAT):
                    return other
            return _nonlinear(ins)
        return _nonlinear(ins)


def rows(d):
    return ("rows", d)


def is_rows(kind) -> bool:
    return isinstance(kind, tuple)


def _moved(name, p, d, in_shape, out_shape, out_rank):
    """Where the row dim ``d`` of an operand lands in the output (None: not known)."""
    if d is None:
        return None
    if name == "transpose":
        return list(p["permutation"]).index(d)
    if name == "broadcast_in_dim":
        return p["broadcast_dimensions"][d]
    if name == "squeeze":
        return d - sum(a < d for a in p["dimensions"])
    if name == "reshape":
        before = math.prod(in_shape[:d])
        acc = 1
        for j, n in enumerate(out_shape):
            if acc <= before < acc * n or (before == acc and n > 1):
                return j
            acc *= n
        return None
    if len(in_shape) == out_rank and d < out_rank and in_shape[d] == out_shape[d]:
        return d
    return None


def _nonlinear(ins):
    """A nonlinear op without row operands: on means and constants, a statistic."""
    if all(k in (MEAN, STAT, SAME) for k in ins):
        return STAT
    return OTHER


def _inside(e, j, in_kinds):
    """The kind of output ``j`` of a call, from its body."""
    jaxpr, _ = body_of(e)
    seeds = {u: k for u, k in zip(jaxpr.invars, in_kinds, strict=True) if k != SAME}
    inner = _Kinds(jaxpr.eqns, set(seeds), seeds)
    out = jaxpr.outvars[j]
    return SAME if isinstance(out, Literal) else inner.of(out)


def _stored_in_state(jaxpr, cut, aliases) -> set[int]:
    """Positions of marked values that the step returns (through casts) as an output that
    replaces one of its inputs: a running statistic stored back into the state."""
    aliased_outs = {o for _, o in aliases}
    origin = {o: j for j, o in enumerate(jaxpr.eqns[cut].outvars)}
    for e in jaxpr.eqns[cut + 1:]:
        if e.primitive.name in KIND_PRESERVING and e.invars and isinstance(e.invars[0], Var) and (
                e.invars[0] in origin):
            for o in e.outvars:
                origin[o] = origin[e.invars[0]]
    return {origin[v] for n, v in enumerate(jaxpr.outvars)
            if n in aliased_outs and isinstance(v, Var) and v in origin}


def _cannot(v, i, marker, kinds, out_paths, jaxpr, cut) -> str:
    return (
        f"{_describe(jaxpr, cut, i, kinds.producer, out_paths)} cannot be rebuilt from "
        "micro-batches: it is neither a mean, a sum, a count nor a batch-independent value "
        "(e.g. exp of a mean loss, a maximum over rows). Declare how to combine it with "
        "autoshard.value_and_grad(..., aux_reduction=...) ('mean' or 'sum', or a pytree of "
        "them matching the aux), or compute it after the gradient from values that combine "
        "(e.g. exp of the returned mean loss).")


def per_row_error(jaxpr, i: int, out_paths=()) -> str:
    """Why marked value ``i`` (one entry per row) cannot be summed or averaged."""
    cut = grad_marker_index(jaxpr)
    producer = {o: e for e in jaxpr.eqns[:cut] for o in e.outvars}
    return (
        f"{_describe(jaxpr, cut, i, producer, out_paths)} holds one entry per row of the "
        "micro-batch (e.g. logits), so it cannot be summed or averaged over micro-batches, "
        "and this step was built without its function, so its update cannot run on the whole "
        "batch. Reduce it inside the loss function (a mean, a sum or a count, returned as "
        "aux), parallelize the step with autoshard.parallelize, or use num_micro_batches=1.")


def _describe(jaxpr, cut, i, producer, out_paths) -> str:
    """``Marked value i of the gradient marker (dtype[shape], returned as ..., computed at
    file:line)``."""
    v = jaxpr.eqns[cut].invars[i]
    where = source_line(producer[v]) if v in producer else None
    shape = "x".join(map(str, v.aval.shape)) or "scalar"
    outs = _outputs_of(jaxpr, cut, i, out_paths)
    return (f"Marked value {i} of the gradient marker ({v.aval.dtype.name}[{shape}]"
            f"{', returned as ' + ', '.join(outs) if outs else ''}"
            f"{', computed at ' + where if where else ''})")


def _outputs_of(jaxpr, cut, i, out_paths) -> list[str]:
    target = jaxpr.eqns[cut].outvars[i]
    return [p for p, o in zip(out_paths, jaxpr.outvars, strict=False) if o is target]


__all__ = ["MEAN", "ROWS", "SUM", "per_row_error", "resolve"]
