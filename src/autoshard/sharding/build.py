"""Assembling the planning problem: strategies, ties of loops and donated state, input masks.

Inputs get masks (strategies the options forbid) instead of shorter lists, so tied variables
keep equal strategy lists. ``repeats`` adds the ties of repeated layers afterwards.
"""

from __future__ import annotations

import dataclasses

from .cost import CostModel
from .fusion import fuse_memory_bound
from .graph import Graph
from .options import AutoShardingOption
from .problem import Problem
from .rules_linalg import heaviest_flops
from .simplify import node_strategies
from .spec import replicated, to_partition_spec
from .strategy import RuleContext

LIGHT_OP_FRACTION = 0.01
"""A dot or convolution of at most this fraction of the program's largest one's FLOPs is light:
it may be recomputed on several devices (``rules_linalg._heavy_filter``)."""


def build_problem(graph: Graph, mesh_shape: tuple[int, ...], option: AutoShardingOption, *,
                  batch_invars, aliases, warned: set[str],
                  devices_per_host: int | None = None,
                  axis_names: tuple[str, ...] = (), fixed_in_specs=None,
                  alpa_costs: bool = False, batch_dims: dict | None = None,
                  scatter_gradients: bool = False) -> Problem:
    """``fixed_in_specs``: per input its only allowed spec (internal form), or None.
    ``batch_dims``: value site -> the dim holding the batch's rows (``after_grad.
    row_dims_by_site``): with ``force_batch_dim_to_mesh_dim``, that dim of every such value
    is split over the forced axis (not split where the axis has one device), as Alpa forces
    it; None: the batch inputs alone are forced.
    ``alpa_costs``: the user gave Alpa's cost parameters (``mesh_alpha`` and ``mesh_beta``):
    the reductions later work reads are priced one latency each, as Alpa's ILP does.
    ``scatter_gradients``: under a budget the user gave (not one filled in from a cluster's
    memory) and in the default that weighs memory (``pareto.expert_choice``), contractions and
    sums whose result feeds no later heavy op (a weight gradient) are offered reduce-scatters
    beside their all-reduces
    (``RuleContext.scatter_reductions``; ``_scatter_gradients_only``), as with
    ``prefer_reduce_scatter`` but without forbidding the all-reduces, so a plan under a tight
    budget can update weights on the shards their gradients are reduced into. A cluster's
    memory (80 GiB) is a limit every plan is checked against, not a target to plan towards:
    those ILPs keep their size."""
    cost = CostModel.from_option(mesh_shape, option, devices_per_host)
    light = LIGHT_OP_FRACTION * heaviest_flops(graph.nodes, graph.values)
    ctx = RuleContext(mesh_shape, cost, option, warned, keep_whole=conv_spatial_dims(graph),
                      axis_names=tuple(axis_names), light_flops=light,
                      scatter_gradients=scatter_gradients)
    prob = Problem(graph, ctx, [], list(range(len(graph.nodes))))
    for node in graph.nodes:
        prob.strategies.append(node_strategies(prob, node))
    fuse_memory_bound(prob)
    if option.prefer_reduce_scatter:
        _prefer_reduce_scatter(prob, aliases)
    elif ctx.scatter_reductions:
        _scatter_gradients_only(prob)
    _combine_tail_reductions(prob)
    if not alpa_costs:
        _combine_sibling_reductions(prob)
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
    if option.prefer_reduce_scatter:
        _hold_parameters_whole(prob, aliases, fixed_in_specs)
    _input_masks(prob, batch_invars, fixed_in_specs)
    if option.force_data_parallel and not option.prefer_reduce_scatter:
        _replicate_batch_free(prob, batch_invars)
    if batch_dims and option.force_batch_dim_to_mesh_dim is not None and not (
            option.force_data_parallel):
        _batch_dim_masks(prob, batch_dims, option.force_batch_dim_to_mesh_dim)
    return prob


def _batch_dim_masks(prob: Problem, batch_dims: dict, axis: int):
    """Every equation output whose ``batch_dims`` entry names a dim keeps the strategies
    that split that dim over mesh axis ``axis`` (none that split it, for an axis of one
    device); a node with no such strategy keeps its own."""
    g, mesh = prob.graph, prob.ctx.mesh_shape
    if axis >= len(mesh):
        return
    for node in g.nodes:
        if node.kind in ("input", "output") or not node.outputs:
            continue
        d = batch_dims.get(g.sites.get(node.outputs[0]))
        if d is None:
            continue
        specs = [s.out_specs[0] for s in prob.strategies[node.id]]
        keep = {k for k, spec in enumerate(specs) if d < len(spec) and (
            not spec[d] if mesh[axis] == 1 else axis in spec[d])}
        if keep and len(keep) < len(specs):
            prob.allowed[node.id] = prob.allowed.get(node.id, set(range(len(specs)))) & keep


COMBINED_KINDS = ("all-reduce", "reduce-scatter")
"""Collectives XLA's combiners merge when they do not depend on each other."""
LOOP_KINDS = frozenset({"carry", "carry_back", "xs", "ys", "cond_out"})
CHAIN_KINDS = LOOP_KINDS | {"dot_general", "conv_general_dilated", "gather", "scatter-add",
                            "scatter_add"}
"""Nodes that put a reduction before them on the step's dependency chain: a heavy op waits for
its operands, and a loop or branch boundary keeps the combiner from merging across it."""


def _combine_tail_reductions(prob: Problem) -> None:
    """Charge the all-reduces XLA's combiner merges into one a single latency between them.

    XLA merges all-reduces (and reduce-scatters) over the same devices that do not depend on
    each other into one collective. The reductions whose results feed no heavy op (weight
    gradients, normalisation parameter gradients, the loss: what only the update and the
    outputs read) are such a set, so they pay one latency per mesh axis between them, not one
    each: their strategies keep their bytes and drop their alpha, and the ILP pays each axis's
    alpha once when any of them reduces over it (``merged_reductions``). Without this, a plan
    of one gradient all-reduce per weight looked costlier than one that gathers activations to
    save a few small reductions, which XLA would have merged anyway.
    """
    g = prob.graph
    feeds_chain = feeds_chain_mask(g)
    feeds_body = _feeds_chain_in_body(g)
    replaced: dict[int, list] = {}  # one new list per shared list: repeated layers share it
    for node in g.nodes:
        if node.kind in LOOP_KINDS or (feeds_body if node.body >= 0 else feeds_chain)[node.id]:
            continue
        strategies = prob.strategies[node.id]
        if not any(k in COMBINED_KINDS for s in strategies for k, _, _ in s.collectives):
            continue
        prob.combined.add(node.id)
        _without_latency(prob, node.id, replaced)
    prob.keepalive.extend(replaced.values())


def _without_latency(prob: Problem, node_id: int, replaced: dict[int, list]) -> None:
    """Give the node strategies whose merged collectives carry no latency (the ILP pays it
    once per group, ``merged_reductions``); one new list per shared list (``replaced``):
    repeated layers share their strategy lists."""
    strategies = prob.strategies[node_id]
    new = replaced.get(id(strategies))
    if new is None:
        cost = prob.ctx.cost
        new = replaced[id(strategies)] = [dataclasses.replace(s, comm_s=s.comm_s - sum(
            cost.latency(axes) for k, axes, _ in s.collectives if k in COMBINED_KINDS))
            for s in strategies]
    prob.strategies[node_id] = new


def _combine_sibling_reductions(prob: Problem) -> None:
    """Charge the reductions that feed later work one latency per level between them.

    The reductions ``_combine_tail_reductions`` leaves (their results feed heavy ops: a
    normalisation's statistics, an activation's partial sums) are merged by XLA too where they
    do not depend on each other: a batch norm's mean and mean of squares, the two sums of its
    backward pass, the statistics of parallel branches. Two reductions with the same number of
    reducing nodes on the longest path before them (their level) cannot depend on each other,
    so those of one level in one loop body pay each mesh axis's latency once
    (``merged_reductions``); a level with one reduction pays what it paid before. Not with
    Alpa's cost parameters (``build_problem``'s ``alpa_costs``): those plan as Alpa's ILP
    does, which prices these reductions one latency each.
    """
    g = prob.graph
    reducing = [any(k in COMBINED_KINDS for s in prob.strategies[n.id] for k, _, _ in s.collectives)
                for n in g.nodes]
    level = [0] * len(g.nodes)
    for node in g.nodes:
        before = 0
        for u in node.operands:
            if u is None:
                continue
            p = g.values[u].producer
            before = max(before, level[p] + (1 if reducing[p] else 0))
        level[node.id] = before
    replaced: dict[int, list] = {}
    for node in g.nodes:
        if (not reducing[node.id] or node.id in prob.combined or node.kind in LOOP_KINDS
                or node.comm_mult is not None):
            continue
        prob.siblings[node.id] = level[node.id]
        _without_latency(prob, node.id, replaced)
    prob.keepalive.extend(replaced.values())


def feeds_chain_mask(g: Graph) -> list[bool]:
    """Per node: whether its result feeds a heavy op or a loop boundary (``CHAIN_KINDS``)."""
    consumers = g.consumers()
    feeds_chain = [False] * len(g.nodes)
    for node in reversed(g.nodes):
        feeds_chain[node.id] = any(g.nodes[c].kind in CHAIN_KINDS or feeds_chain[c]
                                   for c, _ in consumers[node.id] if c > node.id)
    return feeds_chain


def _feeds_chain_in_body(g: Graph) -> list[bool]:
    """Per node in a loop body: whether its result feeds a heavy op or a loop boundary in the
    same iteration of its body. The reductions that feed only the body's carries and stacked
    outputs (a weight's gradient accumulated over the iterations) are independent of each other
    within an iteration, and XLA merges them there into one per iteration (``merge_group``)."""
    consumers = g.consumers()
    feeds = [False] * len(g.nodes)
    for node in reversed(g.nodes):
        if node.body < 0:
            continue
        feeds[node.id] = any(
            g.nodes[c].kind not in ("carry_back", "ys") and (
                g.nodes[c].body != node.body or g.nodes[c].kind in CHAIN_KINDS or feeds[c])
            for c, _ in consumers[node.id] if c > node.id)
    return feeds


def merge_group(prob: Problem, node_id: int) -> tuple:
    """(loop body, times it runs per step[, level]) within which a merged reduction shares its
    latency: the step (-1, once) for the gradients after the backward pass (and those a loop
    accumulates and the micro-batch loop defers, ``Node.after_loop``), each iteration of a
    loop body for the reductions of one iteration (``_combine_tail_reductions``), and one
    level of that for the reductions later work reads (``_combine_sibling_reductions``)."""
    group = prob.graph.nodes[node_id].merge_group
    level = prob.siblings.get(node_id)
    return group if level is None else group + (level,)


def is_merged(prob: Problem, node_id: int) -> bool:
    """Whether the node's reductions share their latency with others' (``merge_group``)."""
    return node_id in prob.combined or node_id in prob.siblings


def _prefer_reduce_scatter(prob: Problem, aliases=()) -> None:
    """``prefer_reduce_scatter``: a contraction whose result feeds no heavy op (a weight
    gradient, read by the update only) is reduce-scattered, its all-reduce priced as
    forbidden; one that feeds later heavy ops (an activation) keeps the all-reduce beside the
    reduce-scatter and the cost decides (Alpa's plans all-reduce activations: one collective
    instead of two).

    Where the parameters are held whole (``holds_parameters_whole``: ZeRO-2), a sum
    (``reduce_sum``) that ends the backward pass (a bias or normalisation gradient:
    ``_gradient_sums``) is reduce-scattered too where a weight gradient's reduce-scatter runs
    in the same place (``Node.merge_group``): the reduce-scatters merge into one collective
    there, and the all-gather of the updated parameter into the update's one buffer
    (``apply.gather_outputs_once``), so the pair moves the all-reduce's bytes with no
    collective more (its reduce-scatter is priced without that all-gather's latency:
    ``_forced_price``), and the parameter's optimizer state is held in shards (as Alpa
    rewrites every gradient all-reduce). Elsewhere (ZeRO-3 included, where the update of a
    sharded parameter gathers nothing), and for sums of reduced gradients (an optimizer's
    statistics), the cost decides between the all-reduce and the reduce-scatter. The lists
    keep their length, so followers' strategy indices still match.

    Without all-gathers (``allow_all_gather=False``) nothing is forced: the all-gather that
    makes an updated parameter whole again is off too, so a forced reduce-scatter forced the
    parameter to stay split and the forward pass to be planned around it (Alpa adds that
    all-gather after its ILP, outside the option). Since sums over two axes are offered
    reduce-scatters, that made test_moe_layer_2d_reduce_scatter's plan on (2, 2) move
    1,540,992 B per device instead of 500,736."""
    g = prob.graph
    feeds_chain = feeds_chain_mask(g)
    cost = prob.ctx.cost
    if not cost.allow_all_gather:
        return  # the cost decides everywhere
    forbidden = cost.forbidden_s
    replaced: dict[int, list] = {}

    def scattered_in_specs(node):
        return {s.in_specs for s in prob.strategies[node.id]
                if any(k == "reduce-scatter" for k, _, _ in s.collectives)}

    def forbid_all_reduce(node, scattered, credit: bool = False):
        strategies = prob.strategies[node.id]
        new = replaced.get(id(strategies))
        if new is None:
            new = replaced[id(strategies)] = [_forced_price(s, scattered, forbidden, cost, credit)
                                              for s in strategies]
        prob.strategies[node.id] = new

    groups = set()
    for node in g.nodes:
        scattered = scattered_in_specs(node)
        if feeds_chain[node.id] or not scattered or node.kind == "reduce_sum":
            continue
        forbid_all_reduce(node, scattered)
        groups.add(node.merge_group)
    if not holds_parameters_whole(prob.ctx.option):
        prob.keepalive.extend(replaced.values())
        return
    for node_id in _gradient_sums(g, feeds_chain, aliases):
        node = g.nodes[node_id]
        scattered = scattered_in_specs(node)
        if scattered and node.merge_group in groups:
            forbid_all_reduce(node, scattered, credit=True)
    prob.keepalive.extend(replaced.values())


def _scatter_gradients_only(prob: Problem) -> None:
    """Under a user's budget (without ``prefer_reduce_scatter``): the reduce-scatters of
    reductions whose result feeds a later heavy op (an activation's partial sums) are not
    allowed (``Problem.allowed``: their columns are fixed at 0); those of the reductions the
    update alone reads (weight gradients) stay beside their all-reduces. An activation
    reduce-scattered over the model axis and all-gathered before the next product (Megatron's
    sequence parallelism) costs about the time of its all-reduce but moves 1.5x its bytes (2x
    on XLA:CPU, where the reduce-scatter is an all-reduce): the families ViT's budget plan
    (4x2) took it for every block's projections and sent 1.166x the expert's bytes, 0.957x
    without it. Every such strategy has its all-reduce beside it (same operands), so nothing
    becomes infeasible. Priced as forbidden instead, their columns stayed in the LP with costs
    13 orders of magnitude above the rest: a pipeline task's budgeted ILP (test_stage_weights)
    took 52 s of branch and bound where it took 4 s before the reduce-scatters were offered."""
    g = prob.graph
    feeds_chain = feeds_chain_mask(g)
    for node in g.nodes:
        strategies = prob.strategies[node.id]
        if not feeds_chain[node.id]:
            continue
        scattered = {k for k, s in enumerate(strategies)
                     if any(kind == "reduce-scatter" for kind, _, _ in s.collectives)}
        if scattered:
            keep = set(range(len(strategies))) - scattered
            prob.allowed[node.id] = prob.allowed.get(node.id, set(range(len(strategies)))) & keep


def _forced_price(s, scattered, forbidden: float, cost: CostModel, credit: bool):
    """``s`` priced for ``_prefer_reduce_scatter``: an all-reduce it offers a reduce-scatter
    for is forbidden; with ``credit``, a reduce-scatter is priced without the latency of the
    all-gather after the update (the update's one buffer carries it, ``apply.
    gather_outputs_once``), so the pair costs what the merged all-reduce costs."""
    kinds = [k for k, _, _ in s.collectives]
    if s.in_specs in scattered and "all-reduce" in kinds:
        return dataclasses.replace(s, comm_s=s.comm_s + forbidden)
    if credit and "reduce-scatter" in kinds:
        return dataclasses.replace(s, comm_s=s.comm_s - sum(
            cost.latency(axes) for k, axes, _ in s.collectives if k == "reduce-scatter"))
    return s


def holds_parameters_whole(option: AutoShardingOption) -> bool:
    """Whether ``prefer_reduce_scatter`` holds the parameters whole between steps (ZeRO-2,
    ``_hold_parameters_whole``): not under ZeRO-3 (``allow_replicated_parameters=False``),
    without all-gathers (no gather after the update either) or with a memory budget (ZeRO-3's
    layout may be what fits it)."""
    return (option.prefer_reduce_scatter and option.allow_replicated_parameters
            and option.allow_all_gather and option.memory_budget_per_device is None)


def _hold_parameters_whole(prob: Problem, aliases, fixed_in_specs) -> None:
    """``prefer_reduce_scatter`` without ZeRO-3 (``allow_replicated_parameters``): the
    parameters (state the step updates and its forward and backward passes read) are held
    between steps as their readers read them, so a reduce-scattered gradient's update ends in
    an all-gather of the new parameter (ZeRO-2, as in Alpa), never in a parameter held in
    shards and gathered before the forward pass (ZeRO-3's layout).

    The two move the same bytes, and holding an input in shards is what the planner prefers
    among equally fast plans (``simplify._compute_strategies``), so without this the plan
    held some parameters in shards: one all-gather each before the forward pass, where the
    update's all-gathers are one (``apply.gather_outputs_once``). The edges out of these
    inputs, and out of the light ops computed from them alone (a bias reshaped to broadcast,
    a transposed tied embedding), allow no resharding but slices (``ilp._Edges.held``); a
    whole parameter is always there to slice. Not with a memory budget (ZeRO-3's layout may
    be what fits it), without all-gathers (``allow_all_gather=False``: ZeRO-2's gather after
    the update is off too), or for inputs whose layout is given (``fixed_in_specs``)."""
    if not holds_parameters_whole(prob.ctx.option):
        return
    g = prob.graph
    feeds_chain = feeds_chain_mask(g)
    held = prob.held_whole
    for i, _ in aliases:
        node_id = g.inputs[i]
        if feeds_chain[node_id] and (fixed_in_specs is None or fixed_in_specs[i] is None):
            held.add(node_id)
    for node in g.nodes:  # node ids are in program order
        if node.kind in CHAIN_KINDS or node.kind in ("input", "output") or node.id in prob.free:
            continue
        producers = {g.values[u].producer for u in node.operands if u is not None}
        if producers & held and producers <= held | prob.free:
            held.add(node.id)


def _gradient_sums(g: Graph, feeds_chain: list[bool], aliases) -> list[int]:
    """The ``reduce_sum`` nodes that end the backward pass: they feed no heavy op, their
    results reach the updated state (an output ``aliases`` pairs with an input; not the loss,
    which a sum over the vocabulary feeds), and they read values computed from the forward and
    backward passes only (``dy`` of a bias, ``dy * x_hat`` of a normalisation's scale), not
    from a reduction after them (a weight gradient: the sum of its squares is an optimizer's
    statistic, not a gradient)."""
    updates = [False] * len(g.nodes)  # reaches an updated state output
    for o in {o for _, o in aliases}:
        updates[g.outputs[o]] = True
    consumers = g.consumers()
    for node in reversed(g.nodes):
        updates[node.id] = updates[node.id] or any(updates[c] for c, _ in consumers[node.id]
                                                   if c > node.id)
    after = [False] * len(g.nodes)  # computed from a gradient or the optimizer's state
    found = []
    for node in g.nodes:
        if feeds_chain[node.id] or node.kind == "output":
            continue
        if node.kind == "input":  # read by the update only: optimizer state
            after[node.id] = True
            continue
        reads = any(after[g.values[u].producer] for u in node.operands if u is not None)
        if node.kind == "reduce_sum" and not reads and updates[node.id]:
            found.append(node.id)
        after[node.id] = reads or node.kind == "reduce_sum" or node.kind in CHAIN_KINDS
    return found


def merged_reductions(prob: Problem) -> dict[tuple, list[tuple[int, list[int]]]]:
    """(mesh axis, ``merge_group``) -> (ILP variable, its strategies that reduce over the
    axis) of the merged reductions (``Problem.combined``): the axis's latency is paid once per
    run of the group if any is chosen (``merged_alpha``)."""
    members: dict[tuple, list[tuple[int, list[int]]]] = {}
    seen = set()
    axes_of = {}   # strategy list (shared by repeated nodes) -> axis -> its reducing strategies
    for node_id in sorted(prob.combined | set(prob.siblings)):
        r = prob.var(node_id)
        group = merge_group(prob, node_id)
        if (r, group) in seen:
            continue
        seen.add((r, group))
        strategies = prob.strategies[node_id]
        by_axis = axes_of.get(id(strategies))
        if by_axis is None:
            by_axis = axes_of[id(strategies)] = {
                a: ks for a in prob.ctx.cost.live_axes()
                if (ks := [k for k, s in enumerate(strategies)
                           if any(kind in COMBINED_KINDS and a in axes
                                  for kind, axes, _ in s.collectives)])}
        for a, ks in by_axis.items():
            members.setdefault((a,) + group, []).append((r, ks))
    return members


def merged_alpha(prob: Problem, key: tuple) -> float:
    """Seconds a ``merged_reductions`` key costs when used: its axis's alpha per run."""
    a, times = key[0], key[2]
    return prob.ctx.cost.alpha[a] * times


def merged_latency(prob: Problem, choice: dict[int, int]) -> float:
    """The latency the merged reductions of a plan pay: each axis's alpha once per group run,
    if used."""
    return sum(merged_alpha(prob, key) for key, members in merged_reductions(prob).items()
               if any(choice[r] in ks for r, ks in members))


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
                      keep_whole=prob.ctx.keep_whole, light_flops=prob.ctx.light_flops)
    dp = Problem(prob.graph, ctx, prob.strategies, list(prob.parent), free=prob.free,
                 no_reshard=True, combined=prob.combined, siblings=prob.siblings)
    _input_masks(dp, batch_invars)
    return dp


def _replicate_batch_free(prob: Problem, batch_invars) -> None:
    """Pure data parallel: a value computed from no batch input (a parameter broadcast for a
    bias add, a weight cast) stays replicated. A free slice would otherwise let a plan keep
    such a value split over a non-batch dim where only elementwise work reads it, which a
    pipeline's forward task did with a broadcast bias it hands to its backward: the backward
    then gathered it every micro-batch. Nodes with no replicated strategy keep theirs."""
    g = prob.graph
    from_batch = [False] * len(g.nodes)
    for i, node_id in enumerate(g.inputs):
        from_batch[node_id] = bool(batch_invars[i])
    producer = {v: node.id for node in g.nodes for v in node.outputs}
    for node in g.nodes:
        if node.kind in ("input", "output"):
            continue
        from_batch[node.id] = any(from_batch[producer[v]] for v in node.operands
                                  if v in producer)
        if from_batch[node.id]:
            continue
        strategies = prob.strategies[node.id]
        whole = {k for k, s in enumerate(strategies)
                 if not any(axes for spec in s.out_specs for axes in spec)}
        allowed = prob.allowed.get(node.id, set(range(len(strategies)))) & whole
        if allowed:
            prob.allowed[node.id] = allowed


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
                if a < len(ctx.mesh_shape) and ctx.mesh_shape[a] == 1:
                    # An axis of one device: the batch dim is split over no other axis (in
                    # Alpa, the batch dim follows that axis: it is not split).
                    keep = {k for k, s in enumerate(specs) if not s[0]}
                else:
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
