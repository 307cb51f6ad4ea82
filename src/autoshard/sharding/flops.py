"""Model FLOPs: the count Megatron-LM's eq. 3 makes, beside the traced program's.

``Objective.flops`` counts every matrix product the traced step runs. Published TFLOP/s
figures count differently: Megatron-LM (Narayanan et al., SC'21, eq. 3) takes a training step
as three forward passes (forward, and a backward of twice the forward's FLOPs) plus, with
activation recomputation, one more forward of every recomputed layer: ``96 B s l h^2 (1 +
s/6h + V/16lh)`` for a GPT with remat; without, ``72 B s l h^2 (1 + s/6h) + 6 B s h V`` (the
logit layer is recomputed in neither, so its term does not scale with 96 -> 72). JAX's remat
does not recompute what the backward does not need (a layer's last matmul), so the traced
count reads 7-8% under eq. 3.

``model_flops`` counts the same way for any program: ``3 x forward + the forward of every
rematerialised region + products outside differentiation``. The parts are told apart by the
name stack JAX gives each equation: ``jvp(...)`` without ``transpose(...)`` is the forward,
``transpose(...)`` the backward, ``rematted_computation`` the recomputation inside a
checkpointed region's backward. A checkpointed region's forward is found from the
recomputation: each recomputed product has a forward twin (same operand shapes, dtypes,
dimension numbers and repeat count); the region also holds every forward product reached from
a twin through values the backward never reads (values a remat recomputes rather than saves:
the last matmul JAX does not recompute is found this way). A program without a backward is
counted as traced.
"""

from __future__ import annotations

from collections import Counter, deque

from ..ir import _prims
from ..ir._walk import Walker, body_of, eqn_site
from .graph import Graph

PRODUCTS = frozenset({"dot_general", "conv_general_dilated"})
ROLES = ("forward", "backward", "recompute", "other")


def role_of(name_stack: str) -> str:
    """The part of a training step an equation with this (full) name stack belongs to."""
    if "rematted_computation" in name_stack:
        return "recompute"
    if "transpose(" in name_stack:
        return "backward"
    if "jvp(" in name_stack:
        return "forward"
    return "other"


class _Roles(Walker):
    """Walks a jaxpr as the planner's graph does (same paths) and notes each equation's role."""

    def __init__(self):
        self.stack: list[str] = []
        self.roles: dict[str, str] = {}

    def literal(self, lit):
        return None

    def constant(self, var, value, path):
        return None

    def _within(self, eqn, fn):
        self.stack.append(str(eqn.source_info.name_stack))
        try:
            return fn()
        finally:
            self.stack.pop()

    def equation(self, eqn, ins, path):
        self.roles[eqn_site(path)] = role_of("/".join(
            self.stack + [str(eqn.source_info.name_stack)]))
        return [None] * len(eqn.outvars)

    def call(self, eqn, ins, path):
        jaxpr, consts = body_of(eqn)
        return self._within(eqn, lambda: self.walk(jaxpr, consts, ins, path))

    def loop(self, eqn, ins, path):
        p, name = eqn.params, eqn.primitive.name

        def run():
            if name == "scan":
                self.walk(p["jaxpr"].jaxpr, p["jaxpr"].consts, [None] * len(
                    p["jaxpr"].jaxpr.invars), path)
            elif name == "while":
                for k, key in ((0, "cond_jaxpr"), (1, "body_jaxpr")):
                    sub = p[key]
                    self.walk(sub.jaxpr, sub.consts, [None] * len(sub.jaxpr.invars),
                              path + (k,))
            else:  # cond
                for b, br in enumerate(p["branches"]):
                    self.walk(br.jaxpr, br.consts, [None] * len(br.jaxpr.invars), path + (b,))
        self._within(eqn, run)
        return [None] * len(eqn.outvars)


def eqn_roles(closed_jaxpr) -> dict[str, str]:
    """Equation site (``_walk.eqn_site``) -> ``role_of`` its name stack."""
    walker = _Roles()
    jaxpr = closed_jaxpr.jaxpr
    walker.walk(jaxpr, closed_jaxpr.consts, [None] * len(jaxpr.invars))
    return walker.roles


def node_flops(graph: Graph, node) -> float:
    """FLOPs of one run of a product node (0 for any other node)."""
    out = graph.values[node.outputs[0]].shape if node.outputs else ()
    if node.kind == "dot_general":
        return _prims.dot_flops(node.in_avals[0].shape, out, node.params)
    if node.kind == "conv_general_dilated":
        return _prims.conv_flops(node.in_avals[0].shape, node.in_avals[1].shape, out,
                                 node.params)
    return 0.0


def model_flops(graph: Graph, roles: dict[str, str]) -> float:
    """Megatron-LM eq.-3-style FLOPs of one step (the module's rule); ``roles``: from
    ``eqn_roles`` of the program ``graph`` was built from."""
    role = {n.id: roles.get(graph.node_sites.get(n.id, ""), "other") for n in graph.nodes}
    products = [n for n in graph.nodes if n.kind in PRODUCTS]
    total = {r: 0.0 for r in ROLES}
    for n in products:
        total[role[n.id]] += node_flops(graph, n) * n.mult
    if total["backward"] == 0.0 and total["recompute"] == 0.0:
        return sum(total.values())
    region = _rematerialised(graph, role, products)
    return (3 * total["forward"] + sum(node_flops(graph, graph.nodes[i]) * graph.nodes[i].mult
                                       for i in region) + total["other"])


def _signature(n) -> tuple:
    return (n.kind, tuple((tuple(a.shape), str(a.dtype)) for a in n.in_avals),
            repr(n.params.get("dimension_numbers")), n.mult)


def _rematerialised(graph: Graph, role: dict[int, str], products) -> set[int]:
    """Forward product nodes inside checkpointed regions (twins of recomputed products and
    the forward products reached from them through values the backward does not read)."""
    wanted = Counter(_signature(n) for n in products if role[n.id] == "recompute")
    region: set[int] = set()
    for n in products:
        sig = _signature(n)
        if role[n.id] == "forward" and wanted[sig] > 0:
            wanted[sig] -= 1
            region.add(n.id)
    consumers = graph.consumers()
    readers = {n.id: {c for c, _ in consumers[n.id]} for n in graph.nodes}
    queue, seen = deque(region), set(region)
    while queue:
        i = queue.popleft()
        if any(role[c] in ("backward", "recompute") for c in readers[i]):
            continue  # saved for the backward: the region ends here
        for c in readers[i]:
            if role[c] == "forward" and c not in seen:
                seen.add(c)
                queue.append(c)
                if graph.nodes[c].kind in PRODUCTS:
                    region.add(c)
    return region


__all__ = ["eqn_roles", "model_flops", "node_flops", "role_of"]
