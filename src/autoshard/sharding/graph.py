"""The planner's graph: one node per equation of the flattened jaxpr, one value per array.

Calls (``jit``, ``closed_call``, ``custom_jvp_call``, ``custom_vjp_call``, ``custom_vmap_call``,
``remat``) are inlined; identities (pipeline markers, optimization barriers, device_put)
forward their operands; a user's sharding constraint is a node whose spec is the user's. Loops get extra nodes so that a loop-carried value has one
spec for all iterations:

* ``carry``: the value inside the loop; its operand is the initial value (resharded once).
* ``carry_back``: consumes the body's new carry and is tied to ``carry`` (same ILP variable).
* ``xs``: a per-iteration slice of a scanned input; ``ys``: the stacked per-iteration outputs.

Costs inside a scan body count ``length`` times (``Node.mult``). Every node and value gets its
id in program order, so two builds of the same jaxpr give the same ids (``apply_plan`` relies
on it through ``Graph.eqn_outputs`` and ``Graph.loops``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jax.extend import core

INLINE_CALLS = {
    "jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr", "remat2": "jaxpr", "checkpoint": "jaxpr",
    "remat": "jaxpr", "custom_vmap_call": "call",
}
IDENTITIES = {"pipeline_marker", "optimization_barrier", "device_put", "mesh_cast", "reshard"}
"""Forwarded as their operands. A user's ``sharding_constraint`` is a node of its own: the
planner keeps it as a pin (``rules.user_constraint``)."""
WHILE_TRIPS = 1
"""Iterations assumed for a while loop (unknown statically)."""

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
    eqn_outputs: dict[tuple, list[Ref]] = field(default_factory=dict)
    """(context, equation index) -> refs of its outputs."""
    loops: dict[tuple, dict] = field(default_factory=dict)
    """(context, equation index) -> value ids of carries and scanned slices of a loop."""
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


def build_graph(closed_jaxpr: core.ClosedJaxpr, in_paths, out_paths) -> Graph:
    g = Graph()
    refs = []
    for i, var in enumerate(closed_jaxpr.jaxpr.invars):
        node = g.add_node("input", [], [], [var.aval], {}, 1.0, in_paths[i], index=i)
        g.inputs.append(node.id)
        refs.append(node.outputs[0])
    outs = _walk(g, closed_jaxpr.jaxpr, closed_jaxpr.consts, refs, (), 1.0)
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


def _walk(g: Graph, jaxpr: core.Jaxpr, consts, in_refs, ctx: tuple, mult: float) -> list[Ref]:
    env: dict[Any, Ref] = {}
    for var in jaxpr.constvars[: len(consts)]:
        env[var] = g.add_node("const", [], [], [var.aval], {}, mult, "constant").outputs[0]
    assert len(jaxpr.invars) == len(in_refs), (len(jaxpr.invars), len(in_refs))
    for var, ref in zip(jaxpr.invars, in_refs, strict=False):
        env[var] = ref

    def read(atom):
        return atom if isinstance(atom, core.Literal) else env[atom]

    for i, eqn in enumerate(jaxpr.eqns):
        name = eqn.primitive.name
        ins = [read(a) for a in eqn.invars]
        key = ctx + (i,)
        if name in INLINE_CALLS:
            sub = eqn.params[INLINE_CALLS[name]]
            if isinstance(sub, core.ClosedJaxpr):
                outs = _walk(g, sub.jaxpr, sub.consts, ins, key, mult)
            else:
                outs = _walk(g, sub, (), ins, key, mult)
        elif name in IDENTITIES:
            outs = ins[: len(eqn.outvars)]
        elif name == "scan":
            outs = _scan(g, eqn, ins, key, mult)
        elif name == "while":
            outs = _while(g, eqn, ins, key, mult)
        elif name == "cond":
            outs = _cond(g, eqn, ins, key, mult)
        else:
            node = g.add_node(name, [None if isinstance(r, core.Literal) else r for r in ins],
                              [g.aval(r) for r in ins], [v.aval for v in eqn.outvars],
                              eqn.params, mult, _where(eqn, name))
            outs = list(node.outputs)
        g.eqn_outputs[key] = list(outs)
        for var, ref in zip(eqn.outvars, outs, strict=False):
            env[var] = ref
    return [read(a) for a in jaxpr.outvars]


def _where(eqn, name: str) -> str:
    shapes = ",".join("x".join(map(str, v.aval.shape)) or "()" for v in eqn.invars
                      if hasattr(v.aval, "shape"))
    return f"{name}[{shapes}]"


def _carries(g: Graph, init_refs, mult: float, where: str) -> list[int]:
    values = []
    for ref in init_refs:
        aval = g.aval(ref)
        operand = None if isinstance(ref, core.Literal) else ref
        node = g.add_node("carry", [operand], [aval], [aval], {}, mult, where)
        values.append(node.outputs[0])
    return values


def _close_loop(g: Graph, carry_values, new_refs, mult: float, where: str):
    for value_id, ref in zip(carry_values, new_refs, strict=False):
        operand = _materialize(g, ref, mult)
        node = g.add_node("carry_back", [operand], [g.aval(operand)], [], {}, mult, where)
        g.ties.append((g.values[value_id].producer, node.id))


def _scan(g: Graph, eqn, ins, key, mult):
    p = eqn.params
    nc, ncar, length = p["num_consts"], p["num_carry"], p["length"]
    body = p["jaxpr"]
    consts, init, xs = ins[:nc], ins[nc:nc + ncar], ins[nc + ncar:]
    carry = _carries(g, init, mult, f"scan carry (length {length})")
    slices = []
    for ref in xs:
        aval = g.aval(ref)
        operand = None if isinstance(ref, core.Literal) else ref
        node = g.add_node("xs", [operand], [aval], [_Aval(aval.shape[1:], aval.dtype)], {},
                          mult, "scan input slice")
        slices.append(node.outputs[0])
    inner = mult * length
    outs = _walk(g, body.jaxpr, body.consts, list(consts) + carry + slices, key, inner)
    _close_loop(g, carry, outs[:ncar], inner, "scan carry")
    stacked = []
    for ref in outs[ncar:]:
        operand = _materialize(g, ref, inner)
        aval = g.aval(operand)
        node = g.add_node("ys", [operand], [aval], [_Aval((length,) + aval.shape, aval.dtype)],
                          {}, inner, "scan stacked output")
        stacked.append(node.outputs[0])
    g.loops[key] = {"carry": carry, "xs": slices}
    return carry + stacked


def _while(g: Graph, eqn, ins, key, mult):
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
    carry = _carries(g, init, mult, "while carry")
    inner = mult * WHILE_TRIPS
    cj, bj = p["cond_jaxpr"], p["body_jaxpr"]
    _walk(g, cj.jaxpr, cj.consts, list(cconsts) + carry, key + (0,), inner)
    outs = _walk(g, bj.jaxpr, bj.consts, list(bconsts) + carry, key + (1,), inner)
    _close_loop(g, carry, outs, inner, "while carry")
    g.loops[key] = {"carry": carry, "xs": []}
    return list(carry)


def _cond(g: Graph, eqn, ins, key, mult):
    branches = eqn.params["branches"]
    ops = ins[1:]
    branch_outs = [
        [_materialize(g, r, mult) for r in _walk(g, br.jaxpr, br.consts, ops, key + (b,), mult)]
        for b, br in enumerate(branches)]
    outs = []
    for j, var in enumerate(eqn.outvars):
        operands = [bo[j] for bo in branch_outs]
        node = g.add_node("cond_out", operands, [g.aval(o) for o in operands], [var.aval], {},
                          mult, "cond output")
        outs.append(node.outputs[0])
    return outs
