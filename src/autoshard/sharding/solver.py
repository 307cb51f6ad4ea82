"""The sharding ILP solved with HiGHS (``highs.milp``): its LP bound, the solve, and
the rounds that add memory rows where a plan went over the budget (``ilp.build_ilp`` builds
it)."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from .highs import INFEASIBLE, OPTIMAL, STOPPED
from .ilp import OBJECTIVE_SCALE, Ilp, _in_budgets, build_ilp, evaluate, with_memory
from .memory import (
    copy_bound_bytes,
    live_bytes,
    memory_rows,
    reshard_bytes,
)
from .problem import Problem

CUTOFF_MIN_COLUMNS = 2_000
"""ILPs with fewer columns are solved outright even under a cutoff: the LP bound would cost
about as much as the solve, and the solved cost is what ``explain()`` lists per mesh."""
MEMORY_ROUNDS = 12
"""Most times the ILP is solved again with rows at the points where its plan went over budget;
a plan still over it then is no plan (``solve_ilp`` says by how much)."""
MEMORY_POINTS_PER_ROUND = 8
"""Rows added per round: the points furthest over the budget."""
ROUNDS_GAP = 0.01
"""Relative gap at which a memory round's solve stops (``solver_mip_gap`` where wider). Its
rows cut off the plan found before and each solve starts from scratch; proving the last
fraction of a percent is what took the time: the families decoder on 16 devices under the
2-D expert's memory, one round 600 s at HiGHS's time limit with 0.6% left, against 52-59 s
per round at 1% (root node, the same plan). The cost estimate is not finer than percents."""


class OverBudget(ValueError):
    """No plan within the memory budget: ``peak_bytes`` is the estimate of the last one tried
    (the ILP's rows fitted it, the resharded copies it holds did not)."""

    def __init__(self, peak_bytes: int, mesh_shape, message: str):
        super().__init__(message)
        self.peak_bytes, self.mesh_shape = peak_bytes, tuple(mesh_shape)


@dataclass
class Solution:
    choice: dict[int, int]
    """Variable (root node id) -> chosen strategy index."""
    status: str
    objective_s: float
    solve_s: float
    num_ilp_vars: int = 0
    info: dict = field(default_factory=dict)
    bound_s: float | None = None
    """Set when the problem was not solved because no plan of it can beat ``cutoff_s``: the
    LP relaxation's objective, a lower bound of every plan. ``choice`` is empty then."""

    def k(self, prob: Problem, node_id: int) -> int:
        return self.choice[prob.var(node_id)]


def build_and_solve(prob: Problem, *, time_limit_s: float, memory_budget: int | None,
                    extra_allowed: dict[int, set[int]] | None = None,
                    node_limit: int | None = None, cutoff_s: float | None = None,
                    mip_gap: float = 1e-4) -> Solution:
    """Build and solve ``prob``'s ILP (``build_ilp`` then ``solve_ilp``)."""
    return solve_ilp(build_ilp(prob, time_limit_s=time_limit_s, memory_budget=memory_budget,
                               extra_allowed=extra_allowed, node_limit=node_limit,
                               mip_gap=mip_gap),
                     cutoff_s=cutoff_s)


def lp_bound_s(ilp: Ilp, *, memory: bool = True) -> float | None:
    """The LP relaxation's objective: a lower bound of every plan of the ILP (cached).

    ``memory=False``: the relaxation without the memory rows, a weaker bound that is much
    cheaper under a budget (a 48-layer step's whole-mesh ILPs on 512 devices: 0.7-1.2 s
    against 6-10 s, and still 2-3x the cutoff that pruned them). Where the memory rows hold
    fewer nonzeros than the rest (``_memory_heavy``), the full relaxation costs about as much
    and is solved instead (a pipeline task priced pair by pair on a (2, 8, 8) sub-mesh:
    720,000 resharding columns)."""
    core = not memory and _memory_heavy(ilp)
    found = ilp.lp_core if core else ilp.lp
    if found is None:
        found = _relaxed(ilp, ilp.constraints[:ilp.num_core_constraints] if core
                         else ilp.constraints)
        if core:
            ilp.lp_core = found
        else:
            ilp.lp = found
    return found[0]


BLOCKS = 64
"""Blocks of consecutive variables ``block_bound_s`` splits the ILP into."""
BLOCK_BOUND_MIN_COLUMNS = 20_000
"""Under a cutoff, ILPs of this many columns or more try ``block_bound_s`` before their LP
relaxation. On smaller ones the relaxation takes about a second and the blocks' bound is
often far weaker (the families decoder, whose cost is mostly resharding between variables:
2% of its relaxation's)."""


def cutoff_bound_s(ilp: Ilp, cutoff_s: float | None) -> float | None:
    """A lower bound of ``ilp``'s plans to compare with ``cutoff_s``: the blocks' bound
    where it is large enough to reach the cutoff (``BLOCK_BOUND_MIN_COLUMNS``), else the LP
    relaxation without the memory rows (``lp_bound_s``). The planner asks it for a cutoff its
    caller sets (AutoParallel's whole-mesh candidate under the fastest pipeline); ``solve_ilp``
    reads the blocks' bound found, and computes none itself: under the cutoff of the best mesh
    so far (a pipeline task's mesh search on Table 1's 76.1B step) it did not rule out one of
    40 ILPs and cost 37 s."""
    if cutoff_s is not None and ilp.total >= BLOCK_BOUND_MIN_COLUMNS:
        bound = block_bound_s(ilp)
        if bound is not None and bound >= cutoff_s:
            return bound
    return lp_bound_s(ilp, memory=False)


def block_bound_s(ilp: Ilp) -> float | None:
    """A lower bound of every plan of ``ilp``, much cheaper than its LP relaxation on large
    ILPs (cached): the relaxation without the memory rows and without every row that joins
    variables of different blocks (``BLOCKS`` runs of consecutive variables), which falls
    apart into one small LP per block. Dropping rows only widens the LP, so each block's
    optimum is at most its share of the full relaxation's and their sum bounds it from below;
    a column left in no row sits at the bound its cost prefers. None where that is unbounded.

    On Table 1's 76.1B step the whole-mesh candidate's 3-D meshes have LP relaxations of
    25,399-27,271 rows that HiGHS did not finish within their share of the time (simplex
    28-35 s and more, interior point 22-29 s; optima 51-76 s against an 18.3 s cutoff); split
    into 64 blocks their bounds are 20.2 s and 30.0 s in 0.6-0.7 s (the third: 10.7 s, its
    full relaxation 19.7 s)."""
    if ilp.lp_blocks is None:
        ilp.lp_blocks = (_block_bound(ilp, BLOCKS),)
    return ilp.lp_blocks[0]


def _block_bound(ilp: Ilp, num_blocks: int) -> float | None:
    import scipy.sparse as sp
    from scipy.optimize import LinearConstraint

    from .highs import csr_rows, milp
    parts = [csr_rows(con) for con in ilp.constraints[:ilp.num_core_constraints]]
    if not parts:
        return None
    A = sp.vstack([p[0] for p in parts], format="csr")
    lb = np.concatenate([p[1] for p in parts])
    ub = np.concatenate([p[2] for p in parts])
    lower, upper = (np.broadcast_to(np.asarray(b, dtype=float), ilp.total)
                    for b in ilp.bounds)
    block = np.full(ilp.total, -1)   # strategy columns: their variable's block
    for i, r in enumerate(ilp.roots):
        block[ilp.col0[r]:ilp.col0[r] + ilp.K[r]] = i * num_blocks // len(ilp.roots)
    rows = np.repeat(np.arange(A.shape[0]), np.diff(A.indptr))
    cols = A.indices
    strategy = block[cols] >= 0
    # A row whose strategy columns lie in one block belongs to it; its other (edge) columns
    # go to the block of the first such row that reads them.
    row_block = _one_block(A.shape[0], rows[strategy], block[cols[strategy]])
    first = np.full(ilp.total, A.shape[0])
    edge = ~strategy & (row_block[rows] >= 0)
    np.minimum.at(first, cols[edge], rows[edge])
    assigned = first < A.shape[0]
    block[assigned & (block < 0)] = row_block[first[assigned & (block < 0)]]
    # Rows of edge columns only take the block their columns agree on; a row reading a
    # column of another block is dropped.
    known = block[cols] >= 0
    row_block = _one_block(A.shape[0], rows[known], block[cols[known]])
    row_block[rows[~known]] = -1
    free = block < 0
    c = ilp.c * OBJECTIVE_SCALE
    if np.any(free & (c < 0) & ~np.isfinite(upper)) or np.any(
            free & (c > 0) & ~np.isfinite(lower)):
        return None
    total = float(c[free & (c < 0)] @ upper[free & (c < 0)]
                  + c[free & (c > 0)] @ lower[free & (c > 0)])
    options = {k: v for k, v in ilp.options.items() if k == "disp"}
    limit, t0 = ilp.options.get("time_limit", np.inf), time.perf_counter()
    for b in range(num_blocks):
        bcols = np.flatnonzero(block == b)
        if not len(bcols):
            continue
        brows = np.flatnonzero(row_block == b)
        left = limit - (time.perf_counter() - t0)   # the blocks share the ILP's time limit
        if left <= 0:
            return None
        res = milp(c[bcols], integrality=np.zeros(len(bcols)),
                   bounds=(lower[bcols], upper[bcols]),
                   constraints=[LinearConstraint(A[brows][:, bcols], lb[brows], ub[brows])],
                   options=dict(options, **({"time_limit": left} if np.isfinite(left) else {})))
        if res.fun is None or res.status != OPTIMAL:
            return None
        total += float(res.fun)
    return total / OBJECTIVE_SCALE


def _one_block(num_rows: int, rows: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """Per row, the one block of ``blocks`` its entries (``rows``) name, or -1 where they name
    none or several."""
    lo = np.full(num_rows, np.iinfo(np.int64).max)
    hi = np.full(num_rows, -1)
    np.minimum.at(lo, rows, blocks)
    np.maximum.at(hi, rows, blocks)
    return np.where(lo == hi, lo, -1)


def _memory_heavy(ilp: Ilp) -> bool:
    """Whether ``ilp``'s memory rows hold at least as many nonzeros as its other rows."""
    def nnz(block):
        return block.A.nnz if hasattr(block.A, "nnz") else int(np.count_nonzero(block.A))
    blocks = ilp.constraints
    core = sum(nnz(c) for c in blocks[:ilp.num_core_constraints])
    return sum(nnz(c) for c in blocks[ilp.num_core_constraints:]) >= core > 0


def _relaxed(ilp: Ilp, constraints) -> tuple:
    """(objective in seconds or None, HiGHS's status, the solution or None) of the LP
    relaxation of ``ilp`` under ``constraints``."""
    from .highs import milp
    relaxed = milp(ilp.c * OBJECTIVE_SCALE, integrality=np.zeros(ilp.total), bounds=ilp.bounds,
                   constraints=constraints,
                   options={k: v for k, v in ilp.options.items() if k != "node_limit"})
    return (None if relaxed.x is None else float(relaxed.fun) / OBJECTIVE_SCALE,
            relaxed.status, relaxed.x, relaxed.basis)


def _integral_relaxation(ilp: Ilp):
    """The ILP's solution where its LP relaxation was solved already (``lp_bound_s``: the
    mesh search's ordering and cutoff), with every row of ``ilp``, by the dual simplex, and is
    integral: what ``highs.milp`` would return for the ILP, which starts by solving that LP
    the same way (``highs._simplex_first``), without a second solve (the families' mesh
    searches solved each chosen mesh's LP twice: 1.0 s on the decoder, 3.0 s on the T5).
    None otherwise (a relaxation by another path carries no basis)."""
    from .highs import integral_solution
    found = ilp.lp
    if found is None and ilp.num_core_constraints == len(ilp.constraints):
        found = ilp.lp_core
    if found is None or found[1] != OPTIMAL or found[2] is None or found[3] is None:
        return None
    return integral_solution(found[2], found[0] * OBJECTIVE_SCALE, found[3],
                             ilp.integrality > 0)


BOUND_ROUNDS = 3
BOUND_ROWS = 4
"""Between the relaxation without memory rows and the full one: up to ``BOUND_ROUNDS`` LPs,
each adding the ``BOUND_ROWS`` memory (and copy-bound) rows of each block that the last LP's
solution goes over most. Each is a relaxation of the ILP, so a lower bound; on a 96-layer scan
step's (4, 32, 8) mesh under 80 GiB the first added 6 rows and took the bound from 27.4 s to
49.3 s in 16 s, where the full relaxation (445 memory rows) took 165 s."""


def _bound_with_rows(ilp: Ilp, cutoff_s: float) -> float | None:
    """``ilp``'s relaxation with the memory rows its solutions go over, added until the bound
    reaches ``cutoff_s`` (``BOUND_ROUNDS``); the full relaxation's objective where no row is
    violated (cached as ``ilp.lp``)."""
    from scipy.optimize import LinearConstraint

    from .highs import csr_rows
    bound, _, x, _ = ilp.lp_core
    constraints = list(ilp.constraints[:ilp.num_core_constraints])
    # (rows, lower, upper) of each memory block, converted once
    blocks = [csr_rows(block) for block in ilp.constraints[ilp.num_core_constraints:]]
    for _ in range(BOUND_ROUNDS):
        added = []
        for A, lb, ub in blocks:
            over = A @ x - ub
            top = np.argsort(-over, kind="stable")[:BOUND_ROWS]
            top = np.sort(top[over[top] > 1e-9])
            if len(top):
                added.append(LinearConstraint(A[top], lb[top], ub[top]))
        if not added:  # the solution keeps every row: the full relaxation's optimum
            ilp.lp = (bound, 0, x, None)
            return bound
        constraints += added
        bound, _, x, _ = _relaxed(ilp, constraints)
        if bound is None or bound >= cutoff_s:
            return bound
    return bound


LP_STOPPED = STOPPED
"""``highs.milp``'s status for a solve stopped by a limit (time, nodes)."""

BLOCKS_BOUND = "LP bound of the ILP split into blocks"
LP_BOUND = "LP relaxation bound"
"""``Solution.status`` of an ILP not solved because a bound reached the cutoff."""


def _stopped_at_bound(ilp: Ilp, status: str, bound: float, t0: float, info: dict) -> Solution:
    """The solution of ``ilp`` not solved: ``bound`` (seconds, found since ``t0``) reached the
    cutoff; no choice, ``bound_s`` set."""
    return Solution({}, status, bound, time.perf_counter() - t0, num_ilp_vars=ilp.total,
                    info=info, bound_s=bound)


def ruled_out_without_rows(ilp: Ilp, memory_budget: int | None,
                           cutoff_s: float | None) -> Solution | None:
    """For ``ilp`` built without the memory rows of ``memory_budget`` (``build_ilp``'s
    ``memory_budget=None``; ``ilp.with_memory`` adds them): the solution that stops at a
    bound reading none of them (the blocks', the relaxation without them) where one reaches
    ``cutoff_s``, else None (then ``solve_ilp(with_rows(ilp, memory_budget))``). These are the
    bounds ``solve_ilp`` tries first, so the outcome is the one of an ILP built with its rows;
    the rows are built only for a mesh that is solved."""
    if (memory_budget is None or ilp.memory_budget is not None or cutoff_s is None
            or ilp.total < CUTOFF_MIN_COLUMNS):
        return None
    t0 = time.perf_counter()
    blocks = ilp.lp_blocks[0] if ilp.lp_blocks is not None else None
    if blocks is not None and blocks >= cutoff_s:
        return _stopped_at_bound(ilp, BLOCKS_BOUND, blocks, t0, dict(ilp.info))
    bound = lp_bound_s(ilp)   # without memory rows: the relaxation without them
    if bound is not None and bound >= cutoff_s:
        return _stopped_at_bound(ilp, LP_BOUND, bound, t0, dict(ilp.info))
    return None


def with_rows(ilp: Ilp, memory_budget: int | None) -> Ilp:
    """``ilp`` with the memory rows of ``memory_budget`` (itself where it has them, or where
    there is no budget)."""
    if memory_budget is None or ilp.memory_budget is not None:
        return ilp
    return with_memory(ilp, memory_budget)


def solve_ilp(ilp: Ilp, *, cutoff_s: float | None = None) -> Solution:
    """Solve ``ilp``; with ``cutoff_s`` (the best objective found on another mesh), skip it
    when no plan of it can cost less (``Solution.bound_s`` is then set); an ILP under
    ``CUTOFF_MIN_COLUMNS`` columns is solved outright.

    The cutoff is deterministic: the LP relaxation (a lower bound of every plan, a second or
    so on the largest ILPs, where the branch and bound takes minutes) is compared with it. It
    bounds the ILP's objective, which is exact unless the pairwise resharding costs fell back
    to per-axis terms (``exact_resharding_columns``). Below the cutoff the ILP is solved as
    without one (an objective row bounded by the cutoff was tried: it made those solves up to
    2x slower).
    """
    from scipy.optimize import LinearConstraint  # loads on first use

    from .highs import milp
    t0 = time.perf_counter() - ilp.build_s
    prob, c, integrality, bounds = ilp.prob, ilp.c, ilp.integrality, ilp.bounds
    constraints, options, col0, K, roots = (list(ilp.constraints), ilp.options, ilp.col0,
                                            ilp.K, ilp.roots)
    memory_budget, time_limit_s, total = ilp.memory_budget, ilp.time_limit_s, ilp.total
    info = dict(ilp.info)
    if cutoff_s is not None and total >= CUTOFF_MIN_COLUMNS:
        # The blocks' bound where the planner found one (cutoff_bound_s), then the relaxation
        # without the memory rows, then with the rows its solutions go over (BOUND_ROUNDS),
        # the full one only where none reaches the cutoff.
        blocks = ilp.lp_blocks[0] if ilp.lp_blocks is not None else None
        if blocks is not None and blocks >= cutoff_s:
            return _stopped_at_bound(ilp, BLOCKS_BOUND, blocks, t0, info)
        bound = lp_bound_s(ilp, memory=False)
        if bound is not None and bound < cutoff_s and ilp.lp is None:
            bound = max(bound, _bound_with_rows(ilp, cutoff_s) or bound)
        if bound is not None and bound < cutoff_s:
            bound = lp_bound_s(ilp)
        if bound is not None and bound >= cutoff_s:
            return _stopped_at_bound(ilp, LP_BOUND, bound, t0, info)
        if bound is not None:
            info["lp_bound_s"] = bound
    t_solve = time.perf_counter()
    if any(lp is not None and lp[0] is None and lp[1] == LP_STOPPED
           for lp in (ilp.lp, ilp.lp_core)):
        # The LP relaxation alone ran out of solver_time_limit_s: the branch and bound, which
        # starts from it, finds no plan in that time either (no second wait for the clock).
        res = SimpleNamespace(x=None, status=LP_STOPPED)
        t_solve -= time_limit_s
    else:
        res = _integral_relaxation(ilp) or milp(
            c * OBJECTIVE_SCALE, integrality=integrality, bounds=bounds,
            constraints=constraints, options=options)
        ilp.lp_basis = res.basis
    last_over = None   # (peak, where) of the last plan that went over the budget
    for _ in range(MEMORY_ROUNDS if memory_budget is not None else 0):
        # The budget rows sample the program; where the plan found goes over at a point
        # they skipped, that point gets its row and the ILP is solved again.
        if res.x is None:
            break
        choice = {r: int(np.argmax(res.x[col0[r]:col0[r] + K[r]])) for r in roots}
        live = live_bytes(prob, choice)
        last_over = (int(live.max()), int(np.argmax(live)))
        over = np.flatnonzero(live > memory_budget)
        if not len(over):
            break
        worst = np.sort(over[np.argsort(-live[over], kind="stable")[:MEMORY_POINTS_PER_ROUND]])
        # The rows see the copies' lower bounds (memory.CopyBounds); what this plan's copies
        # hold beyond them at those points comes off the rows' bound.
        copies = reshard_bytes(prob, choice)[worst]
        if ilp.copies is not None:
            copies = np.maximum(
                copies - copy_bound_bytes(prob, ilp.copies[0], choice)[worst], 0.0)
        constraints.append(LinearConstraint(_in_budgets(
            memory_rows(prob, col0, K, total, points=worst, copies=ilp.copies),
            memory_budget, total if ilp.copies is None else ilp.copies[1]),
            -np.inf, 1.0 - copies / memory_budget))
        info["memory_rounds"] = info.get("memory_rounds", 0) + 1
        res = milp(c * OBJECTIVE_SCALE, integrality=integrality, bounds=bounds,
                   constraints=constraints, options=dict(options, mip_rel_gap=max(
                       ROUNDS_GAP, options.get("mip_rel_gap", 0.0))))
    if memory_budget is not None and res.x is not None:
        live = live_bytes(prob, {r: int(np.argmax(res.x[col0[r]:col0[r] + K[r]]))
                                 for r in roots})
        last_over = (int(live.max()), int(np.argmax(live))) if live.max() > memory_budget \
            else None
    if memory_budget is not None and last_over is not None:
        # Still over after the rounds, or the rows that took the copies off made it
        # infeasible: no plan, and by how much the last one missed.
        peak, at = last_over
        where = prob.graph.nodes[min(at, len(prob.graph.nodes) - 1)].where
        raise OverBudget(peak, prob.ctx.mesh_shape,
            f"No plan on mesh {prob.ctx.mesh_shape} fits memory_budget_per_device "
            f"({memory_budget:,} B): the closest plan found needs {peak:,} B per device at "
            f"{where} ({peak / memory_budget:.3f}x the budget, {peak - memory_budget:,} B "
            f"over). Raise the budget to {peak:,} B or more.")
    hit_clock = time.perf_counter() - t_solve >= 0.95 * time_limit_s
    if res.x is None:
        if res.status == INFEASIBLE:
            raise ValueError(
                "The sharding ILP is infeasible: no plan fits memory_budget_per_device "
                f"({memory_budget} bytes) on mesh {prob.ctx.mesh_shape}, or the forced specs "
                "contradict each other. Raise the budget or relax the options.")
        if memory_budget is not None:
            raise RuntimeError(
                f"HiGHS found no plan within solver_time_limit_s ({time_limit_s}) under "
                f"memory_budget_per_device ({memory_budget}); raise solver_node_limit or "
                "solver_time_limit_s.")
        if hit_clock:
            _warn_clock(prob, time_limit_s, " (no plan found yet: greedy fallback)")
        # No incumbent yet: take each variable's cheapest allowed strategy on its own.
        choice = {}
        upper, unary = bounds[1], ilp.unary
        for r in roots:
            costs = np.where(upper[col0[r]:col0[r] + K[r]] > 0, unary[col0[r]:col0[r] + K[r]],
                             np.inf)
            choice[r] = int(np.argmin(costs))
        return Solution(choice, "solver limit: no incumbent, greedy fallback",
                        evaluate(prob, choice, ilp.edges), time.perf_counter() - t0,
                        num_ilp_vars=total, info=info)
    gap = getattr(res, "mip_gap", None)
    gap_text = f" (gap {gap:.2%})" if gap is not None and np.isfinite(gap) else ""
    if res.status == OPTIMAL:
        status = "optimal"
    elif hit_clock:
        status = "time limit: best incumbent" + gap_text
        _warn_clock(prob, time_limit_s, gap_text)
    else:
        status = "node limit: best incumbent" + gap_text
    choice = {r: int(np.argmax(res.x[col0[r]:col0[r] + K[r]])) for r in roots}
    # With per-axis fallbacks the ILP saw an approximation: report the plan's exact cost.
    objective = (evaluate(prob, choice, ilp.edges) if ilp.approximate
                 else float(res.fun) / OBJECTIVE_SCALE)
    return Solution(choice, status, objective, time.perf_counter() - t0,
                    num_ilp_vars=total, info=info)


def _warn_clock(prob: Problem, time_limit_s: float, found: str):
    warnings.warn(
        f"autoshard: the sharding ILP on mesh {prob.ctx.mesh_shape} stopped at "
        f"solver_time_limit_s ({time_limit_s} s) with the best plan found{found}; a wall-clock "
        "stop can give another plan on another run. Lower solver_node_limit (a deterministic "
        "stop) or raise solver_time_limit_s.", RuntimeWarning, stacklevel=4)


