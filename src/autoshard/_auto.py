"""ShardParallel's automatic plan: the planner over the traced step, applied with pins."""

from __future__ import annotations

import dataclasses
import math

from . import sharding
from ._mesh import as_auto_mesh, mesh_from_shape, resolve_devices
from ._method_base import Compiled
from ._program import Program
from .distributed.plan_sync import agree_on_plan
from .grad_accum import StepHooks, batch_axes
from .sharding.options import AutoShardingOption


def compile_auto(method, program: Program) -> Compiled:
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
    # The traced step itself is planned (no re-trace). With micro-batches it is one
    # micro-batch's step: the loop then runs each device on its own rows and reduces the
    # gradients once, as in that step.
    closed = program.closed
    # Across processes, process 0 plans and the others receive its plan (after checking that
    # they traced the same program); with one process this just plans.
    plan = agree_on_plan("ShardParallel", program, lambda: sharding.plan_auto(
        closed, num_devices=len(devices), option=option, in_paths=program.in_paths,
        out_paths=program.out_paths, batch_invars=program.batch_invars,
        aliases=program.aliases, axis_names=axis_names,
        devices_per_host=sum(d.process_index == devices[0].process_index for d in devices)))
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
