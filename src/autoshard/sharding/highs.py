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
method took 52-91 s.

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
    import highspy
    import scipy.sparse as sp

    options = dict(options or {})
    unknown = set(options) - {"time_limit", "node_limit", "mip_rel_gap", "presolve", "disp"}
    if unknown:
        raise ValueError(f"options ({sorted(unknown)}) are not HiGHS options the planner "
                         "sets: use time_limit, node_limit, mip_rel_gap, presolve or disp.")
    c = np.asarray(c, dtype=float)
    n = len(c)
    lower, upper = (bounds.lb, bounds.ub) if hasattr(bounds, "lb") else bounds
    blocks, row_lower, row_upper = [], [], []
    for con in constraints:
        A = sp.csr_array(con.A)
        blocks.append(A)
        row_lower.append(np.broadcast_to(np.asarray(con.lb, dtype=float), A.shape[0]))
        row_upper.append(np.broadcast_to(np.asarray(con.ub, dtype=float), A.shape[0]))
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
    if not options.get("presolve", True):
        h.setOptionValue("presolve", "off")
    if IPM_MIN_ROWS <= lp.num_row_ and n <= IPM_MAX_COLUMNS_PER_ROW * lp.num_row_:
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


__all__ = ["IPM_MAX_COLUMNS_PER_ROW", "IPM_MIN_ROWS", "Result", "milp"]
