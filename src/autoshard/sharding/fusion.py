"""XLA's fusion in the compute term: a fused chain of memory-bound ops touches memory once.

The rules price a memory-bound op by the bytes of its own output (``cost.byte_cost``), as if
every element-wise op ran as its own kernel. XLA fuses them: a chain of element-wise ops, the
layout ops between them and the reductions they feed run as one kernel that reads its
external inputs and writes its external outputs once. ``fuse_memory_bound`` re-prices the
members of each fusion group that way (the rule and why: ``cost``'s docstring, "Fusion"), and
prices each matrix product on the roofline: the larger of its FLOP time and the time of the
bytes it reads and writes (``cost``'s docstring, "Roofline").

A group is found once per graph (it does not depend on the mesh): fusible nodes joined along
their producer-consumer edges, only between nodes at the same *depth* (the number of
non-fusible nodes, e.g. matrix products, on the longest path from the program's inputs), and
in the same loop body. Equal depth keeps a group convex: no path leaves it through a matrix
product and comes back, which one kernel could not run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..ir import _prims
from .cost import byte_cost
from .graph import Graph
from .problem import Problem
from .spec import shards
from .strategy import nbytes

REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                        "reduce_or", "reduce_xor", "argmax", "argmin"})
"""Reductions: they fuse with the element-wise ops around them (XLA's reduction fusions)."""
FUSIBLE = _prims.ELEMENTWISE | _prims.LAYOUT | REDUCTIONS | {"copy", "copy_p"}
"""Ops XLA puts into one loop or reduction fusion."""
BITCASTS = frozenset({"reshape", "squeeze", "expand_dims"})
"""Layout ops that move no data: a group of only these is a bitcast and costs nothing."""
PRODUCTS = frozenset({"dot_general", "conv_general_dilated"})
"""Matrix products: priced by their FLOPs, operand reads included."""
PROLOGUE = _prims.LAYOUT | {"convert_element_type", "copy", "copy_p"}
"""Ops XLA folds into a product's operand read when only products read their result."""
CHEAP = _prims.LAYOUT | frozenset("""
neg sign floor ceil round is_finite abs not imag real conj integer_pow square reduce_precision
convert_element_type copy copy_p population_count clz sin cos add add_any sub mul max min and
or xor eq ne lt le gt ge shift_left shift_right_logical shift_right_arithmetic select_n clamp
complex
""".split())
"""Ops XLA duplicates into every kernel that reads them (those its ``IsExpensive`` calls
cheap on the CPU: tanh, exp, log, logistic, rsqrt, sqrt, erf, pow and floating division are
not, nor a reduction or a product). A division by a constant is cheap too (XLA multiplies by
its inverse): see ``recomputed``."""
LOOP_FUSIBLE = _prims.ELEMENTWISE | _prims.LAYOUT | {
    "copy", "copy_p", "pad", "slice", "dynamic_slice", "dynamic_update_slice", "concatenate",
    "gather", "rev", "iota"}
"""Readers XLA fuses a cheap producer into (its CPU ``CanBeLoopFused``, less the reduction:
see ``taken_products``)."""


@dataclass(frozen=True)
class Charge:
    """What one node of a fusion group pays: bytes of some operands and some outputs."""

    reads: tuple[int, ...]
    """Operand positions read from outside the group (each outside value once per group)."""
    writes: tuple[int, ...]
    """Output positions read outside the group (written to memory once)."""


@dataclass(frozen=True)
class Roofline(Charge):
    """A matrix product's bytes: its operand reads and its result write (none when a fusion
    group takes the result as its epilogue and writes it). The product costs the larger of
    its FLOP time and these bytes' time (``cost``'s docstring, "Roofline")."""


FOLDED = Charge((), ())
"""A prologue folded into a product, or a member of a bitcast-only group: nothing to pay."""


def fusion_charges(graph: Graph, free: set[int]) -> dict[int, Charge]:
    """Node id -> its ``Charge``, for every node the fusion re-prices (mesh independent).

    ``free``: nodes computed from constants only (``Problem.free``): XLA makes them inside the
    kernel that reads them, so reading them costs nothing and they join no group.
    """
    nodes, consumers = graph.nodes, graph.consumers()
    readers = [{c for c, _ in consumers[n.id]} for n in nodes]
    folded: set[int] = set()
    for node in reversed(nodes):  # a prologue may feed another prologue
        if (node.kind in PROLOGUE and node.id not in free and readers[node.id] and all(
                nodes[c].kind in PRODUCTS or c in folded for c in readers[node.id])):
            folded.add(node.id)
    member = [n.kind in FUSIBLE and n.id not in free and n.id not in folded for n in nodes]
    depth = [0] * len(nodes)
    parent = list(range(len(nodes)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for node in nodes:
        producers = [graph.values[u].producer for u in node.operands if u is not None]
        producers = [p for p in producers if p not in free]
        depth[node.id] = max((depth[p] + (0 if member[p] else 1) for p in producers), default=0)
        if not member[node.id]:
            continue
        for p in producers:
            if member[p] and depth[p] == depth[node.id] and nodes[p].mult == node.mult:
                parent[root(p)] = root(node.id)
    groups: dict[int, list[int]] = {}
    for node in nodes:
        if member[node.id]:
            groups.setdefault(root(node.id), []).append(node.id)
    charges = {n: FOLDED for n in folded}
    epilogue: set[int] = set()  # products whose result a fusion group reads as its epilogue
    for group, ids in groups.items():
        if all(nodes[i].kind in BITCASTS for i in ids):
            charges.update((i, FOLDED) for i in ids)
            continue
        has_reduction = any(nodes[i].kind in REDUCTIONS for i in ids)
        seen: set[int] = set()
        for i in ids:
            node = nodes[i]
            reads = []
            for pos, u in enumerate(node.operands):
                if u is None or u in seen:
                    continue
                p = graph.values[u].producer
                if p in free or (member[p] and root(p) == group) or len(
                        graph.values[u].shape) == 0:
                    continue
                if nodes[p].kind in PRODUCTS and readers[p] == {i} and not has_reduction:
                    epilogue.add(p)
                    continue  # the product's epilogue (bias, activation, residual add)
                seen.add(u)
                reads.append(pos)
            writes = [j for j, v in enumerate(node.outputs)
                      if any(not (member[c] and root(c) == group)
                             for c, _ in consumers_of(graph, consumers, v))]
            charges[i] = Charge(tuple(reads), tuple(writes))
    for node in nodes:  # the roofline's bytes of each product (``Roofline``)
        if node.kind in PRODUCTS:
            reads = tuple(p for p, u in enumerate(node.operands) if u is not None
                          and graph.values[u].producer not in free)
            charges[node.id] = Roofline(reads, () if node.id in epilogue else (0,))
    return charges


def taken_products(graph: Graph, free: set[int]) -> dict[int, int]:
    """Reduction node id -> the ``mul`` node its kernel takes, for every reduction of a
    product of two values that only the reduction reads (mesh independent).

    XLA's CPU hands a reduction to a kernel of its own, which takes at most the multiply
    that feeds it: a reduction's operand is read from memory, or, when it is such a
    multiply, the multiply's operands are (read from XLA's fusions of the families ViT and
    LLaMA steps: the normalisations' scale gradients, ``sum(g * x_hat)``)."""
    nodes, consumers = graph.nodes, graph.consumers()
    taken = {}
    for node in nodes:
        if node.kind not in REDUCTIONS or node.id in free or not node.operands:
            continue
        u = node.operands[0]
        if u is None:
            continue
        p = graph.values[u].producer
        if nodes[p].kind == "mul" and p not in free and {
                c for c, _ in consumers_of(graph, consumers, u)} == {node.id}:
            taken[node.id] = p
    return taken


def recomputed(graph: Graph, free: set[int], charges: dict[int, Charge]) -> set[int]:
    """Values a fusion group writes (read outside it) that XLA computes again in each of
    their readers' kernels instead (mesh independent).

    XLA's fusion duplicates a cheap producer (``CHEAP``) into every reader that can take it
    (``LOOP_FUSIBLE``, in the same loop body; not a reduction, nor the multiply a
    reduction's kernel takes, ``taken_products``), unless the producer reads more than one
    full-size operand (``_at_most_unary``: XLA's ``ComputeGloballyUnfusible``). When all of
    its readers take it, nothing writes it, and its readers read what it is computed from.
    So of a tanh-GELU's pieces, kept by autodiff for the backward pass, XLA writes the tanh
    (expensive) and ``x * 0.5 (1 + t)`` (two full-size operands; a matrix product reads
    it); the bias add, the cube's scaling, ``1 - t`` and ``0.5 (1 + t)`` are recomputed in
    the backward's kernels from the matrix product's result and the tanh (read from XLA's
    buffer assignment of the families ViT: 3 of 6 pieces per block)."""
    nodes, consumers = graph.nodes, graph.consumers()
    taken = set(taken_products(graph, free).values())
    found = set()
    for node_id, charge in charges.items():
        node = nodes[node_id]
        if (not charge.writes or isinstance(charge, Roofline) or not _cheap(graph, node, free)
                or not _at_most_unary(graph, node, free)):
            continue
        for j in charge.writes:
            v = node.outputs[j]
            readers = [nodes[c] for c, _ in consumers_of(graph, consumers, v)]
            if readers and all(r.kind in LOOP_FUSIBLE and r.id not in taken
                               and r.body == node.body and r.mult == node.mult
                               for r in readers):
                found.add(v)
    return found


def _cheap(graph: Graph, node, free: set[int]) -> bool:
    """Whether XLA duplicates ``node`` into its readers' kernels (``CHEAP``)."""
    if node.kind in CHEAP:
        return True
    if node.kind == "div" and len(node.operands) == 2:   # x / constant: x * (1 / constant)
        u = node.operands[1]
        return u is None or graph.values[u].producer in free
    return False


def _at_most_unary(graph: Graph, node, free: set[int]) -> bool:
    """At most one operand as large as the result, counting dims above 1 (XLA's
    ``EffectivelyAtMostUnary``: a bias, a per-row statistic or a constant does not count)."""
    out = max((_true_rank(graph.values[v].shape) for v in node.outputs), default=0)
    large = [u for u in node.operands if u is not None
             and graph.values[u].producer not in free
             and _true_rank(graph.values[u].shape) >= out]
    return len(large) <= 1


def _true_rank(shape) -> int:
    return sum(1 for d in shape if d != 1)


def consumers_of(graph: Graph, consumers, value_id: int):
    """(consumer node, operand position) pairs reading value ``value_id``."""
    producer = graph.values[value_id].producer
    return [(c, p) for c, p in consumers[producer]
            if graph.nodes[c].operands[p] == value_id]


def fuse_memory_bound(prob: Problem) -> None:
    """Re-price the compute term of every fused node's strategies by its ``Charge``.

    Each operand read and output written costs ``byte_cost`` of its bytes over the pieces the
    strategy cuts it into. Lists keep their length and order (followers and ties still
    match); nodes sharing a list and a charge share the new list.
    """
    g = prob.graph
    charges = g.memoised("fusion", lambda: fusion_charges(g, prob.free))
    mesh = prob.ctx.mesh_shape
    replaced: dict[tuple[int, Charge], list] = {}
    for node_id, charge in charges.items():
        strategies = prob.strategies[node_id]
        new = replaced.get((id(strategies), charge))
        if new is None:
            node = g.nodes[node_id]
            outs = [g.values[v] for v in node.outputs]
            new = replaced[(id(strategies), charge)] = [dataclasses.replace(
                s, compute_s=_charged_s(node, outs, s, charge, mesh)) for s in strategies]
        prob.strategies[node_id] = new
    prob.keepalive.extend(replaced.values())


def _charged_s(node, outs, s, charge: Charge, mesh) -> float:
    """Seconds strategy ``s`` of ``node`` pays under ``charge``: its bytes at the memory
    bandwidth, or for a product (``Roofline``) the larger of that and its FLOP time."""
    touched = sum(byte_cost(nbytes(node.in_avals[p]), shards(s.in_specs[p], mesh))
                  for p in charge.reads if s.in_specs[p] is not None) + sum(
        byte_cost(nbytes(outs[j]), shards(s.out_specs[j], mesh)) for j in charge.writes)
    return max(s.compute_s, touched) if isinstance(charge, Roofline) else touched


__all__ = ["BITCASTS", "CHEAP", "Charge", "FUSIBLE", "LOOP_FUSIBLE", "PROLOGUE", "REDUCTIONS",
           "Roofline", "fuse_memory_bound", "fusion_charges", "recomputed", "taken_products"]
