"""Internal sharding specs: one tuple of mesh-axis indices per tensor dim.

``((0,), ())`` splits dim 0 over mesh axis 0 and keeps dim 1 whole; ``((0, 1),)`` splits dim 0
over axes 0 and 1 (axis 0 major). Axes inside one dim are kept in ascending order, so every
layout has exactly one spelling; that keeps strategies and plans comparable.
"""

from __future__ import annotations

import functools
import itertools
import math

from jax.sharding import PartitionSpec

Spec = tuple[tuple[int, ...], ...]


def replicated(rank: int) -> Spec:
    return ((),) * rank


def axis_dim(spec: Spec, axis: int) -> int | None:
    """The dim that ``axis`` splits in ``spec``, or None."""
    for d, axes in enumerate(spec):
        if axis in axes:
            return d
    return None


def axis_place(spec: Spec, axis: int):
    """Where ``axis`` sits in ``spec``: (dim, the axes more major than it on that dim), or None.

    Two specs agree on an axis only if it has the same place in both: with axes 0 and 1 on one
    dim, device (i, j) holds chunk 4i + j, so dropping the major axis 0 is no all-gather of the
    other's chunks; the minor axis 1 changes place and must move too.
    """
    for d, axes in enumerate(spec):
        if axis in axes:
            return d, axes[: axes.index(axis)]
    return None


def used_axes(spec: Spec) -> tuple[int, ...]:
    return tuple(sorted(a for axes in spec for a in axes))


def shards(spec: Spec, mesh_shape: tuple[int, ...]) -> int:
    return math.prod(mesh_shape[a] for axes in spec for a in axes)


def dim_shards(axes: tuple[int, ...], mesh_shape: tuple[int, ...]) -> int:
    return math.prod(mesh_shape[a] for a in axes)


def is_valid(spec: Spec, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> bool:
    """Each axis used once, ascending inside a dim, and every split dim divisible."""
    if len(spec) != len(shape):
        return False
    seen: set[int] = set()
    for axes, size in zip(spec, shape, strict=False):
        if list(axes) != sorted(axes) or seen & set(axes):
            return False
        seen |= set(axes)
        if axes and size % dim_shards(axes, mesh_shape) != 0:
            return False
    return True


@functools.lru_cache(maxsize=4096)
def candidate_specs(shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> list[Spec]:
    """Every valid spec of an array: each axis (of size > 1) on one dim or on none.

    Ordered: replicated first, then by the dims the axes pick, so the list is deterministic.
    """
    rank = len(shape)
    live = [a for a, n in enumerate(mesh_shape) if n > 1]
    out: list[Spec] = []
    for choice in itertools.product(range(-1, rank), repeat=len(live)):
        spec = [[] for _ in range(rank)]
        for a, d in zip(live, choice, strict=False):
            if d >= 0:
                spec[d].append(a)
        s = tuple(tuple(sorted(x)) for x in spec)
        if is_valid(s, shape, mesh_shape) and s not in out:
            out.append(s)
    return out


def from_assignment(rank: int, assignment: dict[int, int]) -> Spec:
    """Spec from {axis: dim}."""
    spec = [[] for _ in range(rank)]
    for a, d in sorted(assignment.items()):
        spec[d].append(a)
    return tuple(tuple(x) for x in spec)


def to_partition_spec(spec: Spec, axis_names: tuple[str, ...]) -> PartitionSpec:
    entries = []
    for axes in spec:
        if not axes:
            entries.append(None)
        elif len(axes) == 1:
            entries.append(axis_names[axes[0]])
        else:
            entries.append(tuple(axis_names[a] for a in axes))
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def from_partition_spec(pspec: PartitionSpec, rank: int, axis_names: tuple[str, ...]) -> Spec:
    index = {n: i for i, n in enumerate(axis_names)}
    spec = []
    for d in range(rank):
        entry = pspec[d] if d < len(pspec) else None
        if entry is None:
            spec.append(())
        elif isinstance(entry, str):
            spec.append((index[entry],))
        else:
            spec.append(tuple(index[n] for n in entry))
    return tuple(spec)
