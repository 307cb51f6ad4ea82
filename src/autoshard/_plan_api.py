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

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ._api import (
    _DEFAULT_BATCH,
    _argnums,
    batch_argnums_of,
    batch_positions,
    collector_paused,
    static_positions,
    trace_call,
)
from .cluster import Cluster
from .ir._jaxpr import flatten_args
from .methods._base import ParallelMethod
from .methods._mesh import resolve_devices
from .methods._methods import ShardParallel
from .sharding.plan import ShardingPlan

if TYPE_CHECKING:
    from .pipeline.price import PipelineEstimate


def plan(fun: Callable, *args, method: ParallelMethod | None = None,
         cluster: Cluster | None = None, static_argnums: str | Sequence[int] = "auto",
         batch_argnums: Sequence[int] = _DEFAULT_BATCH,
         donate_argnums: str | Sequence[int] = "auto") -> ShardingPlan | PipelineEstimate:
    """Plan ``fun(*args)`` for ``cluster`` without its devices; returns the ``ShardingPlan``.

    ``args``: arrays or ``jax.ShapeDtypeStruct``s (nothing is allocated). ``method``:
    ``ShardParallel()`` (the default) with any ``auto_sharding_option``. ``cluster``: the
    hardware to cost for (default: the method's ``cluster``, else the devices of ``method``,
    ``Cluster.from_devices``).
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

    With ``AutoParallel(...)`` the whole-mesh plan and pipelines of every stage count are
    priced as above and the fastest that fits memory is chosen: the result is a
    ``pipeline.auto.AutoEstimate`` (``explain()``: every candidate's step time and memory,
    the choice and why, then the chosen plan's explanation); ``AutoParallel(plan=result)``
    runs that choice on the devices.
    """
    if not callable(fun):
        raise TypeError(f"autoshard.plan expects a function, got {fun!r}.")
    method = ShardParallel() if method is None else method
    if not isinstance(method, ParallelMethod):
        raise TypeError(f"method ({method!r}) must be a ParallelMethod such as "
                        "autoshard.ShardParallel(), PipeshardParallel(...) or "
                        "AutoParallel().")
    own = getattr(method, "cluster", None)
    if cluster is not None and own is not None and cluster != own:
        raise ValueError(
            f"autoshard.plan: cluster ({cluster.name}) and the method's cluster ({own.name}) "
            "differ. Give the cluster once, to plan(..., cluster=...) or to the method.")
    if cluster is None:
        cluster = own if own is not None else Cluster.from_devices(
            resolve_devices(method.devices)[0])
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster ({cluster!r}) must be an autoshard.Cluster, e.g. "
                        "Cluster.a100_80gb(num_hosts=4).")
    static = static_positions(_argnums(static_argnums, "static_argnums"), args)
    batch = batch_positions(batch_argnums_of(batch_argnums), batch_argnums is _DEFAULT_BATCH,
                            args)
    with collector_paused():
        program, _ = trace_call(fun, args, flatten_args(args, static), static=static,
                                batch=batch, donate=_argnums(donate_argnums, "donate_argnums"),
                                method=method, name=getattr(fun, "__name__", "the function"))
        if method.devices is not None and len(resolve_devices(method.devices)[0]) != (
                cluster.num_devices):
            raise ValueError(
                f"The method's devices ({len(resolve_devices(method.devices)[0])}) and the "
                f"cluster ({cluster.num_devices} devices, {cluster.name}) differ. Give one of "
                "the two.")
        return method.plan_for(program, cluster)


__all__ = ["plan"]
