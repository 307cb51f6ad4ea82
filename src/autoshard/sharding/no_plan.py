"""Why no plan fits the memory: the planner's errors and their advice (more devices, a
pipeline, more micro-batches, remat), from a lower bound of the inputs' bytes per device and
the smallest estimate found."""

from __future__ import annotations

import math

import numpy as np

from . import solver
from .graph import Graph
from .memory import peak_bytes
from .solver import build_and_solve
from .spec import candidate_specs, shards
from .strategy import itemsize


def state_bytes_lower_bound(graph: Graph, mesh_shape: tuple[int, ...]) -> int:
    """Bytes per device the inputs need at least on ``mesh_shape`` (each split its finest)."""
    total = 0
    for node_id in graph.inputs:
        value = graph.values[graph.nodes[node_id].outputs[0]]
        finest = max(shards(s, mesh_shape) for s in candidate_specs(tuple(value.shape),
                                                                  tuple(mesh_shape)))
        total += itemsize(value.dtype) * math.prod(value.shape) // finest
    return total


def state_too_large(pruned, budget, graph) -> ValueError:
    smallest = min((state_bytes_lower_bound(graph, shape), shape) for shape in pruned)
    return ValueError(
        f"No plan fits memory_budget_per_device ({budget:,} B): the smallest estimate found is "
        f"{smallest[0]:,} B per device (mesh {smallest[1]}, a lower bound: the inputs alone, "
        f"each split its finest). The largest arrays: {largest_inputs(graph)}. "
        + what_would_fit(graph, smallest[1], smallest[0], budget, state=smallest[0]))


def what_would_fit(graph: Graph, mesh_shape, smallest: int, budget: int, *,
                    state: int | None = None) -> str:
    """Which of more devices, a pipeline, more micro-batches or remat would fit ``budget``,
    from the inputs' lower bound (``state``, computed when not given) on the mesh of the
    ``smallest`` estimate found."""
    n = math.prod(mesh_shape)
    if state is None:
        state = state_bytes_lower_bound(graph, tuple(mesh_shape))
    if state > budget:  # the state alone does not fit: only more devices hold it
        devices = math.ceil(n * state / budget)
        stages = math.ceil(state / budget)
        return (f"The inputs (parameters, optimizer state, batch) alone need {state:,} B per "
                f"device on these {n} devices: use about {devices} devices or more, or a "
                f"pipeline of at least {stages} stages (PipeshardParallel: each stage holds "
                "only its layers' state); more micro-batches or remat do not shrink the state.")
    return (f"The inputs fit ({state:,} B per device at best) but the values computed from "
            f"them do not ({smallest:,} B in all): more micro-batches (num_micro_batches) "
            "shrink the activations of a step, remat recomputes them in the backward pass "
            "(jax.checkpoint, or ManualLayerOption(remat_layer=True) in a pipeline), and more "
            "devices or a pipeline split them further.")


def largest_inputs(graph: Graph) -> str:
    inputs = sorted(((itemsize(graph.values[graph.nodes[n].outputs[0]].dtype) * int(np.prod(
        graph.values[graph.nodes[n].outputs[0]].shape)), graph.nodes[n].where)
        for n in graph.inputs), reverse=True)[:3]
    return ", ".join(f"{where} ({size:,} B)" for size, where in inputs)


def no_plan_error(errors, option, graph) -> Exception:
    """Why no mesh gave a plan: the budget, the smallest estimate found, the largest arrays."""
    budget = option.memory_budget_per_device
    if budget is None:
        return errors[0][1]
    smallest = None
    for prob, err in errors:  # the plan that went over, or the problem without the budget
        if isinstance(err, solver.OverBudget):
            if smallest is None or err.peak_bytes < smallest[0]:
                smallest = (err.peak_bytes, err.mesh_shape)
            continue
        try:
            sol = build_and_solve(prob, time_limit_s=option.solver_time_limit_s,
                                  memory_budget=None, node_limit=option.solver_node_limit,
                                  mip_gap=option.solver_mip_gap)
        except (ValueError, RuntimeError):
            continue
        peak = peak_bytes(prob, sol.choice)
        if smallest is None or peak < smallest[0]:
            smallest = (peak, prob.ctx.mesh_shape)
    largest = largest_inputs(graph)
    found = (f"the smallest estimate found is {smallest[0]:,} B per device (mesh {smallest[1]}: "
             f"{smallest[0] / budget:.3f}x the budget, "
             f"{smallest[0] - budget:,} B {'over' if smallest[0] > budget else 'under'})"
             if smallest
             else "no plan was found even without it")
    advice = (what_would_fit(graph, smallest[1], smallest[0], budget) if smallest else
              "Raise the budget, use more devices, or shrink the model or batch (gradient "
              "accumulation: num_micro_batches).")
    return ValueError(
        f"No plan fits memory_budget_per_device ({budget:,} B): {found}. The largest arrays: "
        f"{largest}. " + advice)
