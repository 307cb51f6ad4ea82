"""The update after the gradient marker, run on the whole batch when it reads the batch.

Gradient accumulation (``grad_accum``, and every pipeline) traces its step on one micro-batch. The part after the gradient marker usually
reads only the accumulated values and the train state; when it also reads the batch (flax's
pattern: metrics from the aux logits and the labels after ``value_and_grad``), or a marked
value with one entry per row (aux logits: reduction ``"rows"``, ``combine``), it must see the
whole batch, as ``jax.jit`` of the step does. That part is then taken from the step traced on
the full batch (``Program.whole_batch_closed``) and joined to the micro-batch trace's forward
and backward:

* a batch input it reads is a new variable, the whole argument (``whole_inputs``);
* a marked value whose full-batch shape has ``k`` times the micro-batch's rows on one dim (a
  row-shaped aux such as logits) is a new variable: the ``k`` micro-batches' values joined in
  row order along that dim (``joined``; row ``r * k + j`` of the batch is row ``r`` of
  micro-batch ``j``), in place of their sum; every other marked value is the marker's output
  as accumulated (``combine``'s rule);
* a literal marked value (a Python int in aux) is the full-batch trace's literal;
* a value computed before the marker that does not depend on the batch (from parameters or
  constants) is computed again after it; one that depends on the batch without passing
  through the marker cannot be rebuilt from micro-batches: an error names it, its source line
  and the fix. With one micro-batch the two traces are one and such a value is joined too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .ir import _compat
from .ir._compat import Literal, Var
from .ir._jaxpr import dependents, draws_random, grad_marker_index, used_vars
from .ir._walk import Walker, site


@dataclass(frozen=True, eq=False)
class AfterGrad:
    """The step with its update on the whole batch, and the values the runtime provides."""

    closed: Any
    """ClosedJaxpr: the micro-batch forward/backward and marker, then the whole-batch update.
    It reads variables no equation defines: the keys of the two dicts below."""
    whole_inputs: dict = field(default_factory=dict)
    """New variable -> index of the batch input whose whole argument it is."""
    joined: dict = field(default_factory=dict)
    """New variable -> the per-micro-batch variable whose values it joins in row order."""


def whole_batch_update(micro, whole, batch_invars, k: int) -> AfterGrad:
    """``micro``'s forward, backward and marker followed by ``whole``'s update (both traces
    with identity markers inlined; ``whole is micro`` when ``k`` is 1). See the module doc."""
    mj, wj = micro.jaxpr, whole.jaxpr
    mcut, wcut = grad_marker_index(mj), grad_marker_index(wj)
    assert mcut is not None
    if wcut is None or len(wj.eqns[wcut].invars) != len(mj.eqns[mcut].invars):
        raise ValueError(
            "The step traced on the whole batch has a different gradient marker than on one "
            f"micro-batch (num_micro_batches={k}): its Python code depends on the batch size. "
            "Make the step's structure independent of the batch size, or use "
            "num_micro_batches=1.")
    mmarker, wmarker = mj.eqns[mcut], wj.eqns[wcut]
    wpre, wpost = wj.eqns[:wcut], wj.eqns[wcut + 1:]
    producer = {v: e for e in wpre for v in e.outvars}
    wbatch = [v for v, b in zip(wj.invars, batch_invars, strict=True) if b]
    from_batch = dependents(wpre, set(wbatch))
    whole_inputs: dict = {}
    joined: dict = {}
    env: dict = {}
    batch_index = {}
    for i, (wv, mv, b) in enumerate(zip(wj.invars, mj.invars, batch_invars, strict=True)):
        if b:
            batch_index[wv] = i
        else:
            env[wv] = mv

    def read(v):  # a batch input becomes a whole input when something reads it
        if isinstance(v, Var) and v in batch_index and v not in env:
            env[v] = Var(v.aval)
            whole_inputs[env[v]] = batch_index[v]
        return _read(env, v)
    new_consts = {v: Var(v.aval) for v in wj.constvars}
    env.update(new_consts)
    wouts = [v for v in wj.outvars if isinstance(v, Var)]
    used_after = used_vars(wpost) | set(wouts)
    for n, (wi, wo, mi, mo) in enumerate(zip(wmarker.invars, wmarker.outvars, mmarker.invars,
                                             mmarker.outvars, strict=True)):
        if wo not in used_after:
            continue
        if isinstance(wi, Literal):
            env[wo] = wi
        elif _same(wo.aval, mo.aval):
            env[wo] = mo
        elif isinstance(mi, Var) and row_dim(mo.aval, wo.aval, k) is not None:
            if mi in mj.invars and batch_invars[list(mj.invars).index(mi)]:
                env[wo] = read(wj.invars[list(mj.invars).index(mi)])
            else:
                env[wo] = Var(wo.aval)
                joined[env[wo]] = mi
        else:
            raise ValueError(
                f"Marked value {n} of the gradient marker (computed at {_where(wi, producer)}) "
                f"has shape {tuple(mo.aval.shape)} on a micro-batch and "
                f"{tuple(wo.aval.shape)} on the whole batch (num_micro_batches={k}): it is "
                "neither the same value nor the micro-batches' rows joined, so the update after "
                "the gradient, which runs on the whole batch, cannot be given it. Return a "
                "value of fixed shape (e.g. a sum) or one with one entry per row of the batch, "
                "or use num_micro_batches=1.")
    wanted = [v for v in dict.fromkeys(list(used_vars(wpost)) + wouts)
              if v in producer and v not in env]
    leaks = [v for v in wanted if v in from_batch]
    # a value computed from the batch before the marker without passing through it (lm1b's
    # padding weights, tokens > 0) is computed again from the whole batch, unless it draws
    # random numbers (the micro-batches drew theirs)
    drawn = [v for v in leaks if any(draws_random(e) for e in _closure(v, producer))]
    if drawn and k > 1:
        v = drawn[0]
        raise ValueError(
            f"The part of the step after the gradient marker reads a {v.aval.str_short()} "
            f"value computed from the batch by {producer[v].primitive.name} at "
            f"{_where(v, producer)} before the marker without passing through it, and "
            f"computing it draws random numbers{f' (and {len(drawn) - 1} more)' if len(drawn) > 1 else ''}"
            f". With num_micro_batches={k} each micro-batch drew its own, so the whole-batch "
            "value cannot be rebuilt. Return it as the aux of autoshard.value_and_grad(..., "
            "has_aux=True) (values with one entry per row are joined in row order), or use "
            "num_micro_batches=1.")
    if k == 1:
        for v in leaks:  # one micro-batch: the value itself, from the task that makes it
            env[v] = Var(v.aval)
            joined[env[v]] = v
    # values from parameters, constants and the batch alone: computed again after the marker
    needed = {v for v in wanted if v not in from_batch or k > 1}
    again = []
    for e in reversed(wpre):
        if any(o in needed for o in e.outvars):
            again.append(e)
            needed |= {v for v in e.invars if isinstance(v, Var) and v in producer}
    eqns = list(mj.eqns[:mcut + 1])
    for e in reversed(again):
        outs = [Var(o.aval) if not isinstance(o, _compat.DropVar) else o for o in e.outvars]
        env.update(zip(e.outvars, outs, strict=True))
        eqns.append(e.replace(invars=[read(v) for v in e.invars], outvars=outs))
    for e in wpost:
        eqns.append(e.replace(invars=[read(v) for v in e.invars]))
    outvars = [read(v) for v in wj.outvars]
    used = used_vars(eqns[mcut + 1:]) | {v for v in outvars if isinstance(v, Var)}
    consts = [(v, c) for v, c in zip(wj.constvars, whole.consts, strict=True)
              if new_consts[v] in used]
    jaxpr = mj.replace(constvars=list(mj.constvars) + [new_consts[v] for v, _ in consts],
                       eqns=eqns, outvars=outvars)
    closed = micro.replace(jaxpr=jaxpr, consts=list(micro.consts) + [c for _, c in consts])
    return AfterGrad(closed=closed, whole_inputs=whole_inputs, joined=joined)


def _closure(v, producer) -> list:
    """The equations ``v`` is computed by (before the marker), transitively."""
    seen, todo, found = set(), [v], []
    while todo:
        e = producer.get(todo.pop())
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        found.append(e)
        todo += [u for u in e.invars if isinstance(u, Var)]
    return found


def _read(env, v):
    return v if isinstance(v, Literal) else env.get(v, v)


def _same(a, b) -> bool:
    return tuple(getattr(a, "shape", ())) == tuple(getattr(b, "shape", ())) and (
        getattr(a, "dtype", None) == getattr(b, "dtype", None))


def row_dim(micro_aval, whole_aval, k: int) -> int | None:
    """The dim along which ``whole_aval`` is ``k`` values of ``micro_aval`` joined (the one
    dim ``k`` times longer, all others equal), or None."""
    ms, ws = tuple(getattr(micro_aval, "shape", ())), tuple(getattr(whole_aval, "shape", ()))
    if k < 2 or len(ms) != len(ws) or micro_aval.dtype != whole_aval.dtype:
        return None
    differ = [d for d, (m, w) in enumerate(zip(ms, ws, strict=True)) if m != w]
    return differ[0] if len(differ) == 1 and ws[differ[0]] == k * ms[differ[0]] else None


def row_dims(micro, other, factor: int) -> dict | None:
    """The dim holding the rows of each variable of ``micro`` (its inputs and what its
    top-level equations define), from ``other``, the same step traced on ``factor`` times the
    rows: the one dim ``factor`` times longer there (None where no dim is, or more than one).
    A dim that merely has the micro-batch's size (a scan's time steps when there are as many
    as rows) keeps its length and is told apart this way. None when the two traces differ in
    structure (the step's Python code depends on the batch size)."""
    me, oe = micro.jaxpr.eqns, other.jaxpr.eqns
    if len(me) != len(oe) or len(micro.jaxpr.invars) != len(other.jaxpr.invars) or any(
            a.primitive is not b.primitive or len(a.outvars) != len(b.outvars)
            for a, b in zip(me, oe, strict=True)):
        return None
    pairs = list(zip(micro.jaxpr.invars, other.jaxpr.invars, strict=True))
    pairs += [(u, w) for a, b in zip(me, oe, strict=True)
              for u, w in zip(a.outvars, b.outvars, strict=True)]
    return {u: row_dim(u.aval, w.aval, factor) for u, w in pairs
            if hasattr(getattr(u, "aval", None), "shape")}


def row_dims_by_site(micro, other, factor: int) -> dict[str, int | None]:
    """``row_dims`` through inlined calls, keyed by each value's site (``ir._walk.site``, the
    key the planner's graph gives its values): for every equation output of ``micro`` whose
    site ``other`` (the step traced on ``factor`` times the rows) also has, the dim that grows
    with the rows (None: no dim does, or more than one). Loops are one equation here."""
    a, b = _SiteShapes().of(micro), _SiteShapes().of(other)
    return {key: row_dim(aval, b[key], factor) for key, aval in a.items() if key in b}


class _SiteShapes(Walker):
    """The aval of every equation output by site; values are avals."""

    def __init__(self):
        self.avals: dict = {}

    def of(self, closed) -> dict:
        self.walk(closed.jaxpr, closed.consts, [v.aval for v in closed.jaxpr.invars])
        return self.avals

    def literal(self, lit):
        return lit.aval

    def constant(self, var, value, path):
        return var.aval

    def equation(self, eqn, ins, path):
        outs = [v.aval for v in eqn.outvars]
        for j, aval in enumerate(outs):
            self.avals[site(path, j)] = aval
        return outs


def _where(v, producer) -> str:
    e = producer.get(v) if isinstance(v, Var) else None
    line = None if e is None else _compat.source_line(e)
    return line or "an unknown source line"


__all__ = ["AfterGrad", "row_dim", "row_dims", "row_dims_by_site", "whole_batch_update"]
