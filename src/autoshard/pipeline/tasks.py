"""Planning a pipeline's tasks, once for the runtime, the pricing and the stage profiler.

``plan_tasks`` walks a partition's tasks in the order values flow (forward stages, backward
stages last one first, the stages' finalised gradients and the sums spanning stages, then the
apply tasks) and decides how each runs (a ``TaskPlan``): the layouts its inputs arrive in
(``Layouts.arriving``: the layout a value already has on the task's sub-mesh, else its
producer's, or first reader's, carried over where the sub-mesh holds the same shards device
for device), its plan (``plan_task``, on its target's costs), whether a backward task runs
per device over the batch axes its rows arrive split over (``per_device``, and
not where the per-device run would communicate more than a scalar), ZeRO-2 apply tasks, a manual option's pins.
The caller's ``realize`` gets each ``TaskPlan``: the runtime compiles it on its sub-mesh
(``compile.CompiledTask``), the pricing of a described cluster prices it (``price``), the
stage profiler compiles and times a candidate stage's. So the plan that was priced is the
plan that runs (``tests/pipeline/test_task_planner.py`` holds them equal for every schedule).

A task is planned with its inputs pinned to the layouts their producers give them
(``fixed``). If no plan takes them (a ``ValueError``, the memory budget's included: pinned
layouts can cost memory an unpinned plan saves), the task is planned unpinned and its inputs
are resharded inside it; a note says so. Only when the unpinned plan fails too does the error
reach the caller (for the memory budget: "Stage s does not fit in memory").
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

from ..cluster import Cluster
from ..sharding import plan_auto
from ..sharding.cost import CostModel
from ..sharding.highs import once
from ..sharding.options import AutoShardingOption
from ..sharding.plan import ShardingPlan
from .layouts import carried, step_aliases
from .partition import Partition, Task
from .per_device import per_device_run, row_axes
from .reduce import acc_dtype
from .taskfn import pinned, spec_of, task_fn
from .zero import forward_backward_option, gather_once, zero_apply


def plan_task(closed, name: str, *, num_devices: int, option: AutoShardingOption,
              batch: Sequence[bool], aliases: Sequence[tuple[int, int]], fixed=None,
              cluster: Cluster | None = None, axis_names=None,
              notes: list[str] | None = None,
              compare_data_parallel: bool = True) -> ShardingPlan:
    """The plan of task ``name`` (its traced function ``closed``) on ``num_devices`` devices
    with the costs of ``cluster`` (None: the cost model's defaults); ``fixed``: per input the
    PartitionSpec it arrives in, or None. A fallback to an unpinned plan appends to ``notes``.
    ``compare_data_parallel``: ``plan_auto``'s (False when the plan is only priced)."""
    n_args = len(closed.in_avals)

    def plan(fixed_in_specs):
        return plan_auto(
            closed, num_devices=num_devices, option=option,
            in_paths=[f"{name}.in{i}" for i in range(n_args)],
            out_paths=[f"{name}.out{i}" for i in range(len(closed.out_avals))],
            batch_invars=list(batch), aliases=list(aliases), cluster=cluster,
            axis_names=axis_names, fixed_in_specs=fixed_in_specs,
            compare_data_parallel=compare_data_parallel)
    if fixed is None or all(s is None for s in fixed):
        return plan(None)
    try:
        return plan(list(fixed))
    except ValueError as err:
        if notes is not None:
            notes.append(f"{name}: planned without its producers' layouts ({err}); its "
                         "inputs are resharded inside the task")
        return plan(None)


def task_costs(shape, option: AutoShardingOption, cluster: Cluster) -> CostModel:
    """The link costs of a task's sub-mesh of logical ``shape``: the option's constants where
    it gives them (as the planner takes them), else its cluster's."""
    alpha, beta = cluster.mesh_costs(tuple(shape))
    return CostModel(tuple(shape), option.mesh_alpha or alpha, option.mesh_beta or beta)


def mesh_cluster(mesh) -> Cluster:
    """The cluster of a sub-mesh's devices, for its costs (``Cluster.from_devices``: A100/H100
    figures on those GPUs, the cost model's defaults elsewhere)."""
    return Cluster.from_devices(list(mesh.devices.flat))


@dataclass(frozen=True)
class Target:
    """A stage's sub-mesh as its tasks are planned on it."""

    rank: int
    """Which sub-mesh (the model stages of one interleaved rank share it)."""
    mesh_shape: tuple[int, ...]
    """Its logical shape."""
    axis_names: tuple[str, ...]
    """Its axis names."""
    cluster: Cluster
    """Its devices' costs (``mesh_cluster`` at run time, a slice of a described cluster when
    pricing)."""
    mesh: object = None
    """The sub-mesh of devices at run time; None when pricing (an abstract mesh of the shape
    stands in where a function is traced)."""

    @property
    def any_mesh(self):
        """The sub-mesh, or an abstract one of its shape (tracing needs no devices)."""
        if self.mesh is not None:
            return self.mesh
        return AbstractMesh(self.mesh_shape, self.axis_names,
                            axis_types=(AxisType.Auto,) * len(self.axis_names))


@dataclass(eq=False, kw_only=True)
class TaskPlan:
    """A task as it runs on its sub-mesh, decided once for the runtime (which compiles it)
    and the pricing (which prices it)."""

    kind: str
    """``F``, ``B``, ``Ba``, ``Bw`` or ``apply``."""
    task: Task
    target: Target
    invars: list
    """Non-constant inputs, in order."""
    outvars: list
    """Outputs that are not accumulated, in order."""
    accumulated: list
    random: bool
    """Whether the task takes the micro-batch index (it folds random keys with it)."""
    fn: Callable
    """The task's function ``(*inputs, *accumulators[, index]) -> (*outputs, *accumulators)``."""
    closed: object
    """``fn`` traced (None where the task has no planner options)."""
    plan: ShardingPlan | None
    """The plan it runs (less its reductions over ``batch_axes``); None: data parallel."""
    batch_axes: tuple[str, ...]
    """Mesh axes it runs per device over, its accumulators partial sums over them."""
    local: Callable | None
    """The per-device function over ``batch_axes`` (None: ``plan`` or ``fn`` runs)."""
    in_specs: list
    """PartitionSpec per argument (inputs, accumulators, index)."""
    out_specs: list
    """PartitionSpec per result (outputs, accumulators)."""
    acc_shapes: list
    """Per accumulator its shape (a leading dim of one partial sum per device group)."""
    reduced_specs: list | None
    """Per accumulator kept partial: the spec its plan gives the reduced value."""
    option: object = None
    """The planner options it was planned with (None: none)."""
    note: str = ""
    predicted: dict | None = None
    """Collectives predicted where no plan predicts them (per device: none)."""

    @property
    def acc_specs(self) -> list:
        n = len(self.invars)
        return self.in_specs[n:n + len(self.accumulated)]

    def finalized(self, marker) -> dict:
        """Gradient-marker output -> the spec its accumulator is finalised in."""
        out = {}
        for i, (v, spec) in enumerate(zip(self.accumulated, self.acc_specs, strict=True)):
            o = marker.outvars[list(marker.invars).index(v)]
            if not self.batch_axes:
                out[o] = spec
            elif self.reduced_specs is not None:
                out[o] = self.reduced_specs[i]
        return out


class Layouts:
    """Where each value of the step is laid out, per sub-mesh, as its tasks are planned."""

    def __init__(self):
        self.entries: dict = {}
        """Value -> [(Target, spec)], the producer's (or first reader's) first, one per rank."""

    def arriving(self, v, target: Target) -> P | None:
        """The spec ``v`` arrives in on ``target``: the one it already has there, else its
        first layout carried over device for device; None: unknown (the task chooses)."""
        entries = self.entries.get(v)
        if not entries:
            return None
        here = next((spec for t, spec in entries if t.rank == target.rank), None)
        if here is not None:
            return here
        src, spec = entries[0]
        return carried(spec, src.mesh_shape, src.axis_names, target.mesh_shape,
                       target.axis_names, tuple(v.aval.shape))

    def record(self, v, target: Target, spec) -> None:
        """``v`` is laid out as ``spec`` on ``target`` (kept if it has none there yet)."""
        entries = self.entries.setdefault(v, [])
        if not any(t.rank == target.rank for t, _ in entries):
            entries.append((target, spec))


FIXES = ("Use more stages (UniformStageOption(num_stages=...) or ManualStageOption), more "
         "devices per stage, remat (ManualLayerOption(remat_layer=True) or "
         "AutoLayerOption(remat_mode='coarse_grained_remat')), more num_micro_batches, or a "
         "larger default_auto_sharding_option.memory_budget_per_device.")
"""What to change when a stage does not fit in memory."""


class Specs:
    """Data-parallel specs (the fallback): one PartitionSpec per value, the same on every
    stage that holds it (rows split only when every holder's sub-mesh has one shape)."""

    def __init__(self, part: Partition, targets: Sequence[Target], mb_rows: int | None):
        holders: dict = {}
        for t in part.forward + part.backward + [
                t for pair in part.split_backward for t in pair] + part.apply:
            for v in list(t.invars) + list(t.outvars):
                holders.setdefault(v, set()).add(t.stage)
        marker_in = set(part.marker.invars) if part.marker is not None else set()
        self.spec: dict = {}
        for v, stages in holders.items():
            shapes = {targets[s].mesh_shape for s in stages}
            aval = v.aval
            self.spec[v] = P()
            if (mb_rows is not None and v not in marker_in and part.rows_first(v)
                    and len(shapes) == 1):
                target = targets[next(iter(stages))]
                axes = target.axis_names
                if aval.shape[0] % math.prod(target.mesh_shape) == 0:
                    self.spec[v] = P(axes if len(axes) > 1 else axes[0])

    def get(self, v):
        return self.spec.get(v, P())


def task_order(part: Partition, split: bool) -> list[tuple[str, Task]]:
    """(kind, task) of the forward and backward tasks in the order values flow: forward
    stages, then backward stages last one first (``Ba`` then ``Bw`` where ``split``)."""
    order = [("F", t) for t in part.forward]
    if part.has_backward:
        for s in reversed(range(part.num_stages)):
            order += ([("Ba", part.split_backward[s][0]), ("Bw", part.split_backward[s][1])]
                      if split else [("B", part.backward[s])])
    return order


def plan_tasks(part: Partition, targets: Sequence[Target], split: bool, options: Sequence,
               *, program, realize: Callable[[TaskPlan], None], manual=None, given=None,
               once=None, cache: dict | None = None,
               select: Callable[[str, Task], bool] | None = None,
               compare_data_parallel: bool = True) -> Layouts:
    """Plan every task of ``part``, stage ``s``'s on ``targets[s]`` with ``options[s]`` (an
    ``AutoShardingOption``; None: data parallel), in the order values flow, and hand each
    ``TaskPlan`` to ``realize`` (the runtime compiles it, the pricing prices it).

    Each task takes its inputs in the layouts they arrive in (``Layouts.arriving``; a
    ``ManualSpecs``' pins and, for forward tasks, ``given`` specs per stage first), is traced
    as it runs (with its micro-batch index where it draws random numbers), planned by
    ``plan_task`` on its target's costs (``once(name, closed, mesh, option, plan)`` wraps the
    call, e.g. planning on one process; ``cache`` keeps the plans of identical tasks;
    ``select(kind, task)`` False: the task is left out, e.g. a candidate stage's neighbours
    when profiling it), and a backward task whose micro-batch rows arrive split over some
    axes runs per device over them (``per_device.row_axes``; not where that would
    communicate more than a scalar). Apply tasks run ZeRO-2 where their option asks
    (``zero``). Between the backward and apply tasks come the finalised gradients, the sums
    spanning stages (replicated on every sub-mesh), the whole-batch inputs (as the batch
    arrives) and the joined values (in their source's layout). ``compare_data_parallel``:
    ``plan_auto``'s (the pricing passes False: no task plan's ``explain()`` is shown there)."""
    layouts = Layouts()
    consts = set(part.jaxpr.constvars)
    fallback = Specs(part, targets, part.mb_rows)
    rows = frozenset(v for v in fallback.spec if part.holds_rows(v))
    zero_split: set = set()

    def run(kind, t):
        if select is not None and not select(kind, t):
            return
        target = targets[t.stage]
        invars = [v for v in t.invars if v not in consts]
        arriving = [layouts.arriving(v, target) for v in invars]
        if manual is not None:
            arriving = [p if (p := manual.input_spec(v, t.stage)) is not None else a
                        for v, a in zip(invars, arriving, strict=True)]
        option, pins, gathered, aliases, note = options[t.stage], None, (), (), ""
        if kind != "apply":
            option = forward_backward_option(option)
        if kind == "apply":
            aliases = step_aliases(t, part.jaxpr, program.aliases)
            z = None if manual is not None else zero_apply(
                t, part, program, target.any_mesh, option, frozenset(zero_split))
            if z is not None:
                zero_split.update(z.split)
                arriving, pins, gathered, option = list(z.input_specs), z.pins, z.gathered, None
                note = (f"{t.name}: ZeRO-2 update (prefer_reduce_scatter with "
                        f"force_data_parallel): {sum(p != P() for p in z.input_specs)} input(s) "
                        f"split over the sub-mesh, {len(z.gathered)} output(s) gathered in one "
                        "all-gather")
        elif kind == "F" and given is not None:
            if len(given[t.stage]) != len(invars):
                raise ValueError(
                    f"stage_input_shardings gives {len(given[t.stage])} specs for stage "
                    f"{t.stage} but its forward task has {len(invars)} inputs; pass "
                    "executable.stage_input_shard_specs of the same step and options.")
            arriving = list(given[t.stage])
        if pins is None and manual is not None:
            pins = manual.output_pins(t)
        tp = _decide(kind, t, part, target, option, arriving, rows=rows, fallback=fallback,
                     aliases=aliases, pins=pins, gathered=gathered, once=once, cache=cache,
                     compare_data_parallel=compare_data_parallel)
        if note:
            tp.note = note
        realize(tp)
        n = len(tp.invars)
        for v, spec in [*zip(tp.invars, tp.in_specs[:n], strict=True),
                        *zip(tp.outvars, tp.out_specs[:len(tp.outvars)], strict=True)]:
            layouts.record(v, target, spec)
        for o, spec in tp.finalized(part.marker).items():
            layouts.entries.setdefault(o, [(target, spec)])

    for kind, t in task_order(part, split):
        run(kind, t)
    by_rank = {t.rank: t for t in targets}
    for cs in part.sums:  # after its all-reduce, on every sub-mesh
        layouts.entries[cs.out] = [(t, P()) for t in by_rank.values()]
    for w, i in part.whole_inputs.items():  # the update takes them as the batch arrives
        if layouts.entries.get(part.jaxpr.invars[i]):
            layouts.entries[w] = list(layouts.entries[part.jaxpr.invars[i]])
    for w, src in part.joined.items():
        if layouts.entries.get(src):
            layouts.entries[w] = [layouts.entries[src][0]]
    for t in part.apply:
        run("apply", t)
    return layouts


def task_signature(t: Task, part: Partition, random: bool):
    """(constants, inputs, outputs, accumulators, abstract arguments) of task ``t`` as it runs:
    ``(*inputs, *accumulators[, micro-batch index]) -> (*outputs, *accumulators)``."""
    consts = dict(zip(part.jaxpr.constvars, part.consts, strict=True))
    invars = [v for v in t.invars if v not in consts]
    outvars = [v for v in t.outvars if v not in t.accumulated]
    acc = list(t.accumulated)
    abstract = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in invars]
    abstract += [jax.ShapeDtypeStruct(v.aval.shape, acc_dtype(v.aval.dtype)) for v in acc]
    abstract += [jax.ShapeDtypeStruct((), jnp.int32)] if random else []
    return consts, invars, outvars, acc, abstract


def _decide(kind, t: Task, part: Partition, target: Target, option, arriving, *, rows,
            fallback, aliases=(), pins=None, gathered=(), once=None, cache=None,
            compare_data_parallel=True) -> TaskPlan:
    """How task ``t`` runs on ``target``: traced, planned (inputs pinned to ``arriving``),
    per device over its batch axes where it can, else as planned, else data parallel."""
    random = kind != "apply" and t.draws_random
    consts, invars, outvars, acc, abstract = task_signature(t, part, random)
    mesh, note, pins = target.any_mesh, "", dict(pins or {})
    sizes = dict(zip(target.axis_names, target.mesh_shape, strict=True))
    axes = () if pins or kind in ("F", "apply") or not acc else row_axes(invars, rows, arriving)
    model_axes = {a for a, m in sizes.items() if m > 1} - set(axes)
    if axes and model_axes and option is None:
        note = (f"{t.name}: accumulated values reduced per micro-batch (the sub-mesh also "
                f"splits over {sorted(model_axes)} and the task has no plan to keep their "
                "layouts)")
        axes = ()
    fn = task_fn(t.eqns, invars, outvars, acc, consts, random)
    if pins:
        fn = pinned(fn, pins, mesh)
    fn = gather_once(fn, tuple(gathered), mesh)
    n, n_acc = len(invars), len(acc)
    n_args = len(abstract)
    acc_aliases = [(n + i, len(outvars) + i) for i in range(n_acc)]
    plan = closed = in_specs = out_specs = None
    if option is not None:
        closed = jax.make_jaxpr(fn)(*abstract)
        batch = [v in rows for v in invars] + [False] * (n_args - n)
        fixed = [None if a is None else spec_of(a) for a in arriving] + [None] * (n_args - n)

        def attempt():
            notes: list[str] = []
            got = plan_task(closed, t.name, num_devices=math.prod(target.mesh_shape),
                            option=option, batch=batch, aliases=list(aliases) + acc_aliases,
                            fixed=fixed, cluster=target.cluster, axis_names=target.axis_names,
                            notes=notes, compare_data_parallel=compare_data_parallel)
            return got, notes[0] if notes else note
        planned = attempt if once is None else once(t.name, closed, target.mesh, option,
                                                    attempt)
        if cache is not None:  # identical tasks (layers, stages) planned once
            key = (str(closed), tuple(batch), tuple(aliases), target.cluster, repr(option),
                   repr(fixed), target.axis_names)
            planned = _cached(cache, key, planned)
        try:
            plan, note = planned()
            in_specs, out_specs = list(plan.in_specs), list(plan.out_specs)
        except Exception as err:  # the planner's failure must not stop the pipeline
            if isinstance(err, ValueError) and "memory_budget_per_device" in str(err):
                raise ValueError(f"Stage {t.stage} does not fit in memory: its task {t.name} "
                                 f"has no plan within its budget ({err}). " + FIXES) from err
            plan = None
            note = f"{t.name}: planner failed ({type(err).__name__}: {err}); data parallel instead"
            warnings.warn(f"autoshard pipeline: {note}", stacklevel=3)
            if model_axes:
                axes = ()
    acc_shapes = [tuple(v.aval.shape) for v in acc]
    local = reduced = predicted = None
    if axes:
        costs = None if plan is None else task_costs(target.mesh_shape, option, target.cluster)
        found = per_device_run(t, invars, outvars, acc, consts, random, rows, axes, arriving,
                               plan, in_specs, costs, target, part.batch_dependent,
                               cache=cache if closed is not None else None, closed=closed)
        if isinstance(found, str):
            note, axes = found, ()
        else:
            local, in_specs, out_specs, plan, reduced = found
            groups = math.prod(sizes[a] for a in axes)
            acc_shapes = [(groups,) + s for s in acc_shapes]
            if plan is None:
                predicted = {}  # per device: no collective (checked on its trace)
            note = (f"{t.name}: runs per device over the batch axes {axes}; its {n_acc} "
                    "accumulator(s) stay partial sums over micro-batches and are reduced "
                    "once per step")
    if in_specs is None:
        in_specs = [fallback.get(v) for v in invars] + [fallback.get(v) for v in acc] + [
            P()] * (n_args - n - n_acc)
        out_specs = [fallback.get(v) for v in outvars] + in_specs[n:n + n_acc]
    if not axes:
        in_specs[:n] = [spec_of(a) if a is not None else in_specs[i]
                        for i, a in enumerate(arriving)]
        for i, o in aliases:  # the replacement keeps the layout of what it replaces
            out_specs[o] = in_specs[i]
    for o, spec in pins.items():
        out_specs[o] = spec
    return TaskPlan(kind=kind, task=t, target=target, invars=invars, outvars=outvars,
                    accumulated=acc, random=random, fn=fn, closed=closed, plan=plan,
                    batch_axes=axes, local=local, in_specs=list(in_specs),
                    out_specs=list(out_specs), acc_shapes=acc_shapes, reduced_specs=reduced,
                    option=option, note=note, predicted=predicted)


def _cached(cache: dict, key, planned):
    return lambda: once(cache, key, planned)


__all__ = ["FIXES", "Layouts", "Specs", "Target", "TaskPlan", "mesh_cluster", "plan_task",
           "plan_tasks", "task_costs", "task_order", "task_signature"]
