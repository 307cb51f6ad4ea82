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
note) when its plan takes the rows otherwise or running per device would move rows (an
operation without a per-row rule in ``_local.LocalEval``).

If the planner fails on a task, the task falls back to data parallelism (``Specs``): a value
computed per micro-batch whose dim 0 is the micro-batch's rows is split on dim 0 over every
axis of the sub-mesh, everything else is replicated; the plan's notes say which task and why.
"""

from __future__ import annotations

import dataclasses
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from ..grad_accum import reductions_of
from ..ir import _compat
from ..ir._compat import Var
from ..sharding import apply_plan
from ..sharding.hlo import shape_bytes
from ..sharding.options import AutoShardingOption, for_task_plans
from . import _cross_process
from .partition import Partition
from .reduce import acc_dtype
from .tasks import FIXES, TaskPlan


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


TASK_EXACT_RESHARDING_COLUMNS = 1_000_000
"""``AutoShardingOption.exact_resharding_columns`` of a pipeline's task plans where the user
left it at its default (20,000, sized for the plan of a whole step). A task runs once per
micro-batch and holds one stage, so its resharding is priced pair by pair up to here. The
per-axis terms past it price each axis on the bytes the producer holds (``reshard_memo``), but
read high where a consumer adds splits: Table 1's 76.1B paper pipeline (one sequence per data
replica per micro-batch on (32, 8) stages) planned its backward tasks at 0.55 s per
micro-batch with them, gathering the MLP activations over both axes, and at 0.18 s priced
exactly (step 39.98 -> 20.49 s, pricing 9.2 -> 13.1 CPU s;
``benchmarks/results/cluster_paper_pipelines.md``)."""


def task_exact_columns(base: AutoShardingOption, overrides: dict) -> int:
    """The ``exact_resharding_columns`` a stage's tasks are planned with: the stage's own
    dict entry, else the user's value, else (the default) ``TASK_EXACT_RESHARDING_COLUMNS``."""
    if "exact_resharding_columns" in overrides:
        return overrides["exact_resharding_columns"]
    default = AutoShardingOption().exact_resharding_columns
    if base.exact_resharding_columns != default:
        return base.exact_resharding_columns
    return max(default, TASK_EXACT_RESHARDING_COLUMNS)


def shape_auto_option(default, shape, overrides: dict) -> AutoShardingOption:
    """``stage_auto_option`` for a sub-mesh of logical ``shape`` (None: the planner chooses
    it), the pricing of a described cluster's. Resharding is priced exactly up to
    ``task_exact_columns``."""
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
               "show_progress": False,
               "exact_resharding_columns": task_exact_columns(base, overrides)}
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


class CompiledTask:
    """A task as a jit: ``(*inputs, *accumulators[, micro_batch]) -> (*outputs, *accumulators)``,
    compiled on ``mesh`` as its ``TaskPlan`` decided (``tasks.plan_tasks``): the per-device
    function over its batch axes, else its plan applied, else its function in the data-parallel
    specs; accumulators donated and aliased to the accumulated outputs."""

    def __init__(self, tp: TaskPlan, mesh):
        task = tp.task
        self.task, self.stage, self.mesh = task, task.stage, mesh
        self.invars, self.outvars, self.accumulated = tp.invars, tp.outvars, tp.accumulated
        self.random, self.plan, self.note = tp.random, tp.plan, tp.note
        self.predicted = tp.predicted
        self.batch_axes, self.reduced_specs = tp.batch_axes, tp.reduced_specs
        self.acc_shapes = tp.acc_shapes
        n, n_acc = len(self.invars), len(self.accumulated)
        if tp.local is not None:
            run = tp.local
        elif tp.plan is not None:
            run = apply_plan(tp.closed, tp.plan, mesh)
        else:
            run = tp.fn
        abstract = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in self.invars]
        abstract += [jax.ShapeDtypeStruct(shape, acc_dtype(v.aval.dtype))
                     for v, shape in zip(self.accumulated, self.acc_shapes, strict=True)]
        if self.random:
            abstract.append(jax.ShapeDtypeStruct((), jnp.int32))
        in_sh = [NamedSharding(mesh, s) for s in tp.in_specs]
        out_sh = [NamedSharding(mesh, s) for s in tp.out_specs]
        self.in_shardings, self.out_shardings = in_sh, out_sh
        self.acc_shardings = in_sh[n:n + n_acc]
        self.jitted = jax.jit(run, in_shardings=in_sh, out_shardings=out_sh,
                              donate_argnums=tuple(range(n, n + n_acc)))
        self.lowered = self.jitted.lower(*[jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                                           for a, s in zip(abstract, in_sh, strict=True)])
        self.compiled = _cross_process.compile_task(self.lowered, mesh)  # own stages only

    def check_memory(self, option):
        """A task XLA compiled to more bytes per device than the budget (the option's, else
        what the device reports) does not fit: an error naming the stage and the fixes."""
        budget = getattr(option, "memory_budget_per_device", None)
        if budget is None or self.plan is not None:  # a plan already kept its estimate in it
            budget = _device_memory(self.mesh.devices.flat[0])
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
                + FIXES)

    def __call__(self, args):
        return self.compiled(*args)


def _device_memory(device) -> int | None:
    """Bytes the device reports it can allocate (None where it does not say, as on CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # backends without memory statistics
        return None
    return (stats or {}).get("bytes_limit")


_HLO_INSTR = re.compile(
    r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = .*? (?P<op>[\w\-]+)\((?P<args>[^)]*)\)")


def gathered_inputs(hlo: str, positions) -> list[int]:
    """Result bytes of each all-gather in the entry computation of compiled ``hlo`` that is
    computed from the parameters at ``positions`` alone (e.g. a stage's weights): what the
    program gathers of those inputs every time it runs."""
    positions = frozenset(positions)
    at = hlo.find("\nENTRY ")
    if at < 0 or not positions:
        return []
    entry = hlo[at:]
    entry = entry[:entry.find("\n}")]
    sources: dict = {}
    found = []
    for line in entry.splitlines()[1:]:
        m = _HLO_INSTR.match(line)
        if m is None:
            continue
        name, op, args = m.group("name", "op", "args")
        if op == "parameter":
            sources[name] = frozenset([int(args)])
            continue
        sources[name] = frozenset().union(
            *[sources.get(a, frozenset()) for a in re.findall(r"%([\w.\-]+)", args)])
        if op.startswith("all-gather") and sources[name] and sources[name] <= positions:
            found.append(shape_bytes(line.split(" = ", 1)[1].split(" all-gather")[0]))
    return found


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


__all__ = ["TASK_EXACT_RESHARDING_COLUMNS", "CompiledTask", "acc_dtype", "finalize_fn",
           "gathered_inputs", "make_submeshes", "shape_auto_option", "stage_auto_option",
           "task_exact_columns"]
