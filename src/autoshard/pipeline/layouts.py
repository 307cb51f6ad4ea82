"""Layouts across a pipeline: a value's spec on another sub-mesh, and the step inputs a task
replaces (shared by the runtime and the cluster pricing)."""

from __future__ import annotations

import math

import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..sharding.spec import candidate_specs, to_partition_spec


def carried_spec(src: NamedSharding, mesh, shape) -> P | None:
    """The spec on ``mesh`` whose shards are ``src``'s, device i of ``src``'s mesh standing for
    device i of ``mesh`` (so the move is one device-to-device copy), or None if none is."""
    return carried(src.spec, tuple(src.mesh.devices.shape), tuple(src.mesh.axis_names),
                   tuple(mesh.devices.shape), tuple(mesh.axis_names), tuple(shape))


def carried(spec, src_shape: tuple, src_names: tuple, dst_shape: tuple, dst_names: tuple,
            shape: tuple) -> P | None:
    """``carried_spec`` on mesh shapes alone (a described cluster has no devices): the spec on
    a ``dst_shape`` mesh holding, on its i-th device, what the i-th device of a ``src_shape``
    mesh holds of a value of ``shape`` laid out by ``spec``; None if no spec does."""
    if src_shape == dst_shape:
        rename = dict(zip(src_names, dst_names, strict=True))
        return P(*[None if e is None else tuple(rename[a] for a in e) if isinstance(e, tuple)
                   else rename[e] for e in spec])
    if math.prod(src_shape) != math.prod(dst_shape):
        return P() if all(e is None for e in spec) else None
    want = _placement(spec, src_shape, src_names, len(shape))
    for candidate in candidate_specs(shape, dst_shape):
        pspec = to_partition_spec(candidate, dst_names)
        if _placement(pspec, dst_shape, dst_names, len(shape)) == want:
            return pspec
    return None


def _placement(spec, mesh_shape: tuple, names: tuple, ndim: int) -> tuple:
    """(shards per dim, each device's shard index per dim), devices in mesh order."""
    sizes = dict(zip(names, mesh_shape, strict=True))
    entries = [() if e is None else tuple(e) if isinstance(e, tuple) else (e,)
               for e in list(spec) + [None] * (ndim - len(spec))]
    counts = tuple(math.prod(sizes[a] for a in axes) for axes in entries)
    shards = []
    for coords in np.ndindex(*mesh_shape):
        at = dict(zip(names, coords, strict=True))
        index = []
        for axes in entries:
            i = 0
            for a in axes:
                i = i * sizes[a] + at[a]
            index.append(i)
        shards.append(tuple(index))
    return counts, tuple(shards)


def step_aliases(task, jaxpr, aliases) -> list[tuple[int, int]]:
    """(input, output) positions in ``task`` of step inputs it replaces (the train state)."""
    consts = set(jaxpr.constvars)
    invars = [v for v in task.invars if v not in consts]
    out = []
    for i, o in aliases:
        v, w = jaxpr.invars[i], jaxpr.outvars[o]
        if v in invars and w in task.outvars and v.aval.shape == w.aval.shape:
            pair = (invars.index(v), task.outvars.index(w))
            if pair[0] not in [p[0] for p in out] and pair[1] not in [p[1] for p in out]:
                out.append(pair)
    return out


__all__ = ["carried_spec", "step_aliases"]
