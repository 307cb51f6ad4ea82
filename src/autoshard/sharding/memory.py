"""The memory model: what is live at each program point, per device, under a plan.

Values live from their producer to their last consumer (inputs and outputs for the whole
step); a value's bytes per device follow its spec. Ops whose backends hold a workspace add it
at their point. The ILP bounds sampled points with ``memory_rows``; ``peak_bytes`` is the
estimate a plan reports (``Executable.audit()`` compares it with XLA's allocation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .fusion import (
    BITCASTS,
    FOLDED,
    REDUCTIONS,
    Roofline,
    fusion_charges,
    recomputed,
    taken_products,
)
from .problem import Problem, value_bytes
from .rules import ELEMENTWISE
from .spec import axis_place, shards
from .strategy import itemsize, nbytes
from .xla_buffers import (
    WORKSPACE_KINDS,
    broadcast_buffers,
    broadcast_dims,
    copied_operands,
    dot_layout_copies,
    early_scatter_targets,
    ready_points,
    unbitcast,
)


def liveness(prob: Problem) -> list[tuple[int, int, int]]:
    """(value id, first node, last node) of every value that takes memory of its own.

    As XLA allocates them:

    * inputs are arguments, allocated for the whole step; outputs live from their producer to
      the end;
    * a donated input and the output that replaces it (``Graph.memo["aliases"]``, the
      planner's ``aliases``, where ``Graph.memo["donated"]``, per input, says it is donated)
      share one buffer: the output takes memory of its own only while the input is still
      read after the output exists;
    * a scan's stacked output (``ys``) is a buffer of the loop, written slice by slice: it
      lives from the loop's first node, not from after its last iteration;
    * a value XLA never writes to memory takes none (``materialized``): its readers read the
      values it is computed from, which stay live until its last reader;
    * a convolution's operand that XLA copies into another layout (``copied_operands``) is
      read through the copy (``_transients``, made where the operand is): a forward image
      need not stay for its weight-gradient convolution (XLA's buffer assignment of three
      convolutions with ReLU keeps each convolution's result and the image's copy).
    """
    g = prob.graph
    kept = materialized(prob)
    end = {v.id: v.producer for v in g.values}
    for node in reversed(g.nodes):
        if node.kind == "output":
            continue
        read_until = g.loop_ends.get(node.id, node.id)  # a scanned input: every iteration
        copied = copied_operands(node) if node.kind in WORKSPACE_KINDS else ()
        for p, u in enumerate(node.operands):
            if u is not None and p not in copied:   # a copied operand: the copy is read
                end[u] = max(end[u], read_until)
        if node.outputs and not any(kept[v] for v in node.outputs):
            last = max(end[v] for v in node.outputs)  # its readers read its operands
            for u in node.operands:
                if u is not None:
                    end[u] = max(end[u], last)
    for node in g.nodes:   # a result that takes the buffer of an operand read last here
        u = _reused_operand(g, node, kept, end)
        if u is not None:
            end[u] = node.id - 1
    last = len(g.nodes)
    aliased = {}
    donated = g.memo.get("donated")   # per input (None: every aliased input is donated)
    for i, o in g.memo.get("aliases", ()):
        if donated is not None and not donated[i]:
            continue
        vi = g.nodes[g.inputs[i]].outputs[0]
        vo = g.nodes[g.outputs[o]].operands[0]
        if vo is not None and vo != vi:
            aliased[vo] = end[vi]   # the input's last read: the output takes its buffer after
    for node_id in g.outputs:
        u = g.nodes[node_id].operands[0]
        if u is not None:
            end[u] = last
    for node_id in g.inputs:
        end[g.nodes[node_id].outputs[0]] = last
    starts = _loop_starts(g)
    spans = []
    for v in g.values:
        if not kept[v.id]:
            continue
        first = 0 if g.nodes[v.producer].kind == "input" else starts.get(v.producer, v.producer)
        stop = end[v.id]
        if v.id in aliased and g.nodes[v.producer].kind != "input":
            stop = min(stop, aliased[v.id])
            if stop < first:
                continue
        spans.append((v.id, first, stop))
    return spans


IN_PLACE_KINDS = frozenset({"scatter-add", "scatter_add", "scatter", "scatter-mul",
                            "scatter_mul", "scatter-min", "scatter-max", "dynamic_update_slice"})
"""Ops XLA runs in place on their first operand when nothing else reads it afterwards (the
zeros a gather's gradient scatters into become the gradient)."""


def _reused_operand(g, node, kept, end) -> int | None:
    """The operand whose buffer ``node``'s result takes, if any.

    XLA's buffer assignment gives an op's result the buffer of an operand that dies there when
    the op reads it element by element at the result's index (an elementwise kernel: the
    accumulation of two gradients, Adam's moment updates) or updates it in place
    (``IN_PLACE_KINDS``): an operand computed in the step (not an argument, whose buffer the
    caller owns), written to memory, of the result's shape and dtype, read last by this op.
    """
    if not node.outputs or not kept[node.outputs[0]]:
        return None
    if node.kind in IN_PLACE_KINDS:
        candidates = node.operands[:1]
    elif node.kind in ELEMENTWISE:
        candidates = node.operands
    else:
        return None
    out = g.values[node.outputs[0]]
    for u in candidates:
        if u is None or not kept[u] or end[u] != node.id:
            continue
        v = g.values[u]
        if (g.nodes[v.producer].kind != "input" and tuple(v.shape) == tuple(out.shape)
                and v.dtype == out.dtype):
            return u
    return None


def _loop_starts(g) -> dict[int, int]:
    """``ys`` node id -> the first ``xs`` node of its scan (the scan's ``ys`` nodes follow its
    body; ``Graph.loop_ends`` maps each ``xs`` node to the last of them)."""
    first_xs: dict[int, int] = {}
    for x, end in g.loop_ends.items():
        first_xs[end] = min(first_xs.get(end, x), x)
    starts, run = {}, []
    for node in g.nodes:
        if node.kind == "ys":
            run.append(node.id)
            continue
        _close_run(run, first_xs, starts)
    _close_run(run, first_xs, starts)
    return starts


def _close_run(run: list[int], first_xs: dict[int, int], starts: dict[int, int]) -> None:
    if run and run[-1] in first_xs:
        for y in run:
            starts[y] = first_xs[run[-1]]
    run.clear()


def materialized(prob: Problem) -> list[bool]:
    """Per value: whether XLA writes it to memory.

    Not written: the values of a fusion group that only the group reads (``fusion``: one
    kernel reads the group's external inputs and writes what is read outside it), the
    members of a group of bitcasts (a reshape of a buffer is the same buffer), and the cheap
    values a group would write that XLA computes again in every kernel that reads them
    (``fusion.recomputed``: most pieces of a GELU kept for the backward pass). Everything
    else is: products' results (XLA's CPU runs each matrix product as a kernel of its own,
    the epilogue a fusion group takes reads it from memory), products' operand prologues
    (XLA's CPU backend copies a transposed operand into the layout its matrix product
    wants) and values a strategy may reduce over devices (the collective splits the kernel;
    e.g. a bias gradient's sum before the update reads it).
    """
    g = prob.graph
    key = ("materialized", tuple(prob.ctx.mesh_shape))
    memo = g.memo.get(key)
    if memo is not None:
        return memo
    kept = [True] * len(g.values)
    # the same fusion groups the compute term prices (mesh independent)
    charges = g.memoised("fusion", lambda: fusion_charges(g, prob.free))
    again = g.memoised("recomputed", lambda: recomputed(g, prob.free, charges))
    for node_id, charge in charges.items():
        node = g.nodes[node_id]
        if (charge is FOLDED and node.kind not in BITCASTS) or isinstance(charge, Roofline):
            continue  # a prologue folded into a product's read (XLA's CPU copies it); a product
        if any(kind in REDUCING_KINDS for st in prob.strategies[node_id]
               for kind, _, _ in st.collectives):
            continue  # a reduction over devices ends the kernel: its operand is written
        for j, v in enumerate(node.outputs):
            if j not in charge.writes or v in again:
                kept[v] = False
    taken = g.memoised("taken_products", lambda: taken_products(g, prob.free))
    for node in g.nodes:   # what a reduction's kernel reads is written (``taken_products``)
        if node.kind not in REDUCTIONS or node.id in prob.free or not node.operands:
            continue
        if node.id in taken:
            mul = g.nodes[taken[node.id]]
            kept[mul.outputs[0]] = False
            reads = [u for u in mul.operands if u is not None
                     and not broadcast_dims(g, u, mul.outputs[0])]
        else:
            reads = node.operands[:1]
        for u in reads:
            u = unbitcast(g, u)
            if u is not None and g.values[u].producer not in prob.free:
                kept[u] = True
    g.memo[key] = kept
    return kept


def _transients(prob: Problem) -> list[tuple[int, int, int, list[int]]]:
    """(first node, last node, variable, bytes per strategy) of every buffer no value names.

    Layout copies: XLA computes a copy as soon as its operand exists (it depends on nothing
    else), so the copy lives from the operand's producer (an input's: its first use) to the
    convolution: read from XLA's buffer assignment, the transposed forward images of the
    weight-gradient convolutions, and the swapped kernels of the input-gradient ones, are
    made in the forward pass and held through the backward, next to the images themselves.

    Layout copies of step inputs for matrix products (``dot_layout_copies``): from the
    input's first read to the product; they stand for the input's resharded copy for that
    product, if any (``reshard_bytes`` and ``copy_bounds`` leave it out).

    Partial sums (``_partials``): a reduction's result is a new buffer beside its operand.
    Repeated operands of a reduction's multiply (``broadcast_buffers``).
    """
    g, found = prob.graph, []
    mesh = prob.ctx.mesh_shape
    for node in g.nodes:
        if node.kind not in WORKSPACE_KINDS:
            continue
        for p in copied_operands(node):
            u = node.operands[p] if p < len(node.operands) else None
            if u is None:
                continue
            v = g.values[u]
            size = nbytes(v)
            first = v.producer
            if g.nodes[first].kind == "input":   # an input's copy is made at its first use
                first = min((n.id for n in g.nodes if u in n.operands), default=node.id)
            found.append((first, node.id, prob.var(node.id),
                          [size // shards(st.in_specs[p], mesh)
                           for st in prob.strategies[node.id]]))
    ready = ready_points(g)
    for node_id, p in dot_layout_copies(g):
        node = g.nodes[node_id]
        u = node.operands[p]
        size = nbytes(node.in_avals[p])
        found.append((ready.get(u, node_id), node_id, prob.var(node_id),
                      [size // shards(st.in_specs[p], mesh) for st in prob.strategies[node_id]]))
    return found + _partials(prob) + broadcast_buffers(prob) + early_scatter_targets(prob)


REDUCING_KINDS = ("all-reduce", "reduce-scatter")
"""Collectives whose operand, the partial sums, is a buffer of its own beside the result."""


def _partials(prob: Problem) -> list[tuple[int, int, int, list[int]]]:
    """The partial sums a strategy reduces: (first node, last node, variable, bytes).

    A strategy whose output is reduced (``Strategy.collectives``) first computes partial sums
    of the output's per-device size (a reduce-scatter's: ``group`` times it), and the
    reduction writes a new buffer: both are live where it runs, one point. XLA merges the
    reductions only the update and the outputs read (``Problem.combined``: weight gradients)
    into one, after the last of them is computed: there every gradient is held twice
    (partials and reduced results). Before that point the partial sums stand for the results
    (the value's own span), after it the results.
    """
    g, mesh = prob.graph, prob.ctx.mesh_shape
    # the step's merged reductions; those of a loop iteration are merged there (Node.body)
    step_merged = {n for n in prob.combined if g.nodes[n].merge_group[0] < 0}
    merged_at = max(step_merged, default=0)
    found = []
    priced: dict[tuple, list[int] | None] = {}   # repeated layers share strategy lists
    for node in g.nodes:
        if not node.outputs:
            continue
        strategies = prob.strategies[node.id]
        v = g.values[node.outputs[0]]
        key = (id(strategies), v.shape, v.dtype)
        sizes = priced.get(key, False)
        if sizes is False:
            sizes = priced[key] = _partial_sizes(strategies, v, mesh)
        if sizes is None:
            continue
        at = max(node.id, merged_at) if node.id in step_merged else node.id
        found.append((at, at, prob.var(node.id), sizes))
    return found


def _partial_sizes(strategies, v, mesh) -> list[int] | None:
    """Bytes of the partial sums each of ``strategies`` reduces into value ``v`` (None when
    none reduces)."""
    if not any(kind in REDUCING_KINDS for s in strategies for kind, _, _ in s.collectives):
        return None
    size = nbytes(v)
    sizes = []
    for s in strategies:
        group = max((math.prod(mesh[a] for a in axes) if kind == "reduce-scatter"
                     else 1 for kind, axes, _ in s.collectives if kind in REDUCING_KINDS),
                    default=0)
        sizes.append(group * size // shards(s.out_specs[0], mesh))
    return sizes if any(sizes) else None


@dataclass(frozen=True)
class CopyBounds:
    """Lower bounds of the resharded copies (``reshard_bytes``) for the ILP's memory rows.

    A copy of value ``u`` in spec ``d`` depends on two choices (its producer's spec and a
    reader's in_spec). A reader holds ``sum_d b_d Y_d (1 - X_d)`` bytes of copies, ``Y_d``:
    it takes a strategy reading ``d``, ``X_d``: the producer makes ``d``, ``b_d``: bytes per
    device in ``d``. That is at least ``sum_j b(dst_j) y_j - sum_i b(src_i) x_i`` over the
    producer strategies ``i`` whose spec some strategy of the reader reads: exact for a
    gather from a spec the reader cannot read, short by the producer's bytes otherwise (an
    all-to-all of equal sizes counts 0), exact when one variable chooses both ends. (Exact
    bounds, one column ``max(0, Y_d - X_d)`` per spec, made the families decoder's budgeted
    ILP 2-8x slower: the solver's rounds, ``solver.solve_ilp``, take the rest.) A copy lives
    from where ``u`` is ready (from its first reader where every copy a choice could make is
    a local slice) until its last reader, so the points between two readers of ``u`` count
    one column ``m >= 0`` bounded below by every later reader's bound (the largest: readers
    that need one spec share one copy)."""

    spans: list[tuple[int, int]]
    """Per column: the first and last program point it counts at."""
    terms: list[tuple[int, list[tuple[int, np.ndarray]]]]
    """(column, [(variable, coefficient per strategy)]): column >= the sum."""
    chain: list[tuple[int, int]]
    """(a, b): column a >= column b (a's readers include b's)."""


def copy_bounds(prob: Problem) -> CopyBounds:
    """The copy columns of ``prob`` (see ``CopyBounds``)."""
    g, mesh = prob.graph, prob.ctx.mesh_shape
    ready = ready_points(g)
    readers: dict[int, list[tuple[int, int, int]]] = {}
    layout = set(dot_layout_copies(g))   # counted as transients
    for node in g.nodes:
        for p, u in enumerate(node.operands):
            if (u is not None and g.values[u].producer not in prob.free
                    and (node.id, p) not in layout):
                readers.setdefault(u, []).append((g.loop_ends.get(node.id, node.id), node.id, p))
    spans, terms, chain = [], [], []
    split: dict = {}  # spec -> devices it splits a value over (specs recur across values)

    def shards_of(spec) -> int:
        found = split.get(spec)
        if found is None:
            found = split[spec] = shards(spec, mesh)
        return found
    sliced: dict = {}  # (src, dst) -> is_local_slice

    def moves(srcs, dsts) -> bool:  # some copy of a src into a dst is made by a collective
        for a in srcs:
            for d in dsts:
                if d is not None and d != a:
                    key = (a, d)
                    if key not in sliced:
                        sliced[key] = is_local_slice(a, d, mesh)
                    if not sliced[key]:
                        return True
        return False
    for u, found in readers.items():
        v = g.values[u]
        size = nbytes(v)
        producer = v.producer
        out = g.nodes[producer].outputs.index(u)
        src = [st.out_specs[out] for st in prob.strategies[producer]]
        src_bytes = np.array([size // shards_of(s) for s in src], dtype=float)
        ru = prob.var(producer)
        by_end: dict[int, list] = {}
        gathers = False
        for end, node_id, p in found:
            dsts = [st.in_specs[p] if p < len(st.in_specs) else None
                    for st in prob.strategies[node_id]]
            rv = prob.var(node_id)
            gathers = gathers or moves(set(src), set(dsts))
            if ru == rv:
                coef = np.array([0.0 if d is None or d == a else size // shards_of(d)
                                 for a, d in zip(src, dsts, strict=True)])
                bound = [(ru, coef)] if coef.max() > 0 else []
            else:
                read = set(dsts)
                dst_bytes = np.array([0.0 if d is None else size // shards_of(d)
                                      for d in dsts])
                sub = np.where([s in read for s in src], -src_bytes, 0.0)
                bound = ([(rv, dst_bytes), (ru, sub)]
                         if dst_bytes.max() + sub.max() > 0 else [])
            if bound:
                by_end.setdefault(end, []).append(bound)
        # As ``reshard_bytes``: only a copy made by a collective lives from where u is ready.
        first = ready.get(u, producer) if gathers else min(node_id for _, node_id, _ in found)
        previous = None
        for end in sorted(by_end):
            col = len(spans)
            spans.append((first, end))
            for bound in by_end[end]:
                terms.append((col, bound))
            if previous is not None:
                chain.append((previous, col))
            previous, first = col, end + 1
    return CopyBounds(spans=spans, terms=terms, chain=chain)


def copy_bound_bytes(prob: Problem, bounds: CopyBounds, choice: dict[int, int]) -> np.ndarray:
    """Per program point, the bytes ``bounds``' columns hold at least under ``choice``
    (what the ILP's rows count for the copies ``reshard_bytes`` holds)."""
    value = np.zeros(len(bounds.spans))
    for col, bound in bounds.terms:
        value[col] = max(value[col], sum(coef[choice[r]] for r, coef in bound))
    for a, b in reversed(bounds.chain):   # chains run forward: settle the later ones first
        value[a] = max(value[a], value[b])
    n = len(prob.graph.nodes) + 1
    delta = np.zeros(n + 1)
    for (a, b), size in zip(bounds.spans, value, strict=True):
        delta[a] += size
        delta[b + 1] -= size
    return np.cumsum(delta)[:n]


def copy_bound_rows(bounds: CopyBounds, col0, K, total: int, aux0: int, scale: float = 1.0):
    """``bounds``' rows ``sum - column <= 0`` (its columns from ``aux0``; bytes times
    ``scale``) as a sparse matrix."""
    import scipy.sparse as sp  # loads on first use
    rows, cols, vals = [], [], []
    n = 0
    for col, bound in bounds.terms:
        for r, coef in bound:
            nz = np.flatnonzero(coef)
            rows.extend([n] * len(nz))
            cols.extend((col0[r] + nz).tolist())
            vals.extend((coef[nz] * scale).tolist())
        rows.append(n), cols.append(aux0 + col), vals.append(-1.0)
        n += 1
    for a, b in bounds.chain:
        rows.extend([n, n]), cols.extend([aux0 + b, aux0 + a]), vals.extend([1.0, -1.0])
        n += 1
    return sp.csr_array((vals, (rows, cols)), shape=(n, total))


def memory_rows(prob: Problem, col0, K, total, num_points: int = 48, points=None,
                copies: tuple[CopyBounds, int] | None = None):
    """One row per sampled program point: bytes per device of everything live there.

    Points: the half with the largest replicated live set, plus evenly spaced ones; or the
    given ``points`` (node indices, ascending), e.g. where a solved plan went over budget.
    ``copies``: (``copy_bounds(prob)``, its first column): the rows count the copy columns
    live at each point as well.
    """
    import scipy.sparse as sp  # loads on first use
    spans = prob.derived_value("liveness", liveness)
    n = len(prob.graph.nodes) + 1
    repl = np.zeros(n + 1)
    for vid, a, b in spans:
        v = prob.graph.values[vid]
        size = float(itemsize(v.dtype) * math.prod(v.shape))
        repl[a] += size
        repl[b + 1] -= size
    transients = prob.derived_value("transients", _transients)
    for a, b, _, sizes in transients:
        repl[a] += max(sizes)
        repl[b + 1] -= max(sizes)
    if points is None:
        live = np.cumsum(repl)[:n]
        top = np.argsort(-live, kind="stable")[: num_points // 2]
        even = np.linspace(0, n - 1, num_points // 2).astype(int)
        points = np.array(sorted(set(top.tolist()) | set(even.tolist())))
    points = np.asarray(points)
    # Per block of entries, in the order the rows are read (HiGHS sees each row's entries in
    # that order): every row of the points inside [a, b] gets one entry per strategy.
    rows, cols, vals = [], [], []

    def inside(ranges):  # the first and past-the-last point in each [a, b]
        ab = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
        return (np.searchsorted(points, ab[:, 0]).tolist(),
                np.searchsorted(points, ab[:, 1], side="right").tolist())

    def add(lo, hi, first_col, sizes):
        if hi > lo:
            rows.append(np.repeat(np.arange(lo, hi), len(sizes)))
            cols.append(np.tile(np.arange(first_col, first_col + len(sizes)), hi - lo))
            vals.append(np.tile(np.asarray(sizes, dtype=float), hi - lo))
    for (vid, _, _), lo, hi in zip(spans, *inside([(a, b) for _, a, b in spans]), strict=True):
        if hi > lo:
            r = prob.var(prob.graph.values[vid].producer)
            add(lo, hi, col0[r], [float(value_bytes(prob, vid, k)) for k in range(K[r])])
    for (_, _, r, sizes), lo, hi in zip(transients, *inside([t[:2] for t in transients]),
                                        strict=True):
        if len(sizes) == K[r]:
            add(lo, hi, col0[r], [float(s) for s in sizes])
    if copies is not None:
        bounds, aux0 = copies
        for col, lo, hi in zip(range(len(bounds.spans)), *inside(bounds.spans), strict=True):
            add(lo, hi, aux0 + col, [1.0])
    if not rows:
        return sp.csr_array((len(points), total))
    return sp.csr_array((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                        shape=(len(points), total))


def is_local_slice(src, dst, mesh_shape) -> bool:
    """Whether ``dst`` only adds splits to ``src`` (each mesh axis of ``src`` keeps its place):
    a device takes its piece of what it holds, no collective."""
    return all(axis_place(src, a) in (None, axis_place(dst, a))
               for a, n in enumerate(mesh_shape) if n > 1)


def peak_bytes(prob: Problem, choice: dict[int, int]) -> int:
    """Largest estimated live set per device under ``choice`` (variable -> strategy index)."""
    live = live_bytes(prob, choice)
    return int(live.max()) if len(live) else 0


def warm(prob: Problem) -> None:
    """Compute the memory model's parts that depend on no choice (liveness, transients), which
    ``live_bytes`` and ``memory_rows`` read: while a solve runs on another core."""
    prob.derived_value("liveness", liveness)
    prob.derived_value("transients", _transients)


def live_bytes(prob: Problem, choice: dict[int, int], *, copies: bool = True) -> np.ndarray:
    """Estimated live bytes per device at every program point under ``choice``; without the
    resharded copies (``reshard_bytes``) when ``copies`` is False (what the ILP's rows see)."""
    spans = prob.derived_value("liveness", liveness)
    n = len(prob.graph.nodes) + 1
    delta = np.zeros(n + 1)
    for vid, a, b in spans:
        k = choice[prob.var(prob.graph.values[vid].producer)]
        size = value_bytes(prob, vid, k)
        delta[a] += size
        delta[b + 1] -= size
    for a, b, r, sizes in prob.derived_value("transients", _transients):
        size = sizes[choice[r]] if len(sizes) > choice[r] else max(sizes)
        delta[a] += size
        delta[b + 1] -= size
    live = np.cumsum(delta)[:n]
    return live + reshard_bytes(prob, choice) if copies else live


def reshard_bytes(prob: Problem, choice: dict[int, int]) -> np.ndarray:
    """Bytes per device at every program point of the resharded copies ``choice`` makes.

    A consumer that needs a value in another spec than its producer's reads a copy (the
    result of an all-gather, all-to-all or local slice). XLA makes one copy per (value, spec)
    for all the consumers that need it, so it lives to the last of them: a parameter gathered
    for the forward pass is held for the backward one (XLA does not gather it twice). A copy
    that moves data is made where its source is ready (``ready_points``); a local slice
    (``is_local_slice``) where its first reader runs (XLA fuses it into that reader: the ViT
    budget plan's Adam update, run split over the data axis on state held whole over it,
    slices 2.6 MB per device that the compiled program never holds before the update). The
    ILP's memory rows cannot see these (they depend on two choices at once);
    ``solver.solve_ilp`` lowers a row's bound by the copies its plan holds there.
    """
    g, mesh = prob.graph, prob.ctx.mesh_shape
    spans: dict[tuple[int, object], list[int]] = {}
    ready = ready_points(g)
    layout = set(dot_layout_copies(g))   # a layout copy (a transient) stands for the copy
    for node in g.nodes:
        s = prob.strategies[node.id][choice[prob.var(node.id)]]
        for p, u in enumerate(node.operands):
            if (u is None or p >= len(s.in_specs) or s.in_specs[p] is None
                    or (node.id, p) in layout):
                continue
            v = g.values[u]
            if v.producer in prob.free:
                continue
            dst, src = s.in_specs[p], prob.value_spec(u, choice[prob.var(v.producer)])
            if src == dst:
                continue
            start = node.id if is_local_slice(src, dst, mesh) else ready[u]
            span = spans.setdefault((u, dst), [start, node.id])
            span[1] = max(span[1], g.loop_ends.get(node.id, node.id))  # xs: the whole scan
    n = len(g.nodes) + 1
    delta = np.zeros(n + 1)
    for (u, dst), (a, b) in spans.items():
        v = g.values[u]
        size = nbytes(v) // shards(dst, mesh)
        delta[a] += size
        delta[b + 1] -= size
    return np.cumsum(delta)[:n]


