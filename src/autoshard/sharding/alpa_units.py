"""A plan's objective in Alpa's units, for users who give Alpa's cost parameters.

Alpa's auto-sharding reports the objective of its ILP: every collective priced with the
formulas of its ``LogicalDeviceMesh`` (``cost.alpa_collective_cost``: alpha + beta x volume x
bytes, plus a small constant per kind, all-to-all weighted ``n/2``), a penalty for each input
left replicated (``round(all_reduce_cost(1, 0) + all_reduce_cost(1, 1))``, 0.8 of it for an
input split over fewer than all axes of a 2-D mesh), and no compute term. Alpa users compare
that number with what they expect (their tests do); ``AutoShardingOption(mesh_alpha=...,
mesh_beta=...)`` makes ``Executable.auto_sharding_objective`` this number for autoshard's plan,
so a plan equal to Alpa's reports Alpa's objective.

A reduce-scatter costs the all-reduce it replaces and the all-gather of the same array after
it costs nothing: Alpa's ILP prices the all-reduce and rewrites it into the pair after solving.
A collective over several mesh axes costs the sum of its per-axis costs (as Alpa prices a
reduction over both axes of a 2-D mesh). With ``force_data_parallel`` Alpa flattens the mesh to
one axis of every device, its latency the largest and its inverse bandwidth the smallest of
the axes'; so does this.
"""

from __future__ import annotations

import math

from .cost import alpa_collective_cost
from .plan import ShardingPlan, spec_axes


def alpa_objective(plan: ShardingPlan, mesh_alpha, mesh_beta, *,
                   force_data_parallel: bool = False) -> float:
    """The objective Alpa's ILP would report for ``plan`` on the mesh with these costs."""
    sizes = plan.mesh_sizes
    names = tuple(plan.axis_names)
    if len(mesh_alpha) != len(names) or len(mesh_beta) != len(names):
        raise ValueError(
            f"mesh_alpha ({tuple(mesh_alpha)}) and mesh_beta ({tuple(mesh_beta)}) must have one "
            f"entry per mesh axis {names}.")
    alpha = dict(zip(names, mesh_alpha, strict=True))
    beta = dict(zip(names, mesh_beta, strict=True))
    if force_data_parallel:
        flat = "*".join(names)
        alpha = {flat: max(mesh_alpha)}
        beta = {flat: min(mesh_beta)}
        sizes = {flat: math.prod(sizes.values())}
        names = (flat,)

        def axes_of(axes):
            return (flat,) if axes else ()
    else:
        def axes_of(axes):
            return tuple(axes)

    total = 0.0
    scattered: dict[tuple, float] = {}  # (axes, whole bytes, dtype) -> reduce-scatters left
    for c in plan.collectives:
        axes = tuple(a for a in axes_of(c.axes) if sizes[a] > 1)
        num_bytes, kind = c.num_bytes, c.kind
        if kind == "reduce-scatter":
            # Alpa's ILP prices the all-reduce a reduce-scatter replaces (its rewrite into a
            # reduce-scatter and an all-gather runs after the ILP), on the whole array.
            num_bytes *= math.prod(sizes[a] for a in axes)
            kind = "all-reduce"
            key = (axes, num_bytes, c.dtype)
            scattered[key] = scattered.get(key, 0) + c.count
        total += c.count * sum(alpa_collective_cost(kind, sizes[a], num_bytes, alpha[a],
                                                    beta[a]) for a in axes)
    for c in plan.collectives:  # the all-gathers of that rewrite are free in Alpa's objective
        if c.kind != "all-gather":
            continue
        axes = tuple(a for a in axes_of(c.axes) if sizes[a] > 1)
        key = (axes, c.num_bytes, c.dtype)
        free = min(c.count, scattered.get(key, 0))
        if free:
            scattered[key] -= free
            total -= free * sum(alpa_collective_cost("all-gather", sizes[a], c.num_bytes,
                                                     alpha[a], beta[a]) for a in axes)
    live = [a for a in names if sizes[a] > 1]
    # Alpa's logical meshes are 2-D: (size, alpha, beta) of dims 0 and 1 (a 1-D mesh's
    # missing dim has one device).
    dims = [(sizes[a], alpha[a], beta[a]) for a in names][:2]
    dims += [(1, dims[0][1], dims[0][2])] * (2 - len(dims))
    penalty = round(sum(alpa_collective_cost("all-reduce", n, 1, a, b) for n, a, b in dims))
    for leaf in plan.inputs:
        used = {a for entry in leaf.spec for a in spec_axes(entry)}
        if force_data_parallel and used:
            used = {names[0]}
        used &= set(live)
        if not used:
            total += penalty
        elif len(live) > 1 and len(used) < len(live):
            total += 0.8 * penalty
    return total


__all__ = ["alpa_objective"]
