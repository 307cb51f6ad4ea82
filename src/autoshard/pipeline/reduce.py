"""A stage's once-per-step reduction of its partial gradient accumulators, as the audit sees it."""

from __future__ import annotations

import dataclasses

import numpy as np

from .compile import acc_dtype


class ReduceTask:
    """A stage's once-per-step reduction of its partial accumulators (with the finalisation:
    mean, dtype), as the audit reads it: compiled, no plan, its reductions predicted."""

    plan = None

    def __init__(self, stage: int, mesh, compiled, predicted: dict):
        self.stage, self.mesh, self.compiled = stage, mesh, compiled
        self.task = dataclasses.make_dataclass("Named", ["name"])(f"reduce{stage}")
        self.predicted = predicted
        """(collective kind, batch axes) -> bytes of its results on one device per step."""


def reduce_prediction(reduced, batch_axes_of) -> dict:
    """The collectives summing partial accumulators: per value, an all-reduce over its batch
    axes into a result replicated over them, else a reduce-scatter into the result's shard."""
    out: dict = {}
    for v, sh in reduced:
        axes = batch_axes_of[v]
        num_bytes = int(np.prod(sh.shard_shape(v.aval.shape))) * acc_dtype(
            v.aval.dtype).itemsize
        used = {a for e in sh.spec if e is not None
                for a in ((e,) if isinstance(e, str) else e)} & set(axes)
        kind = "reduce-scatter" if used else "all-reduce"
        if used and sh.mesh.devices.flat[0].platform == "cpu":
            # XLA:CPU all-reduces the whole value, then slices (as ``sharding.audit`` counts)
            sizes = dict(zip(sh.mesh.axis_names, sh.mesh.devices.shape, strict=True))
            kind, num_bytes = "all-reduce", num_bytes * int(np.prod([sizes[a] for a in used]))
        out[(kind, axes)] = out.get((kind, axes), 0) + num_bytes
    return out


__all__ = ["ReduceTask", "reduce_prediction"]
