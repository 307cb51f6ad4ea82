"""Assembling the planning problem: strategies, ties of loops and donated state, input masks.

Inputs get masks (strategies the options forbid) instead of shorter lists, so tied variables
keep equal strategy lists. ``repeats`` adds the ties of repeated layers afterwards.
"""

from __future__ import annotations

import dataclasses

from .cost import CostModel
from .graph import Graph
from .options import AutoShardingOption
from .problem import Problem
from .simplify import node_strategies
from .spec import replicated, to_partition_spec
from .strategy import RuleContext


def build_problem(graph: Graph, mesh_shape: tuple[int, ...], option: AutoShardingOption, *,
                  batch_invars, aliases, warned: set[str],
                  devices_per_host: int | None = None,
                  axis_names: tuple[str, ...] = (), fixed_in_specs=None) -> Problem:
    """``fixed_in_specs``: per input its only allowed spec (internal form), or None."""
    cost = CostModel.from_option(mesh_shape, option, devices_per_host)
    ctx = RuleContext(mesh_shape, cost, option, warned, keep_whole=conv_spatial_dims(graph),
                      axis_names=tuple(axis_names))
    prob = Problem(graph, ctx, [], list(range(len(graph.nodes))))
    for node in graph.nodes:
        prob.strategies.append(node_strategies(prob, node))
    for a, b in graph.ties:
        prob.union(a, b)
    for i, o in aliases:
        ni, no = graph.inputs[i], graph.outputs[o]
        vi = graph.values[graph.nodes[ni].outputs[0]]
        vo = graph.values[graph.nodes[no].operands[0]]
        if vi.shape != vo.shape:
            raise ValueError(
                f"aliases pair (input {i}, output {o}) have different shapes {vi.shape} and "
                f"{vo.shape}; a donated input can only be replaced by an output of its shape.")
        prob.union(ni, no)
    _input_masks(prob, batch_invars, fixed_in_specs)
    return prob


def conv_spatial_dims(graph: Graph) -> dict[tuple[int, ...], frozenset[int]]:
    """Shape -> spatial dims of the images (conv inputs and outputs) of that shape.

    Convolutions split batch and features only (a spatial split needs halo exchanges), so a
    spatial split of an image only ever buys a reshard back. Dropping those specs from every
    value of an image's shape removes the height/width-symmetric choices that made the ILP of
    conv nets slow to prove optimal (minutes instead of a second on a 2-D mesh).
    """
    memo = graph.memo.get("conv_spatial")
    if memo is None:
        memo = {}
        for node in graph.nodes:
            if node.kind != "conv_general_dilated":
                continue
            dn = node.params["dimension_numbers"]
            out_shape = graph.values[node.outputs[0]].shape
            for shape, spec in ((node.in_avals[0].shape, dn.lhs_spec), (out_shape, dn.out_spec)):
                shape = tuple(shape)
                memo[shape] = memo.get(shape, frozenset()) | frozenset(spec[2:])
        graph.memo["conv_spatial"] = memo
    return memo


def data_parallel_variant(prob: Problem, batch_invars) -> Problem:
    """The same problem restricted to pure data parallel (strategies and ties are reused)."""
    option = dataclasses.replace(prob.ctx.option, force_data_parallel=True,
                                 memory_budget_per_device=None)
    cost = CostModel.from_option(prob.ctx.mesh_shape, option, prob.ctx.cost.devices_per_host)
    ctx = RuleContext(prob.ctx.mesh_shape, cost, option, prob.ctx.warned,
                      axis_names=prob.ctx.axis_names,
                      keep_whole=prob.ctx.keep_whole)
    dp = Problem(prob.graph, ctx, prob.strategies, list(prob.parent), free=prob.free,
                 no_reshard=True)
    _input_masks(dp, batch_invars)
    return dp


def _input_masks(prob: Problem, batch_invars, fixed_in_specs=None):
    option, ctx, g = prob.ctx.option, prob.ctx, prob.graph
    live = tuple(a for a, n in enumerate(ctx.mesh_shape) if n > 1)
    for i, node_id in enumerate(g.inputs):
        value = g.values[g.nodes[node_id].outputs[0]]
        specs = [s.out_specs[0] for s in prob.strategies[node_id]]
        rank = len(value.shape)
        is_batch = bool(batch_invars[i]) and rank > 0
        allowed = set(range(len(specs)))
        fixed = fixed_in_specs[i] if fixed_in_specs is not None else None
        if fixed is not None:  # the layout a producer gives this input: the only choice
            if fixed not in specs:
                raise ValueError(
                    f"fixed_in_specs entry {i} ({to_partition_spec(fixed, ctx.axis_names)}) "
                    f"is not a layout of input {g.nodes[node_id].where} (shape {tuple(value.shape)}) on mesh "
                    f"{tuple(ctx.mesh_shape)}: each split dim must divide by its axes and each "
                    "axis appear once, in mesh order. Give a valid spec or None to let the "
                    "planner choose.")
            allowed = {specs.index(fixed)}
        elif option.force_data_parallel:
            want = ((live,) + ((),) * (rank - 1)) if is_batch else replicated(rank)
            if want not in specs:
                want = replicated(rank)
                prob.notes.append(f"input {g.nodes[node_id].where}: batch dim {value.shape[0]} "
                                  f"does not divide over the mesh; kept replicated")
            allowed = {specs.index(want)}
        else:
            if is_batch and option.force_batch_dim_to_mesh_dim is not None:
                a = option.force_batch_dim_to_mesh_dim
                keep = {k for k, s in enumerate(specs) if a in s[0]}
                if keep:
                    allowed &= keep
                elif a < len(ctx.mesh_shape) and ctx.mesh_shape[a] > 1:
                    prob.notes.append(f"input {g.nodes[node_id].where}: batch dim "
                                      f"{value.shape[0]} cannot be split over mesh axis {a}")
            if not is_batch and not option.allow_replicated_parameters and rank > 0:
                keep = {k for k, s in enumerate(specs) if any(s)}
                if keep:
                    allowed &= keep
        if allowed != set(range(len(specs))):
            prob.allowed[node_id] = allowed
