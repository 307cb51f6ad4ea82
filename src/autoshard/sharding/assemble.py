"""make_plan: a solved ILP's choice as a ``ShardingPlan``.

Per leaf its spec, per collective its kind, axes, bytes and seconds (as XLA compiles it), the
values pinned where the plan needs them kept, and the objective's terms. The mesh search
(``planner.plan_auto``) calls it for the plan it keeps and for the trade-off table's plans.
"""

from __future__ import annotations

import numpy as np

from .build import COMBINED_KINDS, is_merged, merge_group, merged_latency
from .memory import peak_bytes
from .partial_sums import partial_sum_regions, reduce_scattered_regions
from .plan import Collective, LeafPlan, Objective, ShardingPlan
from .problem import Problem
from .solver import Solution
from .spec import to_partition_spec
from .strategy import itemsize

PINNED_KINDS_EXCLUDED = {"input", "output", "const", "carry_back"}
SLICE_PINNED_KINDS = {"dot_general", "conv_general_dilated"}


def make_plan(prob: Problem, sol: Solution, names: tuple[str, ...], *,
              dp_objective: float | None) -> ShardingPlan:
    g, ctx = prob.graph, prob.ctx

    made: dict = {}   # a plan's values share a few hundred specs

    def pspec(spec):
        hit = made.get(spec)
        if hit is None:
            hit = made[spec] = to_partition_spec(spec, names)
        return hit

    inputs, outputs = [], []
    for node_id in g.inputs:
        node = g.nodes[node_id]
        value = g.values[node.outputs[0]]
        spec = prob.strategies[node_id][sol.k(prob, node_id)].out_specs[0]
        note = ""
        if not any(spec) and len(prob.strategies[node_id]) == 1 and np.prod(value.shape) > 1:
            note = "no dim divides over the mesh"
        inputs.append(LeafPlan(path=node.where, shape=value.shape, dtype=str(value.dtype),
                               spec=pspec(spec), note=note))
    for node_id in g.outputs:
        node = g.nodes[node_id]
        value = g.values[node.operands[0]]
        spec = prob.strategies[node_id][sol.k(prob, node_id)].in_specs[0]
        outputs.append(LeafPlan(path=node.where, shape=value.shape, dtype=str(value.dtype),
                                spec=pspec(spec)))
    pinned, operand_specs, collectives = [], [], {}
    resharded: set = set()
    comm = reshard = compute = 0.0

    def add(kind, axes, num_bytes, cost_s, where, count, dtype):
        key = (kind, tuple(names[a] for a in axes), int(num_bytes), where, str(dtype))
        c, n = collectives.get(key, (0.0, 0.0))
        collectives[key] = (c + cost_s, n + count)

    latency_paid: set[tuple] = set()
    comm = merged_latency(prob, sol.choice)
    for node in g.nodes:
        k = sol.k(prob, node.id)
        s = prob.strategies[node.id][k]
        comm += s.comm_s * node.comm_times
        compute += s.compute_s * node.mult
        for kind, axes, num_bytes in s.collectives:
            dtype = g.values[node.outputs[0]].dtype if node.outputs else ""
            cost_s = ctx.cost.collective(kind, axes, num_bytes)
            if is_merged(prob, node.id) and kind in COMBINED_KINDS:
                # Merged by XLA: one latency per axis (per run of its merge group), charged
                # to the first reduction over it.
                group = merge_group(prob, node.id)
                cost_s -= ctx.cost.latency(tuple(a for a in axes if (a, group) in latency_paid))
                latency_paid.update((a, group) for a in axes)
            add(kind, axes, num_bytes, cost_s * node.comm_times, node.where, node.comm_times,
                dtype)
        # Every node is pinned, followers included: a value XLA may place by itself is a
        # value whose collectives the audit finds unpredicted (elementwise chains around
        # normalisations were re-placed by XLA's propagation when left free).
        if (node.kind not in PINNED_KINDS_EXCLUDED
                and node.id not in prob.free):
            for vid, spec in zip(node.outputs, s.out_specs, strict=False):
                pinned.append((g.sites[vid], pspec(spec)))
        for p, u in enumerate(node.operands):
            if u is None:
                continue
            value = g.values[u]
            src = prob.value_spec(u, sol.k(prob, value.producer))
            dst = s.in_specs[p]
            if src == dst:
                continue
            steps = ctx.cost.reshard_steps(src, dst, value.shape, itemsize(value.dtype))
            # Consumers that need one value in one layout share its resharding (XLA computes
            # it once): it is counted once.
            counted = (u, dst, node.mult) in resharded
            resharded.add((u, dst, node.mult))
            for kind, axes, num_bytes, cost_s in ([] if counted else _as_compiled(steps)):
                reshard += cost_s * node.mult
                add(kind, axes, num_bytes, cost_s * node.mult,
                    f"reshard into {node.where}", node.mult, value.dtype)
            # Pin a planned collective before its consumer. A local slice needs no pin (XLA
            # slices by itself, and every extra constraint costs compile time), except before
            # a dot or convolution: there XLA would rather gather the other operand and
            # compute replicated than slice and reduce partial sums as planned.
            if (steps or node.kind in SLICE_PINNED_KINDS) and node.kind not in (
                    PINNED_KINDS_EXCLUDED | {"carry", "xs", "ys", "cond_out"}):
                operand_specs.append((g.node_sites[node.id], p, pspec(dst)))
    objective = Objective(communication_s=comm, resharding_s=reshard, compute_s=compute,
                          _data_parallel_s=dp_objective,
                          peak_bytes_per_device=peak_bytes(prob, sol.choice),
                          solver_status=sol.status)
    colls = tuple(Collective(kind=k[0], axes=k[1], num_bytes=k[2], cost_s=v[0], where=k[3],
                             count=v[1], dtype=k[4]) for k, v in collectives.items())
    notes = list(prob.notes)
    if prob.ctx.warned:
        notes.append("no rule (replicated): " + ", ".join(sorted(prob.ctx.warned)))
    if prob.ctx.dropped_constraints:
        notes.append("sharding constraints on another mesh, left to the planner: "
                     + "; ".join(sorted(prob.ctx.dropped_constraints)))
    def choice_of(node_id):
        return sol.k(prob, node_id)

    partial_sums = partial_sum_regions(prob, choice_of, names)
    return ShardingPlan(method="ShardParallel", mesh_shape=tuple(ctx.mesh_shape),
                        axis_names=names, inputs=tuple(inputs), outputs=tuple(outputs),
                        intermediates=tuple(pinned), operand_specs=tuple(operand_specs),
                        collectives=colls, objective=objective, notes=tuple(notes),
                        partial_sums=partial_sums,
                        reduce_scattered=reduce_scattered_regions(prob, choice_of, names,
                                                                  partial_sums))


def _as_compiled(steps: list[tuple[str, int, float, float]]
                 ) -> list[tuple[str, tuple[int, ...], float, float]]:
    """Reshard steps as XLA compiles them: a chain of all-gathers is one over all their axes.

    Per axis the chain moves the same bytes as the single gather (each step receives
    ``(n-1)/n`` of its result), so the cost is their sum; the one collective's result is the
    last step's.
    """
    gathers = [st for st in steps if st[0] == "all-gather"]
    if len(gathers) < 2:
        return [(kind, (axis,), b, c) for kind, axis, b, c in steps]
    rest = [(kind, (axis,), b, c) for kind, axis, b, c in steps if kind != "all-gather"]
    axes = tuple(sorted(st[1] for st in gathers))
    return rest + [("all-gather", axes, gathers[-1][2], sum(st[3] for st in gathers))]


__all__ = ["make_plan"]
