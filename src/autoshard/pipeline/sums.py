"""Sums whose terms are computed on several stages (found in the step's jaxpr).

Two kinds reach across stages in a training step:

* a parameter used by two stages (tied embeddings): ``jax.grad`` adds the stages' gradient
  contributions (``add_any``) before the gradient marker. ``split_tied_gradients`` moves that
  addition past the marker, so each stage accumulates its own contribution over the
  micro-batches and the step adds the stage sums once;
* a reduction over every gradient (the global norm for clipping): a chain of scalar ``add``s
  over per-parameter values living on the parameters' stages.

Both become a ``CrossStageSum``: each stage adds its own terms, then one all-reduce over a
mesh spanning every stage's devices adds the stage sums (``span.SpanReduce`` runs it), and the
result is on every sub-mesh. No term moves between sub-meshes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..ir._compat import Var
from ..ir._prims import ADDS

SMALL = 16
"""Elements of a value cheap enough to compute on every stage that reads it (scalars)."""


@dataclass(eq=False)
class CrossStageSum:
    """``out`` = the sum of ``terms`` (variables of several stages, and literals)."""

    name: str
    """``sum0``, ``sum1``, ... in program order."""
    out: Var
    """The sum; after the reduction it is on every sub-mesh, replicated."""
    terms: list
    """Variables (each added on its stage) and literals, in program order."""
    eqns: list = field(default_factory=list)
    """The addition equations it replaces."""
    level: int = -1
    """Apply-grad level of its latest term (-1: gradients and step inputs only)."""
    before: int = 0
    """Index of the first apply task that may read it (it runs before that task)."""


def _is_add(e) -> bool:
    return e.primitive.name in ADDS and all(
        getattr(v, "aval", None) == e.outvars[0].aval for v in e.invars if isinstance(v, Var)
    )


def _uses(eqns, extra=()) -> dict:
    n: dict = {}
    for e in eqns:
        for v in e.invars:
            if isinstance(v, Var):
                n[v] = n.get(v, 0) + 1
    for v in extra:
        if isinstance(v, Var):
            n[v] = n.get(v, 0) + 1
    return n


def add_trees(eqns, outvars=()) -> list[tuple]:
    """Maximal trees of additions in ``eqns``: ``(root eqn, tree eqns, terms)``.

    An addition belongs to the tree of the one addition that reads its result, when nothing
    else reads it (``outvars``: values read outside ``eqns``)."""
    uses = _uses(eqns, outvars)
    made = {e.outvars[0]: e for e in eqns if _is_add(e)}
    reader = {}
    for e in eqns:
        if _is_add(e):
            for v in e.invars:
                if isinstance(v, Var) and v in made and uses.get(v) == 1:
                    reader[v] = e
    trees = []
    for e in eqns:
        if not _is_add(e) or e.outvars[0] in reader:
            continue
        tree, terms, todo = [e], [], list(reversed(e.invars))
        while todo:  # depth first, left operand first: terms in program order
            x = todo.pop()
            if isinstance(x, Var) and reader.get(x) is not None:
                tree.append(made[x])
                todo += reversed(made[x].invars)
            else:
                terms.append(x)
        trees.append((e, tree, terms))
    return trees


def split_tied_gradients(marker, pre, post, stage_of) -> tuple:
    """Gradient-marker inputs that add contributions of several stages, added after the marker.

    ``stage_of(var)`` is the stage computing a pre-marker value (None for step inputs). Returns
    ``(marker, skipped, post, tied)``: the marker with one input per contribution, the ids of
    the pre-marker additions no task runs any more, the post-marker equations with the new
    additions first, and the variables those additions produce (the gradients).
    """
    if marker is None:
        return marker, set(), post, set()
    roots = {}
    marked = set(v for v in marker.invars if isinstance(v, Var))
    # A parameter cast once and used by two stages (``embed.astype(bf16)``, as flax's
    # ``Embed`` does) has its gradient cast back after the addition: the marked value is the
    # cast of the tree. The cast moves after the marker, the stages' terms are marked.
    cast = _casts_of_marked(pre, marker)
    for e, tree, terms in add_trees(pre, list(marker.invars) + [c.invars[0] for c in
                                                                cast.values()]):
        out = e.outvars[0]
        top = next((v for v, c in cast.items() if c.invars[0] is out), out)
        if top not in marked or list(marker.invars).count(top) != 1:
            continue
        if any(not isinstance(t, Var) for t in terms):
            continue
        stages = {stage_of(t) for t in terms}
        if None in stages or len(stages) < 2:
            continue
        roots[top] = (e, tree + ([cast[top]] if top in cast else []), terms)
    if not roots:
        return marker, set(), post, set()
    reds = list(marker.params.get("reductions", ("mean",) * len(marker.invars)))
    invars, outvars, new_reds, new_post, skipped = [], [], [], [], set()
    for v, o, r in zip(marker.invars, marker.outvars, reds, strict=True):
        if v not in roots:
            invars.append(v)
            outvars.append(o)
            new_reds.append(r)
            continue
        e, tree, terms = roots[v]
        skipped.update(id(x) for x in tree)
        parts = [Var(t.aval) for t in terms]
        invars += terms
        outvars += parts
        new_reds += [r] * len(terms)
        c = cast.get(v)
        total = o if c is None else Var(e.outvars[0].aval)
        acc = parts[0]
        for i, p in enumerate(parts[1:]):
            out = total if i == len(parts) - 2 else Var(total.aval)
            new_post.append(e.replace(invars=[acc, p], outvars=[out]))
            acc = out
        if c is not None:
            new_post.append(c.replace(invars=[total], outvars=[o]))
    params = dict(marker.params)
    if "reductions" in params:
        params["reductions"] = tuple(new_reds)
    marker = marker.replace(invars=invars, outvars=outvars, params=params)
    return marker, skipped, new_post + list(post), {e.outvars[0] for e in new_post}


CASTS = ("convert_element_type",)
"""Equations between a tied gradient's addition and the marker that move after the marker."""


def _casts_of_marked(pre, marker) -> dict:
    """Marked value -> the cast in ``pre`` that makes it from an addition's result read by
    nothing else (the gradient of a parameter cast before its uses)."""
    made = {e.outvars[0]: e for e in pre if len(e.outvars) == 1}
    uses = _uses(pre, marker.invars)
    out = {}
    for v in marker.invars:
        c = made.get(v) if isinstance(v, Var) else None
        if c is None or c.primitive.name not in CASTS or not isinstance(c.invars[0], Var):
            continue
        src = made.get(c.invars[0])
        if src is not None and _is_add(src) and uses.get(c.invars[0]) == 1:
            out[v] = c
    return out


def cross_stage_sums(post, outvars, home, tied, known=()) -> list[CrossStageSum]:
    """Addition trees after the marker whose terms live on several stages: the tied gradients'
    (``tied``) and those of small values (the global norm's squared sums).

    With ``known`` sums (found before, with ``home`` placing the equations without them), the
    list with the ones found now added, or an empty list if there are none."""
    old = {id(s.eqns[0]): s for s in known}
    sums, new = [], False
    for e, tree, terms in add_trees(post, outvars):
        out = e.outvars[0]
        if id(e) in old:
            sums.append(old[id(e)])
            continue
        if out not in tied and out.aval.size > SMALL:
            continue
        stages = {home.get(t) for t in terms if isinstance(t, Var)} - {None}
        if len(stages) < 2:
            continue
        new = True
        sums.append(CrossStageSum(name="", out=out, terms=list(terms), eqns=tree))
    for i, s in enumerate(sums):
        s.name = f"sum{i}"
    return sums if new else []


__all__ = ["CrossStageSum", "add_trees", "cross_stage_sums", "split_tied_gradients"]
