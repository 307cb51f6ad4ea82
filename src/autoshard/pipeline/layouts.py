"""Layouts across a pipeline: a value's spec on another sub-mesh, and the step inputs a task
replaces (shared by the runtime and the cluster pricing)."""

from __future__ import annotations

import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..ir import _compat
from ..sharding.spec import candidate_specs, to_partition_spec


def carried_spec(src: NamedSharding, mesh, shape) -> P | None:
    """The spec on ``mesh`` whose shards are ``src``'s, device i of ``src``'s mesh standing for
    device i of ``mesh`` (so the move is one device-to-device copy), or None if none is."""
    if tuple(src.mesh.devices.shape) == tuple(mesh.devices.shape):
        rename = dict(zip(src.mesh.axis_names, mesh.axis_names, strict=True))
        return P(*[None if e is None else tuple(rename[a] for a in e) if isinstance(e, tuple)
                   else rename[e] for e in src.spec])
    if src.mesh.devices.size != mesh.devices.size:
        return P() if src.is_fully_replicated else None
    like = _compat.make_auto_mesh(np.array(list(src.mesh.devices.flat), dtype=object).reshape(
        mesh.devices.shape), mesh.axis_names)
    for spec in candidate_specs(tuple(shape), tuple(mesh.devices.shape)):
        pspec = to_partition_spec(spec, tuple(mesh.axis_names))
        if NamedSharding(like, pspec).is_equivalent_to(src, len(shape)):
            return pspec
    return None


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
