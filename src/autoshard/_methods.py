"""Parallel methods: how a traced step is planned (which spec every array gets) and run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._auto import compile_auto
from ._manual import compile_manual
from ._method_base import Compiled, ParallelMethod
from ._program import Program
from ._zero import compile_data_parallel
from .sharding.options import AutoShardingOption
from .sharding.plan import ShardingPlan


@dataclass(frozen=True, kw_only=True)
class ManualShardingOption:
    """User-given PartitionSpecs for ``ShardParallel``."""

    mesh_axis_names: tuple[str, ...]
    """Names of the mesh axes the specs refer to."""
    in_axis_resources: Any = None
    """PartitionSpec or pytree prefix of the positional arguments; None leaves inputs replicated."""
    out_axis_resources: Any = None
    """PartitionSpec or pytree prefix of the outputs; None: state follows inputs, rest replicated."""

    def __init__(self, mesh_axis_names, in_axis_resources=None, out_axis_resources=None):
        if isinstance(mesh_axis_names, str) or not all(
                isinstance(n, str) for n in mesh_axis_names):
            raise TypeError(
                f"mesh_axis_names ({mesh_axis_names!r}) must be a sequence of axis names, "
                "e.g. ('data', 'model').")
        object.__setattr__(self, "mesh_axis_names", tuple(mesh_axis_names))
        object.__setattr__(self, "in_axis_resources", in_axis_resources)
        object.__setattr__(self, "out_axis_resources", out_axis_resources)


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

    def __post_init__(self):
        self._validate_common()
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

    def compile(self, program: Program) -> Compiled:
        if self.manual_sharding_option is not None:
            return compile_manual(self, program)
        return compile_auto(self, program)


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

    def compile(self, program: Program) -> Compiled:
        return compile_data_parallel(self, program, zero_stage=self.stage)


@dataclass(frozen=True, eq=False)
class Zero2Parallel(DataParallel):
    """Data parallel with gradients reduce-scattered and optimizer state sharded (ZeRO-2)."""

    stage: int = field(default=2, init=False, repr=False)


@dataclass(frozen=True, eq=False)
class Zero3Parallel(DataParallel):
    """ZeRO-2 plus parameters sharded between steps and gathered at use (ZeRO-3)."""

    stage: int = field(default=3, init=False, repr=False)


