"""The planner's second pass: trade a little estimated time for much less memory.

The first ILP minimises estimated step time. That estimate is not finer than some percent
(alpha-beta constants, per-axis resharding terms), and plans whose times differ by a few
percent can differ a lot in memory: a GPT's model split over the 2-way axis of a 2x4 mesh
instead of the 4-way one saves a few percent of collective bytes and holds twice the
parameters and optimizer state per device. So the chosen mesh's ILP is solved a second time
with the objective ``time / T + live / P``: ``T`` and ``P`` are the first plan's estimated
time and peak bytes per device, ``live`` the bytes live at the first plan's peak point (one
linear row of the memory model), so a fraction of memory saved there counts as much as the
same fraction of time. The second plan replaces the first when its peak (over every point) is
at least ``MIN_SAVING`` smaller and its time, priced exactly, is within
``AutoShardingOption.memory_tradeoff`` of ``T``. One more solve of the same ILP, with the
same deterministic limits. ``memory_tradeoff=0`` skips it (Alpa's behaviour: the fastest plan
whatever its memory). When it runs, the plan returned carries the other plans it saw in
``Solution.info["found"]`` (the fastest, a second plan not taken): ``pareto`` shows them in
``explain()``'s trade-off table.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from .ilp import Ilp, evaluate
from .memory import live_bytes, memory_rows
from .pareto import GAP
from .solver import Solution

MIN_SAVING = 0.01
"""The second plan replaces the first only when its peak is at least this fraction smaller."""
SCALE = 1e3
"""The second objective is a sum of fractions near 2; HiGHS wants it away from its tolerances."""


def least_memory(ilp: Ilp, first: Solution, tradeoff: float) -> Solution:
    """A plan of much less peak memory whose time is within ``tradeoff`` of ``first``'s."""
    from .highs import milp
    prob = ilp.prob
    if tradeoff <= 0 or not first.choice or first.objective_s <= 0:
        return first
    fastest = dataclasses.replace(first, info=dict(first.info, found=(first,)))
    t0 = time.perf_counter()
    # Compared as the ILP's rows see a plan (values and buffers of one choice each): the
    # resharded copies come with the time the objective already prices.
    live = live_bytes(prob, first.choice, copies=False)
    first_peak = float(live.max()) if len(live) else 0.0
    if first_peak <= 0:
        return fastest
    at_peak = memory_rows(prob, ilp.col0, ilp.K, ilp.total,
                          points=[int(np.argmax(live))]).toarray()[0]
    c = (ilp.c / first.objective_s + at_peak / first_peak) * SCALE
    # A plan within GAP of the weighted optimum is as good a candidate (the trade-off
    # allows percents): the proof of the last fraction of a percent is what made this solve
    # slow on ILPs with per-axis resharding classes (minutes against 1 s for the first).
    # Without presolve, as ``pareto.least_peak``: the relaxation of this ILP is integral on
    # the models measured, and HiGHS's presolve of it took a third of the solve (the families
    # decoder at 16 layers: 3.3 -> 2.3 s).
    options = dict(ilp.options, mip_rel_gap=max(GAP, ilp.options.get("mip_rel_gap", 0.0)),
                   presolve=False)
    res = milp(c, integrality=ilp.integrality, bounds=ilp.bounds,
               constraints=ilp.constraints, options=options, start=ilp.lp_basis)
    if res.x is None:
        return fastest
    choice = {r: int(np.argmax(res.x[ilp.col0[r]:ilp.col0[r] + ilp.K[r]])) for r in ilp.roots}
    peak = int(live_bytes(prob, choice, copies=False).max())
    if ilp.memory_budget is not None and live_bytes(prob, choice).max() > ilp.memory_budget:
        # Its rows are the ILP's sampled ones, without the rows the budget's rounds added
        # and without the resharded copies: a plan over the budget is no plan.
        return fastest
    objective = evaluate(prob, choice, ilp.edges)
    if (peak > first_peak * (1 - MIN_SAVING)
            or objective > (1 + tradeoff) * first.objective_s * (1 + 1e-9)):
        second = Solution(choice, first.status, objective, 0.0, num_ilp_vars=first.num_ilp_vars)
        return dataclasses.replace(first, info=dict(first.info, found=(first, second)))
    info = dict(first.info, found=(first,), least_memory=(
        f"peak {int(first_peak):,} -> {peak:,} B per device for "
        f"{objective / first.objective_s - 1:+.1%} estimated time "
        f"(memory_tradeoff {tradeoff:g})"))
    return Solution(choice, first.status, objective,
                    first.solve_s + time.perf_counter() - t0, num_ilp_vars=first.num_ilp_vars,
                    info=info)


__all__ = ["least_memory"]
