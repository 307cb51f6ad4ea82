"""Parallel methods: how a traced step is planned (which spec every array gets) and run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .._program import Program
from ..cluster import Cluster
from ..sharding.options import AutoShardingOption
from ..sharding.plan import ShardingPlan
from ._auto import compile_auto, plan_program
from ._base import Call, Compiled, ParallelMethod
from ._data import compile_data_parallel
from ._manual import compile_manual, price_manual


@dataclass(frozen=True, kw_only=True)
class ManualShardingOption:
    """User-given PartitionSpecs for ``ShardParallel`` and ``PipeshardParallel``."""

    mesh_axis_names: tuple[str, ...] | None
    """Names of the mesh axes the specs refer to (with a pipeline: of every sub-mesh, unless
    ``submesh_axis_names`` names each)."""
    in_axis_resources: Any = None
    """PartitionSpec or pytree prefix of the positional arguments; None leaves inputs replicated
    (with a pipeline: None leaves them to the planner, a None leaf replicates that input)."""
    out_axis_resources: Any = None
    """PartitionSpec or pytree prefix of the outputs; None: state follows inputs, rest replicated
    (with a pipeline: the rest planned)."""
    submesh_axis_names: tuple[tuple[str, ...], ...] | None = None
    """PipeshardParallel only: per sub-mesh, the names of its axes (Alpa's option)."""
    pipeline_intermediate_axes: tuple[tuple[str, int], ...] | None = None
    """PipeshardParallel only: ``(axis name, dim)`` pairs: values crossing between stages are
    split on ``dim`` over that axis on every sub-mesh that has it (Alpa's option)."""

    def __init__(self, mesh_axis_names=None, in_axis_resources=None, out_axis_resources=None,
                 *, submesh_axis_names=None, pipeline_intermediate_axes=None):
        if mesh_axis_names is None and submesh_axis_names is None:
            raise TypeError("ManualShardingOption needs mesh_axis_names (e.g. ('data', 'model')) "
                            "or, for PipeshardParallel, submesh_axis_names=... (a keyword: "
                            "the second positional argument is in_axis_resources).")
        for names in ([] if mesh_axis_names is None else [mesh_axis_names]) + list(
                submesh_axis_names or []):
            if isinstance(names, str) or not all(isinstance(n, str) for n in names):
                raise TypeError(
                    f"mesh_axis_names ({names!r}) must be a sequence of axis names, "
                    "e.g. ('data', 'model').")
        object.__setattr__(self, "mesh_axis_names",
                           None if mesh_axis_names is None else tuple(mesh_axis_names))
        object.__setattr__(self, "in_axis_resources", in_axis_resources)
        object.__setattr__(self, "out_axis_resources", out_axis_resources)
        object.__setattr__(self, "submesh_axis_names", None if submesh_axis_names is None else
                           tuple(tuple(n) for n in submesh_axis_names))
        object.__setattr__(self, "pipeline_intermediate_axes",
                           None if pipeline_intermediate_axes is None else
                           tuple(tuple(x) if isinstance(x, list | tuple) else x
                                 for x in pipeline_intermediate_axes))


# ShardParallel ---------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class ShardParallel(ParallelMethod):
    """Intra-operator parallelism: automatic (cost model + ILP) or from manual specs."""

    devices: Any = None
    """None (all devices), a list of devices, or a Mesh."""
    num_micro_batches: int | None = None
    """Micro-batches for gradient accumulation; None means 1."""
    auto_sharding_option: AutoShardingOption | None = None
    """Options of the automatic planner."""
    manual_sharding_option: ManualShardingOption | None = None
    """Fixed specs instead of the automatic planner."""
    plan: ShardingPlan | None = None
    """A plan made earlier (``autoshard.plan``, ``ShardingPlan.load``): used without re-planning
    after checking that it was made for this program and device count."""
    cluster: Cluster | None = None
    """The hardware the automatic plan is priced for. None: ``Cluster.from_devices`` of the
    devices (GPU presets; CPUs priced like an accelerator, so a CPU run shows the plan an
    accelerator would get); ``Cluster.measure()``: what these devices deliver (on CPUs, the
    plan that runs fastest there)."""

    def __post_init__(self):
        self._validate_common()
        if self.cluster is not None and not isinstance(self.cluster, Cluster):
            raise TypeError(f"cluster ({self.cluster!r}) must be an autoshard.Cluster, e.g. "
                            "Cluster.measure() or Cluster.from_devices(jax.devices()).")
        if self.cluster is not None and (self.plan is not None
                                         or self.manual_sharding_option is not None):
            raise ValueError(
                "ShardParallel's cluster prices the automatic plan; with plan=... or "
                "manual_sharding_option=... nothing is planned. Drop cluster, or pass it to "
                "autoshard.plan(..., cluster=...) when making the plan.")
        if self.plan is not None and not isinstance(self.plan, ShardingPlan):
            raise TypeError(f"plan ({type(self.plan).__name__}) must be a ShardingPlan, e.g. "
                            "autoshard.plan(...) or ShardingPlan.load(path).")
        if self.plan is not None and self.manual_sharding_option is not None:
            raise ValueError("ShardParallel takes plan or manual_sharding_option, not both. "
                             "Drop one of the two.")
        opt = self.auto_sharding_option
        if opt is not None and not isinstance(opt, AutoShardingOption):
            raise TypeError(f"auto_sharding_option ({opt!r}) must be an AutoShardingOption.")
        man = self.manual_sharding_option
        if man is not None and not isinstance(man, ManualShardingOption):
            raise TypeError(f"manual_sharding_option ({man!r}) must be a ManualShardingOption.")
        if man is not None and (man.mesh_axis_names is None or man.submesh_axis_names is not None
                                or man.pipeline_intermediate_axes is not None):
            raise ValueError(
                "ShardParallel's manual_sharding_option needs mesh_axis_names and takes no "
                "submesh_axis_names or pipeline_intermediate_axes (those are for "
                "PipeshardParallel's sub-meshes); got " f"{man!r}.")

    def compile(self, program: Program, call: Call) -> Compiled:
        if self.manual_sharding_option is not None:
            return compile_manual(self, program, call)
        return compile_auto(self, program, call)

    def plan_for(self, program: Program, cluster) -> ShardingPlan:
        if self.plan is not None:
            raise ValueError(
                "autoshard.plan: the method already carries a plan (ShardParallel(plan=...)); "
                "its estimate is plan.explain(). Pass ShardParallel() to plan again, or "
                "ShardParallel(manual_sharding_option=...) to price hand-written specs.")
        if self.manual_sharding_option is not None:
            return price_manual(self, program, cluster)
        return plan_program(self, program, cluster)


# Data parallel and ZeRO ------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class DataParallel(ParallelMethod):
    """Batch split on dim 0 over all devices; state replicated; gradients all-reduced."""

    devices: Any = None
    """None (all devices), a list of devices, or a Mesh (all its axes split the batch)."""
    num_micro_batches: int | None = None
    """Micro-batches for gradient accumulation; None means 1."""

    stage: int = field(default=0, init=False, repr=False)

    def __post_init__(self):
        self._validate_common()

    def compile(self, program: Program, call: Call) -> Compiled:
        return compile_data_parallel(self, program, call, zero_stage=self.stage)


@dataclass(frozen=True, eq=False)
class Zero2Parallel(DataParallel):
    """Data parallel with gradients reduce-scattered and optimizer state sharded (ZeRO-2)."""

    stage: int = field(default=2, init=False, repr=False)


@dataclass(frozen=True, eq=False)
class Zero3Parallel(DataParallel):
    """ZeRO-2 plus parameters sharded between steps and gathered at use (ZeRO-3)."""

    stage: int = field(default=3, init=False, repr=False)


