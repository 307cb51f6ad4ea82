"""ZeRO-2 under pure data parallel: the update of a solved data-parallel plan, resharded.

``force_data_parallel`` with ``prefer_reduce_scatter`` (Alpa's ZeRO-2 option) keeps the
forward and backward of the data-parallel plan and frees only the update, so the gradients
can be reduce-scattered into sharded optimizer state. The planner calls ``zero_update`` on
each mesh's problem after ``build.build_problem``; it solves the data-parallel ILP first,
so it sits above both ``build`` and ``solver``.
"""

from __future__ import annotations

from .build import CHAIN_KINDS, LOOP_KINDS, feeds_chain_mask
from .problem import Problem
from .solver import build_and_solve


def zero_update(prob: Problem) -> None:
    """ZeRO-2 under pure data parallel (``force_data_parallel`` with ``prefer_reduce_scatter``).

    As Alpa does after its ILP, the step runs data parallel and only the update changes: the
    gradients are reduce-scattered, the optimizer state is held and updated in shards (one dim
    split over every mesh axis) and the new parameters are all-gathered. Here the data-parallel
    plan is solved first (resharding forbidden), then the nodes that feed the forward and
    backward passes (``build.feeds_chain_mask``: activations, parameters, loop boundaries)
    keep their data-parallel strategy, heavy ops outside it (weight gradients) keep their
    operands' specs and may change only where the reduction lands, and the rest (the update,
    the optimizer state) is free, with the all-gather the cost model allows under this
    option. Without the first solve, allowing the parameters' all-gather let the plan gather
    activations as well (the tokens of an MoE dispatch), which is not data parallel.
    """
    g, option = prob.graph, prob.ctx.option
    dp = Problem(g, prob.ctx, prob.strategies, prob.parent, free=prob.free, no_reshard=True,
                 allowed=prob.allowed, combined=prob.combined,
                 siblings=prob.siblings)
    sol = None
    for no_reshard in (True, False):
        dp.no_reshard = no_reshard
        try:
            sol = build_and_solve(dp, time_limit_s=option.solver_time_limit_s,
                                  memory_budget=None, node_limit=option.solver_node_limit)
            break
        except (ValueError, RuntimeError):
            continue
    if sol is None:
        prob.notes.append("prefer_reduce_scatter: no data-parallel plan to start ZeRO-2 from; "
                          "the update is planned with the rest")
        return
    feeds_chain = feeds_chain_mask(g)
    live = prob.ctx.cost.live_axes()
    fixed = reduce_scattered = 0
    for node in g.nodes:
        if node.id in prob.free or node.kind == "output":
            continue
        strategies, k = prob.strategies[node.id], sol.k(prob, node.id)
        if feeds_chain[node.id] or node.kind in LOOP_KINDS:
            prob.allowed[node.id] = {k}
            fixed += 1
        elif node.kind == "input":
            specs = [s.out_specs[0] for s in strategies]
            prob.allowed[node.id] = {k} | {j for j, spec in enumerate(specs)
                                           if zero_layout(spec, live)}
        elif node.kind in CHAIN_KINDS:
            ins = strategies[k].in_specs
            prob.allowed[node.id] = {j for j, s in enumerate(strategies) if s.in_specs == ins}
            reduce_scattered += len(prob.allowed[node.id]) > 1
    prob.notes.append(f"prefer_reduce_scatter under force_data_parallel: {fixed} nodes keep "
                      f"their data-parallel strategy; {reduce_scattered} weight-gradient ops may "
                      "reduce-scatter into the sharded update")


def zero_layout(spec, live: tuple[int, ...]) -> bool:
    """Whether ``spec`` splits one dim over every live mesh axis and nothing else (ZeRO's
    layout of an optimizer state under pure data parallel)."""
    split = [axes for axes in spec if axes]
    return len(split) == 1 and tuple(split[0]) == tuple(live)


__all__ = ["zero_layout", "zero_update"]
