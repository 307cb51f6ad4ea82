"""ZeRO-2 apply tasks: ``prefer_reduce_scatter`` on a data-parallel stage.

With ``AutoShardingOption(force_data_parallel=True, prefer_reduce_scatter=True)`` (Alpa's
"grad_acc_friendly" setting) a stage keeps its gradients and its optimizer states split on dim
0 over its sub-mesh: the stage's once-per-step reduction leaves each device its shard of every
gradient (a reduce-scatter; XLA:CPU all-reduces, then slices), the update runs on the shards,
and the new parameters come back whole in one all-gather: every device's shards of all of
them in one buffer per dtype (XLA:CPU does not combine all-gathers itself). Against the
replicated update the gradients move the same bytes (reduce-scatter + all-gather =
all-reduce) and each device keeps ``1 / devices`` of the optimizer state. Values whose dim 0
the devices do not divide stay replicated.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..ir._jaxpr import dependents


@dataclass(frozen=True, kw_only=True)
class ZeroApply:
    """How an apply task runs ZeRO-2: its input specs and the outputs gathered at once."""

    input_specs: tuple
    """Per (non-constant) input of the task, its PartitionSpec."""
    gathered: tuple[int, ...]
    """Output positions (new parameters) computed on shards and all-gathered in one buffer."""
    split: frozenset
    """Outputs left split on dim 0: updated optimizer states, and values only later apply
    tasks of the stage read (they take them split)."""
    pins: dict
    """Output position -> its spec, for the outputs left split."""


def forward_backward_option(option):
    """The option a stage's forward and backward tasks are planned with: pure data parallel
    where the stage's option asks for ZeRO-2 (``force_data_parallel`` with
    ``prefer_reduce_scatter``). ZeRO-2 is the apply tasks' (``zero_apply``); a forward or
    backward task holds no update, and with that option's all-gathers allowed its plan drifted
    from data parallel: a forward left a broadcast bias split over the sub-mesh for its
    backward to gather every micro-batch, and the whole-step ZeRO-2 of ``sharding.zero_update``
    sharded a backward's gradient accumulators (Alpa's ``test_bert_grad_acc_friendly`` asserts
    one all-reduce and nothing else in each backward)."""
    if option is not None and option.force_data_parallel and option.prefer_reduce_scatter:
        return dataclasses.replace(option, prefer_reduce_scatter=False)
    return option


def zero_apply(task, part, program, mesh, option, split_before=frozenset()
               ) -> ZeroApply | None:
    """The ZeRO-2 layout of apply ``task`` on ``mesh``, or None when the stage's option does
    not ask for it (``force_data_parallel`` and ``prefer_reduce_scatter`` both set).
    ``split_before``: values earlier apply tasks of the stage left split."""
    if option is None or not (option.force_data_parallel and option.prefer_reduce_scatter):
        return None
    jaxpr = part.jaxpr
    n = math.prod(mesh.axis_sizes)
    if n == 1:
        return None
    axes = tuple(mesh.axis_names)
    entry = axes if len(axes) > 1 else axes[0]
    index = {v: i for i, v in enumerate(jaxpr.invars)}
    grads = set(part.marker.outvars) if part.marker is not None else set()
    updated = {i for i, _ in program.aliases}

    def splits(v) -> bool:
        shape = getattr(v.aval, "shape", ())
        return bool(shape) and shape[0] % n == 0 and jnp.issubdtype(v.aval.dtype, jnp.inexact)

    consts = set(jaxpr.constvars)
    specs, sharded = [], set()
    for v in task.invars:
        if v in consts:
            continue
        i = index.get(v)
        state = i is not None and i in updated and not program.param_invars[i] and (
            not program.batch_invars[i])
        split = (v in grads or state) and splits(v) or v in split_before
        specs.append(P(entry) if split else P())
        if split:
            sharded.add(v)
    from_shards = dependents(task.eqns, sharded)
    states = {jaxpr.outvars[o] for i, o in program.aliases if jaxpr.invars[i] in sharded}
    at = next(k for k, t in enumerate(part.apply) if t is task)
    later = {id(t) for t in part.apply[at + 1:] if t.stage == task.stage}
    step_outputs = set(jaxpr.outvars)

    def stays_split(w) -> bool:  # read only by later apply tasks of this stage
        readers = [t for t in part.apply + part.forward + part.backward if w in t.invars]
        return (bool(readers) and w not in step_outputs
                and all(id(t) in later for t in readers))
    split_out = frozenset(w for w in task.outvars if w in from_shards and splits(w) and (
        w in states or stays_split(w)))
    gathered = tuple(k for k, w in enumerate(task.outvars)
                     if w in from_shards and w not in split_out and splits(w))
    pins = {k: P(entry) for k, w in enumerate(task.outvars) if w in split_out}
    return ZeroApply(input_specs=tuple(specs), gathered=gathered, split=split_out, pins=pins)


def gather_once(fn, positions, mesh):
    """``fn`` whose outputs at ``positions`` are computed split on dim 0 over every axis of
    ``mesh`` and made whole by one all-gather of a buffer holding all of them."""
    if not positions:
        return fn
    axes = tuple(mesh.axis_names)
    n = math.prod(mesh.axis_sizes)
    split = NamedSharding(mesh, P(axes if len(axes) > 1 else axes[0]))
    whole = NamedSharding(mesh, P())
    constrain = jax.lax.with_sharding_constraint

    def run(*args):
        outs = list(fn(*args))
        by_dtype: dict = {}  # one buffer per dtype
        for k in positions:
            by_dtype.setdefault(jnp.dtype(outs[k].dtype), []).append(k)
        for ks in by_dtype.values():
            # each device's rows of every value side by side: (devices, total / devices)
            pieces = [constrain(constrain(outs[k], split).reshape(n, -1), split) for k in ks]
            buf = constrain(constrain(jnp.concatenate(pieces, axis=1), split), whole)
            at = 0
            for k, p in zip(ks, pieces, strict=True):
                outs[k] = buf[:, at:at + p.shape[1]].reshape(outs[k].shape)
                at += p.shape[1]
        return outs
    return run


__all__ = ["ZeroApply", "forward_backward_option", "gather_once", "zero_apply"]
