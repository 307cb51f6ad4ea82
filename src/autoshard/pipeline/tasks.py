"""Planning a pipeline's tasks, once for the runtime, the pricing and the stage profiler.

``plan_tasks`` walks a partition's tasks in the order values flow (forward stages, backward
stages last one first, the stages' finalised gradients and the sums spanning stages, then the
apply tasks) and gives each task the layouts its inputs arrive in (``Layouts.arriving``): the
layout a value already has on the task's sub-mesh, else its producer's (or first reader's),
carried over where the sub-mesh holds the same shards device for device. What a task does with
them is the caller's ``realize``: the runtime compiles the task on its sub-mesh
(``compile.CompiledTask``), the pricing of a described cluster plans it on the sub-mesh's
cluster (``price``); both plan through ``plan_task`` and decide a backward task's batch axes
with ``row_axes``/``rows_taken``, so the plan that was priced is the plan that runs
(``tests/pipeline/test_task_planner.py`` holds them equal for every schedule).

A task is planned with its inputs pinned to the layouts their producers give them
(``fixed``). If no plan takes them (a ``ValueError``, the memory budget's included: pinned
layouts can cost memory an unpinned plan saves), the task is planned unpinned and its inputs
are resharded inside it; a note says so. Only when the unpinned plan fails too does the error
reach the caller (for the memory budget: "Stage s does not fit in memory").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from jax.sharding import PartitionSpec as P

from ..cluster import Cluster
from ..sharding import plan_auto
from ..sharding.cost import CostModel
from ..sharding.options import AutoShardingOption
from ..sharding.plan import ShardingPlan, spec_axes
from .layouts import carried
from .partition import Partition, Task


def plan_task(closed, name: str, *, num_devices: int, option: AutoShardingOption,
              batch: Sequence[bool], aliases: Sequence[tuple[int, int]], fixed=None,
              cluster: Cluster | None = None, axis_names=None,
              notes: list[str] | None = None) -> ShardingPlan:
    """The plan of task ``name`` (its traced function ``closed``) on ``num_devices`` devices
    with the costs of ``cluster`` (None: the cost model's defaults); ``fixed``: per input the
    PartitionSpec it arrives in, or None. A fallback to an unpinned plan appends to ``notes``."""
    n_args = len(closed.in_avals)

    def plan(fixed_in_specs):
        return plan_auto(
            closed, num_devices=num_devices, option=option,
            in_paths=[f"{name}.in{i}" for i in range(n_args)],
            out_paths=[f"{name}.out{i}" for i in range(len(closed.out_avals))],
            batch_invars=list(batch), aliases=list(aliases), cluster=cluster,
            axis_names=axis_names, fixed_in_specs=fixed_in_specs)
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


@dataclass(frozen=True)
class Realized:
    """The layouts a task runs in, as its ``realize`` decided them."""

    in_specs: Sequence
    """Per (non-constant) input, the PartitionSpec it takes."""
    out_specs: Sequence
    """Per output that is not accumulated, its PartitionSpec."""
    finalized: dict = field(default_factory=dict)
    """Gradient-marker output -> the spec its accumulator is finalised in (reduced once per
    step), for the apply tasks that read it."""


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


def task_order(part: Partition, split: bool) -> list[tuple[str, Task]]:
    """(kind, task) of the forward and backward tasks in the order values flow: forward
    stages, then backward stages last one first (``Ba`` then ``Bw`` where ``split``)."""
    order = [("F", t) for t in part.forward]
    if part.has_backward:
        for s in reversed(range(part.num_stages)):
            order += ([("Ba", part.split_backward[s][0]), ("Bw", part.split_backward[s][1])]
                      if split else [("B", part.backward[s])])
    return order


def plan_tasks(part: Partition, targets: Sequence[Target], split: bool,
               realize: Callable[[str, Task, list], Realized]) -> Layouts:
    """Walk the tasks of ``part`` in the order values flow, each stage's on ``targets[s]``,
    calling ``realize(kind, task, arriving)`` with the spec each (non-constant) input arrives
    in (None: unknown) and recording the layouts it returns; the finalised gradients, the sums
    spanning stages (replicated on every sub-mesh), the whole-batch inputs (as the batch
    arrives) and the joined values (in their source's layout) before the apply tasks."""
    layouts = Layouts()
    consts = set(part.jaxpr.constvars)

    def run(kind, t):
        target = targets[t.stage]
        invars = [v for v in t.invars if v not in consts]
        done = realize(kind, t, [layouts.arriving(v, target) for v in invars])
        outs = [v for v in t.outvars if v not in t.accumulated]
        for v, spec in [*zip(invars, done.in_specs, strict=False),
                        *zip(outs, done.out_specs, strict=False)]:
            layouts.record(v, target, spec)
        for o, spec in done.finalized.items():
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


def row_axes(invars, rows, arriving) -> tuple[str, ...]:
    """The mesh axes splitting dim 0 of the micro-batch-row inputs as they arrive (empty when
    they differ, some arrive unknown, or none is split; rows split on another dim do not
    count: the task reshards them). A backward task runs per device over these axes and keeps
    its gradients partial over them (reduced once per step)."""
    if arriving is None:
        return ()
    found = set()
    for v, s in zip(invars, arriving, strict=True):
        if v in rows:
            if s is None:
                return ()
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


__all__ = ["Layouts", "Realized", "Target", "mesh_cluster", "plan_task", "plan_tasks",
           "row_axes", "rows_taken", "task_costs", "task_order"]
