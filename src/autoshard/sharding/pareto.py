"""The trade-off on the chosen mesh: bytes and memory of the chosen, least-memory and
least-bytes plans found, so ``explain()`` shows what a memory budget would cost.

The planner finds several plans on the chosen mesh: the fastest (its first ILP), the one
``least_memory`` trades some time for, and here one more, a plan of much less memory
(``least_peak``: the same ILP weighing the bytes live where the fastest plan peaks 4x as much
as its time; usually one solve, a few seconds on the families benchmark). The default
chooses among the three (``expert_choice``). Each is
costed as the plan it is: collective bytes one device receives per step (``received_bytes``)
and the estimated peak bytes per device (``memory.peak_bytes``). Of the plans found, the row
of fewest bytes and the row of least memory are shown next to the chosen one
(``table_lines``): a budget between the chosen plan's memory and the least-memory one's buys
that memory at up to that plan's bytes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

TIME_WEIGHT = 0.25
"""In the least-memory ILP, a fraction of step time counts this much against the same
fraction of peak memory. Lower weights solved far slower (the families decoder at its
default size: 0.001 took 93 s and found 0.91x the chosen plan's memory, 0.3 4.5 s and 0.80x;
at its tiny size 0.01 took 13 s for 0.49x, 0.3 1.4 s for 0.65x) or found plans the copies
they reshard into (which this ILP does not see) make larger: the 16-device decoder at 0.15,
26.4 MB estimated for +72% time. 0.3 took a 9% faster plan of 1.07x the memory there (27.7
against 25.9 MB estimated; compiled 1.086x the 2-D expert's against 1.033x at 0.25)."""
ROUNDS = 2
"""Most solves of the least-memory ILP (``least_peak``); each costs about as much as the
planner's first solve (its root LP)."""
NEAR_PEAK = 0.05
"""The first solve weighs every point where the chosen plan's live bytes are within this
fraction of its peak (a plateau: a plan that lowers one point of it peaks at the next)."""
MAX_POINTS = 16
"""Most points the first solve weighs (the highest)."""
ENOUGH = 0.1
"""A solve whose plan peaks this fraction below the chosen plan ends the search: a second round
(weighing where that plan peaks) is for a first round that found no plan of less memory."""
SCALE = 1e3
"""The objective is a sum of fractions near 1; HiGHS wants it away from its tolerances."""
NODE_LIMIT = 2000
"""Branch-and-bound nodes of each least-memory solve (deterministic; the best plan found when
it stops), which runs without HiGHS's presolve (with it, the root alone took 3x the planning
time of the families benchmark's decoder)."""
GAP = 0.01
"""Relative optimality gap at which a least-memory solve stops."""
LEAST_PEAK = "least peak memory found"
"""The status of ``least_peak``'s solution."""


@dataclass(frozen=True, kw_only=True)
class TradeOffRow:
    """One plan found on the chosen mesh."""

    role: str
    """``"chosen"``, ``"least memory"`` or ``"least bytes"`` (one plan may take several roles,
    joined by ``", "``)."""
    bytes: int
    """Collective bytes one device receives per step."""
    memory: int
    """Estimated peak bytes per device."""
    time_s: float
    """Estimated step time in seconds."""


def received_bytes(collectives, mesh_sizes: dict[str, int]) -> int:
    """Bytes one device receives per step from ``collectives`` (``plan.Collective``s).

    As the audit reads a compiled program: the result of each collective, times how often it
    runs; an all-to-all is priced on its group's array, of which a device receives one shard.
    """
    total = 0.0
    for c in collectives:
        num_bytes = c.num_bytes
        if c.kind == "all-to-all":
            num_bytes /= math.prod(mesh_sizes[a] for a in c.axes)
        total += c.count * num_bytes
    return int(round(total))


def trade_off(ilp, found, make_plan) -> tuple[TradeOffRow, ...]:
    """The rows of ``explain()``'s trade-off table for the chosen mesh.

    ``ilp``: the chosen mesh's ILP (``ilp.Ilp``); ``found``: its solutions, the chosen one
    first; ``make_plan(solution)``: the ``ShardingPlan`` of a solution. The least-memory plan
    is solved here (``least_peak``) and joins ``found``: from the chosen plan, unless the
    default's search (``expert_choice``, from the fastest plan) found the chosen plan or the
    chosen plan is the fastest. (The README's MLP chose least_memory's plan; searched from it,
    the table's least-memory row holds 0.77x its memory, from the fastest 0.98x.)
    """
    chosen = found[0]
    searched = any(sol.status == LEAST_PEAK for sol in found)   # by expert_choice
    fastest = min(sol.objective_s for sol in found)
    again = (searched and chosen.status != LEAST_PEAK
             and chosen.objective_s > fastest * (1 + 1e-9))
    extra = least_peak(ilp, chosen) if not searched or again else None
    plans = [row[:3] for row in _costed(
        list(found) + ([extra] if extra is not None else []), make_plan, ilp.memory_budget)]
    fewest = min(plans, key=lambda p: (p[0], p[1], p[2]))
    smallest = min(plans, key=lambda p: (p[1], p[0], p[2]))
    roles: dict[tuple, list[str]] = {}   # one row per plan, the chosen first
    for plan, role in ((plans[0], "chosen"), (smallest, "least memory"),
                       (fewest, "least bytes")):
        roles.setdefault(plan, []).append(role)
    return tuple(TradeOffRow(role=", ".join(r), bytes=p[0], memory=p[1], time_s=p[2])
                 for p, r in roles.items())


def _costed(found, make_plan, budget) -> list[tuple]:
    """(bytes one device receives per step, estimated peak bytes per device, estimated time,
    solution) of each distinct plan in ``found`` (the first always; a later one over
    ``budget``, the budget its ILP was made under, is no plan and left out)."""
    rows, seen = [], set()
    for sol in found:
        key = tuple(sorted(sol.choice.items()))
        if key in seen:
            continue
        seen.add(key)
        plan = make_plan(sol)   # its objective's peak is memory.peak_bytes of the choice
        peak = plan.objective.peak_bytes_per_device or 0
        if rows and budget is not None and peak > budget:
            continue
        rows.append((received_bytes(plan.collectives, plan.mesh_sizes), peak,
                     sol.objective_s, sol))
    return rows


MAX_SLOWDOWN = 0.5
"""The default plan (``expert_choice``) is estimated at most this fraction slower than the
fastest plan found."""


def expert_choice(ilp, chosen, make_plan, least_peak_found: tuple | None = None):
    """The default's plan on the chosen mesh: of the plans found there (``chosen``, the others
    in its ``info["found"]`` and ``least_peak``'s), the one of least collective bytes sent per
    step plus estimated peak bytes per device, among those within ``MAX_SLOWDOWN`` of the
    fastest's estimated time. A byte of memory saved is worth a byte more sent each step: an
    expert shards parameters and optimizer state over the data axis (FSDP x TP) when that
    saves more memory than the gathers add traffic, and keeps them whole when it does not.
    ``least_peak_found``: ``(least_peak(ilp, chosen),)`` where the caller has it."""
    found = [chosen, *chosen.info.get("found", ())]
    extra = (least_peak_found[0] if least_peak_found is not None
             else least_peak(ilp, chosen))
    if extra is not None:
        found.append(extra)
    rows = _costed(found, make_plan, ilp.memory_budget)
    fastest = min(r[2] for r in rows)
    ok = [r for r in rows if r[2] <= (1 + MAX_SLOWDOWN) * fastest]
    pick = min(ok, key=lambda r: (r[0] + r[1], r[2]))
    others = tuple(r[3] for r in rows if r is not pick)
    info = dict(chosen.info, found=(pick[3], *others))   # the trade-off table's plans
    info.pop("least_memory", None)
    info["expert_choice"] = (
        f"of {len(rows)} plans found on this mesh, the least bytes sent plus peak memory "
        f"within {MAX_SLOWDOWN:.0%} of the fastest's time: {pick[0]:,} B sent, {pick[1]:,} B "
        f"per device, {pick[2] / fastest - 1:+.1%} estimated time")
    return dataclasses.replace(pick[3], solve_s=chosen.solve_s, info=info)


def plan_trade_off(plan, ilp, chosen, make_plan) -> tuple[TradeOffRow, ...]:
    """The trade-off rows of ``plan`` (made from the solution ``chosen`` of ``ilp``); the
    other plans found on its mesh are ``chosen.info["found"]`` (set by ``least_memory``)."""
    found = [chosen, *chosen.info.get("found", ())]
    # The chosen solution's plan is ``plan`` (the same collectives and peak): not made again.
    return trade_off(ilp, found, lambda sol: plan if sol is chosen else make_plan(sol))


def least_peak(ilp, first):
    """A plan of much less peak memory on ``ilp``'s mesh (a ``solver.Solution``), or None
    when the solver finds none. Not the least memory any plan has (that min-max ILP took
    7x the planning time): the least this search finds.

    One more solve of the same ILP (its constraints, the budget's rows included) with the
    objective ``live / P + TIME_WEIGHT * time / T``: ``live`` the mean bytes live at the points
    where ``first`` peaks (within ``NEAR_PEAK``; rows of the memory model), ``P`` and ``T``
    ``first``'s peak and time. Where that plan peaks at another point and is not ``ENOUGH``
    below ``first``, a second solve weighs that point too; the plan of least peak is kept.
    Weighing the whole plateau found in one solve what the peak point alone took two for (the
    suite's 2-D GPT, the families decoder at 2 and 16 layers: 1.3-2.7 CPU s each).
    """
    from . import solver
    from .highs import milp
    from .ilp import evaluate
    from .memory import live_bytes, memory_rows

    prob = ilp.prob
    if not first.choice or first.objective_s <= 0:
        return None
    live = live_bytes(prob, first.choice, copies=False)
    peak = float(live.max()) if len(live) else 0.0
    if peak <= 0:
        return None
    points, best, start = _near_peak(live), None, ilp.lp_basis
    options = dict(ilp.options, mip_rel_gap=GAP, presolve=False,
                   node_limit=min(NODE_LIMIT, ilp.options.get("node_limit", NODE_LIMIT)))
    for _ in range(ROUNDS):
        at = memory_rows(prob, ilp.col0, ilp.K, ilp.total, points=sorted(points)).sum(axis=0)
        c = (ilp.c * (TIME_WEIGHT / first.objective_s)
             + np.asarray(at).ravel() / (peak * len(points))) * SCALE
        res = milp(c, integrality=ilp.integrality, bounds=ilp.bounds,
                   constraints=ilp.constraints, options=options, start=start)
        if res.x is None:
            break
        start = res.basis if res.basis is not None else start   # the next round's objective differs by one point
        choice = {r: int(np.argmax(res.x[ilp.col0[r]:ilp.col0[r] + ilp.K[r]]))
                  for r in ilp.roots}
        live = live_bytes(prob, choice, copies=False)
        if best is None or live.max() < best[1]:
            best = (choice, float(live.max()))
        top = int(np.argmax(live))
        if top in points or live.max() <= (1 - ENOUGH) * peak:
            break
        points.append(top)
    if best is None:
        return None
    return solver.Solution(best[0], LEAST_PEAK,
                           evaluate(prob, best[0], ilp.edges), 0.0,
                           num_ilp_vars=ilp.total)


def _near_peak(live: np.ndarray) -> list[int]:
    """The points where ``live`` is within ``NEAR_PEAK`` of its maximum (at most
    ``MAX_POINTS``, the highest first): a plan that only lowers one point of a plateau peaks
    at its neighbour."""
    top = np.flatnonzero(live >= live.max() * (1 - NEAR_PEAK))
    top = top[np.argsort(-live[top], kind="stable")[:MAX_POINTS]]
    return sorted(int(p) for p in top)


def table_lines(rows: tuple[TradeOffRow, ...], mesh_shape) -> list[str]:
    """``explain()``'s trade-off table (empty without rows)."""
    if not rows:
        return []
    chosen = rows[0]
    lines = [f"  trade-off on mesh {tuple(mesh_shape)} (plans found; bytes one device "
             "receives per step, estimated peak memory per device, step time):",
             f"    {'plan':<36}{'bytes':>14}{'memory':>14}{'time':>12}   vs chosen"]
    for r in rows:
        rel = ("" if r is chosen else
               f"bytes {_ratio(r.bytes, chosen.bytes)}, memory {_ratio(r.memory, chosen.memory)}")
        lines.append(f"    {r.role:<36}{r.bytes:>14,}{r.memory:>14,}{r.time_s * 1e3:>10.4f}ms"
                     f"   {rel}")
    return lines


def _ratio(a: int, b: int) -> str:
    return f"{a / b:.2f}x" if b else ("1.00x" if a == 0 else "inf")


__all__ = ["MAX_SLOWDOWN", "TradeOffRow", "expert_choice", "least_peak", "plan_trade_off",
           "received_bytes", "table_lines", "trade_off"]
