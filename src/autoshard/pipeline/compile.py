"""Compile a step's tasks: one jit per task on its stage's sub-mesh, planned by the planner.

Every task (``F``, ``B``, ``Ba``/``Bw``, ``apply``) is traced as the function that runs (its
equations, the micro-batch key folding, the accumulation into its donated accumulators) and
planned by ShardParallel's planner (``sharding.plan_auto``) on the logical shape of its
sub-mesh, with the stage's options (``default_auto_sharding_option`` updated with the stage's
``submesh_autosharding_option_dicts`` entry); ``sharding.apply_plan`` gives the function that
is jitted with the plan's input and output shardings. Accumulators are aliased to the
accumulated outputs (same spec), parameters to their updates in the apply tasks.

Tasks are planned in the order values flow, each with its inputs pinned (``plan_auto``'s
``fixed_in_specs``) to the layout their producer gives them when the producer's sub-mesh has
the consumer's shape: a backward task takes its residuals as its forward task left them, a
stage its activations as the previous stage sent them, and any reshard is priced by the
planner and predicted in the plan. Across sub-meshes of other shapes the runtime reshards on
the source devices before copying (see ``runtime.Mover``).

A backward task whose micro-batch rows arrive split on dim 0 over some axes (its batch axes)
runs per device over them, auto over the other axes in the layouts its plan gives them, and
keeps its accumulated gradients as partial sums over the batch axes: the stage's reduce task
sums them once per step (``reduce``). It stays planned and reduces per micro-batch (with a
note) when its plan takes the rows otherwise or running per device would communicate (an
operation without a per-row rule in ``_local.LocalEval``).

If the planner fails on a task, the task falls back to data parallelism (``Specs``): a value
computed per micro-batch whose dim 0 is the micro-batch's rows is split on dim 0 over every
axis of the sub-mesh, everything else is replicated; the plan's notes say which task and why.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..grad_accum import fold_keys, reductions_of
from ..ir import _compat
from ..ir._compat import Literal, Var
from ..ir._jaxpr import Env
from ..ir._local import LocalEval, R, split
from ..ir._walk import all_eqns
from ..sharding import apply_plan
from ..sharding.options import AutoShardingOption, for_task_plans
from . import _cross_process
from .partition import Partition, Task
from .reduce import acc_dtype, stacked_spec, without_batch_reductions
from .tasks import mesh_cluster, plan_task, row_axes, rows_taken, task_costs
from .zero import gather_once


def make_submeshes(devices, sizes, logical_shapes, axis_names=None):
    """Disjoint sub-meshes over ``devices`` in order, one per stage group; axes named
    ``axis_names[r]`` (a ``ManualShardingOption``'s), else ``x`` or ``x0, x1, ...``."""
    meshes, start = [], 0
    for r, (n, shape) in enumerate(zip(sizes, logical_shapes, strict=True)):
        devs = np.array(devices[start:start + n], dtype=object).reshape(shape)
        names = ("x",) if len(shape) == 1 else tuple(f"x{i}" for i in range(len(shape)))
        if axis_names is not None:
            names = tuple(axis_names[r])
        meshes.append(_compat.make_auto_mesh(devs, names))
        start += n
    return meshes


def stage_auto_option(default, mesh, overrides: dict) -> AutoShardingOption:
    """The planner options of a stage: the default, its sub-mesh shape, then its own dict."""
    return shape_auto_option(default, tuple(mesh.devices.shape), overrides)


def shape_auto_option(default, shape, overrides: dict) -> AutoShardingOption:
    """``stage_auto_option`` for a sub-mesh of logical ``shape`` (None: the planner chooses
    it), the pricing of a described cluster's."""
    base = default or AutoShardingOption()
    if not isinstance(base, AutoShardingOption):
        raise TypeError(f"default_auto_sharding_option ({base!r}) must be an "
                        "AutoShardingOption or None.")
    fields = {f.name for f in dataclasses.fields(AutoShardingOption)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(
            f"submesh_autosharding_option_dicts entry {overrides} names {unknown}, which are not "
            f"AutoShardingOption fields. Use fields such as 'force_batch_dim_to_mesh_dim'.")
    changes = {"logical_mesh_shape": None if shape is None else tuple(shape),
               "show_progress": False}
    changes.update(overrides)
    axis = changes.get("force_batch_dim_to_mesh_dim", base.force_batch_dim_to_mesh_dim)
    if shape is not None and isinstance(axis, int) and 0 <= axis < len(shape) and (
            shape[axis] == 1):
        # Alpa accepts it: the batch is split over that axis, i.e. not at all
        warnings.warn(
            f"force_batch_dim_to_mesh_dim ({axis}) names an axis of size 1 of the stage's "
            f"sub-mesh {shape}; it has no effect there (ignored).", UserWarning, stacklevel=2)
        changes["force_batch_dim_to_mesh_dim"] = None
    return for_task_plans(dataclasses.replace(base, **changes))


class Specs:
    """Data-parallel specs (the fallback): one PartitionSpec per value, the same on every
    stage that holds it (rows split only when every holder's sub-mesh has one shape)."""

    def __init__(self, part: Partition, meshes, mb_rows: int | None):
        self.part, self.meshes = part, meshes
        holders: dict = {}
        for t in part.forward + part.backward + [
                t for pair in part.split_backward for t in pair] + part.apply:
            for v in list(t.invars) + list(t.outvars):
                holders.setdefault(v, set()).add(t.stage)
        marker_in = set(part.marker.invars) if part.marker is not None else set()
        self.spec: dict = {}
        for v, stages in holders.items():
            shapes = {tuple(meshes[s].devices.shape) for s in stages}
            aval = v.aval
            self.spec[v] = P()
            if (mb_rows is not None and v in part.batch_dependent and v not in marker_in
                    and getattr(aval, "shape", ()) and aval.shape[0] == mb_rows
                    and len(shapes) == 1):
                mesh = meshes[next(iter(stages))]
                axes = tuple(mesh.axis_names)
                if aval.shape[0] % math.prod(mesh.devices.shape) == 0:
                    self.spec[v] = P(axes if len(axes) > 1 else axes[0])

    def get(self, v):
        return self.spec.get(v, P())


class CompiledTask:
    """A task as a jit: ``(*inputs, *accumulators[, micro_batch]) -> (*outputs, *accumulators)``.

    ``option``: planner options (None: the data-parallel ``fallback`` specs). ``rows``: the
    values whose dim 0 is the micro-batch's rows (the planner's batch inputs). ``aliases``:
    (input, output) positions of values the task replaces (same spec). ``input_specs``: per
    input the spec it arrives in (None: the plan chooses), e.g. the layout its producer gives
    it; the planner plans the task around them. ``output_pins``: output position -> the spec
    the result is pinned to (a ``with_sharding_constraint`` the planner keeps). ``gathered``:
    output positions computed on shards and made whole by one all-gather (``zero``).
    """

    def __init__(self, task: Task, part: Partition, mesh, *, with_index: bool, option,
                 fallback: Specs, rows=frozenset(), aliases=(), input_specs=None,
                 output_pins=None, partial_accumulators: bool = False, gathered=()):
        self.task, self.stage, self.mesh = task, task.stage, mesh
        consts = dict(zip(part.jaxpr.constvars, part.consts, strict=True))
        self.invars = [v for v in task.invars if v not in consts]
        self.outvars = [v for v in task.outvars if v not in task.accumulated]
        self.accumulated = list(task.accumulated)
        self.random = with_index and task.draws_random
        self.plan, self.note, self.predicted = None, "", None
        self.option = option
        self.reduced_specs = None
        """Per accumulator kept partial: the spec its plan gives the reduced value (None: no
        plan, the reduced value goes where its reader wants it)."""
        pins = dict(output_pins or {})
        # Per device over the batch axes: accumulators stay partial sums, (groups, *shape).
        self.batch_axes = () if pins or not partial_accumulators or not self.accumulated else (
            row_axes(self.invars, rows, input_specs))
        sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
        model_axes = {a for a, m in sizes.items() if m > 1} - set(self.batch_axes)
        if self.batch_axes and model_axes and option is None:
            self.note = (f"{task.name}: accumulated values reduced per micro-batch (the "
                         f"sub-mesh also splits over {sorted(model_axes)} and the task has no "
                         "plan to keep their layouts)")
            self.batch_axes = ()
        fn = _task_fn(task.eqns, self.invars, self.outvars, self.accumulated, consts,
                      self.random)
        if pins:
            fn = _pinned(fn, pins, mesh)
        fn = gather_once(fn, tuple(gathered), mesh)
        n, n_acc = len(self.invars), len(self.accumulated)
        abstract = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in self.invars]
        abstract += [jax.ShapeDtypeStruct(v.aval.shape, acc_dtype(v.aval.dtype))
                     for v in self.accumulated]
        if self.random:
            abstract.append(jax.ShapeDtypeStruct((), jnp.int32))
        n_args = len(abstract)
        acc_aliases = [(n + i, len(self.outvars) + i) for i in range(n_acc)]
        run, in_specs, out_specs = fn, None, None
        if option is not None:
            closed = jax.make_jaxpr(fn)(*abstract)
            batch = [v in rows for v in self.invars] + [False] * (n_args - n)
            fixed = None if input_specs is None else [
                None if s is None else _spec(s) for s in input_specs] + [None] * (n_args - n)
            planned = _cross_process.planned_once(  # several processes: on process 0 only
                task.name, closed, mesh, option, lambda: (self._plan(
                    closed, mesh, option, batch, list(aliases) + acc_aliases, fixed), self.note))
            try:
                self.plan, self.note = planned()
                run = apply_plan(closed, self.plan, mesh)
                in_specs, out_specs = list(self.plan.in_specs), list(self.plan.out_specs)
            except Exception as err:  # the planner's failure must not stop the pipeline
                if isinstance(err, ValueError) and "memory_budget_per_device" in str(err):
                    raise ValueError(f"Stage {task.stage} does not fit in memory: its task "
                                     f"{task.name} {_shrink_hint(err)}") from err
                self.plan, run = None, fn
                self.note = (f"{task.name}: planner failed ({type(err).__name__}: {err}); "
                             "data parallel instead")
                warnings.warn(f"autoshard pipeline: {self.note}", stacklevel=2)
                if model_axes:
                    self.batch_axes = ()
        local = self._local(task, consts, rows, input_specs, in_specs, out_specs, sizes) if (
            self.batch_axes) else None
        self.acc_shapes = [tuple(v.aval.shape) for v in self.accumulated]
        if local is not None:
            run, in_specs, out_specs = local
            groups = math.prod(sizes[a] for a in self.batch_axes)
            self.acc_shapes = [(groups,) + s for s in self.acc_shapes]
            abstract[n:n + n_acc] = [jax.ShapeDtypeStruct(s, a.dtype) for s, a in zip(
                self.acc_shapes, abstract[n:n + n_acc], strict=True)]
            if self.plan is None:
                self.predicted = {}  # per device: no collective (checked on its trace)
            self.note = (f"{task.name}: runs per device over the batch axes "
                         f"{self.batch_axes}; its {n_acc} accumulator(s) stay partial sums "
                         "over micro-batches and are reduced once per step")
        if in_specs is None:
            in_specs = [fallback.get(v) for v in self.invars] + [
                fallback.get(v) for v in self.accumulated] + [P()] * (n_args - n - n_acc)
            out_specs = [fallback.get(v) for v in self.outvars] + in_specs[n:n + n_acc]
        if input_specs is not None and not self.batch_axes:
            assert len(input_specs) == n
            in_specs[:n] = [_spec(s) if s is not None else in_specs[i]
                            for i, s in enumerate(input_specs)]
            for i, o in aliases:  # the replacement keeps the layout of what it replaces
                out_specs[o] = in_specs[i]
        for o, spec in pins.items():
            out_specs[o] = spec
        in_sh = [NamedSharding(mesh, s) for s in in_specs]
        out_sh = [NamedSharding(mesh, s) for s in out_specs]
        self.in_shardings, self.out_shardings = in_sh, out_sh
        self.acc_shardings = in_sh[n:n + n_acc]
        self.jitted = jax.jit(run, in_shardings=in_sh, out_shardings=out_sh,
                              donate_argnums=tuple(range(n, n + n_acc)))
        self.lowered = self.jitted.lower(*[jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                                           for a, s in zip(abstract, in_sh, strict=True)])
        self.compiled = _cross_process.compile_task(self.lowered, mesh)  # own stages only
        self._check_memory(option, mesh)

    def _local(self, task, consts, rows, input_specs, plan_in, plan_out, sizes):
        """(function, input specs, output specs) of the task run per device over its batch
        axes, the other axes as its plan lays them out; None (with a note, no batch axes)
        when the plan takes the rows otherwise or the per-device run would communicate."""
        axes, mesh = self.batch_axes, self.mesh
        n, n_acc = len(self.invars), len(self.accumulated)
        entry = P(axes if len(axes) > 1 else axes[0])
        if plan_in is not None:
            takes = rows_taken(self.invars, rows, plan_in)
            if takes != {axes}:
                self.note = (f"{task.name}: accumulated values reduced per micro-batch (its "
                             f"plan takes the rows over {sorted(takes)}, not {axes})")
                self.batch_axes = ()
                return None
            ins = [_spec(s) if s is not None else plan_in[i]  # as they arrive
                   for i, s in enumerate(input_specs or [None] * n)]
            costs = task_costs(tuple(mesh.devices.shape), self.option, mesh_cluster(mesh))
            plan = without_batch_reductions(
                self.plan, axes, costs, [i for i, v in enumerate(self.invars) if v in rows],
                [i for i, v in enumerate(self.outvars) if v in rows], arriving=ins)
            outs = list(plan.out_specs[:len(self.outvars)])
            accs = [stacked_spec(s, axes) for s in plan_in[n:n + n_acc]]
        else:
            plan = None
            ins = [_spec(s) if s is not None else entry if v in rows else P()
                   for v, s in zip(self.invars, input_specs, strict=True)]
            outs = [entry if v in rows else P() for v in self.outvars]
            accs = [entry] * n_acc
        groups = math.prod(sizes[a] for a in axes)
        local = _local_task(task.eqns, self.invars, self.outvars, self.accumulated, consts,
                            self.random, rows, axes, groups, mesh, ins, accs, outs)
        shapes = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in self.invars]
        shapes += [jax.ShapeDtypeStruct((groups,) + tuple(v.aval.shape),
                                        acc_dtype(v.aval.dtype)) for v in self.accumulated]
        shapes += [jax.ShapeDtypeStruct((), jnp.int32)] if self.random else []
        talks = _collectives_in(jax.make_jaxpr(local[0])(*shapes).jaxpr)
        if talks:  # an operation without a per-row rule: the planned task does better
            self.note = (f"{task.name}: accumulated values reduced per micro-batch (run "
                         f"per device over {axes} it would communicate: "
                         f"{', '.join(sorted(talks))})")
            self.batch_axes = ()
            return None
        if plan is not None:  # the plan less its reductions over the batch axes
            self.plan, self.reduced_specs = plan, list(plan_in[n:n + n_acc])
        return local

    def _check_memory(self, option, mesh):
        """A task XLA compiled to more bytes per device than the budget (the option's, else
        what the device reports) does not fit: an error naming the stage and the fixes."""
        budget = getattr(option, "memory_budget_per_device", None)
        if budget is None or self.plan is not None:  # a plan already kept its estimate in it
            budget = _device_memory(mesh.devices.flat[0])
            what = "the device's memory (bytes_limit)"
        else:
            what = "memory_budget_per_device"
        if budget is None:
            return
        m = self.compiled.memory_analysis()
        need = int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                   - m.alias_size_in_bytes)
        if need > budget:
            raise ValueError(
                f"Stage {self.stage} does not fit in memory: its task {self.task.name} needs "
                f"{need:,} B per device as compiled, over {what} ({int(budget):,} B). "
                + _FIXES)

    def __call__(self, args):
        return self.compiled(*args)

    def _plan(self, closed, mesh, option, batch, aliases, fixed):
        """The task's plan with its inputs pinned to ``fixed`` (the layouts its producers give
        them), so the planner prices any reshard of an input (``tasks.plan_task``)."""
        notes: list[str] = []
        plan = plan_task(closed, self.task.name, num_devices=mesh.devices.size, option=option,
                         batch=batch, aliases=aliases, fixed=fixed, cluster=mesh_cluster(mesh),
                         axis_names=tuple(mesh.axis_names), notes=notes)
        if notes:
            self.note = notes[0]
        return plan


_FIXES = ("Use more stages (UniformStageOption(num_stages=...) or ManualStageOption), more "
          "devices per stage, remat (ManualLayerOption(remat_layer=True) or "
          "AutoLayerOption(remat_mode='coarse_grained_remat')), more num_micro_batches, or a "
          "larger default_auto_sharding_option.memory_budget_per_device.")


def _device_memory(device) -> int | None:
    """Bytes the device reports it can allocate (None where it does not say, as on CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # backends without memory statistics
        return None
    return (stats or {}).get("bytes_limit")


def _shrink_hint(err) -> str:
    return f"has no plan within its budget ({err}). " + _FIXES


def _spec(s) -> P:
    return s.spec if isinstance(s, NamedSharding) else s if isinstance(s, P) else P(*s)


def _pinned(fn, pins: dict, mesh):
    """``fn`` with its outputs at the positions of ``pins`` constrained to their specs."""
    def pinned(*args):
        outs = list(fn(*args))
        for o, spec in pins.items():
            outs[o] = jax.lax.with_sharding_constraint(outs[o], NamedSharding(mesh, spec))
        return outs
    return pinned


def _task_fn(eqns, invars, outvars, acc, consts, random):
    def fn(*args):
        n = len(invars)
        values = dict(zip(invars, args[:n], strict=True))
        values.update(consts)
        if random:
            LocalEval((), 1, key_hook=fold_keys(args[-1])).run(eqns, values, {})
        else:
            env = Env()
            env.values = values
            env.run(eqns)
        accs = args[n:n + len(acc)]
        new = [a + values[v].astype(a.dtype) for a, v in zip(accs, acc, strict=True)]
        return [values[v] for v in outvars] + new
    return fn


_COLLECTIVES = ("psum", "all_gather", "all_to_all", "ppermute", "reduce_scatter", "pmax",
                "pmin")


def _collectives_in(jaxpr) -> set[str]:
    """Names of the collective primitives in ``jaxpr``, at any depth."""
    return {e.primitive.name for e in all_eqns(jaxpr) if e.primitive.name.startswith(_COLLECTIVES)}


def _local_task(eqns, invars, outvars, acc, consts, random, rows, axes, size, mesh,
                in_specs, acc_specs, out_specs):
    """A task run per device over the batch ``axes`` (``shard_map`` manual over them, auto
    over the other axes, ``_local.LocalEval``): micro-batch-row values are each device's own
    rows, reductions over them stay partial, and every accumulator gains a leading dim of one
    partial sum per device group, added to locally. ``in_specs``/``acc_specs``/``out_specs``:
    the jit's specs of the inputs, the stacked accumulators and the outputs. Returns
    (function, input specs, output specs)."""
    entry = axes if len(axes) > 1 else axes[0]
    rows_spec = stacked = P(entry)
    n, n_acc = len(invars), len(acc)
    in_specs = list(in_specs) + list(acc_specs) + ([P()] if random else [])
    out_specs = list(out_specs) + list(acc_specs)
    # inside the shard_map only the manual axes are named: rows split, the rest whole
    body_in = [rows_spec if v in rows else P() for v in invars] + [stacked] * n_acc + (
        [P()] if random else [])
    body_out = [rows_spec if v in rows else P() for v in outvars] + [stacked] * n_acc

    def body(*args):
        local = LocalEval(axes, size)
        values = dict(zip(invars, args[:n], strict=True))
        values.update(consts)
        kinds = {v: split(0) for v in invars if v in rows}
        if random:
            local.key_hook = fold_keys(args[-1])
        local.run(eqns, values, kinds)

        def read(v):
            if isinstance(v, Literal):
                return jnp.asarray(v.val, v.aval.dtype), R
            return values[v], kinds.get(v, R)
        outs = [local.to_split(*read(v), 0) if v in rows else local.to_r(*read(v))
                for v in outvars]
        new = [a + local.to_p(*read(v))[None].astype(a.dtype)
               for a, v in zip(args[n:n + n_acc], acc, strict=True)]
        return tuple(outs + new)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=tuple(body_in),
                           out_specs=tuple(body_out), axis_names=set(axes), check_vma=False)

    def run(*args):
        return list(mapped(*args))
    return run, in_specs, out_specs


def finalize_fn(part: Partition, stage: int, k: int, stacked=frozenset()):
    """Per stage: accumulators -> gradient-marker outputs (mean divides by ``k``). An
    accumulator in ``stacked`` holds one partial sum per device group along dim 0: summing
    them is the step's one reduction of that value."""
    if part.marker is None:
        return None, []
    reds = reductions_of(part.marker)
    pairs = [(v, o, r) for v, o, r in zip(part.marker.invars, part.marker.outvars, reds,
                                          strict=True)
             if isinstance(v, Var) and part.home.get(o) == stage and v in part.per_micro_batch
             and v not in part.join_sources]

    def fn(*accs):
        accs = [a.sum(axis=0) if v in stacked else a
                for a, (v, _, _) in zip(accs, pairs, strict=True)]
        return [(a / k if r == "mean" else a).astype(v.aval.dtype)
                for a, (v, _, r) in zip(accs, pairs, strict=True)]
    return fn, pairs


__all__ = ["CompiledTask", "Specs", "acc_dtype", "finalize_fn", "make_submeshes",
           "stage_auto_option"]
