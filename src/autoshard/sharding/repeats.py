"""Solve repeated identical layers once: tie structurally identical nodes to one ILP variable.

An unrolled stack of identical layers gives the ILP the same sub-problem many times. Nodes are
labelled by Weisfeiler-Lehman refinement (primitive, shapes, params, then the labels of their
operands and consumers, for a few rounds); variable roots with equal labels share their ILP
variable. Layers at the ends of the stack see different neighbours within the refinement
radius and keep their own variables, so the embedding and head boundaries stay free. Tying
only restricts the ILP, so every tied plan is a valid plan. Even and odd layers are tied
separately, so a plan that alternates between neighbouring layers stays available.
"""

from __future__ import annotations

import functools
from collections import Counter

from .problem import Problem

ROUNDS = 4
"""Refinement rounds: how far (in graph hops) a node's surroundings must match to be tied."""


@functools.lru_cache(maxsize=256)
def _dtype_name(dtype) -> str:
    """``str(dtype)``, which numpy works out anew on each call (19,000 calls, 0.1 s, labelling
    the 16-layer decoder)."""
    return str(dtype)


def _initial_label(prob: Problem, node, batch_invars) -> str:
    g = prob.graph
    base = g.labels.get(node.id)
    if base is None:  # mesh independent: computed once per graph
        outs = tuple((g.values[v].shape, _dtype_name(g.values[v].dtype)) for v in node.outputs)
        ins = tuple((tuple(a.shape), _dtype_name(a.dtype)) for a in node.in_avals)
        params = {k: v for k, v in node.params.items() if "jaxpr" not in k}
        batch = bool(batch_invars[node.index]) if node.kind == "input" else None
        base = g.labels[node.id] = f"{node.kind}|{ins}|{outs}|{params}|{node.mult}|{node.comm_mult}|{batch}"
    if node.kind == "input":
        return f"{base}|{prob.allowed.get(node.id)}"
    return base


def tie_repeated(prob: Problem, batch_invars, rounds: int = ROUNDS) -> int:
    """Union variable roots with equal refined labels; returns how many variables were merged."""
    g = prob.graph
    masks = tuple(sorted((n, tuple(sorted(ks))) for n, ks in prob.allowed.items()))
    label = g.memo.get(("wl", rounds, masks))
    if label is None:  # the same for every mesh with the same input masks
        label = g.memo[("wl", rounds, masks)] = _refine(prob, batch_invars, rounds)
    roots = [n.id for n in g.nodes if prob.var(n.id) == n.id]
    phase = _layer_phase(roots, label)
    first: dict[tuple[int, int], int] = {}
    merged = 0
    for r in roots:
        if prob.var(r) != r:
            continue
        other = first.setdefault((label[r], phase[r]), r)
        if other != r and len(prob.strategies[other]) == len(prob.strategies[r]) and (
                prob.var(other) != prob.var(r)):
            prob.union(other, r)
            merged += 1
    return merged


def _layer_phase(roots: list[int], label: list[int]) -> dict[int, int]:
    """Parity of the repeat (layer) each node belongs to, within its label class.

    Tying even and odd layers separately keeps alternating plans (column split, then row
    split, as Megatron does for a stack of square layers) available to the ILP; tying every
    layer to one variable would force each layer into the same split. The number of repeats is
    the class size covering the most nodes; a class with ``k`` members per repeat counts its layers as
    ``index // k``.
    """
    classes: dict[int, list[int]] = {}
    for r in roots:
        classes.setdefault(label[r], []).append(r)
    sizes = Counter(len(m) for m in classes.values() if len(m) > 1)
    # The class size covering the most nodes: small classes (a layer's two ends, pairs of
    # forward and backward ops) are many but cover few nodes; counting classes instead once
    # took 2 for a 6-layer MLP and tied layers 0-2 and 3-5, which forbids alternating splits.
    repeats = max(sizes, key=lambda n: (sizes[n] * n, n)) if sizes else 1
    phase = {}
    for members in classes.values():
        per_layer = len(members) // repeats if len(members) % repeats == 0 else 1
        for i, r in enumerate(members):
            phase[r] = (i // max(per_layer, 1)) % 2
    return phase


def _refine(prob: Problem, batch_invars, rounds: int) -> list[int]:
    """Weisfeiler-Lehman labels: a node's label, its operands' and its consumers' labels."""
    g = prob.graph
    names: dict = {}
    label = [names.setdefault(_initial_label(prob, n, batch_invars), len(names)) for n in g.nodes]
    consumers = g.consumers()
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
    return label
