"""Backward tasks run per device over the batch axes their micro-batch rows arrive split
over (``pipeline.tasks`` decides where): which axes those are (``row_axes``, ``rows_taken``),
the task's plan without its reductions over them (``per_device_plan``), and the run itself
with its layouts (``per_device_run``), refused where it would communicate more than a scalar.
Its gradients stay partial sums over those axes and are reduced once per step."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ..ir._walk import all_eqns
from ..sharding.highs import once
from ..sharding.plan import Collective, spec_axes
from ..sharding.spec import axis_place
from .reduce import acc_dtype, stacked_spec, without_batch_reductions
from .taskfn import is_collective, local_task, reads, spec_of


def per_device_plan(t, plan, axes, costs, invars, outvars, acc, rows, arriving=None,
                    read=None):
    """Backward task ``t``'s ``plan`` run per device over the batch ``axes``: its
    reductions over them of the row inputs it reads (toward its outputs and accumulators
    ``acc``; ``read``: those values, when known) and of its row outputs dropped
    (``reduce.without_batch_reductions``)."""
    if read is None:
        read = reads(t.eqns, list(outvars) + list(acc))
    return without_batch_reductions(
        plan, axes, costs, [i for i, v in enumerate(invars) if v in rows and v in read],
        [i for i, v in enumerate(outvars) if v in rows], arriving=arriving)


def per_device_run(t, invars, outvars, acc, consts, random, rows, axes, arriving, plan, plan_in,
                   costs, target, batched=frozenset(), cache=None, closed=None):
    """(function, input specs, output specs, plan, reduced specs) of a backward task run per
    device over ``axes``, the other axes as its plan lays them out; a note why not when the
    plan takes the rows otherwise or the per-device run would communicate more than a scalar.
    A value computed from the rows (``batched``) that arrives (or leaves) with another dim
    split over ``axes`` (a scan's stacked residuals: time steps first, rows second) stays
    split there inside: made whole, it would be gathered on entry and every device would run
    the whole batch. ``costs``: the link costs of the task's sub-mesh (``tasks.task_costs``;
    None where there is no ``plan``). ``cache`` (with ``closed``, the task traced as planned):
    the check of identical tasks run per device the same way is traced once."""
    n, n_acc = len(invars), len(acc)
    entry = P(axes if len(axes) > 1 else axes[0])
    if plan is not None:
        takes = rows_taken(invars, rows, plan_in)
        if takes != {axes}:
            return (f"{t.name}: accumulated values reduced per micro-batch (its plan takes the "
                    f"rows over {sorted(takes)}, not {axes})")
        ins = [spec_of(a) if a is not None else plan_in[i] for i, a in enumerate(arriving)]
        read = reads(t.eqns, list(outvars) + list(acc))
        plan = per_device_plan(t, plan, axes, costs, invars, outvars, acc, rows,
                               arriving=ins, read=read)
        outs = list(plan.out_specs[:len(outvars)])
        accs = [stacked_spec(s, axes) for s in plan_in[n:n + n_acc]]
        reduced = list(plan_in[n:n + n_acc])
    else:
        ins = [spec_of(a) if a is not None else entry if v in rows else P()
               for v, a in zip(invars, arriving, strict=True)]
        outs = [entry if v in rows else P() for v in outvars]
        accs, reduced = [entry] * n_acc, None
    sizes = dict(zip(target.axis_names, target.mesh_shape, strict=True))
    groups = math.prod(sizes[a] for a in axes)
    split_at = {v: 0 for v in list(invars) + list(outvars) if v in rows}
    for v, spec in [*zip(invars, ins, strict=True), *zip(outvars, outs, strict=True)]:
        if v not in split_at and v in batched:
            d = rows_dim(spec, axes, getattr(v.aval, "shape", ()), groups)
            if d is not None:
                split_at[v] = d
    if plan is not None:
        plan = gathered_on_entry(plan, invars, ins, split_at, axes, costs, read)
    run, in_specs, out_specs = local_task(t.eqns, invars, outvars, acc, consts, random,
                                          split_at, axes, groups, target.any_mesh, ins, accs,
                                          outs)
    shapes = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in invars]
    shapes += [jax.ShapeDtypeStruct((groups,) + tuple(v.aval.shape), acc_dtype(v.aval.dtype))
               for v in acc]
    shapes += [jax.ShapeDtypeStruct((), jnp.int32)] if random else []
    # Communication per micro-batch inside the per-device run (rows gathered for an operation
    # without a per-row rule, statistics summed over the rows): the planned task does better.
    # A scalar summed (a loss, a count) costs nothing to speak of and is allowed.
    def traced_talks():
        return {e.primitive.name for e in all_eqns(jax.make_jaxpr(run)(*shapes).jaxpr)
                if is_collective(e) and any(math.prod(getattr(v.aval, "shape", ())) > 1
                                            for v in e.invars)}
    if cache is None:
        talks = traced_talks()
    else:  # what the run's trace depends on (the task's equations, as ``closed`` prints)
        where = {v: i for i, v in enumerate(list(invars) + list(outvars))}
        key = ("per-device collectives", str(closed), random, axes, groups,
               tuple(target.axis_names), tuple(target.mesh_shape),
               tuple(sorted((where[v], d) for v, d in split_at.items())),
               tuple(map(str, ins)), tuple(map(str, accs)), tuple(map(str, outs)))
        talks = once(cache, key, traced_talks)
    if talks:
        return (f"{t.name}: accumulated values reduced per micro-batch (run per device over "
                f"{axes} it would communicate: {', '.join(sorted(talks))})")
    return run, in_specs, out_specs, plan, reduced


def gathered_on_entry(plan, invars, ins, split_at, axes, costs, read):
    """``plan``'s collectives as the task runs per device over ``axes``: nothing moves over
    them inside (``per_device_run`` checks its trace), so the plan's gathers over them alone (a
    weight gathered for a dot inside a scan, once per iteration) are replaced by one gather
    on entry of each input that arrives split over them and is whole inside (every input but
    the rows, ``split_at``) and is ``read``."""
    batch = set(axes)
    inside = [c for c in plan.collectives if c.kind == "all-gather" and c.axes
              and set(c.axes) <= batch and not c.where.startswith("rows of ")]
    index = {a: i for i, a in enumerate(plan.axis_names)}
    entry = []
    for v, spec, leaf in zip(invars, ins, plan.inputs, strict=False):
        shape = tuple(getattr(v.aval, "shape", ()))
        if v in split_at or v not in read or not shape:
            continue
        entries = list(P(*spec)) + [None] * (len(shape) - len(spec))
        src = tuple(tuple(index[a] for a in spec_axes(e)) for e in entries)
        dst = tuple(tuple(index[a] for a in spec_axes(e) if a not in batch) for e in entries)
        try:
            itemsize = np.dtype(v.aval.dtype).itemsize
        except TypeError:  # a PRNG key array
            itemsize = 8
        for a in axes:
            i = index[a]
            step = costs.axis_step(i, axis_place(src, i), axis_place(dst, i),
                                   math.prod(shape) * itemsize)
            if step is not None:
                kind, num_bytes, cost = step
                entry.append(Collective(kind=kind, axes=(a,), num_bytes=int(num_bytes),
                                        cost_s=cost, where=f"{leaf.path} whole in the per-device task",
                                        dtype=str(v.aval.dtype)))
    if not inside and not entry:
        return plan
    saved, added = sum(c.cost_s for c in inside), sum(c.cost_s for c in entry)
    objective = dataclasses.replace(
        plan.objective, resharding_s=max(0.0, plan.objective.resharding_s - saved) + added)
    note = (f"inside the per-device run {len(inside)} gather(s) over {tuple(axes)} "
            f"({saved:.3g} s) become {len(entry)} gather(s) of inputs on entry ({added:.3g} s)")
    kept = tuple(c for c in plan.collectives if c not in inside) + tuple(entry)
    return dataclasses.replace(plan, collectives=kept, objective=objective,
                               notes=plan.notes + (note,))


def rows_dim(spec, axes, shape, groups: int) -> int | None:
    """The one dim ``spec`` splits over exactly the mesh axes ``axes`` (no other dim naming
    any of them), when it divides into ``groups`` blocks; else None."""
    spec = P(*spec)
    dims = [d for d, e in enumerate(spec) if set(spec_axes(e)) & set(axes)]
    if len(dims) != 1 or tuple(spec_axes(spec[dims[0]])) != tuple(axes):
        return None
    d = dims[0]
    return d if d < len(shape) and shape[d] % groups == 0 else None


def row_axes(invars, rows, arriving) -> tuple[str, ...]:
    """The mesh axes splitting dim 0 of the micro-batch-row inputs as they arrive (empty when
    they differ or none is split; rows split on another dim do not count: the task reshards
    them). A row input arriving unknown (from a sub-mesh of another size: no layout carries
    over device for device) does not count either: it is moved into the layout the task's
    plan takes it in, whatever its source's. A backward task runs per device over these axes
    and keeps its gradients partial over them (reduced once per step)."""
    if arriving is None:
        return ()
    found = set()
    for v, s in zip(invars, arriving, strict=True):
        if v in rows and s is not None:
            spec = P(*s)
            found.add(spec_axes(spec[0]) if len(spec) else ())
    found.discard(())
    return found.pop() if len(found) == 1 else ()


def rows_taken(invars, rows, plan_in_specs) -> set:
    """The mesh axes (tuples) a plan splits dim 0 of the micro-batch-row inputs over. A
    backward task runs per device over ``row_axes`` only when this is exactly
    ``{row_axes}``: its plan takes the rows as they arrive."""
    return {spec_axes(s[0]) if len(s) else () for v, s in zip(
        invars, plan_in_specs, strict=False) if v in rows} - {()}


__all__ = ["gathered_on_entry", "per_device_plan", "per_device_run", "row_axes", "rows_dim",
           "rows_taken"]
