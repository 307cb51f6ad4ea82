"""Strategies per primitive: a registry with one rule per primitive family.

A rule gets the shapes and params of one equation and returns its candidate strategies: the
spec of every output, the spec every operand must arrive in, and the communication the
strategy itself implies (an all-reduce after a contracting split, ...). Resharding an operand
into the required spec is not the rule's business; the solver prices it on the graph edge.
Shape-manipulating rules enumerate specs on one side and map them through the op; a spec that
does not map is simply not offered.

Dots, convolutions, gathers and scatters live in ``rules_linalg`` and register here on import.
"""

from __future__ import annotations

import math

from jax.sharding import PartitionSpec

from ..ir import _prims
from .cost import byte_cost
from .spec import Spec, dim_shards, from_partition_spec, is_valid, replicated, shards
from .strategy import (
    Strategy,
    nbytes,
    register,
    replicated_strategy,
)

ELEMENTWISE = _prims.ELEMENTWISE
"""Primitives whose output is split exactly like their full-rank operands."""


def _map_operand(spec: Spec, op_shape, out_shape) -> Spec:
    """Spec of a broadcasting operand of an elementwise op with output spec ``spec``."""
    if len(op_shape) == 0:
        return ()
    offset = len(out_shape) - len(op_shape)
    return tuple(spec[offset + d] if op_shape[d] == out_shape[offset + d] else ()
                 for d in range(len(op_shape)))


@register(*ELEMENTWISE)
def elementwise(ctx, in_avals, out_avals, params):
    out = out_avals[0]
    result = []
    for s in ctx.candidates(out.shape):
        ins = tuple(_map_operand(s, a.shape, out.shape) for a in in_avals)
        result.append(Strategy((s,) * len(out_avals), ins,
                               compute_s=byte_cost(nbytes(out), shards(s, ctx.mesh_shape))))
    return result


@register("iota", "rng_uniform", "empty")
def creation(ctx, in_avals, out_avals, params):
    out = out_avals[0]
    return [Strategy((s,), tuple(replicated(len(a.shape)) for a in in_avals))
            for s in ctx.candidates(out.shape)]


@register("random_bits")
def random_bits(ctx, in_avals, out_avals, params):
    """Counter-based (partitionable threefry) bits: any split of the output, keys whole."""
    return creation(ctx, in_avals, out_avals, params)


@register("reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
          "select_and_scatter_add", "select_and_gather_add", "select_and_scatter")
def windowed(ctx, in_avals, out_avals, params):
    """Pooling and its gradients: dims the window does not touch split like elementwise ops.

    A dim with window 1, stride 1, no padding and no dilation maps element to element between
    every operand and the output; the pooled (spatial) dims stay whole.
    """
    window = params["window_dimensions"]
    strides = params.get("window_strides") or (1,) * len(window)
    padding = params.get("padding") or ((0, 0),) * len(window)
    dilations = [params.get(k) or (1,) * len(window) for k in ("base_dilation", "window_dilation")]
    whole = {d for d in range(len(window)) if window[d] != 1 or strides[d] != 1 or tuple(
        padding[d]) != (0, 0) or any(dl[d] != 1 for dl in dilations)}
    out = out_avals[0]
    arrays = [a for a in in_avals if len(a.shape) == len(window)]
    result = []
    for s in ctx.candidates(out.shape):
        if any(s[d] for d in whole):
            continue
        ins = tuple(s if len(a.shape) == len(window) else replicated(len(a.shape))
                    for a in in_avals)
        result.append(Strategy((s,) * len(out_avals), ins, compute_s=byte_cost(
            sum(nbytes(a) for a in arrays), shards(s, ctx.mesh_shape))))
    return result


@register("sharding_constraint")
def user_constraint(ctx, in_avals, out_avals, params):
    """A user's ``with_sharding_constraint``: its spec is kept when it names the plan's mesh."""
    sharding, rank = params.get("sharding"), len(out_avals[0].shape)
    mesh = getattr(sharding, "mesh", None)
    sizes = dict(zip(ctx.axis_names, ctx.mesh_shape, strict=False))
    pspec = getattr(sharding, "spec", None)
    if mesh is not None and pspec is not None and all(
            sizes.get(n) == s for n, s in mesh.shape.items() if s > 1):
        entries = [pspec[d] if d < len(pspec) else None for d in range(rank)]
        free = {d for d, e in enumerate(entries) if e is PartitionSpec.UNCONSTRAINED}
        fixed = from_partition_spec(PartitionSpec(*[
            None if d in free else e for d, e in enumerate(entries)]), rank, ctx.axis_names)
        found = [s for s in ctx.candidates(out_avals[0].shape)
                 if all(s[d] == fixed[d] for d in range(rank) if d not in free)]
        if not free and fixed not in found:
            found = [fixed]
        return [Strategy((s,), (s,)) for s in found]
    ctx.dropped_constraints.add(f"{pspec} on mesh {dict(mesh.shape) if mesh else None}")
    return [Strategy((s,), (s,)) for s in ctx.candidates(out_avals[0].shape)]


@register("bitcast_convert_type")
def bitcast(ctx, in_avals, out_avals, params):
    """Same bit width: elementwise. A width change adds or drops a last dim: keep it whole."""
    if len(in_avals[0].shape) == len(out_avals[0].shape):
        return elementwise(ctx, in_avals, out_avals, params)
    return [replicated_strategy(in_avals, out_avals)]


@register("random_seed", "random_wrap", "random_unwrap", "random_split", "random_fold_in")
def key_ops(ctx, in_avals, out_avals, params):
    """Key arithmetic on a handful of keys: kept whole on every device."""
    return [replicated_strategy(in_avals, out_avals)]


@register("reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor",
          "argmax", "argmin")
def reduction(ctx, in_avals, out_avals, params, *, sums: bool = False):
    axes = set(params["axes"])
    x, out = in_avals[0], out_avals[0]
    is_arg = "index_dtype" in params
    result = []
    for s in ctx.candidates(x.shape):
        reduced = tuple(a for d in sorted(axes) for a in s[d])
        if reduced and is_arg:
            continue
        out_spec = tuple(s[d] for d in range(len(x.shape)) if d not in axes)
        group_bytes = nbytes(out) / shards(out_spec, ctx.mesh_shape)
        ins = (s,) + tuple(() for _ in in_avals[1:])
        compute = byte_cost(nbytes(x), shards(s, ctx.mesh_shape))
        if sums:
            result.extend(scattered_sums(ctx, out, out_spec, reduced, group_bytes, ins,
                                          compute, in_avals))
        comm, coll = ctx.all_reduce(reduced, group_bytes)
        result.append(Strategy((out_spec,), ins, comm, compute, coll))
    return result


@register("reduce_sum")
def reduce_sum(ctx, in_avals, out_avals, params):
    return reduction(ctx, in_avals, out_avals, params, sums=True)


def scattered_sums(ctx, out, out_spec, reduced, group_bytes, ins, compute, in_avals):
    """With ``ctx.scatter_reductions`` (``prefer_reduce_scatter``, or a user's memory budget),
    a sum over mesh axes may leave each device its slice of the result (a reduce-scatter
    into one of its dims) instead of all of it: a bias gradient, or an embedding's (a
    scatter-add of the batch's rows: ``rules_linalg._scatter``), can then be updated on shards
    like the kernels' (the cost decides between the two: ``build._prefer_reduce_scatter``)."""
    if not ctx.scatter_reductions or not reduced or in_avals[0].dtype.kind not in "fc":
        return []
    return reduce_scatters(ctx, out, out_spec, reduced, group_bytes, ins, compute)


def reduce_scatters(ctx, out, out_spec: Spec, axes, group_bytes: float, ins, compute: float
                    ) -> list[Strategy]:
    """The reduce-scatters of a sum over mesh ``axes`` whose result would have ``out_spec``:
    one per dim of the result that the axes can split, all of them on that one dim.

    A sum over several axes (a weight gradient with the batch split over two axes) is one
    reduce-scatter over all their devices, as XLA emits it (one collective over the product
    of the groups, scattered along one dim; a dim per axis would be an all-reduce and a
    slice on two dims, or one reduce-scatter per axis). Priced by the hierarchical rule of
    ``CostModel.collective`` on the group's whole array; the recorded bytes are what one
    device keeps."""
    axes = tuple(sorted(a for a in axes if ctx.mesh_shape[a] > 1))
    if not axes:
        return []
    cost = ctx.cost.collective("reduce-scatter", axes, group_bytes)
    kept = int(group_bytes) // dim_shards(axes, ctx.mesh_shape)
    found = []
    for d in range(len(out_spec)):
        spec = list(out_spec)
        spec[d] = tuple(sorted(spec[d] + axes))
        spec = tuple(spec)
        if is_valid(spec, tuple(out.shape), ctx.mesh_shape):
            found.append(Strategy((spec,), ins, cost, compute,
                                  (("reduce-scatter", axes, kept),)))
    return found


def _keep_dims_whole(ctx, in_avals, out_avals, whole: set[int]):
    """Output split like the operands except ``whole`` dims; all operands share the spec."""
    out = out_avals[0]
    result = []
    for s in ctx.candidates(out.shape):
        if any(s[d] for d in whole):
            continue
        ins = tuple(s if len(a.shape) == len(out.shape) else replicated(len(a.shape))
                    for a in in_avals)
        result.append(Strategy((s,) * len(out_avals), ins,
                               compute_s=byte_cost(nbytes(out), shards(s, ctx.mesh_shape))))
    return result


@register("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
def cumulative(ctx, in_avals, out_avals, params):
    return _keep_dims_whole(ctx, in_avals, out_avals, {params["axis"]})


@register("sort")
def sort(ctx, in_avals, out_avals, params):
    return _keep_dims_whole(ctx, in_avals, out_avals, {params["dimension"]})


@register("top_k")
def top_k(ctx, in_avals, out_avals, params):
    x = in_avals[0]
    return _keep_dims_whole(ctx, in_avals, out_avals, {len(x.shape) - 1})


@register("rev")
def rev(ctx, in_avals, out_avals, params):
    return _keep_dims_whole(ctx, in_avals, out_avals, set(params["dimensions"]))


@register("split")
def split(ctx, in_avals, out_avals, params):
    axis = params["axis"]
    x = in_avals[0]
    return [Strategy((s,) * len(out_avals), (s,)) for s in ctx.candidates(x.shape) if not s[axis]]


@register("concatenate")
def concatenate(ctx, in_avals, out_avals, params):
    return _keep_dims_whole(ctx, in_avals, out_avals, {params["dimension"]})


@register("pad")
def pad(ctx, in_avals, out_avals, params):
    changed = {d for d, cfg in enumerate(params["padding_config"]) if tuple(cfg) != (0, 0, 0)}
    out = out_avals[0]
    return [Strategy((s,), (s, ())) for s in ctx.candidates(out.shape)
            if not any(s[d] for d in changed)]


@register("slice")
def slice_(ctx, in_avals, out_avals, params):
    x = in_avals[0]
    strides = params.get("strides") or (1,) * len(x.shape)
    whole = {d for d in range(len(x.shape))
             if not (params["start_indices"][d] == 0 and params["limit_indices"][d] == x.shape[d]
                     and strides[d] == 1)}
    return [Strategy((s,), (s,)) for s in ctx.candidates(x.shape) if not any(s[d] for d in whole)]


@register("dynamic_slice")
def dynamic_slice(ctx, in_avals, out_avals, params):
    x = in_avals[0]
    sizes = params["slice_sizes"]
    whole = {d for d in range(len(x.shape)) if sizes[d] != x.shape[d]}
    rest = tuple(replicated(len(a.shape)) for a in in_avals[1:])
    return [Strategy((s,), (s,) + rest) for s in ctx.candidates(x.shape)
            if not any(s[d] for d in whole)]


@register("dynamic_update_slice")
def dynamic_update_slice(ctx, in_avals, out_avals, params):
    x, upd = in_avals[0], in_avals[1]
    whole = {d for d in range(len(x.shape)) if upd.shape[d] != x.shape[d]}
    rest = tuple(replicated(len(a.shape)) for a in in_avals[2:])
    return [Strategy((s,), (s, s) + rest) for s in ctx.candidates(x.shape)
            if not any(s[d] for d in whole)]


@register("broadcast_in_dim")
def broadcast_in_dim(ctx, in_avals, out_avals, params):
    x, out = in_avals[0], out_avals[0]
    dims = params["broadcast_dimensions"]
    result = []
    for s in ctx.candidates(out.shape):
        in_spec = tuple(s[dims[i]] if x.shape[i] == out.shape[dims[i]] else ()
                        for i in range(len(x.shape)))
        rest = tuple(replicated(len(a.shape)) for a in in_avals[1:])
        result.append(Strategy((s,), (in_spec,) + rest,
                               compute_s=byte_cost(nbytes(out), shards(s, ctx.mesh_shape))))
    return result


@register("transpose")
def transpose(ctx, in_avals, out_avals, params):
    perm = params["permutation"]
    out = out_avals[0]
    result = []
    for s in ctx.candidates(out.shape):
        in_spec = [()] * len(perm)
        for j, d in enumerate(perm):
            in_spec[d] = s[j]
        result.append(Strategy((s,), (tuple(in_spec),),
                               compute_s=byte_cost(nbytes(out), shards(s, ctx.mesh_shape))))
    return result


@register("squeeze")
def squeeze(ctx, in_avals, out_avals, params):
    x = in_avals[0]
    dims = {d % len(x.shape) for d in params["dimensions"]}
    keep = [d for d in range(len(x.shape)) if d not in dims]
    return [Strategy((tuple(s[d] for d in keep),), (s,)) for s in ctx.candidates(x.shape)
            if not any(s[d] for d in dims)]


@register("expand_dims")
def expand_dims(ctx, in_avals, out_avals, params):
    x, out = in_avals[0], out_avals[0]
    return reshape(ctx, [x], [out], {})


def reshape_groups(in_shape, out_shape) -> list[tuple[list[int], list[int]]] | None:
    """Pair up runs of input and output dims with equal products (None if impossible)."""
    groups, i, j = [], 0, 0
    n, m = len(in_shape), len(out_shape)
    while i < n or j < m:
        gi, gj, pi, pj = [], [], 1, 1
        while True:
            if i < n and (not gi or pi < pj):
                pi *= in_shape[i]
                gi.append(i)
                i += 1
            elif j < m and (not gj or pj < pi):
                pj *= out_shape[j]
                gj.append(j)
                j += 1
            else:
                break
        if pi != pj:
            return None
        groups.append((gi, gj))
    return groups


def map_reshape(spec: Spec, src_shape, dst_shape, groups, mesh_shape) -> Spec | None:
    """Map a spec through a reshape group by group: only the major non-1 dim may be split."""
    out = [()] * len(dst_shape)
    for src_dims, dst_dims in groups:
        src_big = [d for d in src_dims if src_shape[d] > 1]
        dst_big = [d for d in dst_dims if dst_shape[d] > 1]
        for d in src_dims:
            axes = spec[d]
            if not axes:
                continue
            if not src_big or d != src_big[0] or not dst_big:
                return None
            if dst_shape[dst_big[0]] % dim_shards(axes, mesh_shape):
                return None
            out[dst_big[0]] = axes
    return tuple(out)


@register("reshape")
def reshape(ctx, in_avals, out_avals, params):
    x, out = in_avals[0], out_avals[0]
    groups = reshape_groups(tuple(x.shape), tuple(out.shape))
    if groups is None or math.prod(x.shape) == 0:
        return []
    flipped = [(b, a) for a, b in groups]
    pairs: list[tuple[Spec, Spec]] = []
    for s in ctx.candidates(x.shape):
        o = map_reshape(s, x.shape, out.shape, groups, ctx.mesh_shape)
        if o is not None and (s, o) not in pairs:
            pairs.append((s, o))
    for o in ctx.candidates(out.shape):
        s = map_reshape(o, out.shape, x.shape, flipped, ctx.mesh_shape)
        if s is not None and (s, o) not in pairs:
            pairs.append((s, o))
    rest = tuple(replicated(len(a.shape)) for a in in_avals[1:])
    return [Strategy((o,), (s,) + rest) for s, o in pairs]

