"""The sharding ILP of a ``Problem``, built for HiGHS (``solver.solve_ilp`` solves it).

One binary per (variable, strategy) with a one-hot row per variable. A graph edge whose cost
depends on both ends gets continuous edge variables over (producer spec, required spec) pairs,
tied to both one-hot vectors by marginal rows (exact at integral points); an edge whose cost
depends on one end only is folded into that end's cost. Parallel edges between the same two
variables are summed, which is what makes repeated layers cheap once they share variables.
The optional memory budget adds one row per sampled program point.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

import numpy as np

from . import reshard_memo
from .build import merged_alpha, merged_latency, merged_reductions
from .memory import CopyBounds, copy_bound_rows, copy_bounds, memory_rows
from .problem import Problem
from .reshard_memo import _distinct, axis_terms, per_axis_matrix
from .strategy import itemsize

OBJECTIVE_SCALE = 1e6

CLASS_COLUMNS = 5_000
"""Columns an ILP may spend on per-axis resharding terms priced per producer class (the
array each producer strategy's other axes leave, ``reshard_memo.axis_terms``) beyond one class
per term. Terms over the budget take one class at their largest costs (``_merge_classes``)."""
BUDGET_CLASS_COLUMNS = 20_000
"""``CLASS_COLUMNS`` under a memory budget the user gave (``class_budget``). One class prices
a gather out of a producer as if it held the largest array any of its strategies holds, so a
parameter split over both axes of a 2-D mesh (FSDP x TP, what a budget asks for) is charged
its data-axis gathers at the size of the model-axis-whole array: the families decoder on a
4x4 mesh (5,660 class columns needed) priced the 2-D expert's plan at 5.64 ms where its exact
cost is 3.60 ms, and under the expert's memory its ILP chose plans sending 1.075x the
expert's bytes; with the classes 0.915x (benchmarks/results/families.md, session 25)."""


class _Edges:
    """Edge costs grouped by (producer var, consumer var, spec maps)."""

    def __init__(self, prob: Problem):
        self.prob = prob
        self.cache: dict = {}
        self.shared = reshard_memo.MEMO.tables_of(prob.ctx.cost)
        self.reshard_cache: dict = self.shared.costs
        self.held = {prob.var(n) for n in prob.held_whole}
        """Variables whose values are read as held: no resharding out of them but slices
        (``Problem.held_whole``), as every edge of a ``Problem.no_reshard`` problem."""
        self.forbidden: list[int] = []
        self.groups: dict = {}
        """(producer var, consumer var, src dims, classes, dst dims) -> [gathers, moves]."""
        self.pairs: dict = {}
        """(producer var, consumer var) -> matrix of exact resharding costs (several axes)."""
        self.fallback: dict = {}
        """(producer var, consumer var) -> per-axis terms, for pairs too large for the ILP."""

    def add_group(self, group, gathers: np.ndarray, moves: np.ndarray):
        entry = self.groups.get(group)
        if entry is None:
            self.groups[group] = [gathers.copy(), moves.copy()]
        else:
            entry[0] += gathers
            entry[1] += moves

    def reshard(self, src, dst, shape, isize) -> float:
        key = (src, dst, shape, isize)
        hit = self.reshard_cache.get(key)
        if hit is None:
            hit = self.reshard_cache[key] = self.prob.ctx.cost.reshard(src, dst, shape, isize)
        return hit


@dataclass
class Ilp:
    """A built ILP, solved later (``solve_ilp``); its LP bound can be asked first."""

    prob: Problem
    c: np.ndarray
    integrality: np.ndarray
    bounds: tuple
    constraints: list
    options: dict
    col0: dict
    K: dict
    roots: list
    unary: np.ndarray
    edges: _Edges
    approximate: bool
    """Some resharding costs fell back to per-axis terms (pairs over
    ``exact_resharding_columns``) or to one producer class (``CLASS_COLUMNS``): the objective
    is approximate."""
    info: dict
    memory_budget: int | None
    time_limit_s: float
    build_s: float
    num_core_constraints: int = 0
    """The constraints before the memory rows (``constraints[:num_core_constraints]``: the
    one-hot and resharding rows)."""
    lp: tuple | None = None
    """(LP relaxation objective in seconds or None if it found none, HiGHS's status, its
    solution, its basis where the dual simplex found it), once computed."""
    lp_core: tuple | None = None
    """The same for the LP relaxation without the memory rows (``solver.lp_bound_s``)."""
    lp_blocks: tuple | None = None
    """(``solver.block_bound_s``'s bound in seconds or None,), once computed."""
    copies: tuple[CopyBounds, int] | None = None
    """Under a budget: the copy columns' bounds and their first column (memory.CopyBounds)."""
    lp_basis: object | None = None
    """The basis of the LP optimum ``solve_ilp``'s first solve found (``highs.Result.basis``),
    once solved: the start of the re-solves of these rows under other objectives."""

    @property
    def total(self) -> int:
        return len(self.c)


def _unique_rows(mat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(mat, axis=0, return_inverse=True)`` for a small float matrix: its distinct
    rows in lexicographic order and each row's index among them. ``np.unique`` with an axis
    sorts a structured view of the rows, 5x slower on the 24x24 cost matrices of an edge
    (1,608 calls planning the 16-layer decoder: 0.45 s of its 5.5 s under cProfile)."""
    order = np.lexsort(mat.T[::-1])
    rows = mat[order]
    new = np.empty(len(rows), dtype=bool)
    new[:1] = True
    new[1:] = (rows[1:] != rows[:-1]).any(axis=1)
    inverse = np.empty(len(rows), dtype=np.intp)
    inverse[order] = np.cumsum(new) - 1
    return rows[new], inverse


def build_ilp(prob: Problem, *, time_limit_s: float, memory_budget: int | None,
              extra_allowed: dict[int, set[int]] | None = None,
              node_limit: int | None = None, mip_gap: float = 1e-4) -> Ilp:
    """The ILP of ``prob``: one-hot strategy columns, resharding edges, memory rows; HiGHS
    stops at ``mip_gap`` (relative) above its bound."""
    import scipy.sparse as sp  # scipy loads on the first plan, not on import
    from scipy.optimize import LinearConstraint
    t0 = time.perf_counter()
    g = prob.graph
    roots = sorted({prob.var(n.id) for n in g.nodes})
    col0, K = {}, {}
    ncols = 0
    for r in roots:
        col0[r] = ncols
        K[r] = len(prob.strategies[r])
        ncols += K[r]
    unary = np.zeros(ncols)
    edges = _Edges(prob)
    costs: dict[int, tuple] = {}   # per strategy list (repeated layers share one)
    tied: dict[tuple, list] = {}   # edge -> [first consumer node, operand, value, summed runs]
    for node in g.nodes:
        r = prob.var(node.id)
        base = col0[r]
        strats = prob.strategies[node.id]
        cost = costs.get(id(strats))
        if cost is None:
            cost = costs[id(strats)] = (np.array([s.comm_s for s in strats], dtype=float),
                                        np.array([s.compute_s for s in strats], dtype=float))
        unary[base:base + len(strats)] += cost[0] * node.comm_times + cost[1] * node.mult
        for p, u in enumerate(node.operands):
            if u is None:
                continue
            # An edge's costs are linear in its consumer's runs, and the edges of tied
            # layers (the same variables, strategy lists and value) cost the same per run:
            # priced once, at their summed runs (18,153 edges, 3,108 distinct at 32 layers).
            value = g.values[u]
            producer = value.producer
            key = (prob.var(producer), r, id(prob.strategies[producer]), id(strats),
                   g.nodes[producer].outputs.index(u), p, value.shape, value.dtype)
            entry = tied.get(key)
            if entry is None:
                tied[key] = [node, p, u, node.mult]
            else:
                entry[3] += node.mult
    for node, p, u, mult in tied.values():
        _add_edge(prob, edges, node, p, u, unary, col0, mult)
    # Edge variables. Per (producer var, consumer var, mesh axis), with X_d / Y_d the chosen
    # producer / required dim of the axis (None: not split), the resharding cost is
    #   move * (1 - X_None) + (gather - move) * (1 - X_None) * Y_None - move * sum_d X_d * Y_d
    # (all-gather when the split is dropped, all-to-all when it moves, free otherwise; gather
    # and move per class of producer strategies, below). The products become continuous
    # variables bounded by their factors, exact at integral points.
    c_extra, rows, cols, vals, nrows = [], [], [], [], 0
    ub_rows, ub_cols, ub_vals, nub = [], [], [], 0

    def add_terms(row, var_root, dims, d, coef):
        for k, dk in enumerate(dims):
            if dk == d:
                ub_rows.append(row), ub_cols.append(col0[var_root] + k), ub_vals.append(coef)

    # Pairwise edges: e_ij for (producer strategy i, consumer strategy j) with marginal rows
    # sum_j e_ij = x_i and sum_i e_ij = y_j (exact at integral points, and a tight relaxation).
    # Row and column minima go to the unary costs first; a matrix left all zero needs no e.
    # (Pairs are exact but large, so meshes with one axis keep the per-axis terms above.)
    def reduce(ru, rv, mat):
        row = mat.min(axis=1)
        unary[col0[ru]:col0[ru] + K[ru]] += row
        mat = mat - row[:, None]
        col = mat.min(axis=0)
        unary[col0[rv]:col0[rv] + K[rv]] += col
        mat = mat - col[None, :]
        if not (mat > 0).any():
            return None
        # Strategies with equal cost rows (columns) share their e variables: exact, and the
        # relaxation is the same, but the LP is much smaller.
        mat, row_of = _unique_rows(mat)
        mat, col_of = _unique_rows(mat.T)
        return ru, rv, mat.T, row_of, col_of, row, col

    def add_pair(ru, rv, mat, row_of, col_of):
        nonlocal nrows
        e0 = ncols + len(c_extra)
        c_extra.extend(mat.ravel().tolist())
        nu, nv = mat.shape
        for a in range(nu):
            members = [col0[ru] + k for k in np.flatnonzero(row_of == a).tolist()]
            rows.extend([nrows] * (nv + len(members)))
            cols.extend(list(range(e0 + a * nv, e0 + (a + 1) * nv)) + members)
            vals.extend([1.0] * nv + [-1.0] * len(members))
            nrows += 1
        for b in range(nv):
            members = [col0[rv] + k for k in np.flatnonzero(col_of == b).tolist()]
            rows.extend([nrows] * (nu + len(members)))
            cols.extend(list(range(e0 + b, e0 + nu * nv, nv)) + members)
            vals.extend([1.0] * nu + [-1.0] * len(members))
            nrows += 1

    reduced = [r for r in (reduce(ru, rv, mat) for (ru, rv), mat in edges.pairs.items())
               if r is not None]
    # The LP grows with the pair columns: within AutoShardingOption.exact_resharding_columns
    # every pair is priced exactly, beyond it every edge keeps the per-axis terms. Never a mix:
    # half-exact prices mislead the ILP more than consistent approximate ones. The reported
    # objective is the exact cost of the chosen plan either way.
    num_pair_columns = sum(r[2].size for r in reduced)
    exact = (set(range(len(reduced)))
             if num_pair_columns <= prob.ctx.option.exact_resharding_columns else set())
    for i, (ru, rv, mat, row_of, col_of, row, col) in enumerate(reduced):
        if i in exact:
            add_pair(ru, rv, mat, row_of, col_of)
            continue
        unary[col0[ru]:col0[ru] + K[ru]] -= row
        unary[col0[rv]:col0[rv] + K[rv]] -= col
        for group, gathers, moves in edges.fallback.get((ru, rv), ()):
            edges.add_group(group, gathers, moves)
    def add_var(cost) -> int:
        c_extra.append(float(cost))
        return ncols + len(c_extra) - 1

    def add_row(terms):  # sum of coef * column <= 0
        nonlocal nub
        for col, coef in terms:
            ub_rows.append(nub), ub_cols.append(col), ub_vals.append(coef)
        nub += 1

    num_class_columns, num_merged = _merge_classes(edges, class_budget(prob))
    for (ru, rv, src_dims, classes, dst_dims), (gathers, moves) in edges.groups.items():
        if prob.no_reshard or ru in edges.held:
            # X_d <= Y_d: a split the producer has, the consumer keeps
            for d in sorted({d for d in src_dims if d is not None}):
                add_terms(nub, ru, src_dims, d, 1.0)
                add_terms(nub, rv, dst_dims, d, -1.0)
                nub += 1
            continue
        for k, ds in enumerate(src_dims):  # move * (1 - X_None)
            if ds is not None:
                unary[col0[ru] + k] += moves[classes[k]]
        shared = sorted({d for d in src_dims if d is not None} & set(dst_dims) - {None})
        if len(moves) == 1:
            gather, move = gathers[0], moves[0]
            for d in shared:  # z_d <= X_d, z_d <= Y_d, cost -move * z_d
                z = add_var(-move)
                for dims, root in ((src_dims, ru), (dst_dims, rv)):
                    ub_rows.append(nub), ub_cols.append(z), ub_vals.append(1.0)
                    add_terms(nub, root, dims, d, -1.0)
                    nub += 1
            if None in dst_dims and gather > move:  # w >= Y_None - X_None, cost (gather - move) w
                w = add_var(gather - move)
                ub_rows.append(nub), ub_cols.append(w), ub_vals.append(-1.0)
                add_terms(nub, rv, dst_dims, None, 1.0)
                add_terms(nub, ru, src_dims, None, -1.0)
                nub += 1
            continue
        # Producer classes c (reshard_memo.axis_terms: the arrays their other axes leave):
        # the same terms per class, and rows that keep the classes from counting on the same
        # consumer strategies (a flow from producer classes to consumer places, exact at
        # integral points): sum_c z_dc <= Y_d, sum_c w_c >= Y_None - X_None and
        # w_c + sum_d z_dc <= X_c (class c's split strategies).
        split = [[(col0[ru] + k, -1.0) for k, ds in enumerate(src_dims)
                  if ds is not None and classes[k] == c] for c in range(len(moves))]
        takes = [[] for _ in moves]
        for d in shared:
            zs = []
            for c, move in enumerate(moves):
                ks = [k for k, ds in enumerate(src_dims) if ds == d and classes[k] == c]
                if ks:
                    z = add_var(-move)
                    add_row([(z, 1.0)] + [(col0[ru] + k, -1.0) for k in ks])
                    zs.append((z, 1.0))
                    takes[c].append((z, 1.0))
            add_row(zs + [(col0[rv] + j, -1.0) for j, dd in enumerate(dst_dims) if dd == d])
        if None in dst_dims:
            ws = []
            for c, (gather, move) in enumerate(zip(gathers, moves, strict=True)):
                w = add_var(gather - move)
                ws.append((w, -1.0))
                takes[c].append((w, 1.0))
            add_row(ws + [(col0[rv] + j, 1.0) for j, dd in enumerate(dst_dims) if dd is None]
                    + [(col0[ru] + k, -1.0) for k, ds in enumerate(src_dims) if ds is None])
        for c, vs in enumerate(takes):
            if vs:
                add_row(vs + split[c])
    # z_a >= x_rk of merged reductions. Groups of the same members (the tied variables of
    # repeated layers: 1,232 groups of 136 member sets at 32 decoder layers) take the same
    # value in every plan, so they share one column priced at their summed alphas.
    merged: dict[tuple, float] = {}
    for key, members in merged_reductions(prob).items():
        same = tuple(sorted((r, tuple(ks)) for r, ks in members))
        merged[same] = merged.get(same, 0.0) + merged_alpha(prob, key)
    for members, alpha in merged.items():
        z = ncols + len(c_extra)
        c_extra.append(alpha)
        for r, ks in members:
            ub_rows.extend([nub] * (len(ks) + 1)), ub_vals.extend([1.0] * len(ks) + [-1.0])
            ub_cols.extend([col0[r] + k for k in ks] + [z])
            nub += 1
    num_edge = len(c_extra)
    total = ncols + num_edge
    rhs = [0.0] * nrows
    for r in roots:  # one-hot rows
        for k in range(K[r]):
            rows.append(nrows), cols.append(col0[r] + k), vals.append(1.0)
        rhs.append(1.0)
        nrows += 1
    upper = np.ones(total)
    for col in edges.forbidden:
        upper[col] = 0.0
    for allowed in (prob.allowed, extra_allowed or {}):
        for node_id, ks in allowed.items():
            r = prob.var(node_id)
            for k in range(K[r]):
                if k not in ks:
                    upper[col0[r] + k] = 0.0
    c = np.concatenate([unary, np.array(c_extra)])
    A = sp.csr_array((vals, (rows, cols)), shape=(nrows, total))
    constraints = [LinearConstraint(A, np.array(rhs), np.array(rhs))]
    if nub:
        A_ub = sp.csr_array((ub_vals, (ub_rows, ub_cols)), shape=(nub, total))
        constraints.append(LinearConstraint(A_ub, -np.inf, np.zeros(nub)))
    integrality = np.concatenate([np.ones(ncols), np.zeros(num_edge)])
    # HiGHS works in microseconds: seconds put every cost below its tolerances.
    options = {"time_limit": float(time_limit_s), "mip_rel_gap": float(mip_gap),
               "disp": bool(os.environ.get("AUTOSHARD_SOLVER_LOG"))}
    if node_limit is not None:
        options["node_limit"] = int(node_limit)
    info = {"rows": nrows + nub, "edge_vars": num_edge, "copy_vars": 0,
            "approximate_pairs": len(reduced) - len(exact), "class_columns": num_class_columns,
            "merged_class_terms": num_merged, "merged_columns": len(merged),
            "priced_edges": len(tied)}
    core = Ilp(prob=prob, c=c, integrality=integrality, bounds=(np.zeros(total), upper),
               constraints=constraints, options=options, col0=col0, K=K, roots=roots,
               unary=unary, edges=edges, approximate=len(exact) < len(reduced) or num_merged > 0,
               info=info, memory_budget=None, time_limit_s=time_limit_s,
               build_s=time.perf_counter() - t0, num_core_constraints=len(constraints))
    return core if memory_budget is None else with_memory(core, memory_budget)


def with_memory(core: Ilp, memory_budget: int) -> Ilp:
    """``core`` (an ILP built without a budget: its one-hot and resharding rows) with the
    memory rows of ``memory_budget``: under a budget, the resharded copies get columns
    bounded below by their readers' choices (``memory.CopyBounds``), so the memory rows see
    most of them. The bounds found on ``core`` (its LP relaxation, as the relaxation without
    the memory rows; its blocks' bound) carry over: neither reads a memory row.

    Building the rows was most of ``build_ilp``'s time on Table 1's whole-mesh candidates
    (``copy_bounds`` and ``memory_rows``), where a core bound rules most meshes out: the
    planner builds them only for a mesh it solves (``plan_auto`` under a cutoff)."""
    import scipy.sparse as sp
    from scipy.optimize import LinearConstraint
    if core.memory_budget is not None:
        raise ValueError("with_memory takes an ILP built without a memory budget "
                         f"(this one has memory_budget {core.memory_budget:,}).")
    t0 = time.perf_counter()
    prob, col0, K = core.prob, core.col0, core.K
    first = core.total   # the copy columns come after the strategy and edge columns
    copies = copy_bounds(prob)
    num_copy = len(copies.spans)
    total = first + num_copy
    constraints = [LinearConstraint(sp.csr_array((con.A.data, con.A.indices, con.A.indptr),
                                                 shape=(con.A.shape[0], total)),
                                    con.lb, con.ub) for con in core.constraints]
    aux = (copies, first)
    M = _in_budgets(memory_rows(prob, col0, K, total, copies=aux), memory_budget, first)
    constraints.append(LinearConstraint(M, -np.inf, 1.0))
    if num_copy:
        B = copy_bound_rows(copies, col0, K, total, first, scale=1.0 / memory_budget)
        constraints.append(LinearConstraint(B, -np.inf, np.zeros(B.shape[0])))
    pad = np.zeros(num_copy)
    lower, upper = core.bounds
    lp = core.lp   # the core's relaxation: this ILP's relaxation without the memory rows
    if lp is not None and lp[2] is not None:
        lp = (lp[0], lp[1], np.concatenate([lp[2], pad]), None)   # no basis of these rows
    return dataclasses.replace(
        core, c=np.concatenate([core.c, pad]),
        integrality=np.concatenate([core.integrality, pad]),
        bounds=(np.concatenate([lower, pad]), np.concatenate([upper, np.full(num_copy, np.inf)])),
        constraints=constraints, info=dict(core.info, copy_vars=num_copy),
        memory_budget=memory_budget, build_s=core.build_s + time.perf_counter() - t0,
        lp=None, lp_core=lp if lp is not None else core.lp_core, copies=aux)


def _class_columns(src_dims, classes, dst_dims, gathers, moves) -> int:
    """Columns a term's classes add to its one-class form (``build_ilp``'s z and w)."""
    if len(moves) == 1:
        return 0
    shared = {d for d in src_dims if d is not None} & set(dst_dims) - {None}
    per_class = len({(d, c) for d, c in zip(src_dims, classes, strict=True) if d in shared})
    return (per_class - len(shared)) + ((len(moves) - 1) if None in dst_dims else 0)


def class_budget(prob: Problem) -> int:
    """Class columns ``prob``'s ILP may keep: ``BUDGET_CLASS_COLUMNS`` under a memory budget
    the user gave (the problem offers the gradients' reduce-scatters and has a budget; a
    cluster's memory fills in a budget without them), else ``CLASS_COLUMNS``."""
    ctx = prob.ctx
    user_budget = ctx.scatter_gradients and ctx.option.memory_budget_per_device is not None
    return BUDGET_CLASS_COLUMNS if user_budget else CLASS_COLUMNS


def _merge_classes(edges: _Edges, budget: int) -> tuple[int, int]:
    """The producer classes of every term if they add at most ``budget`` columns, else one
    class per term at its largest gather and move (never a mix: on a 24-layer scan step,
    classes kept for the terms whose costs differ most gave a plan 1.1% slower than one class
    everywhere). Returns (class columns kept, terms merged).

    One class prices a move or gather out of a producer as if it held the largest array any
    of its strategies holds: never below the per-axis cost, exact where the consumer keeps the
    split or where all producer strategies hold arrays of one size. The classes' flow rows are
    exact but make the LP much harder: that step on a (2, 64, 8) mesh took 12.7 s for the LP
    relaxation and 20 s per branch-and-bound node with classes, 17.8 s for the whole solve
    with one class."""
    extra = {key: _class_columns(key[2], key[3], key[4], *costs)
             for key, costs in edges.groups.items()}
    if sum(extra.values()) <= budget:
        return sum(extra.values()), 0
    merged = [key for key, n in extra.items() if n]
    for key in merged:
        gathers, moves = edges.groups.pop(key)
        ru, rv, src_dims, classes, dst_dims = key
        edges.add_group((ru, rv, src_dims, (0,) * len(classes), dst_dims),
                        np.array([gathers.max()]), np.array([moves.max()]))
    return 0, len(merged)


def _in_budgets(rows, memory_budget: int, aux0: int):
    """Memory ``rows`` in budgets instead of bytes (HiGHS wants coefficients near 1): the
    strategy and edge columns (before ``aux0``) divided by the budget; the copy columns
    (from ``aux0``) hold budgets already."""
    import scipy.sparse as sp  # loads on first use
    scale = np.ones(rows.shape[1])
    scale[:aux0] = 1.0 / memory_budget
    return sp.csr_array(rows @ sp.diags_array(scale))


def evaluate(prob: Problem, choice: dict[int, int], edges: _Edges) -> float:
    """Objective of an assignment (strategy costs plus resharding on every edge)."""
    g = prob.graph
    total = merged_latency(prob, choice)
    for node in g.nodes:
        s = prob.strategies[node.id][choice[prob.var(node.id)]]
        total += s.comm_s * node.comm_times + s.compute_s * node.mult
        for p, u in enumerate(node.operands):
            if u is None:
                continue
            value = g.values[u]
            src = prob.value_spec(u, choice[prob.var(value.producer)])
            if src != s.in_specs[p]:
                total += edges.reshard(src, s.in_specs[p], value.shape,
                                       itemsize(value.dtype)) * node.mult
    return total


def _add_edge(prob: Problem, edges: _Edges, node, p: int, u: int, unary, col0,
              mult: float):
    """The costs of operand ``p`` (value ``u``) of ``node`` read ``mult`` times per step (the
    runs of every tied node that reads it so) in the ILP's terms."""
    g = prob.graph
    value = g.values[u]
    producer = value.producer
    ru, rv = prob.var(producer), prob.var(node.id)
    out_index = g.nodes[producer].outputs.index(u)
    src_list, dst_list = prob.strategies[producer], prob.strategies[node.id]
    isize = itemsize(value.dtype)
    no_reshard = prob.no_reshard or ru in edges.held
    if ru == rv:
        base = col0[rv]
        for k, (a, b) in enumerate(zip(src_list, dst_list, strict=True)):
            a, b = a.out_specs[out_index], b.in_specs[p]
            if a != b:
                if no_reshard:
                    if prob.ctx.cost.reshard_steps(a, b, value.shape, isize):
                        edges.forbidden.append(base + k)
                    continue
                unary[base + k] += edges.reshard(a, b, value.shape, isize) * mult
        return
    pairwise = not no_reshard and len(prob.ctx.cost.live_axes()) > 1
    if pairwise:
        # Several mesh axes: a step's cost depends on what the other axes do, so the edge is
        # priced pairwise, exactly (see CostModel.reshard_steps), where the ILP can afford it.
        # Edges the per-axis terms already price exactly keep them (a much smaller LP).
        key = ("pairs", id(src_list), out_index, id(dst_list), p, value.shape, isize)
        mat = edges.cache.get(key, False)
        if mat is False:
            # Keyed by the specs too: equal spec lists of unshared strategy lists (one per
            # unrolled layer) are priced once.
            srcs = tuple(a.out_specs[out_index] for a in src_list)
            dsts = tuple(b.in_specs[p] for b in dst_list)
            content = (srcs, dsts, value.shape, isize)
            shared = edges.shared
            mat = shared.matrices.get(content, False)
            if mat is False:
                # Priced once per distinct (src, dst) spec pair: strategies repeat specs.
                (us, si), (ud, di) = _distinct(srcs), _distinct(dsts)
                rows = np.ix_(si, di)
                mat = np.array([[edges.reshard(a, b, value.shape, isize) for b in ud]
                                for a in us])[rows]
                per_axis = per_axis_matrix(prob.ctx.cost, us, ud, value.shape, isize)[rows]
                if np.allclose(mat, per_axis, rtol=1e-9, atol=0.0):
                    mat = None
                else:
                    shared.matrix_bytes += mat.nbytes
                shared.matrices[content] = mat
            edges.cache[key] = mat
        pairwise = mat is not None
    if pairwise:
        acc = edges.pairs.get((ru, rv))
        if acc is None:
            edges.pairs[(ru, rv)] = mat * mult
        else:
            acc += mat * mult
    # Strategy lists are shared by repeated nodes, so the per-axis terms are cached.
    key = (id(src_list), out_index, id(dst_list), p, value.shape, isize, no_reshard)
    terms = edges.cache.get(key)
    if terms is None:
        terms = edges.cache[key] = axis_terms(
            prob.ctx.cost, [s.out_specs[out_index] for s in src_list],
            [s.in_specs[p] for s in dst_list], value.shape, isize,
            by_shards=not no_reshard)
    for src_dims, classes, dst_dims, gathers, moves in terms:
        group = (ru, rv, src_dims, classes, dst_dims)
        if pairwise:
            edges.fallback.setdefault((ru, rv), []).append((group, gathers * mult,
                                                            moves * mult))
            continue
        edges.add_group(group, gathers * mult, moves * mult)
