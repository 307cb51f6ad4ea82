"""Gradient accumulation: run the part before the gradient marker per micro-batch, then the rest.

The traced step is split at its gradient marker. Equations before it that depend on a batch
argument run inside a ``lax.scan`` over micro-batches; the marked values are summed and divided
by the number of micro-batches; the equations after the marker (the optimizer update) run once.
Equations before the marker that do not touch the batch run once, outside the scan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ._compat import Var
from ._jaxpr import Env, dependents, grad_marker_index, used_vars


@dataclass(frozen=True)
class StepHooks:
    """Where a fixed-plan method pins shardings while the step is re-evaluated."""

    forward_inputs: Callable[[list], list] | None = None
    """Maps input values as used before the gradient marker (e.g. gather ZeRO-3 parameters)."""
    gradients: Callable[[list], list] | None = None
    """Maps the (accumulated) marked values (e.g. reduce-scatter ZeRO-2 gradients)."""


def build_step(closed, *, batch_invars: Sequence[bool], num_micro_batches: int,
               hooks: StepHooks = StepHooks(), batch_paths: Sequence[str] = ()) -> Callable:
    """A function of the flat inputs that evaluates ``closed`` with accumulation and hooks.

    When ``num_micro_batches > 1`` the batch inputs of ``closed`` have the micro-batch shape and
    the returned function takes the full batch.
    """
    jaxpr, consts = closed.jaxpr, closed.consts
    k = num_micro_batches
    cut = grad_marker_index(jaxpr)
    if cut is None and k > 1:
        raise ValueError(
            f"num_micro_batches={k} needs a gradient marker in the step, but none was found. "
            "Compute gradients with autoshard.grad or autoshard.value_and_grad (jax.grad plus "
            "a marker) so autoshard knows which values to accumulate.")
    pre = jaxpr.eqns if cut is None else jaxpr.eqns[:cut]
    post = [] if cut is None else jaxpr.eqns[cut + 1:]
    marker = None if cut is None else jaxpr.eqns[cut]
    batch_vars = {v for v, b in zip(jaxpr.invars, batch_invars, strict=True) if b}
    if k > 1:
        _check_split(jaxpr, pre, post, marker, batch_vars, batch_paths)

    def step(*flat_args):
        env = Env()
        for v, c in zip(jaxpr.constvars, consts, strict=True):
            env.write(v, c)
        fwd_args = list(flat_args)
        if hooks.forward_inputs is not None:
            fwd_args = hooks.forward_inputs(fwd_args)
        if k == 1:
            for v, a in zip(jaxpr.invars, fwd_args, strict=True):
                env.write(v, a)
            env.run(pre)
            if marker is None:
                return [env.read(v) for v in jaxpr.outvars]
            marked = [env.read(v) for v in marker.invars]
        else:
            marked = _accumulate(jaxpr, env, pre, marker, fwd_args, batch_invars, k)
        if hooks.gradients is not None:
            marked = hooks.gradients(marked)
        marked = _rebind_marker(marker, marked)
        for v, a in zip(jaxpr.invars, flat_args, strict=True):
            env.write(v, a)  # the update sees the inputs as they arrive (e.g. sharded)
        for v, m in zip(marker.outvars, marked, strict=True):
            env.write(v, m)
        env.run(post)
        return [env.read(v) for v in jaxpr.outvars]

    return step


def _rebind_marker(marker, values):
    return marker.primitive.bind(*values, **marker.params)


def _accumulate(jaxpr, env, pre, marker, args, batch_invars, k):
    batch_vars = [v for v, b in zip(jaxpr.invars, batch_invars, strict=True) if b]
    for v, a, b in zip(jaxpr.invars, args, batch_invars, strict=True):
        if not b:
            env.write(v, a)
    per_batch = dependents(pre, set(batch_vars))
    hoisted = [e for e in pre if not any(o in per_batch for o in e.outvars)]
    looped = [e for e in pre if any(o in per_batch for o in e.outvars)]
    env.run(hoisted)
    outer = dict(env.values)
    micro = [a.reshape((k, a.shape[0] // k) + a.shape[1:])
             for a, b in zip(args, batch_invars, strict=True) if b]
    marked_in = list(marker.invars)

    def body(acc, xs):
        inner = Env()
        inner.values = dict(outer)
        for v, x in zip(batch_vars, xs, strict=True):
            inner.write(v, x)
        inner.run(looped)
        vals = [inner.read(v) for v in marked_in]
        return [a + v.astype(a.dtype) for a, v in zip(acc, vals, strict=True)], None

    init = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in marked_in]
    total, _ = jax.lax.scan(body, init, micro)
    return [t / k for t in total]


def _check_split(jaxpr, pre, post, marker, batch_vars, batch_paths):
    per_batch = dependents(pre, batch_vars)
    for v in marker.invars:
        dtype = getattr(v.aval, "dtype", None)
        if dtype is not None and not jnp.issubdtype(dtype, jnp.inexact):
            raise ValueError(
                f"Gradient accumulation averages marked values, but one has dtype {dtype}. "
                "Only floating-point values can be marked when num_micro_batches > 1; return "
                "integer metrics outside autoshard.value_and_grad's aux.")
    marked_out = set(marker.outvars)
    outs = {v for v in jaxpr.outvars if isinstance(v, Var)}
    leaks = [v for v in used_vars(post) | outs
             if v in per_batch and v not in marked_out and v not in batch_vars]
    if leaks:
        raise ValueError(
            f"{len(leaks)} value(s) computed from the batch before the gradient marker are "
            "used after it without passing through the marker, so they cannot be accumulated "
            "over micro-batches. Return them as the value or aux of autoshard.value_and_grad.")
    direct = [v for v in used_vars(post) | outs if v in batch_vars]
    if direct:
        names = ", ".join(batch_paths) or "a batch argument"
        raise ValueError(
            f"The part of the step after the gradient marker uses the batch ({names}) "
            "directly; with num_micro_batches > 1 it only sees one micro-batch. Compute "
            "batch-dependent values before the marker and return them as aux.")
