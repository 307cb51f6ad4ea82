"""Strategies per node, with the simplifications that keep the ILP small.

* followers: an elementwise op joins the variable of the operand it follows (its k-th strategy
  is "take the operand's k-th spec", other full-size operands are resharded to it), and so do
  transpose / reshape / squeeze with their spec mapped through the op, unless several
  products read them (``_forks``);
* free nodes: values computed from constants only (iota, broadcast scalars, masks) keep one
  replicated strategy, which any consumer slices for free;
* caches: strategy lists are shared by nodes of equal signature, so rules run once per
  distinct node and not once per layer.
"""

from __future__ import annotations

import math

from . import rules_custom, rules_linalg  # noqa: F401  (register their rules)
from .cost import byte_cost
from .fusion import PRODUCTS
from .problem import Problem
from .rules import ELEMENTWISE, map_reshape, reshape_groups
from .spec import replicated, shards
from .strategy import Strategy, itemsize, nbytes, strategies_for


def node_strategies(prob: Problem, node) -> list[Strategy]:
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
            node.operands[0] is not None) and not _forks(g, node) and (
            _shape_mapper(prob, node, out_avals) is not None):
        leader = node.operands[0]
    if leader is not None:
        return shapes, "follow", leader, (node.kind, _params_key(node.params),
                                          tuple(op == leader for op in node.operands))
    return shapes, "rule", None, ("rule", node.kind, _params_key(node.params))


SPECIAL_KINDS = frozenset({"input", "output", "carry_back", "const", "carry", "xs", "ys",
                           "cond_out"})


def _forks(g, node) -> bool:
    """A layout op read by several products keeps a variable of its own instead of following
    its operand. The ILP prices resharding per edge, so a value that two products need in
    another spec (a forward product and its weight gradient) would pay the collective once per
    product, where XLA runs it once; resharding into the layout op's own spec is one edge, paid
    once (Alpa's MoE dispatch: one all-to-all of the dispatched tokens, not one per einsum).
    Outside loop bodies only: in a scanned GPT's body it changed nothing but which of two plans
    of equal objective the solver returned (q/k/v kernels split by rows instead of columns),
    against the unrolled program's (``test_loops``); not investigated further."""
    readers = {c for c, _ in g.consumers()[node.id] if g.nodes[c].kind in PRODUCTS}
    return len(readers) > 1 and node.body == -1


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
    if node.kind in SHAPE_FOLLOWERS and node.operands and node.operands[0] is not None and (
            not _forks(g, node)):
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
