"""Cut a traced step into per-stage tasks: forward, backward (or its two parts), apply-grad.

The step's jaxpr holds, in order: the forward (layers cut by boundary markers, or by the
layer clustering), the backward that ``jax.grad`` emitted after the loss, the gradient marker,
and the apply-grad part (optimizer). Every equation goes to one task:

* forward equations of layer ``l`` to ``F`` of the stage holding ``l``;
* a backward equation to ``B`` of the highest layer at or below the layers of the backward
  values it reads where the forward values it reads are present (produced or received there),
  so weight gradients are computed where their activations live and cotangents flow down;
* an apply-grad equation to the stage holding its largest input (a parameter lives where it
  is first used), in levels: a level reads other stages' values of earlier levels only;
* equations of constants only are copied into every task that needs them.

``B`` splits into ``Ba`` (what other stages read: the input cotangents) and ``Bw`` (the rest,
the weight gradients); ``Bw`` reads the intermediate cotangents ``Ba`` computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax.numpy as jnp

from ..combine import ROWS
from ..grad_accum import reductions_of
from ..ir._compat import Literal, Var
from ..ir._jaxpr import dependents, draws_random, grad_marker_index, used_vars
from ..ir._markers import pipeline_p
from .levels import assign_apply
from .sums import cross_stage_sums, split_tied_gradients


@dataclass(eq=False)
class Task:
    """Equations that run as one jit on one stage's sub-mesh."""

    name: str
    """``F2``, ``B2``, ``Ba2``, ``Bw2`` or ``apply2.0`` (stage 2, level 0)."""
    kind: str
    """``F``, ``B``, ``Ba``, ``Bw`` or ``apply``."""
    stage: int
    """Index of the stage (sub-mesh) that runs it."""
    eqns: list
    """Equations in program order."""
    invars: list = field(default_factory=list)
    """Inputs in order."""
    outvars: list = field(default_factory=list)
    """Outputs in order."""
    accumulated: list = field(default_factory=list)
    """Outputs that are gradient-marker inputs: added into per-stage accumulators."""

    @property
    def draws_random(self) -> bool:
        return any(draws_random(e) for e in self.eqns)


@dataclass(eq=False)
class Partition:
    """The tasks of one step, and where every value lives."""

    jaxpr: object
    consts: list
    num_stages: int
    forward: list
    """Per stage its F task."""
    backward: list
    """Per stage its B task (empty tasks when there is no backward)."""
    split_backward: list
    """Per stage its (Ba, Bw) pair."""
    apply: list
    """Apply-grad tasks in execution order."""
    marker: object
    """The gradient-marker equation, or None."""
    per_micro_batch: set
    """Variables computed once per micro-batch (by F and B tasks)."""
    batch_dependent: set
    """Variables that depend on a batch input."""
    home: dict
    """Stage of every variable produced by a task (marker outputs: their accumulating stage)."""
    sums: list = field(default_factory=list)
    """Sums whose terms live on several stages (``sums.CrossStageSum``), in program order:
    one all-reduce over a mesh spanning the stages each, before apply task ``before``."""
    whole_inputs: dict = field(default_factory=dict)
    """Variables the apply tasks read as a whole batch argument -> that input's index
    (``after_grad``: the update reads the batch)."""
    joined: dict = field(default_factory=dict)
    """Variables the apply tasks read as the micro-batches' values of another variable joined
    in row order -> that variable (``after_grad``)."""
    batch_inputs: frozenset = frozenset()
    """The step's batch inputs (their dim 0 is the batch)."""
    row_dims: dict | None = None
    """The dim holding the rows of each value, where the rows' size alone does not tell
    (``build.Cut.row_dims``); None: dim 0 wherever it has their size."""

    @property
    def mb_rows(self) -> int | None:
        """Rows of one micro-batch: dim 0 of the batch inputs as traced (None: no batch)."""
        return next((v.aval.shape[0] for v in self.batch_inputs if v.aval.shape), None)

    def rows_first(self, v) -> bool:
        """Whether ``v`` is computed from the batch with the micro-batch's rows on dim 0: dim 0
        has their size and, where that size is also another dim's (``row_dims``), it is the
        dim that grows with the rows."""
        shape = getattr(getattr(v, "aval", None), "shape", ())
        return (bool(shape) and shape[0] == self.mb_rows and v in self.batch_dependent
                and (self.row_dims is None or self.row_dims.get(v, 0) == 0))

    def holds_rows(self, v) -> bool:
        """Whether ``v`` holds one micro-batch's rows on dim 0: a batch input, or a value
        computed once per micro-batch from one, whose dim 0 is the micro-batch's rows. The
        one test the runtime, pricing and profiling share."""
        return self.rows_first(v) and (v in self.batch_inputs or v in self.per_micro_batch)

    @property
    def join_sources(self) -> set:
        """Per-micro-batch values kept for a join instead of accumulated."""
        return set(self.joined.values())

    @property
    def has_backward(self) -> bool:
        return any(t.eqns for t in self.backward)


def split_pre_post(jaxpr):
    cut = grad_marker_index(jaxpr)
    if cut is None:
        return list(jaxpr.eqns), None, []
    return list(jaxpr.eqns[:cut]), jaxpr.eqns[cut], list(jaxpr.eqns[cut + 1 :])


def boundary_positions(pre) -> list[int]:
    return [
        i
        for i, e in enumerate(pre)
        if e.primitive is pipeline_p and e.params["mark_type"] == "boundary"
    ]


def forward_end(pre, inference: bool) -> int:
    """Index after the forward: exact after ``autoshard.grad``'s loss marker.

    ``jax.grad`` emits the whole forward (the loss last) before the backward, and
    ``autoshard.grad`` passes the loss through a marker of type ``end`` (whose transpose, of
    type ``start``, seeds the backward). Without it (plain ``jax.grad``) the forward ends at
    the first float scalar after the last boundary that nothing reads. Without a loss (or for
    inference) everything is forward.
    """
    if inference:
        return len(pre)
    marks = [(i, e.params["mark_type"]) for i, e in enumerate(pre) if is_loss_marker(e)]
    if marks:
        seed = next((i for i, kind in marks if kind == "start"), len(pre))
        ends = [i for i, kind in marks if kind == "end" and i < seed]
        return ends[-1] + 1 if ends else seed
    bounds = boundary_positions(pre)
    start = bounds[-1] + 1 if bounds else 0
    used = {v for e in pre for v in e.invars if isinstance(v, Var)}
    for i in range(start, len(pre)):
        for v in pre[i].outvars:
            aval = getattr(v, "aval", None)
            if (
                aval is not None
                and getattr(aval, "shape", None) == ()
                and v not in used
                and jnp.issubdtype(aval.dtype, jnp.floating)
            ):
                return i + 1
    return len(pre)


def assign_backward(pre, fwd_end: int, layer_of: dict, num_layers: int, invars) -> dict:
    """Layer of every backward equation (index in ``pre`` -> layer)."""
    avail: dict = {}
    produced_in: dict = {}
    for i in range(fwd_end):
        e = pre[i]
        if i not in layer_of:
            continue
        for v in e.invars:
            if isinstance(v, Var):
                avail.setdefault(v, set()).add(layer_of[i])
        for v in e.outvars:
            avail.setdefault(v, set()).add(layer_of[i])
            produced_in[v] = layer_of[i]
    out: dict = {}
    bwd_layer: dict = {}
    for i in range(fwd_end, len(pre)):
        e = pre[i]
        ins = [v for v in e.invars if isinstance(v, Var)]
        caps = [bwd_layer[v] for v in ins if v in bwd_layer]
        cap = min(caps) if caps else num_layers - 1
        sets = [avail[v] for v in ins if v not in bwd_layer and v in avail]
        common = set(range(cap + 1))
        for s in sets:
            common &= s
        if common:
            layer = max(common)
        else:
            below = [max(x for x in s if x <= cap) for s in sets if any(x <= cap for x in s)]
            layer = min(below) if below else cap
        out[i] = layer
        for v in e.outvars:
            bwd_layer[v] = layer
    return out


def free_eqns(pre, post, constvars) -> set[int]:
    """Ids of equations that read constants only (copied into every task that needs them)."""
    free_vars = set(constvars)
    free = set()
    for e in list(pre) + list(post):
        if e.primitive is pipeline_p:
            continue
        if all(isinstance(v, Literal) or v in free_vars for v in e.invars) and not draws_random(e):
            free.add(id(e))
            free_vars.update(e.outvars)
    return free


def needs_whole_batch(closed, batch_invars) -> bool:
    """Whether the part after the gradient marker reads the batch, a marked value with one
    entry per row (reduction ``"rows"``), or a value computed before the marker other than
    through it (the runtime holds those per micro-batch only)."""
    jaxpr = closed.jaxpr
    cut = grad_marker_index(jaxpr)
    if cut is None:
        return False
    pre, marker, post = jaxpr.eqns[:cut], jaxpr.eqns[cut], jaxpr.eqns[cut + 1:]
    batch = {v for v, b in zip(jaxpr.invars, batch_invars, strict=True) if b}
    free = free_eqns(pre, post, jaxpr.constvars)
    made = {v for e in pre if id(e) not in free for v in e.outvars}
    reads = used_vars(post) | {v for v in jaxpr.outvars if isinstance(v, Var)}
    rows = {o for o, r in zip(marker.outvars, reductions_of(marker), strict=True)
            if r == ROWS}
    return bool(used_vars(post) & (batch | made) or reads & (batch | rows))


def build_partition(
    closed,
    *,
    layer_of_fwd: dict,
    fwd_end: int,
    stage_of_layer: list,
    batch_invars,
    remat: bool = False,
    after=None,
    row_dims: dict | None = None,
) -> Partition:
    """Tasks for a step whose forward equation ``i`` (index into the pre-marker part) runs in
    layer ``layer_of_fwd[i]``; layer ``l`` runs on stage ``stage_of_layer[l]``. ``after``: an
    ``after_grad.AfterGrad`` whose update reads the whole batch (its values are placed where
    the runtime provides them: a whole batch argument on the last stage, a join on the stage
    of the value it joins)."""
    jaxpr = closed.jaxpr
    pre, marker, post = split_pre_post(jaxpr)
    num_layers = len(stage_of_layer)
    num_stages = max(stage_of_layer) + 1
    free = free_eqns(pre, post, jaxpr.constvars)
    bwd = assign_backward(pre, fwd_end, layer_of_fwd, num_layers, jaxpr.invars)
    made_on: dict = {}
    for i, e in enumerate(pre):
        if id(e) in free or _is_boundary(e) or (i < fwd_end and i not in layer_of_fwd):
            continue
        s = stage_of_layer[layer_of_fwd[i] if i < fwd_end else bwd[i]]
        made_on.update((v, s) for v in e.outvars)
    # gradient contributions of several stages (tied parameters) accumulate on their stages
    marker, skipped, post, tied = split_tied_gradients(marker, pre, post, made_on.get)
    producer = {v: e for e in list(pre) + list(post) for v in e.outvars}

    groups: dict = {}
    for i, e in enumerate(pre):
        if id(e) in free or _is_boundary(e) or id(e) in skipped:
            continue
        if i < fwd_end:
            groups.setdefault(("F", stage_of_layer[layer_of_fwd[i]]), []).append(e)
        else:
            groups.setdefault(("B", stage_of_layer[bwd[i]]), []).append(e)
    fwd_made = {
        v for (kind, _), eqns in groups.items() if kind == "F" for e in eqns for v in e.outvars
    }
    if remat:
        for s in range(num_stages):
            groups[("B", s)] = _recompute(groups.get(("F", s), []), groups.get(("B", s), []))
    home: dict = {}
    for (_kind, s), eqns in groups.items():
        for e in eqns:
            for v in e.outvars:
                home[v] = s
    whole_inputs = dict(after.whole_inputs) if after is not None else {}
    joined = dict(after.joined) if after is not None else {}
    home.update((v, num_stages - 1) for v in whole_inputs)
    home.update((v, home.get(src, num_stages - 1)) for v, src in joined.items())
    join_src = set(joined.values())
    if marker is not None:
        for v, o in zip(marker.invars, marker.outvars, strict=True):
            home[o] = home.get(v, 0) if isinstance(v, Var) else 0
    first_use = _first_use_stage(groups, jaxpr.invars)
    outs = {v for v in jaxpr.outvars if isinstance(v, Var)}
    constant = {v for e in list(pre) + list(post) if id(e) in free for v in e.outvars}
    constant |= set(jaxpr.constvars)
    sums: list = []
    while True:  # placed without the sums' additions, whose results are on every stage
        placed = dict(home)
        apply_groups, dup = assign_apply(post, free, placed, first_use, sums, constant)
        more = cross_stage_sums(post, outs, placed, tied, sums)
        if not more:
            break
        sums = more
    home.update(placed)

    batch_vars = {v for v, b in zip(jaxpr.invars, batch_invars, strict=True) if b}
    per_mb = {v for key, eqns in groups.items() for e in eqns for v in e.outvars}
    batch_dep = dependents(pre, batch_vars | {o for e in pre if draws_random(e) for o in e.outvars})
    needed_by: dict = {}
    marker_in = set(v for v in marker.invars if isinstance(v, Var)) if marker is not None else set()

    def make(name, kind, stage, eqns):
        return _task(name, kind, stage, eqns, producer, free | dup)

    fwd = [make(f"F{s}", "F", s, groups.get(("F", s), [])) for s in range(num_stages)]
    back = [make(f"B{s}", "B", s, groups.get(("B", s), [])) for s in range(num_stages)]
    apply = [
        make(f"apply{s}.{lv}", "apply", s, eqns) for (lv, s), eqns in sorted(apply_groups.items())
    ]
    all_tasks = fwd + back + apply
    for t in all_tasks:
        for v in t.invars:
            needed_by.setdefault(v, set()).add(t.name)
    levels = [lv for lv, _ in sorted(apply_groups)]
    for s in sums:
        for v in s.terms:
            if isinstance(v, Var):
                needed_by.setdefault(v, set()).add(s.name)
        s.before = next((i for i, lv in enumerate(levels) if lv > s.level), len(levels))
    for t in all_tasks:
        produced = [v for e in t.eqns for v in e.outvars if not _is_dropped(v)]
        t.outvars = [
            v
            for v in dict.fromkeys(produced)
            if ((needed_by.get(v, set()) - {t.name}) or v in marker_in or v in outs
                or v in join_src)
            and not (t.kind == "B" and v in fwd_made)
        ]
        t.accumulated = [v for v in t.outvars if v in marker_in and v not in join_src]
    split = [_split_backward(b, needed_by, producer, free) for b in back]
    return Partition(
        jaxpr=jaxpr,
        consts=list(closed.consts),
        num_stages=num_stages,
        forward=fwd,
        backward=back,
        split_backward=split,
        apply=apply,
        marker=marker,
        per_micro_batch=per_mb,
        batch_dependent=batch_dep,
        batch_inputs=frozenset(batch_vars),
        home=home,
        sums=sums,
        whole_inputs=whole_inputs,
        joined=joined,
        row_dims=row_dims,
    )


def _recompute(f_eqns, b_eqns) -> list:
    """The backward with the forward equations it reads recomputed (remat: keep inputs only)."""
    made = {v: e for e in f_eqns for v in e.outvars}
    keep: set = set()
    todo = [v for e in b_eqns for v in e.invars if isinstance(v, Var) and v in made]
    while todo:
        e = made.get(todo.pop())
        if e is None or id(e) in keep:
            continue
        keep.add(id(e))
        todo += [u for u in e.invars if isinstance(u, Var)]
    return [e for e in f_eqns if id(e) in keep] + list(b_eqns)


def _task(name, kind, stage, eqns, producer, free) -> Task:
    """A task of ``eqns`` plus the constant-only equations they need; inputs computed."""
    eqns = list(eqns)
    have = {v for e in eqns for v in e.outvars}
    extra, todo = [], [v for e in eqns for v in e.invars if isinstance(v, Var)]
    while todo:
        v = todo.pop()
        e = producer.get(v)
        if v in have or e is None or id(e) not in free:
            continue
        extra.append(e)
        have.update(e.outvars)
        todo += [u for u in e.invars if isinstance(u, Var)]
    order = {id(e): i for i, e in enumerate(_all_eqns(producer))}
    eqns = sorted(eqns + extra, key=lambda e: order.get(id(e), -1))
    produced, invars = set(), []
    for e in eqns:
        for v in e.invars:
            if isinstance(v, Var) and v not in produced and v not in invars:
                invars.append(v)
        produced.update(e.outvars)
    return Task(name=name, kind=kind, stage=stage, eqns=eqns, invars=invars)


def _all_eqns(producer):
    seen, out = set(), []
    for e in producer.values():
        if id(e) not in seen:
            seen.add(id(e))
            out.append(e)
    return out


def _split_backward(b: Task, needed_by: dict, producer, free) -> tuple[Task, Task]:
    """Ba: what other tasks than this stage's backward read, and its inputs; Bw: the rest."""
    remote = {v for v in b.outvars if needed_by.get(v, set()) - {b.name}}
    keep: set = set()
    todo = list(remote)
    local = {v: e for e in b.eqns for v in e.outvars}
    while todo:
        v = todo.pop()
        e = local.get(v)
        if e is None or id(e) in keep:
            continue
        keep.add(id(e))
        todo += [u for u in e.invars if isinstance(u, Var)]
    ba = _task(
        f"Ba{b.stage}",
        "Ba",
        b.stage,
        [e for e in b.eqns if id(e) in keep and id(e) not in free],
        producer,
        free,
    )
    bw = _task(
        f"Bw{b.stage}", "Bw", b.stage, [e for e in b.eqns if id(e) not in keep], producer, free
    )
    ba_made = {v for e in ba.eqns for v in e.outvars}
    bw_made = {v for e in bw.eqns for v in e.outvars}
    ba.outvars = [v for v in b.outvars if v in ba_made] + [
        v for v in bw.invars if v in ba_made and v not in b.outvars
    ]
    bw.outvars = [v for v in b.outvars if v in bw_made and v not in ba_made]
    ba.accumulated = [v for v in b.accumulated if v in ba.outvars]
    bw.accumulated = [v for v in b.accumulated if v in bw.outvars]
    return ba, bw


def _first_use_stage(groups, invars) -> dict:
    out: dict = {}
    for (_kind, s), eqns in sorted(groups.items(), key=lambda kv: (kv[0][0] != "F", kv[0][1])):
        for e in eqns:
            for v in e.invars:
                if isinstance(v, Var):
                    out.setdefault(v, s)
    return out


def is_loss_marker(e) -> bool:
    """``autoshard.grad``'s marker on the loss (``end``) or on its cotangent (``start``)."""
    return (
        e.primitive is pipeline_p
        and e.params["name"] == "loss"
        and e.params["mark_type"] in ("start", "end")
    )


def _is_boundary(e) -> bool:
    return e.primitive is pipeline_p and e.params["mark_type"] == "boundary"


def _is_dropped(v) -> bool:
    return type(v).__name__ == "DropVar"


__all__ = [
    "Partition",
    "Task",
    "assign_backward",
    "boundary_positions",
    "build_partition",
    "forward_end",
    "is_loss_marker",
    "split_pre_post",
]
