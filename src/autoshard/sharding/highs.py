"""HiGHS through its own Python package (``highspy``): the sharding ILPs and their LP
relaxations, with the interior-point method where the simplex stalls.

``scipy.optimize.milp`` runs the same solver but passes only five of its options. The ILPs
with per-axis resharding terms (large move costs on a producer's split strategies, offset by
negative-cost overlap columns) are degenerate for the dual simplex HiGHS starts from: a
backward task of Table 1's 76.1B model on a (4, 16, 8) sub-mesh (22,011 columns, 15,200
rows) did not finish its root LP in 600 s, where the interior-point method solves it in 11 s
and the whole ILP in 26 s. So LPs of ``IPM_MIN_ROWS`` rows or more and at most
``IPM_MAX_COLUMNS_PER_ROW`` columns per row that the dual simplex does not solve at a first
try (below) are solved by the interior-point method (``solver``), and the root LP of such
ILPs too (``mip_lp_solver``); the branch and bound after the root stays HiGHS's own. The ILPs that price resharding pair by pair (a transportation
problem per edge: 36 columns per row on the 76.1B model's pipeline tasks, 640,000-730,000
columns) stay with the dual simplex, which solves their LPs in 6-9 s where the interior-point
method took 52-91 s; HiGHS's presolve removes 0.2% of their columns and was half the time of
their solves, so ILPs of ``NO_PRESOLVE_MIN_COLUMNS`` columns or more with more than
``IPM_MAX_COLUMNS_PER_ROW`` columns per row are solved without it (a 552,373-column task ILP:
50 -> 20 s, its LP 10 -> 4 s, same optimum). The per-axis ILPs keep it (without it the
22,011-column one ran past 300 s). Every other problem goes to ``scipy.optimize.milp`` as
before: its HiGHS (1.12 with scipy 1.17) breaks ties between equal-cost plans as the tests
and benchmarks were measured with (highspy 1.16 picks other ones, e.g. a pipeline forward's
residual split over both axes, which kept its backward from running per device over the
batch axis).

The interior-point method is the fallback, not the first try, for those problems: on most
sharding ILPs the dual simplex solves the LP in about one iteration per row, 3-4x faster than
the interior-point method (the families benchmark's 16-layer decoder on a 2x4 mesh: 15,735
rows, 18,348 columns; root LP 1.4 s against 4.2 s), and the LP is integral, so the ILP is
solved there. So such a problem's LP is first solved by the dual simplex with at most
``SIMPLEX_ITERATIONS_PER_ROW`` iterations per row. An integral optimum is the ILP's optimum
(the LP bounds every plan) and is returned as it is. Otherwise the ILP goes the interior-point
path as before, with the time left: a simplex that hits its limit (the degenerate per-axis
ILPs above), and a fractional optimum (ILPs with memory rows: on the test decoder under a
budget, 9,271 columns, HiGHS's branch and bound from the simplex root restarted without end
where from the interior-point root it finished in 19 s).

A solve that has the cores to itself (not one of several HiGHS solves ``concurrently`` runs)
takes that LP by HiGHS's parallel dual simplex (``PARALLEL_SIMPLEX``), which on every LP of
the families benchmark's default plans ends on the serial one's vertex, up to 1.7x sooner on
two cores; solves that share the cores stay serial (two parallel ones side by side took 3x as
long as two serial ones).

``milp`` takes ``scipy.optimize.milp``'s arguments and returns what the planner reads of its
result, with scipy's status codes.
"""

from __future__ import annotations

import contextvars
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

IPM_MIN_ROWS = 5_000
"""Rows from which an LP (and an ILP's root LP) that the simplex's first try does not solve
is solved by the interior-point method..."""
IPM_MAX_COLUMNS_PER_ROW = 4
"""...where it has at most this many columns per row (per-axis terms: 1.4; pairs: 36)."""
NO_PRESOLVE_MIN_COLUMNS = 100_000
"""Columns from which an LP or ILP wider than ``IPM_MAX_COLUMNS_PER_ROW`` columns per row is
solved without HiGHS's presolve."""
SIMPLEX_ITERATIONS_PER_ROW = 1.25
"""The dual simplex's first try at an interior-point-sized LP stops after this many
iterations per row. The families decoder's LPs take 0.89-0.95 per row; the degenerate ones
of Table 1's 76.1B pipeline tasks run 2,100 iterations per second, so 3 per row cost 21.5 s
before the interior-point method took over (24 s)."""
INTEGRAL_TOLERANCE = 1e-6
"""An LP solution whose integer columns are this close to integers is an ILP solution."""
SOLVER_THREADS = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                            else os.cpu_count() or 1))
"""Solves ``concurrently`` runs at once: HiGHS releases the GIL while it solves (two of the
16-layer decoder's ILPs: 1.76 s in two threads against 3.22 s one after the other)."""

PARALLEL_SIMPLEX = 3
"""HiGHS's ``simplex_strategy`` for an LP solved alone: 3, the dual simplex with parallel
minor iterations (PAMI). Until session 30 it was 2, which HiGHS 1.16 runs as SIP (its log
says so), not PAMI. Measured on every simplex LP of the families benchmark's default plans
(the decoder at 8, 16 and 32 layers, ViT, T5, U-Net; first solves and the re-solves from their
basis): PAMI ends on SIP's and the serial simplex's vertex on each, up to 1.7x sooner than
SIP alone on two cores (the 16-layer decoder's first solve 1.07 -> 0.68 s, the T5's 2.9 ->
1.7 s, the ViT's 1.02 -> 0.88 s); its iterations are its own (12,808 against 13,610) and the
same on every run, under load too. Alone, not beside another solve: two parallel ones side by side took 3x as long as two
serial ones. A core busy with other work slows any parallel simplex more than the serial one
(the T5's first solve with one core busy elsewhere: serial 3.96 s, SIP 9.32 s, PAMI 5.48 s;
with both cores free 3.86, 3.29, 2.06 s)."""
_SHARED = contextvars.ContextVar("autoshard_highs_shared", default=False)
"""True inside a call ``concurrently`` runs beside other HiGHS solves."""

OPTIMAL, STOPPED, INFEASIBLE, UNBOUNDED, OTHER = range(5)
"""``scipy.optimize.milp``'s status codes (the planner's messages read them)."""


@dataclass
class Result:
    x: np.ndarray | None
    """The best solution found (None when there is none)."""
    fun: float | None
    status: int
    """``OPTIMAL``, ``STOPPED`` (time or node limit), ``INFEASIBLE``, ``UNBOUNDED`` or
    ``OTHER``."""
    mip_gap: float | None = None
    mip_node_count: int | None = None
    basis: object | None = None
    """HiGHS's basis of the LP optimum the dual simplex found (``_simplex_first``), where
    it found one: a start for the same rows and bounds under another objective
    (``milp(start=...)``)."""


def milp(c, *, integrality, bounds, constraints, options: dict | None = None,
         start=None) -> Result:
    """Minimise ``c @ x`` under ``constraints`` (``scipy.optimize.LinearConstraint``s),
    ``bounds`` (a ``Bounds`` or ``(lower, upper)``) and ``integrality`` (1: integer), with
    scipy's ``options`` (``time_limit``, ``node_limit``, ``mip_rel_gap``, ``presolve``,
    ``disp``). ``start``: the ``Result.basis`` of an earlier solve of the same rows and
    bounds, where the dual simplex's LP starts from (the planner's re-solves of its ILP with
    another objective, ``least_memory`` and ``pareto.least_peak``: the families decoder's
    32-layer LP in 1.9 s from the first solve's basis against 3.4 s from scratch, the same
    optimum). Problems ``scipy.optimize.milp`` solves ignore it."""
    options = dict(options or {})
    unknown = set(options) - {"time_limit", "node_limit", "mip_rel_gap", "presolve", "disp"}
    if unknown:
        raise ValueError(f"options ({sorted(unknown)}) are not HiGHS options the planner "
                         "sets: use time_limit, node_limit, mip_rel_gap, presolve or disp.")
    c = np.asarray(c, dtype=float)
    n, m = len(c), sum(con.A.shape[0] for con in constraints)
    wide = n > IPM_MAX_COLUMNS_PER_ROW * m
    ipm = m >= IPM_MIN_ROWS and not wide
    no_presolve = wide and n >= NO_PRESOLVE_MIN_COLUMNS
    if not ipm and not no_presolve:
        return _scipy(c, integrality, bounds, constraints, options)
    model = _Model(c, integrality, bounds, constraints)
    presolve = options.get("presolve", True) and not no_presolve
    if not ipm:
        return model.run(options, ipm=False, presolve=presolve)
    return _simplex_first(model, options, presolve=presolve, start=start)


def _simplex_first(model: _Model, options: dict, *, presolve: bool, start=None) -> Result:
    """``model`` solved as the module's docstring says: the LP by the dual simplex within
    ``SIMPLEX_ITERATIONS_PER_ROW`` iterations per row; then, unless that optimum is integral
    (or the LP infeasible), the interior-point path."""
    import time
    t0 = time.perf_counter()
    lp = model.run(options, ipm=False, presolve=presolve, relax=True,
                   iteration_limit=int(SIMPLEX_ITERATIONS_PER_ROW * model.num_rows),
                   start=start, parallel=SOLVER_THREADS > 1 and not _SHARED.get())
    if lp.status == OPTIMAL:
        if not model.mip:
            return lp
        found = integral_solution(lp.x, lp.fun, lp.basis, model.integer)
        if found is not None:
            return found
    if lp.status == INFEASIBLE:  # no ILP solution where the LP has none
        return lp
    return model.run(_time_left(options, t0), ipm=True, presolve=presolve)


def integral_solution(x: np.ndarray, fun: float, basis, integer: np.ndarray) -> Result | None:
    """An LP optimum ``x`` (objective ``fun``, its ``basis``) as the ILP's solution where its
    ``integer`` columns are integral (within ``INTEGRAL_TOLERANCE``: the LP bounds every plan),
    else None."""
    part = x[integer]
    if not np.all(np.abs(part - np.round(part)) <= INTEGRAL_TOLERANCE):
        return None
    return Result(x=x, fun=fun, status=OPTIMAL, mip_gap=0.0, mip_node_count=0, basis=basis)


def _time_left(options: dict, t0: float) -> dict:
    """``options`` with ``time_limit`` less the seconds spent since ``t0``."""
    import time
    if "time_limit" not in options:
        return options
    spent = time.perf_counter() - t0
    return dict(options, time_limit=max(float(options["time_limit"]) - spent, 0.0))


def _scipy(c, integrality, bounds, constraints, options) -> Result:
    """``scipy.optimize.milp`` (HiGHS with its defaults), its result as a ``Result``."""
    from scipy.optimize import Bounds
    from scipy.optimize import milp as scipy_milp
    res = scipy_milp(c, integrality=integrality,
                     bounds=bounds if hasattr(bounds, "lb") else Bounds(*bounds),
                     constraints=constraints, options=options)
    return Result(x=res.x, fun=None if res.x is None else float(res.fun), status=res.status,
                  mip_gap=getattr(res, "mip_gap", None),
                  mip_node_count=getattr(res, "mip_node_count", None))


def csr_rows(constraint):
    """A ``LinearConstraint``'s rows as (CSR matrix, lower bounds, upper bounds), the bounds
    broadcast to one per row."""
    import scipy.sparse as sp
    A = sp.csr_array(constraint.A)
    n = A.shape[0]
    return (A, np.broadcast_to(np.asarray(constraint.lb, dtype=float), n),
            np.broadcast_to(np.asarray(constraint.ub, dtype=float), n))


class _Model:
    """A problem in ``milp``'s arguments as a ``highspy.HighsLp``, built once and solved one or
    more ways (``run``)."""

    def __init__(self, c, integrality, bounds, constraints):
        import highspy
        import scipy.sparse as sp

        n = len(c)
        lower, upper = (bounds.lb, bounds.ub) if hasattr(bounds, "lb") else bounds
        blocks, row_lower, row_upper = [], [], []
        for con in constraints:
            A, lb, ub = csr_rows(con)
            blocks.append(A)
            row_lower.append(lb)
            row_upper.append(ub)
        A = (sp.vstack(blocks, format="csr") if blocks else sp.csr_array((0, n)))
        self.integer = np.asarray(integrality if integrality is not None else np.zeros(n)) > 0
        self.mip = bool(self.integer.any())
        self.num_rows = A.shape[0]
        inf = highspy.kHighsInf

        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = n, A.shape[0]
        lp.col_cost_ = c
        lp.col_lower_ = np.clip(np.broadcast_to(np.asarray(lower, dtype=float), n), -inf, inf)
        lp.col_upper_ = np.clip(np.broadcast_to(np.asarray(upper, dtype=float), n), -inf, inf)
        lp.row_lower_ = np.clip(np.concatenate(row_lower) if blocks else np.zeros(0), -inf, inf)
        lp.row_upper_ = np.clip(np.concatenate(row_upper) if blocks else np.zeros(0), -inf, inf)
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.start_ = A.indptr.astype(np.int32)
        lp.a_matrix_.index_ = A.indices.astype(np.int32)
        lp.a_matrix_.value_ = A.data.astype(float)
        self.lp = lp

    def run(self, options: dict, *, ipm: bool, presolve: bool, relax: bool = False,
            iteration_limit: int | None = None, start=None, parallel: bool = False) -> Result:
        """Solve with HiGHS: by the interior-point method (``ipm``: the LP, or the ILP's root
        LP) or the dual simplex, with or without ``presolve``; ``relax``: the LP relaxation
        (its optimum's basis comes back, ``Result.basis``), from the basis ``start`` where
        HiGHS takes it; ``iteration_limit``: simplex iterations (a stop is ``STOPPED``);
        ``parallel``: the LP relaxation by ``PARALLEL_SIMPLEX``."""
        import highspy
        mip = self.mip and not relax
        self.lp.integrality_ = ([highspy.HighsVarType.kInteger if i else
                                 highspy.HighsVarType.kContinuous for i in self.integer]
                                if mip else [])
        h = _new_highs()
        h.setOptionValue("output_flag", bool(options.get("disp", False)))
        if "time_limit" in options:
            h.setOptionValue("time_limit", float(options["time_limit"]))
        if "node_limit" in options:
            h.setOptionValue("mip_max_nodes", int(options["node_limit"]))
        if "mip_rel_gap" in options:
            h.setOptionValue("mip_rel_gap", float(options["mip_rel_gap"]))
        if not presolve:
            h.setOptionValue("presolve", "off")
        if ipm:
            h.setOptionValue("mip_lp_solver" if mip else "solver", "ipm")
        if iteration_limit is not None:
            h.setOptionValue("simplex_iteration_limit", int(iteration_limit))
        if parallel and relax and not ipm:
            h.setOptionValue("simplex_strategy", PARALLEL_SIMPLEX)
        h.passModel(self.lp)
        if start is not None and not mip and not ipm:
            h.setBasis(start)   # one HiGHS rejects (other rows) leaves the solve cold
        h.run()
        info = h.getInfo()
        has_x = info.primal_solution_status == 2  # kSolutionStatusFeasible
        x = np.asarray(h.getSolution().col_value, dtype=float) if has_x else None
        status = _status(h.getModelStatus())
        basis = h.getBasis() if relax and not ipm and status == OPTIMAL else None
        return Result(x=x, fun=float(info.objective_function_value) if has_x else None,
                      status=status, mip_gap=float(info.mip_gap) if mip else None,
                      mip_node_count=int(info.mip_node_count) if mip else None,
                      basis=basis if basis is not None and basis.valid else None)


def concurrently(calls: Sequence[Callable[[], object]], solvers: int | None = None) -> list:
    """The results of ``calls`` (functions of no argument whose time is mostly HiGHS's), in
    their order, run up to ``SOLVER_THREADS`` at once, each in a copy of the caller's context
    (``cost.device_speed`` is a context variable); the first exception is raised.
    ``solvers``: how many of them run HiGHS (default all); where more than one does, their
    solves share the cores (serial simplex, ``PARALLEL_SIMPLEX``)."""
    if len(calls) <= 1 or SOLVER_THREADS <= 1:
        return [call() for call in calls]
    from concurrent.futures import ThreadPoolExecutor
    contexts = [contextvars.copy_context() for _ in calls]
    if (len(calls) if solvers is None else solvers) > 1:
        for ctx in contexts:
            ctx.run(_SHARED.set, True)
    with ThreadPoolExecutor(min(SOLVER_THREADS, len(calls))) as pool:
        return list(pool.map(lambda ctx, call: ctx.run(call), contexts, calls))


class _Pending:
    """A value ``once`` is computing: the threads that ask for it wait for ``done``."""

    def __init__(self):
        self.done = threading.Event()
        self.value = self.error = None


_once_lock = threading.Lock()
_MISSING = object()


def once(cache: dict, key, compute: Callable[[], object]):
    """``cache[key]``, computed by ``compute()`` where it is missing; a thread that asks for a
    key another thread is computing waits for that value (or its exception) instead of
    computing it again, so work run ``concurrently`` shares what identical calls plan. An
    exception is not kept: a later call computes again. Every reader of a key ``once``
    writes must read it through ``once`` (it holds a marker while computing)."""
    with _once_lock:
        hit = cache.get(key, _MISSING)
        if hit is _MISSING:
            mine = cache[key] = _Pending()
        elif isinstance(hit, _Pending):
            mine = None
        else:
            return hit
    if mine is None:
        hit.done.wait()
        if hit.error is not None:
            raise hit.error
        return hit.value
    try:
        value = compute()
    except BaseException as err:
        with _once_lock:
            del cache[key]
        mine.error = err
        mine.done.set()
        raise
    with _once_lock:
        cache[key] = value
    mine.value = value
    mine.done.set()
    return value


_banner_shown = False
_banner_lock = threading.Lock()


def _new_highs():
    """A ``highspy.Highs``; the first of the process is made with the C-level stdout sent to
    /dev/null (HiGHS prints its banner there once, before any option can turn it off)."""
    import sys

    import highspy
    global _banner_shown
    with _banner_lock:   # one thread redirects stdout while the others wait
        if _banner_shown:
            return highspy.Highs()
        _banner_shown = True
        sys.stdout.flush()
        saved = os.dup(1)
        try:
            with open(os.devnull, "w") as null:
                os.dup2(null.fileno(), 1)
                return highspy.Highs()
        finally:
            os.dup2(saved, 1)
            os.close(saved)


def _status(model_status) -> int:
    import highspy
    s = highspy.HighsModelStatus
    if model_status == s.kOptimal:
        return OPTIMAL
    if model_status in (s.kTimeLimit, s.kIterationLimit, s.kSolutionLimit, s.kInterrupt):
        return STOPPED
    if model_status == s.kInfeasible:
        return INFEASIBLE
    if model_status in (s.kUnbounded, s.kUnboundedOrInfeasible):
        return UNBOUNDED
    return OTHER


__all__ = ["INTEGRAL_TOLERANCE", "IPM_MAX_COLUMNS_PER_ROW", "IPM_MIN_ROWS",
           "NO_PRESOLVE_MIN_COLUMNS", "PARALLEL_SIMPLEX", "Result", "SIMPLEX_ITERATIONS_PER_ROW",
           "SOLVER_THREADS", "concurrently", "csr_rows", "integral_solution", "milp", "once"]
