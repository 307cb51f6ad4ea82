"""Parallel methods: how a traced step is planned (which spec every array gets) and run."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from jax.sharding import PartitionSpec as P

from . import sharding
from ._mesh import as_auto_mesh, check_devices, mesh_from_shape, resolve_devices
from ._program import Program
from .grad_accum import StepHooks, batch_axes
from .sharding.options import AutoShardingOption
from .sharding.plan import LeafPlan, ShardingPlan


@dataclass(frozen=True, kw_only=True)
class Compiled:
    """What a method hands the front end: a plan, a mesh, and the function to jit."""

    plan: ShardingPlan
    mesh: Any
    fn: Any


class ParallelMethod:
    """Base class: turns a traced Program into a plan and a function to compile."""

    devices: Any = None
    num_micro_batches: int | None = None

    def compile(self, program: Program) -> Compiled:
        raise NotImplementedError

    @property
    def micro_batches(self) -> int:
        return self.num_micro_batches or 1

    def _validate_common(self):
        check_devices(self.devices)
        k = self.num_micro_batches
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise ValueError(
                f"num_micro_batches ({k!r}) must be a positive int or None (no accumulation).")


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

    def __post_init__(self):
        self._validate_common()
        opt = self.auto_sharding_option
        if opt is not None and not isinstance(opt, AutoShardingOption):
            raise TypeError(f"auto_sharding_option ({opt!r}) must be an AutoShardingOption.")
        man = self.manual_sharding_option
        if man is not None and not isinstance(man, ManualShardingOption):
            raise TypeError(f"manual_sharding_option ({man!r}) must be a ManualShardingOption.")

    def compile(self, program: Program) -> Compiled:
        if self.manual_sharding_option is not None:
            from ._manual import compile_manual
            return compile_manual(self, program)
        return _compile_auto(self, program)


def _compile_auto(method: ShardParallel, program: Program) -> Compiled:
    devices, user_mesh = resolve_devices(method.devices)
    option = method.auto_sharding_option or AutoShardingOption()
    axis_names = None
    if user_mesh is not None:
        if option.logical_mesh_shape not in (None, tuple(user_mesh.devices.shape)):
            raise ValueError(
                f"auto_sharding_option.logical_mesh_shape ({option.logical_mesh_shape}) differs "
                f"from the shape {tuple(user_mesh.devices.shape)} of the Mesh passed as devices. "
                "Drop one of the two.")
        option = _replace(option, logical_mesh_shape=tuple(user_mesh.devices.shape))
        axis_names = tuple(user_mesh.axis_names)
    elif option.logical_mesh_shape is not None and math.prod(option.logical_mesh_shape) != len(
            devices):
        raise ValueError(
            f"auto_sharding_option.logical_mesh_shape {option.logical_mesh_shape} has "
            f"{math.prod(option.logical_mesh_shape)} devices but the method uses {len(devices)}. "
            "Choose a shape whose product is the device count.")
    accumulate = program.num_micro_batches > 1
    # With micro-batches the planner costs one micro-batch step: the loop then runs each
    # device on its own rows and reduces the gradients once, as in that step.
    closed = program.closed if accumulate else program.full_jaxpr()
    plan = sharding.plan_auto(
        closed, num_devices=len(devices), option=option, in_paths=program.in_paths,
        out_paths=program.out_paths, batch_invars=program.batch_invars,
        aliases=program.aliases, axis_names=axis_names,
        devices_per_host=sum(d.process_index == devices[0].process_index for d in devices))
    mesh = (as_auto_mesh(user_mesh) if user_mesh is not None
            else mesh_from_shape(devices, plan.mesh_shape, plan.axis_names))
    if not accumulate:
        return Compiled(plan=plan, mesh=mesh, fn=sharding.apply_plan(closed, plan, mesh))
    inputs = tuple(dataclasses.replace(leaf, shape=tuple(a.shape))
                   for leaf, a in zip(plan.inputs, program.in_avals, strict=True))
    plan = dataclasses.replace(plan, inputs=inputs, notes=plan.notes + (
        f"planned for one micro-batch of {program.num_micro_batches}; inputs, outputs and the "
        "accumulated gradients follow the plan, values inside the micro-batch loop follow "
        "XLA's propagation from them",))
    hooks = StepHooks(mesh=mesh, batch_axes=batch_axes(program.batch_invars, plan.in_specs))
    return Compiled(plan=plan, mesh=mesh, fn=program.step(hooks))


def _replace(option, **changes):
    return dataclasses.replace(option, **changes)


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
        from ._zero import compile_data_parallel
        return compile_data_parallel(self, program, zero_stage=self.stage)


@dataclass(frozen=True, eq=False)
class Zero2Parallel(DataParallel):
    """Data parallel with gradients reduce-scattered and optimizer state sharded (ZeRO-2)."""

    stage: int = field(default=2, init=False, repr=False)


@dataclass(frozen=True, eq=False)
class Zero3Parallel(DataParallel):
    """ZeRO-2 plus parameters sharded between steps and gathered at use (ZeRO-3)."""

    stage: int = field(default=3, init=False, repr=False)


def leaf_plan(program: Program, i: int, spec, note: str = "", *, output: bool = False):
    aval = program.out_avals[i] if output else program.in_avals[i]
    path = program.out_paths[i] if output else program.in_paths[i]
    return LeafPlan(path=path, shape=tuple(aval.shape), dtype=aval.dtype.name, spec=spec,
                    note=note)


def batch_spec(program: Program, axes: Sequence[str], num_devices: int) -> list:
    """Specs of the inputs for splitting batch arguments on dim 0 over ``axes``."""
    specs = []
    for i, is_batch in enumerate(program.batch_invars):
        if not is_batch:
            specs.append(P())
            continue
        aval = program.in_avals[i]
        size = aval.shape[0]
        per = num_devices * program.num_micro_batches
        if size % per:
            raise ValueError(
                f"The batch size ({size}) of {program.in_paths[i]} must be divisible by the "
                f"number of devices ({num_devices}) times num_micro_batches "
                f"({program.num_micro_batches}) for data parallelism. Choose a batch size "
                f"that is a multiple of {per}, or fewer devices.")
        specs.append(P(tuple(axes) if len(axes) > 1 else axes[0]))
    return specs

