"""The planner's graph: one node per equation of the flattened jaxpr, one value per array.

Calls (``jit``, ``closed_call``, ``custom_jvp_call``, ``custom_vjp_call``, ``custom_vmap_call``,
``remat``) are inlined; identities (pipeline markers, optimization barriers, device_put)
forward their operands; a user's sharding constraint is a node whose spec is the user's. Loops get extra nodes so that a loop-carried value has one
spec for all iterations:

* ``carry``: the value inside the loop; its operand is the initial value (resharded once).
* ``carry_back``: consumes the body's new carry and is tied to ``carry`` (same ILP variable).
* ``xs``: a per-iteration slice of a scanned input; ``ys``: the stacked per-iteration outputs.

Costs inside a scan body count ``length`` times (``Node.mult``). The walk is ``_walk.Walker``'s;
every value an equation produces gets a ``site`` (its equation's path and output position),
the key plans pin it by: ``apply_plan`` walks the program again and finds the pins by site,
without building the graph a second time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jax.extend import core

from ..ir._prims import ADDS, LINEAR
from ..ir._walk import IDENTITIES, INLINE_CALLS, Walker, eqn_site, site

WHILE_TRIPS = 1
"""Iterations assumed for a while loop (unknown statically)."""

SUM_LINEAR = LINEAR | {"split", "slice"}
"""A sum over devices can be taken after these: what an accumulated carry's increment passes
through after the ops that make its partial sums (``_Builder._accumulated``)."""

Ref = Any  # a value id (int) or a jax Literal


@dataclass
class Value:
    id: int
    shape: tuple[int, ...]
    dtype: np.dtype
    producer: int
    """Id of the node that produces the value."""


@dataclass
class Node:
    id: int
    kind: str
    """Primitive name, or input/output/const/carry/carry_back/xs/ys/cond_out."""
    operands: list[int | None]
    """Value ids; None for a literal operand."""
    in_avals: list[Any]
    outputs: list[int]
    params: dict
    mult: float
    where: str
    index: int = -1
    """Input/output position for input and output nodes."""
    comm_mult: float | None = None
    """Times the node's own collectives run per step when not ``mult`` (a gradient summed
    over micro-batches on each device is reduced once, after the loop)."""
    body: int = -1
    """The innermost loop body (scan body, while body or condition) the node runs in, -1
    outside every loop: XLA merges independent reductions within one body's iteration."""
    after_loop: bool = False
    """Its collectives run once after its loop, which accumulates its result (a gradient
    deferred past the micro-batch loop), with the step's other deferred reductions."""

    @property
    def comm_times(self) -> float:
        return self.mult if self.comm_mult is None else self.comm_mult

    @property
    def merge_group(self) -> tuple[int, float]:
        """(loop body, runs per step) within which XLA merges the node's reductions with the
        other independent ones: the step's (-1, 1.0) outside loops and after them
        (``after_loop``), once per iteration in a loop body."""
        return (-1, 1.0) if self.body < 0 or self.after_loop else (self.body, self.comm_times)


@dataclass
class Graph:
    nodes: list[Node] = field(default_factory=list)
    values: list[Value] = field(default_factory=list)
    inputs: list[int] = field(default_factory=list)
    """Node id of each flat input."""
    outputs: list[int] = field(default_factory=list)
    """Node id of each flat output."""
    ties: list[tuple[int, int]] = field(default_factory=list)
    """Node pairs that must choose the same strategy (same strategy lists)."""
    sites: dict[int, str] = field(default_factory=dict)
    """Value id -> its site (``_walk.site``) for every value an equation or a loop makes."""
    node_sites: dict[int, str] = field(default_factory=dict)
    """Node id -> the path (``_walk.site`` without the output) of its equation."""
    loop_ends: dict[int, int] = field(default_factory=dict)
    """``xs`` node id -> the last node of its scan: the scanned input is read by every
    iteration, so it (or its resharded copy) is live until then."""
    labels: dict[int, str] = field(default_factory=dict)
    """Structural label per node (cache of ``repeats``)."""
    memo: dict = field(default_factory=dict)
    """Mesh-independent facts about nodes, computed once per graph by the planner."""

    def add_node(self, kind, operands, in_avals, out_avals, params, mult, where, index=-1):
        node = Node(len(self.nodes), kind, list(operands), list(in_avals), [], dict(params),
                    mult, where, index)
        self.nodes.append(node)
        for aval in out_avals:
            value = Value(len(self.values), tuple(aval.shape), _dtype(aval.dtype), node.id)
            self.values.append(value)
            node.outputs.append(value.id)
        return node

    def memoised(self, key, compute):
        """``memo[key]``, computed once per graph by ``compute()``."""
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]

    def consumers(self) -> list[list[tuple[int, int]]]:
        """Per node, the (consumer node id, operand position) pairs reading its outputs."""
        memo = self.memo.get("consumers")
        if memo is None:
            memo = self.memo["consumers"] = [[] for _ in self.nodes]
            for node in self.nodes:
                for p, u in enumerate(node.operands):
                    if u is not None:
                        memo[self.values[u].producer].append((node.id, p))
        return memo

    def aval(self, ref):
        if isinstance(ref, core.Literal):
            return ref.aval
        v = self.values[ref]
        return _Aval(v.shape, v.dtype)


def _dtype(dtype):
    """A numpy dtype, or JAX's own dtype object for extended dtypes (PRNG key arrays)."""
    try:
        return np.dtype(dtype)
    except TypeError:
        return dtype


@dataclass(frozen=True)
class _Aval:
    shape: tuple[int, ...]
    dtype: np.dtype


def build_graph(closed_jaxpr: core.ClosedJaxpr, in_paths, out_paths,
                top_mults: dict[int, tuple[float, float]] | None = None) -> Graph:
    """``top_mults``: top-level equation index -> (times it runs per step, times its own
    collectives run), e.g. the body of a micro-batch loop (gradient accumulation)."""
    g = Graph()
    refs = []
    for i, var in enumerate(closed_jaxpr.jaxpr.invars):
        node = g.add_node("input", [], [], [var.aval], {}, 1.0, in_paths[i], index=i)
        g.inputs.append(node.id)
        refs.append(node.outputs[0])
    outs = _Builder(g, top_mults or {}).walk(closed_jaxpr.jaxpr, closed_jaxpr.consts, refs)
    for j, ref in enumerate(outs):
        operand = _materialize(g, ref, 1.0)
        aval = g.aval(operand)
        node = g.add_node("output", [operand], [aval], [], {}, 1.0, out_paths[j], index=j)
        g.outputs.append(node.id)
    return g


def _materialize(g: Graph, ref: Ref, mult: float) -> int:
    """A value id for ``ref``; a literal becomes a constant node."""
    if isinstance(ref, core.Literal):
        return g.add_node("const", [], [], [ref.aval], {}, mult, "literal").outputs[0]
    return ref


def _where(eqn, name: str) -> str:
    shapes = ",".join(_shape_text(v.aval.shape) for v in eqn.invars
                      if hasattr(v.aval, "shape"))
    return f"{name}[{shapes}]"


@functools.lru_cache(maxsize=4096)
def _shape_text(shape: tuple[int, ...]) -> str:
    """``2x3`` for shape (2, 3): a program of repeated layers has few distinct shapes, each
    named by thousands of equations (the 16-layer decoder: 16,300 operands, 0.1 s of its
    graph's build written out each time)."""
    return "x".join(map(str, shape)) or "()"


class _Builder(Walker):
    """Interprets a jaxpr symbolically: a value is a value id (or a Literal), an equation a
    node. ``mult`` is how many times the current body runs per step."""

    def __init__(self, g: Graph, top_mults: dict[int, tuple[float, float]]):
        self.g = g
        self.mult = 1.0
        self.top_mults = top_mults
        self.num_bodies = 0
        self.once: dict[int, float] = {}
        """Node id -> times per step it runs outside the scan whose carry accumulates its
        result (``_accumulated``): a deferred reduction of it runs that often, not once per
        iteration."""

    def run_eqns(self, eqns, env, path=(), indices=None):
        if path or not self.top_mults:
            return super().run_eqns(eqns, env, path, indices)
        for i, eqn in enumerate(eqns):
            mult, comm = self.top_mults.get(i, (1.0, 1.0))
            first = len(self.g.nodes)
            self.mult = mult
            try:
                super().run_eqns([eqn], env, path, [i])
            finally:
                self.mult = 1.0
            if comm != mult:
                # The equation's gradients are summed on each device and reduced after the
                # micro-batch loop: its collectives run comm/mult as often as it does, and
                # those of a gradient a scan accumulates in its carry once after the scan.
                for node in self.g.nodes[first:]:
                    node.comm_mult = self.once.get(node.id, node.mult) * comm / mult
                    node.after_loop = self.once.get(node.id) == mult

    def literal(self, lit):
        return lit

    def constant(self, var, value, path):
        return self.g.add_node("const", [], [], [var.aval], {}, self.mult,
                               "constant").outputs[0]

    def equation(self, eqn, ins, path):
        g, name = self.g, eqn.primitive.name
        node = g.add_node(name, [None if isinstance(r, core.Literal) else r for r in ins],
                          [g.aval(r) for r in ins], [v.aval for v in eqn.outvars],
                          eqn.params, self.mult, _where(eqn, name))
        self._sites(path, node.outputs)
        g.node_sites[node.id] = eqn_site(path)
        return list(node.outputs)

    def _sites(self, path, value_ids, prefix: str = ""):
        for j, vid in enumerate(value_ids):
            self.g.sites[vid] = site(path, f"{prefix}{j}")

    def loop(self, eqn, ins, path):
        outs = {"scan": self._scan, "while": self._while, "cond": self._cond}[
            eqn.primitive.name](eqn, ins, path)
        self._sites(path, [r for r in outs if isinstance(r, int)])
        return outs

    def _inner(self, mult, jaxpr, consts, ins, path, loop: bool = True):
        """Walk a loop body (``loop``) or a branch; a body's nodes get a new ``Node.body``."""
        outer, self.mult = self.mult, mult
        first = len(self.g.nodes)
        try:
            return self.walk(jaxpr, consts, ins, path)
        finally:
            self.mult = outer
            if loop:
                for node in self.g.nodes[first:]:
                    if node.body < 0:  # nested bodies were numbered first
                        node.body = self.num_bodies
                self.num_bodies += 1

    def _carries(self, init_refs, where: str) -> list[int]:
        g, values = self.g, []
        for ref in init_refs:
            aval = g.aval(ref)
            operand = None if isinstance(ref, core.Literal) else ref
            node = g.add_node("carry", [operand], [aval], [aval], {}, self.mult, where)
            values.append(node.outputs[0])
        return values

    def _close_loop(self, carry_values, new_refs, mult: float, where: str):
        g = self.g
        for value_id, ref in zip(carry_values, new_refs, strict=False):
            operand = _materialize(g, ref, mult)
            node = g.add_node("carry_back", [operand], [g.aval(operand)], [], {}, mult, where)
            g.ties.append((g.values[value_id].producer, node.id))

    def _scan(self, eqn, ins, path):
        g, p = self.g, eqn.params
        nc, ncar, length = p["num_consts"], p["num_carry"], p["length"]
        body = p["jaxpr"]
        consts, init, xs = ins[:nc], ins[nc:nc + ncar], ins[nc + ncar:]
        carry = self._carries(init, f"scan carry (length {length})")
        slices = []
        for ref in xs:
            aval = g.aval(ref)
            operand = None if isinstance(ref, core.Literal) else ref
            node = g.add_node("xs", [operand], [aval], [_Aval(aval.shape[1:], aval.dtype)], {},
                              self.mult, "scan input slice")
            slices.append(node.outputs[0])
        self._sites(path, slices, prefix="xs")
        inner = self.mult * length
        first = len(g.nodes)
        outs = self._inner(inner, body.jaxpr, body.consts, list(consts) + carry + slices, path)
        self._accumulated(carry, outs[:ncar], first)
        self._close_loop(carry, outs[:ncar], inner, "scan carry")
        stacked = []
        for ref in outs[ncar:]:
            operand = _materialize(g, ref, inner)
            aval = g.aval(operand)
            node = g.add_node("ys", [operand], [aval],
                              [_Aval((length,) + aval.shape, aval.dtype)], {}, inner,
                              "scan stacked output")
            stacked.append(node.outputs[0])
        for value_id in slices:
            g.loop_ends[g.values[value_id].producer] = len(g.nodes) - 1
        return carry + stacked

    def _accumulated(self, carry_values, new_refs, first: int):
        """Mark the body nodes whose results a carry accumulates (``new = carry + increment``,
        a weight's gradient summed over the iterations): the ops that make the increment's
        partial sums (dots, reductions) and the linear ops after them. Summed on each device,
        the increment is reduced once after the loop (``top_mults``' deferred reductions)."""
        g = self.g
        for value_id, ref in zip(carry_values, new_refs, strict=False):
            if not isinstance(ref, int) or g.values[ref].producer < first:
                continue
            node = g.nodes[g.values[ref].producer]
            if node.kind not in ADDS or value_id not in node.operands:
                continue
            todo = [u for u in node.operands if u is not None and u != value_id]
            self.once[node.id] = self.mult
            while todo:
                producer = g.nodes[g.values[todo.pop()].producer]
                if producer.id < first or producer.id in self.once:
                    continue
                self.once[producer.id] = self.mult
                if producer.kind in SUM_LINEAR:
                    todo += [u for u in producer.operands if u is not None]

    def _while(self, eqn, ins, path):
        p = eqn.params
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, init = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
        carry = self._carries(init, "while carry")
        inner = self.mult * WHILE_TRIPS
        cj, bj = p["cond_jaxpr"], p["body_jaxpr"]
        self._inner(inner, cj.jaxpr, cj.consts, list(cconsts) + carry, path + (0,))
        outs = self._inner(inner, bj.jaxpr, bj.consts, list(bconsts) + carry, path + (1,))
        self._close_loop(carry, outs, inner, "while carry")
        return list(carry)

    def _cond(self, eqn, ins, path):
        g = self.g
        ops = ins[1:]
        branch_outs = [
            [_materialize(g, r, self.mult)
             for r in self._inner(self.mult, br.jaxpr, br.consts, ops, path + (b,),
                                  loop=False)]
            for b, br in enumerate(eqn.params["branches"])]
        outs = []
        for j, var in enumerate(eqn.outvars):
            operands = [bo[j] for bo in branch_outs]
            node = g.add_node("cond_out", operands, [g.aval(o) for o in operands], [var.aval],
                              {}, self.mult, "cond output")
            outs.append(node.outputs[0])
        return outs


__all__ = ["IDENTITIES", "INLINE_CALLS", "Graph", "Node", "Value", "build_graph"]
