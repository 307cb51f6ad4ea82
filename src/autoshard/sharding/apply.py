"""Apply a plan: re-evaluate the jaxpr with ``with_sharding_constraint`` on planned values.

The returned function is meant to be traced under ``jax.jit`` with the plan's input and output
shardings. It walks the jaxpr like the planner's graph builder (same ids), binds every
primitive, inlines calls, rebuilds loops with ``lax.scan`` / ``lax.while_loop`` /
``lax.switch`` so constraints can sit inside their bodies, and pins:

* the output of every node, followers included (dots, convs, gathers, reshapes, elementwise
  ops...),
* every loop carry at the start and the end of an iteration, and scanned slices,
* an operand whose required spec differs from its producer's (the planned resharding).

Values computed from constants only (iota, masks) are left to XLA, which slices them locally.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax import lax
from jax.extend import core
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._compat import bind_eqn
from .graph import IDENTITIES, INLINE_CALLS, Graph, build_graph
from .plan import ShardingPlan


class _Pins:
    def __init__(self, plan: ShardingPlan, mesh: Mesh):
        self.mesh = mesh
        self.values = {vid: NamedSharding(mesh, spec) for vid, spec in plan.intermediates}
        self.operands = {(nid, p): NamedSharding(mesh, spec)
                         for nid, p, spec in plan.operand_specs}

    def value(self, ref, x):
        sharding = self.values.get(ref) if isinstance(ref, int) else None
        if sharding is None or not _shardable(x):
            return x
        return lax.with_sharding_constraint(x, sharding)

    def operand(self, node_id, p, x):
        sharding = self.operands.get((node_id, p))
        if sharding is None or not _shardable(x):
            return x
        return lax.with_sharding_constraint(x, sharding)

    def sliced(self, ref, x, drop_leading: bool):
        """Pin a per-iteration slice with the spec of its stacked value (or the reverse)."""
        sharding = self.values.get(ref) if isinstance(ref, int) else None
        if sharding is None or not _shardable(x):
            return x
        spec = tuple(sharding.spec)
        spec = spec[1:] if drop_leading else (None,) + spec
        return lax.with_sharding_constraint(x, NamedSharding(self.mesh, PartitionSpec(*spec)))


def _shardable(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def apply_plan(closed_jaxpr: core.ClosedJaxpr, plan: ShardingPlan, mesh: Mesh) -> Callable:
    """``fn(*flat_args) -> list of flat outputs`` that follows ``plan`` on ``mesh``."""
    if tuple(mesh.shape.values()) != tuple(plan.mesh_shape) or tuple(mesh.axis_names) != tuple(
            plan.axis_names):
        raise ValueError(
            f"mesh {dict(mesh.shape)} does not match the plan's mesh "
            f"{dict(zip(plan.axis_names, plan.mesh_shape, strict=False))}; build it as "
            "Mesh(devices.reshape(plan.mesh_shape), plan.axis_names).")
    n_in, n_out = len(closed_jaxpr.jaxpr.invars), len(closed_jaxpr.jaxpr.outvars)
    graph = build_graph(closed_jaxpr, [""] * n_in, [""] * n_out)
    pins = _Pins(plan, mesh)

    def fn(*args):
        if len(args) != n_in:
            raise TypeError(f"the planned function takes {n_in} flat arguments, got {len(args)}.")
        return _eval(graph, pins, closed_jaxpr.jaxpr, closed_jaxpr.consts, list(args), ())

    return fn


def _eval(graph: Graph, pins: _Pins, jaxpr, consts, args, ctx):
    env = {}
    for var, c in zip(jaxpr.constvars, consts, strict=False):
        env[var] = c
    for var, a in zip(jaxpr.invars, args, strict=False):
        env[var] = a

    def read(atom):
        return atom.val if isinstance(atom, core.Literal) else env[atom]

    for i, eqn in enumerate(jaxpr.eqns):
        key = ctx + (i,)
        name = eqn.primitive.name
        ins = [read(a) for a in eqn.invars]
        refs = graph.eqn_outputs[key]
        if name in INLINE_CALLS:
            outs = _call(graph, pins, eqn, name, ins, key)
        elif name in IDENTITIES:
            outs = ins[: len(eqn.outvars)]
        elif name == "sharding_constraint":  # the user's pin, kept as the plan's pin
            outs = [pins.value(r, x) for r, x in zip(refs, ins, strict=False)]
        elif name == "scan":
            outs = _scan(graph, pins, eqn, ins, key)
        elif name == "while":
            outs = _while(graph, pins, eqn, ins, key)
        elif name == "cond":
            outs = _cond(graph, pins, eqn, ins, key)
        else:
            node_id = graph.values[refs[0]].producer if refs else None
            if node_id is not None:
                ins = [pins.operand(node_id, p, x) for p, x in enumerate(ins)]
            outs = bind_eqn(eqn, ins)
            outs = [pins.value(r, o) for r, o in zip(refs, outs, strict=False)]
        for var, o in zip(eqn.outvars, outs, strict=False):
            env[var] = o
    return [read(a) for a in jaxpr.outvars]


def _call(graph, pins, eqn, name, ins, key):
    sub = eqn.params[INLINE_CALLS[name]]
    jaxpr, consts = (sub.jaxpr, sub.consts) if isinstance(sub, core.ClosedJaxpr) else (sub, ())

    def body(*xs):
        return _eval(graph, pins, jaxpr, consts, list(xs), key)

    if name in ("remat2", "checkpoint", "remat"):
        body = jax.checkpoint(body, prevent_cse=eqn.params.get("prevent_cse", True),
                              policy=eqn.params.get("policy"))
    return list(body(*ins))


def _scan(graph, pins, eqn, ins, key):
    p = eqn.params
    nc, ncar = p["num_consts"], p["num_carry"]
    body = p["jaxpr"]
    consts, init, xs = ins[:nc], ins[nc:nc + ncar], ins[nc + ncar:]
    loop = graph.loops[key]
    carry_ids, slice_ids = loop["carry"], loop["xs"]
    out_refs = graph.eqn_outputs[key]
    init = [pins.value(v, x) for v, x in zip(carry_ids, init, strict=False)]
    xs = [pins.sliced(v, x, drop_leading=False) for v, x in zip(slice_ids, xs, strict=False)]

    def step(carry, x):
        carry = [pins.value(v, c) for v, c in zip(carry_ids, carry, strict=False)]
        x = [pins.value(v, xi) for v, xi in zip(slice_ids, x, strict=False)]
        outs = _eval(graph, pins, body.jaxpr, body.consts, list(consts) + carry + x, key)
        new = [pins.value(v, c) for v, c in zip(carry_ids, outs[:ncar], strict=False)]
        ys = [pins.sliced(r, y, drop_leading=True) for r, y in zip(out_refs[ncar:], outs[ncar:], strict=False)]
        return new, ys

    carry, ys = lax.scan(step, init, xs, length=p["length"], reverse=p["reverse"],
                         unroll=p["unroll"])
    ys = [pins.value(r, y) for r, y in zip(out_refs[ncar:], ys, strict=False)]
    return list(carry) + list(ys)


def _while(graph, pins, eqn, ins, key):
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
    carry_ids = graph.loops[key]["carry"]
    cj, bj = p["cond_jaxpr"], p["body_jaxpr"]
    init = [pins.value(v, x) for v, x in zip(carry_ids, init, strict=False)]

    def cond_fun(carry):
        return _eval(graph, pins, cj.jaxpr, cj.consts, list(cconsts) + list(carry), key + (0,))[0]

    def body_fun(carry):
        carry = [pins.value(v, c) for v, c in zip(carry_ids, carry, strict=False)]
        outs = _eval(graph, pins, bj.jaxpr, bj.consts, list(bconsts) + carry, key + (1,))
        return [pins.value(v, c) for v, c in zip(carry_ids, outs, strict=False)]

    return list(lax.while_loop(cond_fun, body_fun, init))


def _cond(graph, pins, eqn, ins, key):
    refs = graph.eqn_outputs[key]

    def branch_fn(b, br):
        def run(*ops):
            outs = _eval(graph, pins, br.jaxpr, br.consts, list(ops), key + (b,))
            return [pins.value(r, o) for r, o in zip(refs, outs, strict=False)]
        return run

    branches = [branch_fn(b, br) for b, br in enumerate(eqn.params["branches"])]
    return list(lax.switch(ins[0], branches, *ins[1:]))
