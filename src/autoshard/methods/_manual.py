"""ShardParallel with a ManualShardingOption: the user's PartitionSpecs, validated and applied."""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import PartitionSpec as P

from .._program import Program
from ..grad_accum import StepHooks, batch_axes
from ..sharding.options import AutoShardingOption
from ..sharding.plan import ShardingPlan, format_spec, spec_axes
from ._auto import plan_program
from ._base import Call, Compiled, leaf_plan
from ._mesh import as_auto_mesh, mesh_from_shape, resolve_devices

_UNSET = object()


def compile_manual(method, program: Program, call: Call) -> Compiled:
    option = method.manual_sharding_option
    names = option.mesh_axis_names
    devices, user_mesh = resolve_devices(method.devices)
    if user_mesh is not None:
        if tuple(user_mesh.axis_names) != names:
            raise ValueError(
                f"manual_sharding_option.mesh_axis_names {names} differ from the axis names "
                f"{tuple(user_mesh.axis_names)} of the Mesh passed as devices. Use the same names.")
        mesh = as_auto_mesh(user_mesh)
    else:
        shape = _mesh_shape(method, names, len(devices))
        mesh = mesh_from_shape(devices, shape, names)
    sizes = dict(zip(names, mesh.devices.shape, strict=True))

    in_specs = _leaf_specs(option.in_axis_resources, program.args_shape, "in_axis_resources",
                           len(program.in_avals))
    out_specs = _leaf_specs(option.out_axis_resources, program.out_shape,
                            "out_axis_resources", len(program.out_avals))
    in_specs = [P() if s is _UNSET else s for s in in_specs]
    for i, o in program.aliases:
        if out_specs[o] is _UNSET:
            out_specs[o] = in_specs[i]
    out_specs = [P() if s is _UNSET else s for s in out_specs]
    for specs, avals, paths, arg in ((in_specs, program.in_avals, program.in_paths,
                                      "in_axis_resources"),
                                     (out_specs, program.out_avals, program.out_paths,
                                      "out_axis_resources")):
        for spec, aval, path in zip(specs, avals, paths, strict=True):
            validate_spec(spec, aval.shape, sizes, where=f"{arg} for {path}")
    plan = ShardingPlan(
        method="ShardParallel(manual)", mesh_shape=tuple(mesh.devices.shape), axis_names=names,
        inputs=tuple(leaf_plan(program, i, s) for i, s in enumerate(in_specs)),
        outputs=tuple(leaf_plan(program, i, s, output=True) for i, s in enumerate(out_specs)))
    hooks = StepHooks(mesh=mesh, batch_axes=batch_axes(program.batch_invars, in_specs))
    return Compiled(plan=call.agree(program, plan), mesh=mesh, fn=program.step(hooks))


def price_manual(method, program: Program, cluster) -> ShardingPlan:
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


def _mesh_shape(method, names, num_devices):
    if len(names) == 1:
        return (num_devices,)
    opt = method.auto_sharding_option
    if opt is None or opt.logical_mesh_shape is None:
        raise ValueError(
            f"manual_sharding_option names {len(names)} mesh axes {names} but no mesh shape is "
            "given. Pass devices=jax.make_mesh(shape, names) or auto_sharding_option="
            "AutoShardingOption(logical_mesh_shape=shape).")
    shape = opt.logical_mesh_shape
    if len(shape) != len(names) or math.prod(shape) != num_devices:
        raise ValueError(
            f"logical_mesh_shape {shape} must have one entry per axis name {names} and a "
            f"product equal to the device count ({num_devices}).")
    return shape


def _leaf_specs(prefix, tree, arg_name: str, count: int) -> list:
    """One spec (or _UNSET) per array leaf of ``tree`` from a pytree prefix of specs."""
    if prefix is None:
        return [_UNSET] * count
    is_spec = lambda x: x is None or isinstance(x, P)  # noqa: E731
    if is_spec(prefix):
        full = jax.tree.map(lambda _: prefix, tree)
    else:
        try:
            full = jax.tree.map(
                lambda s, sub: jax.tree.map(lambda _: _UNSET if s is None else s, sub),
                prefix, tree, is_leaf=is_spec)
        except ValueError as e:
            raise ValueError(
                f"{arg_name} must be a PartitionSpec or a pytree prefix of the "
                f"{'arguments' if arg_name.startswith('in') else 'outputs'} with PartitionSpec "
                f"leaves; its structure does not match: {e}") from None
    leaves = jax.tree.leaves(full, is_leaf=lambda x: x is _UNSET or isinstance(x, P))
    assert len(leaves) == count, (len(leaves), count)
    return leaves


def validate_spec(spec, shape, sizes: dict[str, int], *, where: str):
    if not isinstance(spec, P):
        raise TypeError(f"{where}: expected a PartitionSpec, got {spec!r}.")
    if len(spec) > len(shape):
        raise ValueError(
            f"{where}: spec {spec} has {len(spec)} entries but the array has {len(shape)} dims "
            f"(shape {tuple(shape)}). Give at most one entry per dim.")
    for d, entry in enumerate(spec):
        axes = spec_axes(entry)
        for a in axes:
            if a not in sizes:
                raise ValueError(
                    f"{where}: spec {spec} names mesh axis {a!r}, which is not one of the "
                    f"mesh axes {tuple(sizes)}. Use one of those names.")
        parts = math.prod(sizes[a] for a in axes)
        if shape[d] % parts:
            raise ValueError(
                f"{where}: spec {format_spec(spec)} splits dim {d} of size {shape[d]} into "
                f"{parts} parts, which does not divide it. Choose axes whose sizes divide "
                f"{shape[d]}, or leave dim {d} unsplit (None).")
