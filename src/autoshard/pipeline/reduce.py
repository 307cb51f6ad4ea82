"""Once-per-step gradient reduction: a backward task keeps its accumulated gradients as partial
sums over its stage's batch axes, and the stage's reduce task sums them before apply-grad.

A backward task whose micro-batch rows arrive split over some mesh axes (its *batch axes*) runs
per device over them (``compile._local_task``: a ``shard_map`` manual over the batch axes, auto
over the others) and its accumulators gain a leading dim of one partial sum per device group.
Its plan is the one ``plan_auto`` gives the task, less the reductions over the batch axes the
plan placed in it (``without_batch_reductions``): those run once per step, in the reduce task,
as ``reduce_prediction`` predicts and ``reduce_seconds`` prices. The runtime and the cluster
pricing both use these, so the priced task plans are the compiled ones.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ..sharding.plan import spec_axes

REDUCTIONS = ("all-reduce", "reduce-scatter")


def acc_dtype(dtype):
    """The dtype gradients accumulate in: float32 for narrower floats."""
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
        return jnp.float32
    return dtype


class ReduceTask:
    """A stage's once-per-step reduction of its partial accumulators (with the finalisation:
    mean, dtype), as the audit reads it: compiled, no plan, its reductions predicted."""

    plan = None

    def __init__(self, stage: int, mesh, compiled, predicted: dict):
        self.stage, self.mesh, self.compiled = stage, mesh, compiled
        self.task = dataclasses.make_dataclass("Named", ["name"])(f"reduce{stage}")
        self.predicted = predicted
        """(collective kind, batch axes) -> bytes of its results on one device per step."""


def without_batch(entry, batch_axes):
    """A PartitionSpec entry with the batch axes left out."""
    axes = tuple(a for a in spec_axes(entry) if a not in batch_axes)
    return None if not axes else axes[0] if len(axes) == 1 else axes


def stacked_spec(spec, batch_axes) -> P:
    """The spec of a partial accumulator ``(groups, *shape)``: one partial sum per group of
    the batch axes on dim 0, the other dims as ``spec`` splits them over the other axes."""
    entry = batch_axes if len(batch_axes) > 1 else batch_axes[0]
    return P(entry, *[without_batch(e, batch_axes) for e in spec])


def without_batch_reductions(plan, batch_axes):
    """``plan`` with its reductions over the batch axes left out (and their seconds out of its
    objective): the task runs per device over those axes and they run in the reduce task."""
    batch = set(batch_axes)
    dropped = [c for c in plan.collectives if c.kind in REDUCTIONS and batch & set(c.axes)]
    if not dropped:
        return plan
    kept = tuple(c for c in plan.collectives if c not in dropped)
    saved = sum(c.cost_s for c in dropped)
    objective = dataclasses.replace(
        plan.objective, communication_s=max(0.0, plan.objective.communication_s - saved))
    note = (f"run per device over the batch axes {tuple(batch_axes)}: {len(dropped)} "
            f"reduction(s) over them ({saved:.3g} s) left to the stage's once-per-step reduce "
            "task")
    return dataclasses.replace(plan, collectives=kept, objective=objective,
                               notes=plan.notes + (note,))


def reduce_prediction(reduced, batch_axes_of) -> dict:
    """The collectives summing partial accumulators: per value ``(var, accumulator sharding,
    result sharding)``, an all-reduce over its batch axes of its accumulated shard, into a
    result replicated over them (else a reduce-scatter into the result's shard), then an
    all-gather over the other axes that split the accumulator but not the result."""
    out: dict = {}

    def add(key, num_bytes):
        out[key] = out.get(key, 0) + int(num_bytes)

    for v, acc_sh, sh in reduced:
        axes = batch_axes_of[v]
        mesh = sh.mesh
        sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
        itemsize = acc_dtype(v.aval.dtype).itemsize
        total = math.prod(v.aval.shape) * itemsize
        model = {a for e in acc_sh.spec[1:] for a in spec_axes(e)}
        out_axes = {a for e in sh.spec for a in spec_axes(e)}
        shard = total // math.prod(sizes[a] for a in model)  # the accumulated shard
        used = out_axes & set(axes)
        if used and mesh.devices.flat[0].platform != "cpu":
            add(("reduce-scatter", axes), shard // math.prod(sizes[a] for a in used))
        else:  # XLA:CPU all-reduces the whole value, then slices (as ``sharding.audit``)
            add(("all-reduce", axes), shard)
        gather = tuple(a for a in mesh.axis_names if a in model - out_axes and sizes[a] > 1)
        if gather:
            add(("all-gather", gather), int(np.prod(sh.shard_shape(v.aval.shape))) * itemsize)
    return out


def reduce_seconds(costs, axis_names, values) -> float:
    """Seconds of a stage's reduce task on a ``sharding.cost.CostModel``: per ``(bytes of the
    accumulated shard, batch axes)``, one all-reduce over the batch axes."""
    index = {a: i for i, a in enumerate(axis_names)}
    return sum(costs.collective("all-reduce", tuple(index[a] for a in axes), num_bytes)
               for num_bytes, axes in values)


__all__ = ["ReduceTask", "acc_dtype", "reduce_prediction", "reduce_seconds", "stacked_spec",
           "without_batch_reductions"]
