"""``autoshard.plan``: the plan of a step for a described cluster, with no device of it at hand.

    plan = autoshard.plan(train_step, state_shapes, batch_shapes,
                          cluster=autoshard.Cluster.a100_80gb(num_hosts=32))
    print(plan.explain())          # split, memory, collectives, estimated step time
    plan.save("gpt_256.json")
    # later, on the 256 GPUs:
    step = autoshard.parallelize(train_step, method=autoshard.ShardParallel(
        plan=autoshard.ShardingPlan.load("gpt_256.json")))

The step is traced exactly as ``parallelize`` traces it (same static, batch and donated
arguments), so the plan's fingerprint matches the program the real run traces.

A hand-written plan is priced by the same cost model: pass ``ShardParallel(
manual_sharding_option=ManualShardingOption(names, in_axis_resources=...),
auto_sharding_option=AutoShardingOption(logical_mesh_shape=shape))``. The inputs keep the
given specs, the planner places every other value at its cheapest given them, and
``explain()`` gives the estimated step time to set beside the automatic plan's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from jax.sharding import PartitionSpec as P

from ._api import _DEFAULT_BATCH, _argnums
from ._auto import plan_program
from ._jaxpr import flatten_args
from ._manual import _UNSET, _leaf_specs, validate_spec
from ._mesh import resolve_devices
from ._method_base import ParallelMethod
from ._methods import ShardParallel
from ._program import Program, trace_program
from .cluster import Cluster
from .pipeline.method import PipeshardParallel
from .pipeline.price import PipelineEstimate, price_pipeline
from .sharding.options import AutoShardingOption
from .sharding.plan import ShardingPlan


def plan(fun: Callable, *args, method: ParallelMethod | None = None,
         cluster: Cluster | None = None, static_argnums: str | Sequence[int] = "auto",
         batch_argnums: Sequence[int] = _DEFAULT_BATCH,
         donate_argnums: str | Sequence[int] = "auto") -> ShardingPlan | PipelineEstimate:
    """Plan ``fun(*args)`` for ``cluster`` without its devices; returns the ``ShardingPlan``.

    ``args``: arrays or ``jax.ShapeDtypeStruct``s (nothing is allocated). ``method``:
    ``ShardParallel()`` (the default) with any ``auto_sharding_option``. ``cluster``: the
    hardware to cost for (default: the devices of ``method``, ``Cluster.from_devices``).
    ``static_argnums``, ``batch_argnums``, ``donate_argnums``: as in ``parallelize``, so the
    plan fits the program ``parallelize`` traces with the same arguments.

    With a ``manual_sharding_option`` the method's plan is priced instead of searched: its
    inputs keep their specs (unset ones replicated, as when the manual plan runs) on the mesh
    ``auto_sharding_option.logical_mesh_shape`` (1-D for one axis name); every other value is
    placed by the planner around them (``with_sharding_constraint`` in the step pins more).

    With ``PipeshardParallel(...)`` the step is cut into layers and stages as that method
    cuts it (``AutoStageOption``: the stage search, on planned layer times), every task is
    planned on its sub-mesh of ``cluster`` and the schedule is replayed with those times: the
    result is a ``pipeline.price.PipelineEstimate`` (``explain()``: stages, sub-meshes, task
    plans and times, the bubble, memory per stage).
    """
    if not callable(fun):
        raise TypeError(f"autoshard.plan expects a function, got {fun!r}.")
    method = ShardParallel() if method is None else method
    pipeline = isinstance(method, PipeshardParallel)
    if not isinstance(method, ShardParallel) and not pipeline:
        raise TypeError(
            f"autoshard.plan plans ShardParallel or PipeshardParallel (got "
            f"{type(method).__name__}). Pass method=ShardParallel() for one mesh, or "
            "PipeshardParallel(...) for stages on sub-meshes.")
    if not pipeline and method.plan is not None:
        raise ValueError(
            "autoshard.plan: the method already carries a plan (ShardParallel(plan=...)); its "
            "estimate is plan.explain(). Pass ShardParallel() to plan again, or "
            "ShardParallel(manual_sharding_option=...) to price hand-written specs.")
    if cluster is None:
        cluster = Cluster.from_devices(resolve_devices(method.devices)[0])
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster ({cluster!r}) must be an autoshard.Cluster, e.g. "
                        "Cluster.a100_80gb(num_hosts=4).")
    static = _argnums(static_argnums, "static_argnums")
    static = () if static == "auto" else static
    for i in static:
        if not -len(args) <= i < len(args):
            raise ValueError(f"static_argnums ({static_argnums}) names argument {i}, but "
                             f"{len(args)} positional arguments were given.")
    static = tuple(i % len(args) for i in static)
    batch = _argnums(batch_argnums, "batch_argnums")
    if batch == "auto":
        raise TypeError("batch_argnums must be a sequence of ints, e.g. (1,); not 'auto'.")
    if batch_argnums is _DEFAULT_BATCH and len(args) < 2:
        batch = ()  # as parallelize: a one-argument function has no batch argument
    n = len(args)
    batch = tuple(b % n if -n <= b < n else b for b in batch)
    flat = flatten_args(args, static)
    name = getattr(fun, "__name__", "the function")
    program, _ = trace_program(fun, args, flat, batch_argnums=batch,
                               donate_argnums=_argnums(donate_argnums, "donate_argnums"),
                               num_micro_batches=method.micro_batches, name=name)
    if method.devices is not None and len(resolve_devices(method.devices)[0]) != (
            cluster.num_devices):
        raise ValueError(
            f"The method's devices ({len(resolve_devices(method.devices)[0])}) and the cluster "
            f"({cluster.num_devices} devices, {cluster.name}) differ. Give one of the two.")
    if pipeline:
        if method.manual_sharding_option is not None:
            raise ValueError(
                "autoshard.plan does not price PipeshardParallel's manual_sharding_option yet "
                "(its specs would be ignored). Price the pipeline without it, or run it and "
                "read executable.explain().")
        return price_pipeline(method, program, cluster)
    if method.manual_sharding_option is not None:
        return _price_manual(method, program, cluster)
    return plan_program(method, program, cluster)


def _price_manual(method, program: Program, cluster: Cluster) -> ShardingPlan:
    """The manual option's input specs priced on its mesh, the rest placed by the planner."""
    manual = method.manual_sharding_option
    names = manual.mesh_axis_names
    option = method.auto_sharding_option or AutoShardingOption()
    shape = option.logical_mesh_shape
    if shape is None and len(names) == 1:
        shape = (cluster.num_devices,)
    if shape is None or len(shape) != len(names) or math.prod(shape) != cluster.num_devices:
        raise ValueError(
            f"autoshard.plan: manual_sharding_option names the mesh axes {names} but "
            f"auto_sharding_option.logical_mesh_shape is {shape}; give one size per axis with "
            f"a product of {cluster.num_devices} (the cluster's devices), e.g. "
            f"AutoShardingOption(logical_mesh_shape=({cluster.num_hosts}, "
            f"{cluster.devices_per_host})).")
    if manual.out_axis_resources is not None:
        raise ValueError(
            "autoshard.plan prices a manual plan by its inputs: out_axis_resources "
            f"({manual.out_axis_resources}) is not priced (donated state follows its input, the "
            "other outputs are placed by the planner). Drop out_axis_resources to price it.")
    sizes = dict(zip(names, shape, strict=True))
    specs = _leaf_specs(manual.in_axis_resources, program.args_shape, "in_axis_resources",
                        len(program.in_avals))
    specs = [P() if s is _UNSET else s for s in specs]  # unset: replicated, as when it runs
    for spec, aval, path in zip(specs, program.in_avals, program.in_paths, strict=True):
        validate_spec(spec, aval.shape, sizes, where=f"in_axis_resources for {path}")
    option = dataclasses.replace(option, logical_mesh_shape=tuple(shape))
    auto = dataclasses.replace(method, manual_sharding_option=None, auto_sharding_option=option)
    plan = plan_program(auto, program, cluster, axis_names=names, fixed_in_specs=specs)
    return dataclasses.replace(plan, method="ShardParallel(manual, priced)", notes=(
        "hand-written plan priced: the inputs keep the manual_sharding_option's specs "
        "(unset ones replicated); every other value is placed by the planner", *plan.notes))


__all__ = ["plan"]
