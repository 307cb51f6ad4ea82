"""Planning one pipeline task: the one ``plan_auto`` call, with its one fallback rule and the
cluster costs of its sub-mesh, that the runtime (``compile.CompiledTask``) and the pricing of
a described cluster (``price._Pricer``) both make, so the plan that was priced is the plan
that runs.

A task is planned with its inputs pinned to the layouts their producers give them
(``fixed``). If no plan takes them (a ``ValueError``, the memory budget's included: pinned
layouts can cost memory an unpinned plan saves), the task is planned unpinned and its inputs
are resharded inside it; a note says so. Only when the unpinned plan fails too does the error
reach the caller (for the memory budget: "Stage s does not fit in memory").
"""

from __future__ import annotations

from collections.abc import Sequence

from ..cluster import Cluster
from ..sharding import plan_auto
from ..sharding.options import AutoShardingOption
from ..sharding.plan import ShardingPlan


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


def mesh_cluster(mesh) -> Cluster:
    """The cluster of a sub-mesh's devices, for its costs (``Cluster.from_devices``: A100/H100
    figures on those GPUs, the cost model's defaults elsewhere)."""
    return Cluster.from_devices(list(mesh.devices.flat))


__all__ = ["mesh_cluster", "plan_task"]
