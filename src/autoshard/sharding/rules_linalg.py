"""Rules of the heavy primitives: dot_general, conv_general_dilated, gather, scatter.

Each enumerates, per mesh axis, which role the axis takes (a batch dim, a free dim of one side,
a contracting dim, ...) and derives operand and output specs from the roles. Splitting a
contracting dim leaves partial sums: the strategy pays an all-reduce over that axis, or a
reduce-scatter into an output dim where ``RuleContext.scatter_reductions`` is set. Heavy ops (dots and
convolutions) are not recomputed on several devices: strategies that leave a mesh axis unused
are dropped when a strategy using every axis exists (Alpa's ``allow_recompute_heavy_op=False``).
"""

from __future__ import annotations

import itertools
import math

from ..ir._prims import conv_flops, dot_flops
from .cost import byte_cost, flop_cost
from .rules import reduce_scatters, scattered_sums
from .spec import Spec, from_assignment, is_valid, shards
from .strategy import RuleContext, Strategy, nbytes, register


def _live_axes(ctx: RuleContext) -> list[int]:
    return [a for a, n in enumerate(ctx.mesh_shape) if n > 1]


def _enumerate_roles(ctx: RuleContext, roles: list):
    """Every assignment of a role (or None) to each live mesh axis."""
    live = _live_axes(ctx)
    for choice in itertools.product([None] + roles, repeat=len(live)):
        yield dict(zip(live, choice, strict=False))


def _heavy_filter(ctx: RuleContext, found: list[tuple[int, Strategy]], flops: float
                  ) -> list[Strategy]:
    """Keep strategies that use every live axis, when any does (found: (num axes used, s)).

    A light op (``flops`` at most ``ctx.light_flops``) keeps them all: recomputing a small
    projection (an input stem, a classifier head) on every device can save a collective of its
    output that costs more than the repeated FLOPs, as Megatron's hand-written plans do.
    """
    live = len(_live_axes(ctx))
    full = [s for used, s in found if used == live]
    if full and not ctx.allow_recompute_heavy_op and flops > ctx.light_flops:
        return full
    return [s for _, s in found]


def heaviest_flops(nodes, values) -> float:
    """The FLOPs of the program's largest dot or convolution (one execution, loops included)."""
    best = 0.0
    for node in nodes:
        out = values[node.outputs[0]].shape if node.outputs else ()
        if node.kind == "dot_general":
            best = max(best, dot_flops(node.in_avals[0].shape, out, node.params))
        elif node.kind == "conv_general_dilated":
            best = max(best, conv_flops(node.in_avals[0].shape, node.in_avals[1].shape, out,
                                        node.params))
    return best


def _contracting(ctx, out_spec: Spec, out_aval, axes, found, used, ins, compute):
    """Append the strategies of a contracting split over ``axes``: all-reduce, or reduce-scatter.

    With ``ctx.scatter_reductions`` a split whose result can be scattered over its axes (all
    of them on one dim: ``rules.reduce_scatters``) offers reduce-scatters beside the
    all-reduce. Under ``prefer_reduce_scatter`` ``build`` keeps the
    all-reduce only where the result feeds later heavy ops (an activation, as in Alpa), so a
    gradient is reduce-scattered: the optimizer update then runs on shards and the updated
    values are all-gathered where they are needed whole (ZeRO-2-like). Under a user's memory
    budget both stay and the cost decides where the result feeds no later heavy op (``build.
    _scatter_gradients_only`` prices the others' out): a weight gradient contracted over the
    batch on one axis can then be reduced straight into the (batch axis, model axis) shard its
    update runs on, as an FSDP x TP plan does, instead of gathering the batch to split the
    free dims.
    """
    group_bytes = nbytes(out_aval) / shards(out_spec, ctx.mesh_shape)
    if ctx.scatter_reductions:
        found.extend((used, s) for s in reduce_scatters(ctx, out_aval, out_spec, axes,
                                                         group_bytes, ins, compute))
    comm, coll = ctx.all_reduce(axes, group_bytes)
    found.append((used, Strategy((out_spec,), ins, comm, compute, coll)))


@register("dot_general")
def dot_general(ctx: RuleContext, in_avals, out_avals, params):
    lhs, rhs = in_avals[0], in_avals[1]
    out = out_avals[0]
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    lfree = [d for d in range(len(lhs.shape)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rhs.shape)) if d not in rc and d not in rb]
    nb = len(lb)
    roles = ([("b", i) for i in range(nb)] + [("l", i) for i in range(len(lfree))]
             + [("r", i) for i in range(len(rfree))] + [("c", i) for i in range(len(lc))])
    flops = dot_flops(lhs.shape, out.shape, params)
    found = []
    for assign in _enumerate_roles(ctx, roles):
        la, ra, oa, contract = {}, {}, {}, []
        for axis, role in assign.items():
            if role is None:
                continue
            kind, i = role
            if kind == "b":
                la[axis], ra[axis], oa[axis] = lb[i], rb[i], i
            elif kind == "l":
                la[axis], oa[axis] = lfree[i], nb + i
            elif kind == "r":
                ra[axis], oa[axis] = rfree[i], nb + len(lfree) + i
            else:
                la[axis], ra[axis] = lc[i], rc[i]
                contract.append(axis)
        specs = _valid_specs(ctx, (lhs, rhs, out), (la, ra, oa))
        if specs is not None:
            _take(ctx, assign, specs, out, contract, found, flops)
    return _heavy_filter(ctx, found, flops)


@register("conv_general_dilated")
def conv(ctx: RuleContext, in_avals, out_avals, params):
    lhs, rhs = in_avals[0], in_avals[1]
    out = out_avals[0]
    dn = params["dimension_numbers"]
    lspec, rspec, ospec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    groups = params.get("feature_group_count", 1)
    batch_groups = params.get("batch_group_count", 1)
    roles = ["batch"] if batch_groups == 1 else []
    if groups == 1 and batch_groups == 1:
        roles += ["out_feature", "in_feature"]
    elif groups > 1 and batch_groups == 1:
        roles += ["group"]  # grouped/depthwise: whole groups of in and out features per device
    elif groups == 1:
        # batch groups (the kernel gradient of a grouped conv): whole groups of lhs batch rows
        # and of out features per device, or a split of the contracted lhs features
        roles += ["batch_group", "in_feature"]
    flops = conv_flops(lhs.shape, rhs.shape, out.shape, params)
    found = []
    for assign in _enumerate_roles(ctx, roles):
        la, ra, oa, contract = {}, {}, {}, []
        for axis, role in assign.items():
            if role == "batch":
                la[axis], oa[axis] = lspec[0], ospec[0]
            elif role == "out_feature":
                ra[axis], oa[axis] = rspec[0], ospec[1]
            elif role == "in_feature":
                la[axis], ra[axis] = lspec[1], rspec[1]
                contract.append(axis)
            elif role == "group":
                la[axis], ra[axis], oa[axis] = lspec[1], rspec[0], ospec[1]
            elif role == "batch_group":
                la[axis], ra[axis], oa[axis] = lspec[0], rspec[0], ospec[1]
        specs = _valid_specs(ctx, (lhs, rhs, out), (la, ra, oa))
        grouped = math.prod(ctx.mesh_shape[a] for a, r in assign.items()
                            if r in ("group", "batch_group"))
        if specs is not None and groups * batch_groups % grouped == 0:
            _take(ctx, assign, specs, out, contract, found, flops)
    return _heavy_filter(ctx, found, flops)


def _take(ctx: RuleContext, assign: dict, specs, out, contract: list, found: list, flops):
    """Record the strategy of one valid assignment of mesh axes to a product's roles: its
    compute split over the axes given a role, its reductions over the contracted ones."""
    ls, rs, os_ = specs
    used = sum(1 for r in assign.values() if r is not None)
    pieces = math.prod(ctx.mesh_shape[a] for a, r in assign.items() if r is not None)
    _contracting(ctx, os_, out, tuple(contract), found, used, (ls, rs), flop_cost(flops, pieces))


def _gather_maps(operand_rank, indices_rank, out_rank, dn, slice_sizes, operand_shape):
    """Roles of a gather: (name, out dim or None, operand dim or None, indices dim or None)."""
    batch_out = [d for d in range(out_rank) if d not in dn.offset_dims]
    index_dims = list(range(indices_rank - 1))  # the last indices dim holds the index vector
    roles = []
    for out_d, idx_d in zip(batch_out, index_dims, strict=False):
        op_d = None
        if idx_d in dn.start_indices_batching_dims:
            op_d = dn.operand_batching_dims[dn.start_indices_batching_dims.index(idx_d)]
        roles.append(("batch", out_d, op_d, idx_d))
    window = [d for d in range(operand_rank)
              if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
    for out_d, op_d in zip(dn.offset_dims, window, strict=False):
        if slice_sizes[op_d] == operand_shape[op_d]:
            roles.append(("offset", out_d, op_d, None))
    for op_d in dn.collapsed_slice_dims:
        if op_d in dn.start_index_map and slice_sizes[op_d] == 1:
            roles.append(("table", None, op_d, None))
    return roles


@register("gather")
def gather(ctx: RuleContext, in_avals, out_avals, params):
    operand, indices = in_avals[0], in_avals[1]
    out = out_avals[0]
    dn = params["dimension_numbers"]
    roles = _gather_maps(len(operand.shape), len(indices.shape), len(out.shape), dn,
                         params["slice_sizes"], operand.shape)
    result = []
    for assign in _enumerate_roles(ctx, roles):
        split = _role_specs(ctx, assign, (out, operand, indices), partial_role="table")
        if split is None:
            continue
        (os_, xs, is_), partial = split
        comm, coll = ctx.all_reduce(partial, nbytes(out) / shards(os_, ctx.mesh_shape))
        result.append(Strategy((os_,), (xs, is_), comm,
                               byte_cost(nbytes(out), shards(os_, ctx.mesh_shape)), coll))
    return result


def _role_specs(ctx: RuleContext, assign, avals, *, partial_role: str):
    """Specs of ``avals`` under an assignment of mesh axes to roles, and the partial axes.

    A role is ``(name, dim of avals[0], dim of avals[1], ...)`` with None where the role does
    not touch that array. Returns None when a spec does not divide its array.
    """
    per_array = [{} for _ in avals]
    partial = []
    for axis, role in assign.items():
        if role is None:
            continue
        name, *dims = role
        for k, d in enumerate(dims):
            if d is not None:
                per_array[k][axis] = d
        if name == partial_role:
            partial.append(axis)
    specs = _valid_specs(ctx, avals, per_array)
    return None if specs is None else (specs, tuple(partial))


def _valid_specs(ctx: RuleContext, avals, assignments):
    """One spec per aval from its {mesh axis: dim} assignment; None if one does not divide."""
    specs = tuple(from_assignment(len(a.shape), m)
                  for a, m in zip(avals, assignments, strict=True))
    if not all(is_valid(sp, tuple(a.shape), ctx.mesh_shape)
               for sp, a in zip(specs, avals, strict=True)):
        return None
    return specs


@register("scatter-add", "scatter_add")
def scatter_add(ctx: RuleContext, in_avals, out_avals, params):
    return _scatter(ctx, in_avals, out_avals, params, is_add=True)


@register("scatter", "scatter-mul", "scatter_mul", "scatter-min", "scatter_min", "scatter-max",
          "scatter_max")
def scatter(ctx: RuleContext, in_avals, out_avals, params):
    return _scatter(ctx, in_avals, out_avals, params, is_add=False)


def _scatter(ctx: RuleContext, in_avals, out_avals, params, *, is_add: bool):
    operand, indices, updates = in_avals[0], in_avals[1], in_avals[2]
    dn = params["dimension_numbers"]
    update_scatter = [d for d in range(len(updates.shape)) if d not in dn.update_window_dims]
    index_dims = list(range(len(indices.shape) - 1))
    window = [d for d in range(len(operand.shape))
              if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
    roles = []
    for up_d, op_d in zip(dn.update_window_dims, window, strict=False):
        if updates.shape[up_d] == operand.shape[op_d]:
            roles.append(("window", op_d, up_d, None))
    for up_d, idx_d in zip(update_scatter, index_dims, strict=False):
        if idx_d in dn.scatter_indices_batching_dims:
            op_d = dn.operand_batching_dims[dn.scatter_indices_batching_dims.index(idx_d)]
            roles.append(("batched", op_d, up_d, idx_d))
        elif is_add:
            roles.append(("partial", None, up_d, idx_d))
    for op_d in dn.inserted_window_dims:
        if op_d in dn.scatter_dims_to_operand_dims:
            roles.append(("table", op_d, None, None))
    result = []
    for assign in _enumerate_roles(ctx, roles):
        split = _role_specs(ctx, assign, (operand, updates, indices), partial_role="partial")
        if split is None:
            continue
        (xs, us, is_), partial = split
        out = out_avals[0]
        group_bytes = nbytes(out) / shards(xs, ctx.mesh_shape)
        compute = byte_cost(nbytes(updates), shards(us, ctx.mesh_shape))
        if is_add:  # an embedding's gradient: reduce-scattered like a kernel's, where offered
            live = tuple(a for a in partial if ctx.mesh_shape[a] > 1)
            result.extend(scattered_sums(ctx, out, xs, live, group_bytes, (xs, is_, us),
                                          compute, in_avals))
        comm, coll = ctx.all_reduce(partial, group_bytes)
        result.append(Strategy((xs,), (xs, is_, us), comm, compute, coll))
    return result
