"""``PipeshardParallel``: stages on disjoint sub-meshes, micro-batches streamed through them."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from ..methods._methods import ManualShardingOption, ParallelMethod
from .build import method_devices, plan_partition
from .compile import make_submeshes, stage_auto_option
from .layers import layer_option_of
from .manual import submesh_axis_names
from .price import price_pipeline
from .runtime import PipelineExecutable
from .schedules import SCHEDULES
from .stages import AutoStageOption, ManualStageOption, UniformStageOption


@dataclass(frozen=True, eq=False)
class PipeshardParallel(ParallelMethod):
    """Inter-operator (pipeline) parallelism with a plan per stage, as Alpa's.

    ``PipeshardParallel()`` is ``AutoLayerOption(layer_num=2)`` with ``UniformStageOption()``:
    two layers, one stage each, devices split evenly.
    """

    devices: Any = None
    """None (all devices), a list of devices, or a Mesh (its devices in order)."""
    num_micro_batches: int = 1
    """Micro-batches streamed through the stages per step."""
    default_auto_sharding_option: Any = None
    """Planner options for every stage (an ``AutoShardingOption``)."""
    pipeline_schedule: str = "1f1b"
    """``gpipe``, ``1f1b``, ``inference``, ``interleaved_1f1b`` or ``zero_bubble``."""
    layer_option: Any = None
    """``ManualLayerOption``, ``AutoLayerOption``, ``"manual"``; None: AutoLayerOption(2)."""
    stage_option: Any = None
    """``UniformStageOption``, ``ManualStageOption``, ``AutoStageOption`` or ``"uniform"``."""
    stage_input_shardings: Any = None
    """Per stage, input specs to reproduce (``executable.stage_input_shard_specs``)."""
    manual_sharding_option: Any = None
    """A ``ManualShardingOption``: sub-mesh axis names, input/output specs and the split of
    values crossing stages, fixed in every task's plan (``pipeline.manual``)."""
    virtual_stages: int = 2
    """Model stages per sub-mesh with ``interleaved_1f1b`` (Megatron's chunks); else unused."""
    blocking: bool = False
    """Wait for every action before dispatching the next (debugging; XLA:CPU collectives)."""

    def __post_init__(self):
        self._validate_common()
        if self.num_micro_batches is None:
            object.__setattr__(self, "num_micro_batches", 1)
        if self.pipeline_schedule not in SCHEDULES:
            raise ValueError(f"pipeline_schedule ({self.pipeline_schedule!r}) must be one of "
                             f"{SCHEDULES}.")
        man = self.manual_sharding_option
        if man is not None and not isinstance(man, ManualShardingOption):
            raise TypeError(f"manual_sharding_option ({man!r}) must be an "
                            "autoshard.ManualShardingOption.")
        v = self.virtual_stages
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"virtual_stages ({v!r}) must be a positive int.")
        layer = layer_option_of(self.layer_option, default_layers=2)
        stage = self.stage_option
        if stage is None or stage == "uniform":
            stage = UniformStageOption()
        elif stage == "auto":
            stage = AutoStageOption()
        elif not isinstance(stage, UniformStageOption | ManualStageOption | AutoStageOption):
            raise TypeError(f"stage_option ({stage!r}) must be 'uniform', 'auto', "
                            "UniformStageOption, ManualStageOption or AutoStageOption.")
        object.__setattr__(self, "layer_option", layer)
        object.__setattr__(self, "stage_option", stage)

    def plan_for(self, program, cluster):
        if self.manual_sharding_option is not None:
            raise ValueError(
                "autoshard.plan does not price PipeshardParallel's manual_sharding_option yet "
                "(its specs would be ignored). Price the pipeline without it, or run it and "
                "read executable.explain().")
        return price_pipeline(self, program, cluster)

    def compile_executable(self, program, call):
        t0 = time.perf_counter()
        devices = method_devices(self)
        part, plan, sizes, dicts = plan_partition(program, self, devices)
        num_ranks = len(sizes)  # sub-meshes; model stages are a multiple (interleaved)
        names = submesh_axis_names(self.manual_sharding_option, plan.submesh_shapes[:num_ranks])
        if names is not None:
            plan = dataclasses.replace(plan, submesh_axis_names=tuple(
                names[s % num_ranks] for s in range(part.num_stages)))
        meshes = make_submeshes(devices, sizes, plan.submesh_shapes[:num_ranks], names)
        options = [stage_auto_option(self.default_auto_sharding_option,
                                     meshes[s % num_ranks], dicts[s % num_ranks])
                   for s in range(part.num_stages)]
        t1 = time.perf_counter()
        return PipelineExecutable(
            part=part, plan=plan, program=program, flat=call.flat, out_tree=call.out_tree,
            static_argnums=call.static_argnums, devices=devices, sizes=sizes,
            blocking=self.blocking, name=call.name, agree=call.agree, options=options,
            virtual=part.num_stages // num_ranks,
            stage_input_shardings=self.stage_input_shardings,
            manual_sharding_option=self.manual_sharding_option,
            timings={"trace_s": call.trace_s, "planning_s": t1 - t0})


__all__ = ["PipeshardParallel"]
