"""DataParallel, ZeRO-2 and ZeRO-3 plans: batch split on dim 0, state replicated or sharded."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .._program import Program
from ..grad_accum import StepHooks
from ..ir._jaxpr import dependents
from ..ir._local import LocalEval, R, is_split, split
from ..sharding.plan import ShardingPlan
from ._base import Call, Compiled, batch_spec, leaf_plan
from ._mesh import as_auto_mesh, mesh_from_shape, resolve_devices


def shard_dim_spec(shape, axes: tuple[str, ...], num_devices: int) -> tuple[P, str]:
    """Split the first dim divisible by the device count; otherwise replicate and say why."""
    axis = axes if len(axes) > 1 else axes[0]
    for d, size in enumerate(shape):
        if size % num_devices == 0 and size >= num_devices:
            return P(*([None] * d), axis), ""
    dims = "x".join(map(str, shape)) or "scalar"
    return P(), f"replicated: no dim of {dims} divisible by {num_devices}"


def compile_data_parallel(method, program: Program, call: Call, *, zero_stage: int) -> Compiled:
    devices, user_mesh = resolve_devices(method.devices)
    mesh = as_auto_mesh(user_mesh) if user_mesh is not None else mesh_from_shape(
        devices, (len(devices),), ("data",))
    axes = tuple(mesh.axis_names)
    n = len(devices)
    in_specs = batch_spec(program, axes, n)
    in_notes = [""] * len(in_specs)
    name = {0: "DataParallel", 2: "Zero2Parallel", 3: "Zero3Parallel"}[zero_stage]
    notes = []
    if zero_stage >= 2 and not any(program.param_invars):
        found = read_with_the_batch(program) if not program.has_grad_marker else []
        if found:  # plain jax.grad: the updated inputs the forward reads with the batch
            program = dataclasses.replace(program, param_invars=tuple(
                i in found for i in range(len(program.in_avals))))
            notes.append("parameters found without a gradient marker (updated inputs read "
                         "with the batch): " + _paths(program, found))
        else:
            warnings.warn(_no_parameters_message(name, program), RuntimeWarning, stacklevel=6)
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
    return Compiled(plan=call.agree(program, plan), mesh=mesh, fn=program.step(hooks))


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


# Parameters of a step without a gradient marker ----------------------------------------------
_BATCH = -1  # the source of every batch input


class _ReadWithTheBatch(LocalEval):
    """Walks the step on abstract values, batch rows split, and records which inputs the
    forward pass reads: those an operand is computed from (not from the batch), next to an
    operand that holds batch rows (``x @ w``, ``emb[tokens]``, ``h * scale``, ``x @ (w +
    a @ b)``). Gradients and optimizer states never meet the rows (a gradient has summed
    them), so they are not recorded. One device: kinds only, no collectives."""

    def __init__(self):
        super().__init__((), 1)
        self.sources: dict[int, frozenset] = {}  # id of a traced value -> input indices
        self.alive: list = []  # keeps those ids from being reused
        self.readers: set[int] = set()

    def to_r(self, x, kind):
        return x

    def to_p(self, x, kind):
        return x

    def to_split(self, x, kind, d):
        return x

    def equation(self, e, ins, path):
        sources = [self.sources.get(id(x), frozenset()) for x, _ in ins]
        if any(is_split(k) for _, k in ins):
            for (_, k), src in zip(ins, sources, strict=True):
                if k == R and _BATCH not in src:
                    self.readers |= src
        outs = super().equation(e, ins, path)
        union = frozenset().union(*sources)
        for x, _ in outs:
            self.sources[id(x)] = union
            self.alive.append(x)
        return outs


def read_with_the_batch(program: Program) -> list[int]:
    """Inputs that are the parameters of a step differentiated with plain ``jax.grad``: read by
    the forward pass together with the batch rows, floating point, and returned updated by a
    value computed from the batch (their gradient)."""
    jaxpr = program.closed.jaxpr
    if not any(program.batch_invars):
        return []
    walker = _ReadWithTheBatch()

    def walk(*args):
        env, kinds = {}, {}
        for i, (v, a) in enumerate(zip(jaxpr.invars, args, strict=True)):
            env[v] = a
            batch = program.batch_invars[i]
            kinds[v] = split(0) if batch and v.aval.shape else R
            walker.sources[id(a)] = frozenset({_BATCH if batch else i})
            walker.alive.append(a)
        env.update(zip(jaxpr.constvars, program.closed.consts, strict=True))
        walker.run(jaxpr.eqns, env, kinds)
        return []
    jax.make_jaxpr(walk)(*[v.aval for v in jaxpr.invars])
    from_batch = dependents(jaxpr.eqns, {v for v, b in zip(
        jaxpr.invars, program.batch_invars, strict=True) if b})
    updated = {i for i, o in program.aliases if jaxpr.outvars[o] in from_batch}
    return sorted(i for i in walker.readers & updated
                  if jnp.issubdtype(program.in_avals[i].dtype, jnp.inexact))


def _paths(program: Program, indices) -> str:
    paths = [program.in_paths[i] for i in indices]
    return ", ".join(paths[:6]) + (f" and {len(paths) - 6} more" if len(paths) > 6 else "")


def _no_parameters_message(name: str, program: Program) -> str:
    updated = sorted({i for i, _ in program.aliases})
    if program.has_grad_marker:
        found = ("its gradient marker differentiates no argument of the step (gradients "
                 "marked with mark_gradient alone)")
    elif updated:
        found = (f"it has no gradient marker, and the step returns updated "
                 f"{_paths(program, updated)}, but none of them is read together with the "
                 "batch")
    else:
        found = ("it has no gradient marker, and the step returns no updated version of any "
                 "input (no train state)")
    return (
        f"{name} found no parameters in the traced step, so nothing is sharded as parameters "
        f"or optimizer state: {found}. Compute the gradients "
        "with autoshard.value_and_grad(loss_fn)(params) or autoshard.grad(loss_fn)(params) "
        "instead of jax.value_and_grad/jax.grad: the arguments they differentiate are the "
        "parameters.")
