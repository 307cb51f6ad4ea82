"""The functions a pipeline task runs: its equations with the accumulation into its
accumulators (``task_fn``), per device over its batch axes (``local_task``), outputs pinned
(``pinned``); and which equations communicate (``is_collective``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..grad_accum import fold_keys
from ..ir._compat import Literal
from ..ir._jaxpr import Env
from ..ir._local import LocalEval, R, split
from ..ir._walk import INLINE_CALLS, body_of


def spec_of(s) -> P:
    return s.spec if isinstance(s, NamedSharding) else s if isinstance(s, P) else P(*s)


def pinned(fn, pins: dict, mesh):
    """``fn`` with its outputs at the positions of ``pins`` constrained to their specs."""
    def pinned(*args):
        outs = list(fn(*args))
        for o, spec in pins.items():
            outs[o] = jax.lax.with_sharding_constraint(outs[o], NamedSharding(mesh, spec))
        return outs
    return pinned


def task_fn(eqns, invars, outvars, acc, consts, random):
    def fn(*args):
        n = len(invars)
        values = dict(zip(invars, args[:n], strict=True))
        values.update(consts)
        if random:
            LocalEval((), 1, key_hook=fold_keys(args[-1])).run(eqns, values, {})
        else:
            env = Env()
            env.values = values
            env.run(eqns)
        accs = args[n:n + len(acc)]
        new = [a + values[v].astype(a.dtype) for a, v in zip(accs, acc, strict=True)]
        return [values[v] for v in outvars] + new
    return fn


def reads(eqns, outvars) -> set:
    """The vars ``eqns`` read to compute ``outvars`` (calls looked into: an operand their body
    never reads is not read; XLA drops it, and whatever would move it)."""
    live = {v for v in outvars if not isinstance(v, Literal)}
    for e in reversed(eqns):
        wanted = [o in live for o in e.outvars]
        if not any(wanted) and not e.effects:
            continue
        operands = [v for v in e.invars if not isinstance(v, Literal)]
        if e.primitive.name in INLINE_CALLS and not e.effects:
            body, _ = body_of(e)
            if len(body.invars) == len(e.invars) and len(body.outvars) == len(e.outvars):
                inner = reads(body.eqns, [o for o, w in zip(body.outvars, wanted, strict=True)
                                          if w])
                operands = [v for v, b in zip(e.invars, body.invars, strict=True)
                            if b in inner and not isinstance(v, Literal)]
        live.update(operands)
    return live


_COLLECTIVES = ("psum", "all_gather", "all_to_all", "ppermute", "reduce_scatter", "pmax",
                "pmin")


def is_collective(eqn) -> bool:
    """Whether ``eqn`` is a collective (a sum, gather or exchange over mesh axes)."""
    return eqn.primitive.name.startswith(_COLLECTIVES)


def local_task(eqns, invars, outvars, acc, consts, random, rows, axes, size, mesh,
                in_specs, acc_specs, out_specs):
    """A task run per device over the batch ``axes`` (``shard_map`` manual over them, auto
    over the other axes, ``_local.LocalEval``): micro-batch-row values are each device's own
    rows, reductions over them stay partial, and every accumulator gains a leading dim of one
    partial sum per device group, added to locally. ``rows``: value -> the dim its rows are
    on (dim 0 for the micro-batch rows; another dim for a value computed from them, e.g. a
    scan's stacked residuals, time steps first), split over ``axes`` inside; every other
    value is whole there. ``in_specs``/``acc_specs``/``out_specs``: the jit's specs of the
    inputs, the stacked accumulators and the outputs. Returns (function, input specs, output
    specs)."""
    entry = axes if len(axes) > 1 else axes[0]
    stacked = P(entry)
    n, n_acc = len(invars), len(acc)
    in_specs = list(in_specs) + list(acc_specs) + ([P()] if random else [])
    out_specs = list(out_specs) + list(acc_specs)

    def inside(v):  # inside the shard_map only the manual axes are named: rows split
        return P(*[None] * rows[v], entry) if v in rows else P()
    body_in = [inside(v) for v in invars] + [stacked] * n_acc + ([P()] if random else [])
    body_out = [inside(v) for v in outvars] + [stacked] * n_acc

    def body(*args):
        local = LocalEval(axes, size)
        values = dict(zip(invars, args[:n], strict=True))
        values.update(consts)
        kinds = {v: split(rows[v]) for v in invars if v in rows}
        if random:
            local.key_hook = fold_keys(args[-1])
        local.run(eqns, values, kinds)

        def read(v):
            if isinstance(v, Literal):
                return jnp.asarray(v.val, v.aval.dtype), R
            return values[v], kinds.get(v, R)
        outs = [local.to_split(*read(v), rows[v]) if v in rows else local.to_r(*read(v))
                for v in outvars]
        new = [a + local.to_p(*read(v))[None].astype(a.dtype)
               for a, v in zip(args[n:n + n_acc], acc, strict=True)]
        return tuple(outs + new)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=tuple(body_in),
                           out_specs=tuple(body_out), axis_names=set(axes), check_vma=False)

    def run(*args):
        return list(mapped(*args))
    return run, in_specs, out_specs


__all__ = ["is_collective", "local_task", "pinned", "reads", "spec_of", "task_fn"]
