"""Strategies of custom-partitioned operations (``autoshard.custom_partitioning`` or JAX's).

The operation is opaque, but its sharding rule is not: every mesh axis picks a factor of the
rule (or none) and the specs of all operands and results follow from the factors of their dims.
A split reduction factor leaves partial sums that the results all-reduce over; need-replication
and permutation factors are never split. A compound dim ``(a b)`` may only be split through its
major non-trivial factor (a contiguous block per device). Without a rule, the rule is probed
from ``infer_sharding_from_operands`` on an abstract mesh of the planned shape, and each
strategy's result specs are what that callback answers for the strategy's operand specs.
"""

from __future__ import annotations

import itertools
import math
import warnings

import jax
from jax.sharding import AbstractMesh, AxisType, NamedSharding

from .._cp_rules import FactorRule, from_sdy, probe_rule, resolve
from ..custom_partitioning import BoundOp
from ..ir._compat import cp_rule_types
from .cost import byte_cost
from .spec import from_partition_spec, is_valid, shards, to_partition_spec
from .strategy import RuleContext, Strategy, nbytes, register


def _abstract_mesh(mesh_shape) -> AbstractMesh:
    names = tuple(f"a{i}" for i in range(len(mesh_shape)))
    return AbstractMesh(tuple(mesh_shape), names, axis_types=(AxisType.Auto,) * len(names))


def _avals(avals):
    return tuple(jax.ShapeDtypeStruct(tuple(a.shape), a.dtype) for a in avals)


def _rule_and_infer(ctx: RuleContext, in_avals, out_avals, params):
    """The rule to cost, and a ``infer(mesh, arg_shapes)`` when the rule was probed from one."""
    op, mesh = params.get("partition"), _abstract_mesh(ctx.mesh_shape)
    if isinstance(op, BoundOp):
        if op.definition.rule is not None:
            return op.definition.rule, None
        name, infer, static = op.name, op.definition.infer, op.static_args
        in_tree, out_tree = op.in_tree, op.out.get("tree")
    else:
        rule = params.get("sharding_rule")
        if isinstance(rule, cp_rule_types().SdyShardingRule):
            return from_sdy(rule), None
        name, infer, static = "custom_partitioning", params.get(
            "infer_sharding_from_operands"), params.get("static_args", ())
        in_tree, out_tree = params.get("in_tree"), params.get("out_tree")
    if infer is None or out_tree is None:
        return None, None
    try:
        rule = probe_rule(infer, static, mesh, _avals(in_avals), in_tree, _avals(out_avals),
                          out_tree)
    except Exception as err:  # a user callback that needs real devices: plan it as opaque
        warnings.warn(f"autoshard: infer_sharding_from_operands of custom_partitioning {name!r} "
                      f"failed on an abstract mesh ({err}); the operation is planned replicated. "
                      "Give it a sharding_rule to plan through it.", stacklevel=2)
        return None, None

    def ask(arg_specs):
        args = [jax.ShapeDtypeStruct(tuple(a.shape), a.dtype, sharding=NamedSharding(
            mesh, to_partition_spec(s, mesh.axis_names))) for a, s in zip(in_avals, arg_specs,
                                                                          strict=True)]
        result_shape = jax.tree.unflatten(out_tree, list(_avals(out_avals)))
        got = out_tree.flatten_up_to(infer(*static, mesh, jax.tree.unflatten(in_tree, args),
                                           result_shape))
        return tuple(from_partition_spec(s.spec, len(o.shape), mesh.axis_names)
                     for s, o in zip(got, out_avals, strict=True))

    return rule, ask


def _dim_axes(dim, axes_of, sizes):
    """Mesh axes of one dim, or None when its split is not a contiguous block per device."""
    if len(dim) == 1:
        return axes_of.get(dim[0], ())
    split = [f for f in dim if axes_of.get(f)]
    if not split:
        return ()
    major = next((f for f in dim if sizes[f] > 1), dim[0])
    return axes_of[major] if split == [major] else None


@register("custom_partitioning")
def custom_partitioning(ctx: RuleContext, in_avals, out_avals, params):
    rule, ask = _rule_and_infer(ctx, in_avals, out_avals, params)
    if rule is None:
        return []
    return _factor_strategies(ctx, rule, ask, in_avals, out_avals)


def _factor_strategies(ctx: RuleContext, rule: FactorRule, ask, in_avals, out_avals):
    shapes = [tuple(a.shape) for a in list(in_avals) + list(out_avals)]
    r = resolve(rule, shapes[: len(in_avals)], shapes[len(in_avals):], "custom_partitioning")
    splittable = [f for f, n in r.sizes.items() if n > 1 and f not in rule.unsplittable]
    live = [a for a, n in enumerate(ctx.mesh_shape) if n > 1]
    found, seen = [], set()
    for choice in itertools.product([None] + splittable, repeat=len(live)):
        axes_of: dict[str, tuple[int, ...]] = {}
        for axis, factor in zip(live, choice, strict=True):
            if factor is not None:
                axes_of[factor] = axes_of.get(factor, ()) + (axis,)
        if any(r.sizes[f] % math.prod(ctx.mesh_shape[a] for a in axes) for f, axes in
               axes_of.items()):
            continue
        specs = [tuple(_dim_axes(d, axes_of, r.sizes) for d in dims) for dims in r.dims]
        if any(None in s or not is_valid(s, shape, ctx.mesh_shape)
               for s, shape in zip(specs, shapes, strict=True)):
            continue
        in_specs, out_specs = tuple(specs[: len(in_avals)]), tuple(specs[len(in_avals):])
        if ask is not None:
            out_specs = ask(in_specs)
        if (in_specs, out_specs) in seen:
            continue
        seen.add((in_specs, out_specs))
        reduced = tuple(sorted(a for f in rule.reduction for a in axes_of.get(f, ())))
        out_bytes = sum(nbytes(o) / shards(s, ctx.mesh_shape)
                        for o, s in zip(out_avals, out_specs, strict=True))
        comm, coll = ctx.all_reduce(reduced, out_bytes)
        compute = sum(byte_cost(nbytes(a), shards(s, ctx.mesh_shape)) for a, s in
                      zip(list(in_avals) + list(out_avals), in_specs + out_specs, strict=True))
        found.append(Strategy(out_specs, in_specs, comm, compute, coll))
    return found
