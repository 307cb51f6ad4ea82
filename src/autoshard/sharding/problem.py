"""The planning problem on one logical mesh: strategies per node, grouped into ILP variables.

Simplifications before the ILP:

* followers: an elementwise op joins the variable of the operand it follows (its k-th strategy
  is "take the operand's k-th spec", other full-size operands are resharded to it), and so do
  transpose / reshape / squeeze with their spec mapped through the op;
* free nodes: values computed from constants only (iota, broadcast scalars, masks) keep one
  replicated strategy, which any consumer slices for free;
* ties: a loop carry and its loop-back, a donated input and the output replacing it, and (in
  ``repeats``) structurally identical nodes of repeated layers share one variable;
* caches: strategy lists are shared by nodes of equal signature, so rules run once per
  distinct node and not once per layer.

Inputs get masks (strategies the options forbid) instead of shorter lists, so tied variables
keep equal strategy lists.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from . import rules_custom, rules_linalg  # noqa: F401  (register their rules)
from .cost import CostModel, byte_cost
from .graph import Graph
from .options import AutoShardingOption
from .rules import ELEMENTWISE, map_reshape, reshape_groups
from .spec import Spec, replicated, shards
from .strategy import RuleContext, Strategy, itemsize, nbytes, strategies_for


@dataclass
class Problem:
    graph: Graph
    ctx: RuleContext
    strategies: list[list[Strategy]]
    parent: list[int]
    """Union-find over node ids; the root names the ILP variable of a node."""
    cache: dict = field(default_factory=dict)
    """Node signature -> strategy list (shared by repeated nodes)."""
    keepalive: list = field(default_factory=list)
    """Strategy lists whose ids are part of cache keys (kept alive so ids stay unique)."""
    no_reshard: bool = False
    """Forbid resharding outright (pure data parallel) instead of pricing it."""
    free: set[int] = field(default_factory=set)
    """Nodes computed from constants only (one replicated strategy, never pinned)."""
    allowed: dict[int, set[int]] = field(default_factory=dict)
    """Node id -> strategy indices it may take (absent: all)."""
    notes: list[str] = field(default_factory=list)

    def var(self, node_id: int) -> int:
        p = self.parent
        while p[node_id] != node_id:
            p[node_id] = p[p[node_id]]
            node_id = p[node_id]
        return node_id

    def free_values(self) -> _FreeValues:
        return _FreeValues(self)

    def value_spec(self, value_id: int, k: int) -> Spec:
        v = self.graph.values[value_id]
        node = self.graph.nodes[v.producer]
        return self.strategies[node.id][k].out_specs[node.outputs.index(value_id)]

    def union(self, a: int, b: int):
        ra, rb = self.var(a), self.var(b)
        if ra == rb:
            return
        assert len(self.strategies[ra]) == len(self.strategies[rb]), (ra, rb)
        lo, hi = min(ra, rb), max(ra, rb)
        self.parent[hi] = lo


class _FreeValues:
    def __init__(self, prob: Problem):
        self.prob = prob

    def __contains__(self, value_id: int) -> bool:
        return self.prob.graph.values[value_id].producer in self.prob.free


def build_problem(graph: Graph, mesh_shape: tuple[int, ...], option: AutoShardingOption, *,
                  batch_invars, aliases, warned: set[str],
                  devices_per_host: int | None = None,
                  axis_names: tuple[str, ...] = ()) -> Problem:
    cost = CostModel.from_option(mesh_shape, option, devices_per_host)
    ctx = RuleContext(mesh_shape, cost, option, warned, keep_whole=conv_spatial_dims(graph),
                      axis_names=tuple(axis_names))
    prob = Problem(graph, ctx, [], list(range(len(graph.nodes))))
    for node in graph.nodes:
        prob.strategies.append(_node_strategies(prob, node))
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
    _input_masks(prob, batch_invars)
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


def _node_strategies(prob: Problem, node) -> list[Strategy]:
    """Strategies of one node, shared with every node of the same signature.

    Repeated layers repeat signatures, so rules run once per distinct node, not per layer.
    Lists are never mutated; identical lists also let followers of repeated nodes hit the cache.
    """
    key, mode, leader = _signature(prob, node)
    hit = prob.cache.get(key)
    if hit is None:
        hit = prob.cache[key] = _compute_strategies(prob, node)
    elif mode == "free":
        prob.free.add(node.id)
    elif mode == "follow":
        prob.parent[node.id] = prob.var(prob.graph.values[leader].producer)
    return hit


def _avals_key(avals) -> tuple:
    return tuple((tuple(a.shape), a.dtype) for a in avals)


def _params_key(params) -> str:
    return repr(sorted((k, v) for k, v in params.items() if "jaxpr" not in k))


def _signature(prob: Problem, node):
    g = prob.graph
    # How a node is handled (special / free / follower of which operand / rule) depends on the
    # graph only, so it is worked out once per graph and reused for every mesh.
    memo = g.memo.get(("mode", node.id))
    if memo is None:
        memo = g.memo[("mode", node.id)] = _mode(prob, node)
    shapes, mode, leader, tail = memo
    if mode != "follow":
        return tail + shapes, mode, None
    value = g.values[leader]
    producer = g.nodes[value.producer]
    leader_list = prob.strategies[producer.id]
    prob.keepalive.append(leader_list)  # its id is part of the key: keep it unique
    return (("follow", id(leader_list), producer.outputs.index(leader)) + tail + shapes,
            "follow", leader)


def _mode(prob: Problem, node):
    g = prob.graph
    out_avals = [g.values[v] for v in node.outputs]
    shapes = (_avals_key(node.in_avals), _avals_key(out_avals),
              tuple(op is None for op in node.operands))
    if node.kind in SPECIAL_KINDS:
        return shapes, "special", None, ("special", node.kind)
    if _is_free(prob, node):
        return shapes, "free", None, ("free",)
    leader = _follows(prob, node, out_avals)
    if leader is None and node.kind in SHAPE_FOLLOWERS and node.operands and (
            node.operands[0] is not None) and _shape_mapper(prob, node, out_avals) is not None:
        leader = node.operands[0]
    if leader is not None:
        return shapes, "follow", leader, (node.kind, _params_key(node.params),
                                          tuple(op == leader for op in node.operands))
    return shapes, "rule", None, ("rule", node.kind, _params_key(node.params))


SPECIAL_KINDS = frozenset({"input", "output", "carry_back", "const", "carry", "xs", "ys",
                           "cond_out"})


def _compute_strategies(prob: Problem, node) -> list[Strategy]:
    ctx, g = prob.ctx, prob.graph
    kind = node.kind
    if kind == "input":
        # Holding an input costs its bytes per device: among equally fast plans, split inputs.
        value = g.values[node.outputs[0]]
        size = itemsize(value.dtype) * math.prod(value.shape)
        return [Strategy((s,), (), compute_s=byte_cost(size, shards(s, ctx.mesh_shape)))
                for s in ctx.candidates(value.shape)]
    if kind in ("output", "carry_back"):
        return [Strategy((), (s,)) for s in ctx.candidates(node.in_avals[0].shape)]
    if kind == "const":
        return [Strategy((s,), ()) for s in ctx.candidates(g.values[node.outputs[0]].shape)]
    if kind == "carry":
        return [Strategy((s,), (s if node.operands[0] is not None else None,))
                for s in ctx.candidates(node.in_avals[0].shape)]
    if kind == "xs":
        return [Strategy((s,), ((((),) + s) if node.operands[0] is not None else None,))
                for s in ctx.candidates(g.values[node.outputs[0]].shape)]
    if kind == "ys":
        return [Strategy((((),) + s,), (s,)) for s in ctx.candidates(node.in_avals[0].shape)]
    if kind == "cond_out":
        return [Strategy((s,), (s,) * len(node.operands))
                for s in ctx.candidates(node.in_avals[0].shape)]
    out_avals = [g.values[v] for v in node.outputs]
    if _is_free(prob, node):
        prob.free.add(node.id)
        return [Strategy(tuple(replicated(len(a.shape)) for a in out_avals),
                         tuple(None if op is None else replicated(len(a.shape))
                               for op, a in zip(node.operands, node.in_avals, strict=False)))]
    leader = _follows(prob, node, out_avals)
    if leader is not None:
        return _follower_strategies(prob, node, leader, out_avals)
    if node.kind in SHAPE_FOLLOWERS and node.operands and node.operands[0] is not None:
        mapper = _shape_mapper(prob, node, out_avals)
        if mapper is not None:
            return _follower_strategies(prob, node, node.operands[0], out_avals, mapper)
    found = strategies_for(ctx, kind, node.in_avals, out_avals, node.params)
    return [Strategy(s.out_specs,
                     tuple(None if op is None else spec for op, spec in zip(node.operands,
                                                                            s.in_specs, strict=False)),
                     s.comm_s, s.compute_s, s.collectives) for s in found]


SHAPE_FOLLOWERS = frozenset({"transpose", "reshape", "squeeze", "expand_dims"})
FREE_KINDS = frozenset({"iota", "broadcast_in_dim", "reshape", "transpose", "squeeze",
                        "expand_dims", "concatenate", "convert_element_type"}) | ELEMENTWISE


def _is_free(prob: Problem, node) -> bool:
    """A value computed from constants only: every device makes any slice of it for free.

    It keeps one (replicated) strategy, so its edges cost nothing whatever spec the consumer
    wants, and it is not pinned: XLA materialises just the slice each device needs.
    """
    if node.kind == "iota":
        return True
    if node.kind not in FREE_KINDS or not node.operands:
        return False
    g = prob.graph
    for op, aval in zip(node.operands, node.in_avals, strict=False):
        if op is None or len(aval.shape) == 0:
            continue
        producer = g.values[op].producer
        if producer not in prob.free and g.nodes[producer].kind != "const":
            return False
    return True


CHEAP_LEADERS = frozenset({"broadcast_in_dim", "iota", "const", "input"})


def _follows(prob: Problem, node, out_avals) -> int | None:
    """The operand an elementwise node follows: its output takes that operand's spec.

    Other full-size operands are resharded to that spec (an edge). The leader is the first
    operand not produced by a cheap node (broadcast, constant, input), else the first one.
    """
    if node.kind not in ELEMENTWISE:
        return None
    shape = tuple(out_avals[0].shape)
    if any(tuple(a.shape) != shape for a in out_avals):
        return None
    full = [op for op, aval in zip(node.operands, node.in_avals, strict=False)
            if op is not None and len(aval.shape) > 0]
    if not full or any(prob.graph.values[op].shape != shape for op in full):
        return None
    g = prob.graph
    for op in full:
        producer = g.values[op].producer
        if op not in prob.free_values() and g.nodes[producer].kind not in CHEAP_LEADERS:
            return op
    for op in full:
        if g.values[op].producer not in prob.free:
            return op
    return full[0]


def _follower_strategies(prob: Problem, node, leader: int, out_avals, mapper=None
                         ) -> list[Strategy]:
    g = prob.graph
    producer = g.values[leader].producer
    prob.parent[node.id] = prob.var(producer)
    size = sum(nbytes(a) for a in out_avals)
    result = []
    for k in range(len(prob.strategies[producer])):
        s = prob.value_spec(leader, k)
        if mapper is not None:
            s_in, s_out = mapper(s)
            ins = tuple(None if op is None else (s_in if op == leader else replicated(len(a.shape)))
                        for op, a in zip(node.operands, node.in_avals, strict=False))
        else:
            s_out = s
            ins = tuple(None if op is None else (s if len(a.shape) else ())
                        for op, a in zip(node.operands, node.in_avals, strict=False))
        result.append(Strategy((s_out,) * len(out_avals), ins,
                               compute_s=byte_cost(size, shards(s_out, prob.ctx.mesh_shape))))
    return result


def _shape_mapper(prob: Problem, node, out_avals):
    """For transpose/reshape/squeeze: spec of the operand -> (spec it must have, output spec)."""
    x = node.in_avals[0]
    out = out_avals[0]
    mesh = prob.ctx.mesh_shape
    if node.kind == "transpose":
        perm = node.params["permutation"]
        return lambda s: (s, tuple(s[d] for d in perm))
    if node.kind == "squeeze":
        dims = {d % len(x.shape) for d in node.params["dimensions"]}
        keep = [d for d in range(len(x.shape)) if d not in dims]
        return lambda s: (s, tuple(s[d] for d in keep))
    if node.kind in ("reshape", "expand_dims") and len(node.operands) == 1:
        groups = reshape_groups(tuple(x.shape), tuple(out.shape))
        if groups is None:
            return None

        def mapper(s):
            mapped = map_reshape(s, x.shape, out.shape, groups, mesh)
            if mapped is not None:
                return s, mapped
            # Keep only the axes that map; the operand is resharded to that spec first.
            kept = list(s)
            for d in range(len(s)):
                if s[d]:
                    trial = list(replicated(len(s)))
                    trial[d] = s[d]
                    if map_reshape(tuple(trial), x.shape, out.shape, groups, mesh) is None:
                        kept[d] = ()
            kept = tuple(kept)
            mapped = map_reshape(kept, x.shape, out.shape, groups, mesh)
            if mapped is None:
                kept = replicated(len(s))
                mapped = replicated(len(out.shape))
            return kept, mapped
        return mapper
    return None


def _input_masks(prob: Problem, batch_invars):
    option, ctx, g = prob.ctx.option, prob.ctx, prob.graph
    live = tuple(a for a, n in enumerate(ctx.mesh_shape) if n > 1)
    for i, node_id in enumerate(g.inputs):
        value = g.values[g.nodes[node_id].outputs[0]]
        specs = [s.out_specs[0] for s in prob.strategies[node_id]]
        rank = len(value.shape)
        is_batch = bool(batch_invars[i]) and rank > 0
        allowed = set(range(len(specs)))
        if option.force_data_parallel:
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


def value_bytes(prob: Problem, value_id: int, k: int) -> int:
    v = prob.graph.values[value_id]
    size = itemsize(v.dtype)
    for n in v.shape:
        size *= n
    if v.producer in prob.free:  # made slice by slice where it is used
        return size // prob.ctx.cost.num_devices
    return size // shards(prob.value_spec(value_id, k), prob.ctx.mesh_shape)
