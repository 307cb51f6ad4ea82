"""DataParallel, ZeRO-2 and ZeRO-3 plans: batch split on dim 0, state replicated or sharded."""

from __future__ import annotations

import warnings

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ._mesh import as_auto_mesh, mesh_from_shape, resolve_devices
from ._method_base import Compiled, batch_spec, leaf_plan
from ._program import Program
from .grad_accum import StepHooks
from .sharding.plan import ShardingPlan


def shard_dim_spec(shape, axes: tuple[str, ...], num_devices: int) -> tuple[P, str]:
    """Split the first dim divisible by the device count; otherwise replicate and say why."""
    axis = axes if len(axes) > 1 else axes[0]
    for d, size in enumerate(shape):
        if size % num_devices == 0 and size >= num_devices:
            return P(*([None] * d), axis), ""
    dims = "x".join(map(str, shape)) or "scalar"
    return P(), f"replicated: no dim of {dims} divisible by {num_devices}"


def compile_data_parallel(method, program: Program, *, zero_stage: int) -> Compiled:
    devices, user_mesh = resolve_devices(method.devices)
    mesh = as_auto_mesh(user_mesh) if user_mesh is not None else mesh_from_shape(
        devices, (len(devices),), ("data",))
    axes = tuple(mesh.axis_names)
    n = len(devices)
    in_specs = batch_spec(program, axes, n)
    in_notes = [""] * len(in_specs)
    name = {0: "DataParallel", 2: "Zero2Parallel", 3: "Zero3Parallel"}[zero_stage]
    if zero_stage >= 2 and not any(program.param_invars):
        warnings.warn(
            f"{name} found no parameters in the traced step, so nothing is sharded as "
            "parameters or optimizer state. Compute gradients with autoshard.grad or "
            "autoshard.value_and_grad: their differentiated arguments are the parameters.",
            RuntimeWarning, stacklevel=6)
    state = {i for i, _ in program.aliases}  # inputs the step returns updated
    sharded_state = {}  # input index -> spec of a ZeRO-sharded state leaf
    for i, aval in enumerate(program.in_avals):
        is_param = program.param_invars[i]
        if not (is_param or i in state) or program.batch_invars[i]:
            continue
        if zero_stage == 3 or (zero_stage == 2 and not is_param):
            spec, note = shard_dim_spec(aval.shape, axes, n)
            in_specs[i], in_notes[i] = spec, note
            if spec != P():
                sharded_state[i] = spec
    out_specs = [P()] * len(program.out_avals)
    for i, o in program.aliases:
        out_specs[o] = in_specs[i]

    notes = []
    local = {"mesh": mesh, "batch_axes": axes}  # micro-batches accumulate on each device
    hooks = StepHooks(**local)
    if zero_stage >= 2:
        if program.has_grad_marker:
            hooks = StepHooks(
                forward_inputs=_gather_params(program, mesh) if zero_stage == 3 else None,
                gradients=_scatter_gradients(mesh, axes, n), **local)
        else:
            notes.append("no gradient marker: gradients are not pinned to shards; compute them "
                         "with autoshard.grad/value_and_grad to get reduce-scattered gradients")
            if zero_stage == 3:
                hooks = StepHooks(forward_inputs=_gather_params(program, mesh), **local)
    plan = ShardingPlan(
        method=name, mesh_shape=tuple(mesh.devices.shape), axis_names=axes,
        inputs=tuple(leaf_plan(program, i, s, in_notes[i]) for i, s in enumerate(in_specs)),
        outputs=tuple(leaf_plan(program, i, s, output=True) for i, s in enumerate(out_specs)),
        notes=tuple(notes))
    return Compiled(plan=plan, mesh=mesh, fn=program.step(hooks))


def _gather_params(program: Program, mesh):
    """ZeRO-3: parameters are used whole in the forward and backward pass (all-gather at use)."""
    replicated = NamedSharding(mesh, P())

    def gather(values):
        return [jax.lax.with_sharding_constraint(v, replicated) if program.param_invars[i] else v
                for i, v in enumerate(values)]
    return gather


def _scatter_gradients(mesh, axes, n):
    """ZeRO-2/3: each device keeps the gradient shard of the state it updates (reduce-scatter)."""

    def scatter(values):
        out = []
        for v in values:
            spec, _ = shard_dim_spec(v.shape, axes, n)
            out.append(jax.lax.with_sharding_constraint(v, NamedSharding(mesh, spec)))
        return out
    return scatter
