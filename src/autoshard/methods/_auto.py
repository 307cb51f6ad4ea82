"""ShardParallel's automatic plan: planned for a cluster (or checked, when given), applied with pins."""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import Mesh, NamedSharding

from .. import sharding
from .._executable import abstract_leaf
from .._program import Program
from ..after_grad import row_dims_by_site
from ..cluster import Cluster
from ..distributed.plan_sync import program_fingerprint
from ..grad_accum import StepHooks, batch_axes, loop_bytes, loop_costs
from ..sharding import audit
from ..sharding.options import AutoShardingOption
from ..sharding.plan import PlanFingerprint, later
from ..sharding.solver import OverBudget
from ._base import Call, Compiled
from ._mesh import as_auto_mesh, mesh_from_shape, resolve_devices


def compile_auto(method, program: Program, call: Call) -> Compiled:
    devices, user_mesh = resolve_devices(method.devices)
    # The traced step itself is planned (no re-trace). With micro-batches it is one
    # micro-batch's step: the loop then runs each device on its own rows and reduces the
    # gradients once, as in that step.
    if method.plan is not None:  # made earlier (autoshard.plan): checked, not re-planned
        plan = call.agree(program, check_plan(method.plan, program, devices, user_mesh))
        return _compiled(plan, program, devices, user_mesh)
    # Across processes, process 0 plans and the others receive its plan (after checking
    # that they traced the same program); with one process this just plans.
    plan = call.agree(program, lambda: plan_program(method, program, _cluster(method, devices)))
    return _meet_budget(method, program, call, _compiled(plan, program, devices, user_mesh),
                        devices, user_mesh)


def _cluster(method, devices) -> Cluster:
    """The hardware ``method`` plans for: its ``cluster`` when given (checked against the
    devices it runs on), else ``Cluster.from_devices(devices)``."""
    cluster = getattr(method, "cluster", None)
    if cluster is None:
        return Cluster.from_devices(devices)
    if cluster.num_devices != len(devices):
        raise ValueError(
            f"ShardParallel's cluster ({cluster.name}) has {cluster.num_devices} devices but the "
            f"step runs on {len(devices)}. Describe the devices it runs on, e.g. "
            "Cluster.measure(devices) with the same devices as the method's.")
    return cluster


def _compiled(plan, program: Program, devices, user_mesh) -> Compiled:
    """``plan`` on its mesh over ``devices``, with the function that runs it."""
    mesh = (as_auto_mesh(user_mesh) if user_mesh is not None
            else mesh_from_shape(devices, plan.mesh_shape, plan.axis_names))
    if program.num_micro_batches == 1:
        return Compiled(plan=plan, mesh=mesh, fn=sharding.apply_plan(program.closed, plan, mesh))
    inputs = tuple(dataclasses.replace(leaf, shape=tuple(a.shape))
                   for leaf, a in zip(plan.inputs, program.in_avals, strict=True))
    plan = dataclasses.replace(plan, inputs=inputs, notes=plan.notes + (
        f"planned for one micro-batch of {program.num_micro_batches}: every micro-batch runs "
        "this plan inside the loop, and the marked values accumulate in their planned specs",))
    hooks = StepHooks(mesh=mesh, batch_axes=batch_axes(program.batch_invars, plan.in_specs),
                      plan=plan)
    return Compiled(plan=plan, mesh=mesh, fn=program.step(hooks))


def _meet_budget(method, program: Program, call: Call, first: Compiled, devices,
                 user_mesh) -> Compiled:
    """``first``, or a plan re-made under a tighter budget, whose compiled memory keeps within
    ``audit.BUDGET_RATIO_MAX`` of the plan's ``memory_budget_per_device``.

    The estimate can miss what XLA allocates by some percent either way. A plan whose estimate
    is within ``audit.MEMORY_RATIO_MAX`` of its budget (a compiled program within the audit's
    tolerance of its estimate could go over) is compiled here to read its memory; if it goes
    over, it is planned once more under the budget times its estimate over its compiled
    memory, and compiled again. The first plan that keeps the budget runs; when neither
    does, ``OverBudget`` says by how much and what would fit. (The plan that runs is compiled
    once more by the front end: a budgeted plan near its budget costs one or two extra
    compiles.)
    """
    objective = first.plan.objective
    budget = None if objective is None else objective.memory_budget_per_device
    estimate = None if objective is None else objective.peak_bytes_per_device
    if not budget or not estimate or estimate * audit.MEMORY_RATIO_MAX <= budget:
        return first
    memory = compiled_memory(first, program)
    if memory <= audit.BUDGET_RATIO_MAX * budget:
        return first
    tight = int(budget * estimate / memory)
    option = method.auto_sharding_option or AutoShardingOption()
    retry = dataclasses.replace(method, auto_sharding_option=_replace(
        option, memory_budget_per_device=tight))
    tried = (f"the plan on mesh {first.plan.mesh_shape} (estimate {estimate:,} B) compiles to "
             f"{memory:,} B per device, {memory / budget:.3f}x memory_budget_per_device "
             f"({budget:,} B, {memory - budget:,} B over)")
    try:
        plan = call.agree(program, lambda: plan_program(retry, program, _cluster(method, devices)))
    except ValueError as err:
        raise _missed(budget, memory, first.plan.mesh_shape,
                      f"{tried}; re-planned under {tight:,} B (the budget times its estimate "
                      f"over its compiled memory), no plan fits: {err}") from err
    second = _compiled(plan, program, devices, user_mesh)
    memory2 = compiled_memory(second, program)
    if memory2 > audit.BUDGET_RATIO_MAX * budget:
        raise _missed(budget, min(memory, memory2), first.plan.mesh_shape,
                      f"{tried}; re-planned under {tight:,} B (the budget times its estimate "
                      f"over its compiled memory), the plan on mesh {plan.mesh_shape} compiles "
                      f"to {memory2:,} B ({memory2 / budget:.3f}x the budget)")
    plan = dataclasses.replace(
        second.plan,
        objective=dataclasses.replace(second.plan.objective,
                                      memory_budget_per_device=budget),
        notes=second.plan.notes + (
            f"re-planned after compiling: {tried}; planned again under {tight:,} B, this plan "
            f"compiles to {memory2:,} B ({memory2 / budget:.3f}x the budget)",))
    return dataclasses.replace(second, plan=plan)


def _missed(budget: int, memory: int, mesh_shape, found: str) -> OverBudget:
    return OverBudget(memory, mesh_shape,
        f"The compiled program does not keep memory_budget_per_device ({budget:,} B; at most "
        f"{audit.BUDGET_RATIO_MAX}x allowed): {found}. Raise memory_budget_per_device to "
        f"{memory:,} B or more, or make the step smaller per device: more devices, more "
        "micro-batches (num_micro_batches), remat (jax.checkpoint) or a pipeline "
        "(PipeshardParallel: each stage holds only its layers).")


def compiled_memory(compiled: Compiled, program: Program) -> int:
    """Bytes per device XLA allocates for ``compiled`` (arguments + outputs + temporaries -
    aliased), lowered and compiled as the front end does (``ParallelMethod.compile_executable``)."""
    mesh, plan = compiled.mesh, compiled.plan
    in_shardings = tuple(NamedSharding(mesh, leaf.spec) for leaf in plan.inputs)
    out_shardings = tuple(NamedSharding(mesh, leaf.spec) for leaf in plan.outputs)
    donate = tuple(i for i, d in enumerate(program.donated_invars) if d)
    abstract = [abstract_leaf(a, s) for a, s in zip(program.in_avals, in_shardings, strict=True)]
    fn = compiled.fn
    jitted = jax.jit(lambda *a: tuple(fn(*a)), in_shardings=in_shardings,
                     out_shardings=out_shardings, donate_argnums=donate)
    return audit.allocation_bytes(jitted.lower(*abstract).compile().memory_analysis())


def plan_program(method, program: Program, cluster: Cluster, *,
                 axis_names: tuple[str, ...] | None = None,
                 fixed_in_specs=None, cutoff_s: float | None = None) -> sharding.ShardingPlan:
    """ShardParallel's automatic plan of ``program`` for ``cluster`` (no device needed).

    ``axis_names`` and ``fixed_in_specs`` (a PartitionSpec or None per input leaf) price a
    hand-written plan: the inputs keep those specs, the planner places everything else.
    ``cutoff_s``: the plan must beat this step time (``plan_auto``'s; ``planner.Outpriced``
    when no plan can).
    """
    option = method.auto_sharding_option or AutoShardingOption()
    if isinstance(method.devices, Mesh):
        user_mesh = method.devices
        if option.logical_mesh_shape not in (None, tuple(user_mesh.devices.shape)):
            raise ValueError(
                f"auto_sharding_option.logical_mesh_shape ({option.logical_mesh_shape}) differs "
                f"from the shape {tuple(user_mesh.devices.shape)} of the Mesh passed as devices. "
                "Drop one of the two.")
        option = _replace(option, logical_mesh_shape=tuple(user_mesh.devices.shape))
        axis_names = tuple(user_mesh.axis_names)
    elif option.logical_mesh_shape is not None and math.prod(
            option.logical_mesh_shape) != cluster.num_devices:
        raise ValueError(
            f"auto_sharding_option.logical_mesh_shape {option.logical_mesh_shape} has "
            f"{math.prod(option.logical_mesh_shape)} devices but the method uses "
            f"{cluster.num_devices}. Choose a shape whose product is the device count.")
    batch_dims = (_batch_dims(program) if option.force_batch_dim_to_mesh_dim is not None
                  else None)

    bounds: dict = {}  # mesh -> lower bound of its plans with the reductions deferred
    failed: dict = {}  # mesh -> why it has no plan with the reductions deferred

    def solve(option, deferred: bool, cutoff_s=cutoff_s, skip_meshes=None):
        return sharding.plan_auto(
            program.closed, num_devices=cluster.num_devices, option=option,
            in_paths=program.in_paths, out_paths=program.out_paths,
            batch_invars=program.batch_invars, aliases=program.aliases, axis_names=axis_names,
            cluster=cluster, fixed_in_specs=fixed_in_specs, top_mults=loop_costs(
                program.closed, program.batch_invars, program.num_micro_batches, deferred),
            batch_dims=batch_dims, cutoff_s=cutoff_s, skip_meshes=skip_meshes,
            **({"mesh_bounds": bounds, "mesh_failures": failed}
               if deferred and option.logical_mesh_shape is None else {}))

    plan = solve(option, deferred=True)
    if program.num_micro_batches > 1 and _loop_runs(plan, program) != "rows":
        # The micro-batch loop runs a plan as costed in two cases: it keeps the rows whole
        # (every value pinned; the gradients reduced in every micro-batch), or it splits the
        # rows over every mesh axis (each device accumulates its own rows, one reduction
        # after the loop). Price the first honestly, plan the second on a 1-D mesh, and take
        # the cheaper of the two. The second (one mesh) first: its step time is a cutoff for
        # the first's mesh search.
        candidates = []
        if option.force_batch_dim_to_mesh_dim is None and option.logical_mesh_shape is None \
                and axis_names is None:
            try:
                split = solve(_replace(option, force_batch_dim_to_mesh_dim=0,
                                       logical_mesh_shape=(cluster.num_devices,)),
                              deferred=True)
            except ValueError:  # the rows do not split over the devices, or outpriced
                split = None
            if split is not None and _loop_runs(split, program) == "rows":
                candidates.append(split)
        bar = min([p.objective.total_s for p in candidates]
                  + ([cutoff_s] if cutoff_s is not None else []), default=None)
        # Each mesh's ILP here is the first's with costs no lower (the reductions run every
        # micro-batch) and the same size: a mesh the first found no plan on is not searched.
        try:
            whole = solve(option, deferred=False, cutoff_s=bar, skip_meshes={
                **{m: f"no plan with the reductions deferred ({why})"
                   for m, why in failed.items()},
                **{m: f"bound {b:.4g} s with the reductions deferred >= {bar:.4g} s"
                   for m, b in bounds.items() if bar is not None and b >= bar}})
        except sharding.Outpriced:
            if not candidates:
                raise
            whole = None
        if whole is not None and _loop_runs(whole, program) == "whole":
            candidates.append(whole)
        if candidates:
            plan = min(candidates, key=lambda p: p.objective.total_s)
    k = program.num_micro_batches
    if k > 1 and plan.objective.peak_bytes_per_device is not None:
        # planned for one micro-batch: the whole batch and the accumulators are held as well
        batch = sum(leaf.bytes_per_device(plan.mesh_sizes) for leaf, b in zip(
            plan.inputs, program.batch_invars, strict=True) if b)
        plan = dataclasses.replace(plan, objective=dataclasses.replace(
            plan.objective, peak_bytes_per_device=plan.objective.peak_bytes_per_device
            + (k - 1) * batch + loop_bytes(program.closed, plan, k)))
    return dataclasses.replace(plan, fingerprint=PlanFingerprint(
        _program=later(program_fingerprint, program),
        num_equations=len(program.closed.jaxpr.eqns),
        num_devices=cluster.num_devices,
        devices_per_host=cluster.devices_per_host if cluster.num_hosts > 1 else None,
        num_micro_batches=program.num_micro_batches))


def _batch_dims(program: Program) -> dict | None:
    """The dim holding the batch's rows of every value the planner places (by site), for
    ``force_batch_dim_to_mesh_dim``: from the step traced on more rows. None where the step
    does not trace on other rows: then the batch inputs alone are forced."""
    scaled = program.scaled_batch_closed() if any(program.batch_invars) else None
    return None if scaled is None else row_dims_by_site(program.closed, *scaled)


def _loop_runs(plan, program: Program) -> str | None:
    """How the micro-batch loop runs ``plan``: ``"whole"`` (rows whole, every value pinned),
    ``"rows"`` (rows split over every mesh axis of more than one device, per device), or None
    (rows split over some axes only: the other axes inside the loop are left to XLA)."""
    axes = batch_axes(program.batch_invars, plan.in_specs)
    if not axes:
        return "whole"
    others = [a for a, n in zip(plan.axis_names, plan.mesh_shape, strict=True)
              if a not in axes and n > 1]
    return None if others else "rows"


def check_plan(plan, program: Program, devices, user_mesh) -> sharding.ShardingPlan:
    """``plan`` if it was made for ``program`` on as many devices; else what differs."""
    if not isinstance(plan, sharding.ShardingPlan):
        raise TypeError(f"ShardParallel(plan=...) takes a ShardingPlan, got {type(plan).__name__}.")
    fp = plan.fingerprint
    if fp is None:
        raise ValueError(
            "ShardParallel(plan=...): the plan carries no fingerprint of the program it was made "
            "for, so it cannot be checked. Make it with autoshard.plan(fun, *args, ...).")
    if fp.num_devices != len(devices):
        raise ValueError(
            f"ShardParallel(plan=...): the plan is for {fp.num_devices} devices"
            f"{f' ({plan.cluster})' if plan.cluster else ''} but the method has {len(devices)}. "
            f"Run on {fp.num_devices} devices (devices=...), or re-plan for these with "
            "autoshard.plan(fun, *args, cluster=autoshard.Cluster.from_devices(devices)).")
    if user_mesh is not None and tuple(user_mesh.devices.shape) != tuple(plan.mesh_shape):
        raise ValueError(
            f"ShardParallel(plan=...): the plan's mesh {tuple(plan.mesh_shape)} differs from the "
            f"Mesh {tuple(user_mesh.devices.shape)} passed as devices. Pass a list of devices "
            "(the plan builds its mesh), or re-plan with that Mesh.")
    if fp.program != program_fingerprint(program):
        raise ValueError(
            f"ShardParallel(plan=...): the plan was made for another program: "
            f"{_program_difference(plan, program)}. Call the function with the arguments the "
            "plan was made for, or re-plan with autoshard.plan on these arguments.")
    return plan


def _program_difference(plan, program: Program) -> str:
    fp = plan.fingerprint
    for kind, leaves, paths, avals in (
            ("input", plan.inputs, program.in_paths, program.closed.in_avals),
            ("output", plan.outputs, program.out_paths, program.out_avals)):
        if len(leaves) != len(paths):
            return f"the plan has {len(leaves)} {kind} leaves, the call has {len(paths)}"
        for leaf, path, aval in zip(leaves, paths, avals, strict=True):
            now = f"{aval.dtype.name}[{','.join(map(str, aval.shape))}]"
            then = f"{leaf.dtype}[{','.join(map(str, leaf.shape))}]"
            if leaf.path != path or then != now:
                return f"{kind} {leaf.path} was {then} in the plan, {path} is {now} now"
    if fp.num_micro_batches != program.num_micro_batches:
        return (f"num_micro_batches was {fp.num_micro_batches} in the plan, "
                f"{program.num_micro_batches} now")
    return (f"the inputs and outputs agree but the computation differs ({fp.num_equations} "
            f"equations in the plan, {len(program.closed.jaxpr.eqns)} now), or the batch or "
            "donated arguments differ")


def _replace(option, **changes):
    return dataclasses.replace(option, **changes)
