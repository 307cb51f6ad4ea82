"""HiGHS through its own Python package (``highspy``): the sharding ILPs and their LP
relaxations, with the interior-point method where the simplex stalls.

``scipy.optimize.milp`` runs the same solver but passes only five of its options. The ILPs
with per-axis resharding terms (large move costs on a producer's split strategies, offset by
negative-cost overlap columns) are degenerate for the dual simplex HiGHS starts from: a
backward task of Table 1's 76.1B model on a (4, 16, 8) sub-mesh (22,011 columns, 15,200
rows) did not finish its root LP in 600 s, where the interior-point method solves it in 11 s
and the whole ILP in 26 s. So LPs of ``IPM_MIN_ROWS`` rows or more and at most
``IPM_MAX_COLUMNS_PER_ROW`` columns per row are solved by the interior-point method
(``solver``), and the root LP of such ILPs too (``mip_lp_solver``); the branch and bound after
the root stays HiGHS's own. The ILPs that price resharding pair by pair (a transportation
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

``milp`` takes ``scipy.optimize.milp``'s arguments and returns what the planner reads of its
result, with scipy's status codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

IPM_MIN_ROWS = 5_000
"""Rows from which an LP (and an ILP's root LP) is solved by the interior-point method..."""
IPM_MAX_COLUMNS_PER_ROW = 4
"""...where it has at most this many columns per row (per-axis terms: 1.4; pairs: 36)."""
NO_PRESOLVE_MIN_COLUMNS = 100_000
"""Columns from which an LP or ILP wider than ``IPM_MAX_COLUMNS_PER_ROW`` columns per row is
solved without HiGHS's presolve."""

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


def milp(c, *, integrality, bounds, constraints, options: dict | None = None) -> Result:
    """Minimise ``c @ x`` under ``constraints`` (``scipy.optimize.LinearConstraint``s),
    ``bounds`` (a ``Bounds`` or ``(lower, upper)``) and ``integrality`` (1: integer), with
    scipy's ``options`` (``time_limit``, ``node_limit``, ``mip_rel_gap``, ``presolve``,
    ``disp``)."""
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
    return _highspy(c, integrality, bounds, constraints, options, ipm=ipm,
                    presolve=options.get("presolve", True) and not no_presolve)


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


def _highspy(c, integrality, bounds, constraints, options, *, ipm: bool,
             presolve: bool) -> Result:
    """The problem passed to ``highspy`` with the interior-point method (``ipm``) and/or
    without presolve."""
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
    integer = np.asarray(integrality if integrality is not None else np.zeros(n)) > 0
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
    mip = bool(integer.any())
    if mip:
        lp.integrality_ = [highspy.HighsVarType.kInteger if i else
                           highspy.HighsVarType.kContinuous for i in integer]

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
    h.passModel(lp)
    h.run()
    info = h.getInfo()
    has_x = info.primal_solution_status == 2  # kSolutionStatusFeasible
    x = np.asarray(h.getSolution().col_value, dtype=float) if has_x else None
    return Result(x=x, fun=float(info.objective_function_value) if has_x else None,
                  status=_status(h.getModelStatus()),
                  mip_gap=float(info.mip_gap) if mip else None,
                  mip_node_count=int(info.mip_node_count) if mip else None)


_banner_shown = False


def _new_highs():
    """A ``highspy.Highs``; the first of the process is made with the C-level stdout sent to
    /dev/null (HiGHS prints its banner there once, before any option can turn it off)."""
    import os
    import sys

    import highspy
    global _banner_shown
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


__all__ = ["IPM_MAX_COLUMNS_PER_ROW", "IPM_MIN_ROWS", "NO_PRESOLVE_MIN_COLUMNS", "Result", "csr_rows",
           "milp"]
