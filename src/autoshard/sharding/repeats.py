"""Solve repeated identical layers once: tie structurally identical nodes to one ILP variable.

An unrolled stack of identical layers gives the ILP the same sub-problem many times. Nodes are
labelled by Weisfeiler-Lehman refinement (primitive, shapes, params, then the labels of their
operands and consumers, for a few rounds); variable roots with equal labels share their ILP
variable. Layers at the ends of the stack see different neighbours within the refinement
radius and keep their own variables, so the embedding and head boundaries stay free. Tying
only restricts the ILP, so every tied plan is a valid plan; it is what a ``lax.scan`` over
the layers gets by construction.
"""

from __future__ import annotations

from .problem import Problem

ROUNDS = 4
"""Refinement rounds: how far (in graph hops) a node's surroundings must match to be tied."""


def _initial_label(prob: Problem, node, batch_invars) -> str:
    g = prob.graph
    outs = tuple((g.values[v].shape, str(g.values[v].dtype)) for v in node.outputs)
    ins = tuple((tuple(a.shape), str(a.dtype)) for a in node.in_avals)
    extra = ""
    if node.kind == "input":
        extra = f"batch={bool(batch_invars[node.index])} allowed={prob.allowed.get(node.id)}"
    params = {k: v for k, v in node.params.items() if "jaxpr" not in k}
    return f"{node.kind}|{ins}|{outs}|{params}|{node.mult}|{extra}"


def tie_repeated(prob: Problem, batch_invars, rounds: int = ROUNDS) -> int:
    """Union variable roots with equal refined labels; returns how many variables were merged."""
    g = prob.graph
    roots = [n.id for n in g.nodes if prob.var(n.id) == n.id]
    names: dict[str, int] = {}
    label = [names.setdefault(_initial_label(prob, n, batch_invars), len(names)) for n in g.nodes]
    consumers: list[list[tuple[int, int]]] = [[] for _ in g.nodes]
    for node in g.nodes:
        for p, u in enumerate(node.operands):
            if u is not None:
                consumers[g.values[u].producer].append((node.id, p))
    for _ in range(rounds):
        names = {}
        new = []
        for node in g.nodes:
            ins = tuple(-1 if u is None else (label[g.values[u].producer],
                                              g.nodes[g.values[u].producer].outputs.index(u))
                        for u in node.operands)
            outs = tuple(sorted((label[c], p) for c, p in consumers[node.id]))
            new.append(names.setdefault((label[node.id], ins, outs), len(names)))
        label = new
    first: dict[int, int] = {}
    merged = 0
    for r in roots:
        if prob.var(r) != r:
            continue
        other = first.setdefault(label[r], r)
        if other != r and len(prob.strategies[other]) == len(prob.strategies[r]) and (
                prob.var(other) != prob.var(r)):
            prob.union(other, r)
            merged += 1
    return merged
