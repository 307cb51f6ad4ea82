"""Once-per-step gradient reduction: a backward task keeps its accumulated gradients as partial
sums over its stage's batch axes, and the stage's reduce task sums them before apply-grad.

A backward task whose micro-batch rows arrive split over some mesh axes (its *batch axes*) runs
per device over them (``taskfn.local_task``: a ``shard_map`` manual over the batch axes, auto
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

from ..sharding.plan import Collective, spec_axes
from ..sharding.spec import axis_place

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


def rows_first(spec, batch_axes) -> P:
    """A micro-batch-row value's spec in a task run per device over the batch axes: dim 0
    split over them first (then any other axes ``spec`` puts on dim 0), the other dims as
    ``spec`` splits them over the other axes. Each device's rows stay where they are."""
    entries = list(spec) or [None]
    head = tuple(batch_axes) + tuple(a for a in spec_axes(entries[0]) if a not in batch_axes)
    return P(head if len(head) > 1 else head[0],
             *[without_batch(e, batch_axes) for e in entries[1:]])


def without_batch_reductions(plan, batch_axes, costs, row_inputs=(), row_outputs=(),
                             arriving=None):
    """``plan`` as the task runs per device over the batch axes: its reductions over them left
    out (and their seconds out of its objective; they run in the reduce task), the inputs at
    ``row_inputs`` (micro-batch rows) resharded on entry into ``rows_first``
    layouts where they arrive otherwise (priced on ``costs``, a ``sharding.cost.CostModel``,
    axis by axis as the planner prices a reshard) in place of the plan's reshards over the
    batch axes alone, the outputs at ``row_outputs`` left in them. ``arriving``: the spec
    each input arrives in (default: the plan's)."""
    batch = set(batch_axes)
    outputs = tuple(dataclasses.replace(leaf, spec=rows_first(leaf.spec, batch_axes))
                    if i in set(row_outputs) else leaf for i, leaf in enumerate(plan.outputs))
    # Inside the task (manual over the batch axes) nothing moves over them: reductions wait
    # for the reduce task, and an all-to-all over them only was the rows' move, which the
    # entry reshard below makes once (gathers of other inputs still run, before the task).
    dropped = [c for c in plan.collectives if c.kind in REDUCTIONS and batch & set(c.axes)]
    moves = [c for c in plan.collectives
             if c.kind == "all-to-all" and c.axes and set(c.axes) <= batch]
    leaves = [leaf if arriving is None or i >= len(arriving) or arriving[i] is None
              else dataclasses.replace(leaf, spec=arriving[i])
              for i, leaf in enumerate(plan.inputs)]
    entry = [c for i in row_inputs for c in _entry_reshard(plan, leaves[i], batch_axes, costs)]
    if outputs == plan.outputs and not dropped and not moves and not entry:
        return plan
    saved, moved = sum(c.cost_s for c in dropped), sum(c.cost_s for c in entry)
    unmoved = sum(c.cost_s for c in moves)
    objective = dataclasses.replace(
        plan.objective, communication_s=max(0.0, plan.objective.communication_s - saved),
        resharding_s=max(0.0, plan.objective.resharding_s - unmoved) + moved)
    note = (f"run per device over the batch axes {tuple(batch_axes)}: {len(dropped)} "
            f"reduction(s) over them ({saved:.3g} s) left to the stage's once-per-step reduce "
            f"task; {len(entry)} reshard(s) of rows arriving split otherwise ({moved:.3g} s) "
            f"in place of {len(moves)} reshard(s) over them inside ({unmoved:.3g} s)")
    kept = tuple(c for c in plan.collectives if c not in dropped and c not in moves) + tuple(
        entry)
    return dataclasses.replace(plan, outputs=outputs, collectives=kept, objective=objective,
                               notes=plan.notes + (note,))


def _entry_reshard(plan, leaf, batch_axes, costs) -> list:
    """The collectives moving a row input from its spec to ``rows_first`` of it."""
    index = {a: i for i, a in enumerate(plan.axis_names)}
    rank = len(leaf.shape)

    def internal(spec):  # mesh-axis indices per dim, in the spec's (major first) order
        entries = list(spec) + [None] * (rank - len(spec))
        return tuple(tuple(index[a] for a in spec_axes(e)) for e in entries)
    src, dst = internal(leaf.spec), internal(rows_first(leaf.spec, batch_axes))
    if src == dst:
        return []
    try:
        itemsize = np.dtype(leaf.dtype).itemsize
    except TypeError:  # a PRNG key array
        itemsize = 8
    total = math.prod(leaf.shape) * itemsize
    out = []
    for a, name in enumerate(plan.axis_names):
        step = costs.axis_step(a, axis_place(src, a), axis_place(dst, a), total)
        if step is not None:
            kind, num_bytes, cost = step
            out.append(Collective(kind=kind, axes=(name,), num_bytes=int(num_bytes),
                                  cost_s=cost, where=f"rows of {leaf.path} into the "
                                  "per-device task", dtype=leaf.dtype))
    return out


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
        itemsize = np.dtype(acc_dtype(v.aval.dtype)).itemsize
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
