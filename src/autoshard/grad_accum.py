"""Gradient accumulation: run the part before the gradient marker per micro-batch, then the rest.

The traced step is split at its gradient marker. Equations before it that depend on a batch
argument (or draw random numbers) run inside a ``lax.scan`` over micro-batches; equations
before it that touch neither run once, outside the loop; the equations after the marker (the
optimizer update) run once, on the combined marked values.

Micro-batch ``j`` is rows ``j, j + k, j + 2k, ...`` of the batch. Split over devices in blocks,
that is rows ``j, j + k, ...`` of each device's own block: no device ever needs another
device's rows. When the method names the mesh axes that split the batch (``batch_axes``), the
loop runs inside a ``shard_map`` manual over them and every marked value accumulates on each
device as a partial sum (``_local``), in float32 for narrower floats; one reduction per value
(all-reduce, or reduce-scatter where the method pins the result split) follows the loop.
Each marked value is combined by its declared reduction (``mean``: divided by the number of
micro-batches; ``sum``). Random keys are folded with the micro-batch index, so micro-batches
draw different dropout masks.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from . import combine
from .after_grad import row_dim, whole_batch_update
from .ir._compat import Literal, Var, source_line
from .ir._jaxpr import Env, dependents, draws_random, grad_marker_index, used_vars
from .ir._local import LocalEval, P, R, split
from .ir._prims import KEY_USERS, LINEAR
from .ir._walk import site
from .sharding.apply import PlanEvaluator
from .sharding.hlo import ACCUMULATE_SCOPE
from .sharding.plan import spec_axes


@dataclass(frozen=True)
class StepHooks:
    """Where a fixed-plan method pins shardings while the step is re-evaluated."""

    forward_inputs: Callable[[list], list] | None = None
    """Maps input values as used before the gradient marker (e.g. gather ZeRO-3 parameters)."""
    gradients: Callable[[list], list] | None = None
    """Maps the (accumulated) marked values (e.g. reduce-scatter ZeRO-2 gradients)."""
    mesh: object = None
    """The mesh the step runs on; with ``batch_axes``, accumulation is local per device."""
    batch_axes: tuple[str, ...] = field(default=())
    """Mesh axes that split every batch argument on dim 0 (empty: no local accumulation)."""
    plan: object = None
    """The ShardingPlan of one micro-batch's step (ShardParallel): every value it places is
    pinned where it is computed, inside the micro-batch loop too, so what runs is what was
    costed. Inside a loop that is manual over ``batch_axes`` the per-device evaluation places
    the rows and the plan's other axes are left to XLA."""


def batch_axes(batch_invars: Sequence[bool], in_specs) -> tuple[str, ...]:
    """Mesh axes that split dim 0 of every batch input alike (empty if they differ or none)."""
    found = {spec_axes(spec[0]) if len(spec) else () for spec, b in zip(
        in_specs, batch_invars, strict=True) if b}
    return found.pop() if len(found) == 1 else ()


def build_step(closed, *, batch_invars: Sequence[bool], num_micro_batches: int,
               hooks: StepHooks = StepHooks(), batch_paths: Sequence[str] = (),
               whole_batch: Callable | None = None) -> Callable:
    """A function of the flat inputs that evaluates ``closed`` with accumulation and hooks.

    When ``num_micro_batches > 1`` the batch inputs of ``closed`` have the micro-batch shape and
    the returned function takes the full batch. When the part after the gradient marker reads
    the batch, per-row marked values (aux logits) or batch values that skip the marker (flax's
    metrics after ``value_and_grad``), it runs on the whole batch (``after_grad``):
    ``whole_batch()`` gives the step traced on the full batch.
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
    after = None
    if k > 1 and whole_batch is not None and _reads_whole_batch(jaxpr, pre, post, marker,
                                                                batch_vars):
        after = whole_batch_update(closed, whole_batch(), batch_invars, k)
    if k > 1:
        _check_split(jaxpr, pre, post, marker, batch_vars, batch_paths, after is not None)
    joined = [] if after is None else [
        (new, src, row_dim(src.aval, new.aval, k)) for new, src in after.joined.items()]
    loop = _Loop(jaxpr, pre, marker, batch_invars, k, hooks, joined) if k > 1 else None
    update = jaxpr if after is None else after.closed.jaxpr
    update_consts = consts if after is None else after.closed.consts

    def step(*flat_args):
        env = Env()
        pinned = None if hooks.plan is None else PlanEvaluator(hooks.plan, hooks.mesh)
        for v, c in zip(update.constvars, update_consts, strict=True):
            env.write(v, c)
        fwd_args = list(flat_args)
        if hooks.forward_inputs is not None:
            fwd_args = hooks.forward_inputs(fwd_args)
        if loop is None:
            for v, a in zip(jaxpr.invars, fwd_args, strict=True):
                env.write(v, a)
            _run(env, pinned, jaxpr, range(len(pre)))
            if marker is None:
                return _finish(pinned, [env.read(v) for v in jaxpr.outvars])
            marked = [env.read(v) for v in marker.invars]
            if hooks.gradients is not None:
                marked = hooks.gradients(marked)
        else:
            # the loop and the reduction after it: Alpa's accumulate_grad in get_hlo_text()
            with jax.named_scope(ACCUMULATE_SCOPE):
                marked, rows = loop(env, fwd_args, pinned)
                if hooks.gradients is not None:
                    marked = hooks.gradients(marked)
            for (v, _, _), value in zip(joined, rows, strict=True):
                env.write(v, value)
        marked = _rebind_marker(marker, marked)
        for v, a in zip(jaxpr.invars, flat_args, strict=True):
            env.write(v, a)  # the update sees the inputs as they arrive (e.g. sharded)
        for v, m in zip(marker.outvars, marked, strict=True):
            env.write(v, m)
        if after is None:
            _run(env, pinned, jaxpr, range(cut + 1, len(jaxpr.eqns)))
        else:  # the update traced on the whole batch: XLA places it from the step's ends
            for v, n in after.whole_inputs.items():
                env.write(v, flat_args[n])
            if pinned is not None:
                pinned.mark_used(jaxpr, range(cut + 1, len(jaxpr.eqns)))
            env.run(update.eqns[cut + 1:])
        return _finish(pinned, [env.read(v) for v in update.outvars])

    return step




def loop_costs(closed, batch_invars: Sequence[bool], num_micro_batches: int,
               deferred: bool = True) -> dict[int, tuple[float, float]]:
    """How often each top-level equation of one micro-batch's step runs per accumulated step,
    for the planner: index -> (times it runs, times its own collectives run).

    Equations in the micro-batch loop run ``num_micro_batches`` times. Those that produce a
    marked value (through sums, casts and reshapes) accumulate it on each device as a partial
    sum and reduce it once after the loop, so their collectives run once. Equations outside
    the loop (not listed) run once. ``deferred=False``: every collective in the loop runs
    ``num_micro_batches`` times (a plan that keeps the rows whole reduces in the loop).
    """
    jaxpr = closed.jaxpr
    cut = grad_marker_index(jaxpr)
    k = float(num_micro_batches)
    if cut is None or num_micro_batches <= 1:
        return {}
    pre = jaxpr.eqns[:cut]
    batch_vars = {v for v, b in zip(jaxpr.invars, batch_invars, strict=True) if b}
    per_batch = per_micro_batch(pre, batch_vars)
    looped = [i for i, e in enumerate(pre) if any(o in per_batch for o in e.outvars)]
    producer = {o: i for i, e in enumerate(pre) for o in e.outvars}
    in_loop = set(looped)
    comm: dict[int, float] = {}
    for v in jaxpr.eqns[cut].invars:
        if not isinstance(v, Var):
            continue
        # the equations that make this marked value, and among them the sources of its
        # partial sums (dots, scatters, reductions): added together before their one
        # reduction, m sources share it (a tied embedding's two gradients)
        seen, sources, todo = set(), [], [v]
        while todo:
            u = todo.pop()
            i = producer.get(u)
            if i is None or i in seen or i not in in_loop:
                continue
            seen.add(i)
            if pre[i].primitive.name in LINEAR:
                todo += [u for u in pre[i].invars if isinstance(u, Var) and u in per_batch]
            elif not _stacked_output(pre[i], u):
                sources.append(i)
        for i in seen:
            share = 1.0 / len(sources) if i in sources else 1.0
            comm[i] = min(comm.get(i, share), share)
    return {i: (k, comm[i] if deferred and i in comm else k) for i in looped}


def _stacked_output(eqn, var) -> bool:
    """Whether ``var`` is a scan's stacked output (one slice per iteration, e.g. the gradient
    of a scanned input): its rows are the micro-batch's own, no partial sum the scan makes;
    a scan's partial sums are its accumulated carries (a weight's gradient)."""
    if eqn.primitive.name != "scan":
        return False
    return var in eqn.outvars[eqn.params["num_carry"]:]


def loop_bytes(closed, plan, num_micro_batches: int) -> int:
    """Bytes per device that the micro-batch loop holds beyond one micro-batch's step: the
    other micro-batches' rows (the whole batch arrives at once) and one accumulator per
    marked value (float32 for narrower floats), each in its planned spec."""
    cut = grad_marker_index(closed.jaxpr)
    if cut is None or num_micro_batches <= 1:
        return 0
    sizes = plan.mesh_sizes
    specs = dict(plan.intermediates)
    extra = 0
    for v, key in zip(closed.jaxpr.eqns[cut].invars, marked_sites(closed.jaxpr, cut),
                      strict=True):
        if not isinstance(v, Var):
            continue
        spec = None if key is None else specs.get(key)
        shards = 1 if spec is None else math.prod(
            sizes[a] for entry in spec for a in spec_axes(entry))
        itemsize = jnp.dtype(_acc_dtype(v.aval.dtype)).itemsize
        extra += math.prod(v.aval.shape) * itemsize // shards
    return extra


def per_micro_batch(pre, batch_vars) -> set:
    """Variables before the marker that differ from one micro-batch to the next: computed
    from the batch, or drawn at random (each micro-batch draws its own)."""
    return dependents(pre, set(batch_vars) | {o for e in pre if draws_random(e)
                                              for o in e.outvars})


def marked_sites(jaxpr, cut) -> list:
    """Per marked value, the plan's site of the top-level equation output it is (None for a
    literal or an input)."""
    producer = {o: (i, j) for i, e in enumerate(jaxpr.eqns[:cut])
                for j, o in enumerate(e.outvars)}
    return [site((producer[v][0],), producer[v][1]) if isinstance(v, Var) and v in producer
            else None for v in jaxpr.eqns[cut].invars]


def _reads_whole_batch(jaxpr, pre, post, marker, batch_vars) -> bool:
    """Whether the part after the marker reads the batch, a per-row marked value or a value
    computed from the batch (or drawn at random: the loop draws per micro-batch) that skips
    the marker: then it runs on the whole batch."""
    per_batch = per_micro_batch(pre, batch_vars)
    reads = used_vars(post) | {v for v in jaxpr.outvars if isinstance(v, Var)}
    rows = {o for o, r in zip(marker.outvars, reductions_of(marker), strict=True)
            if r == combine.ROWS}
    return bool(reads & (batch_vars | rows | (per_batch - set(marker.outvars))))


def _run(env: Env, pinned, jaxpr, indices, key_hook=None) -> None:
    """Evaluate ``jaxpr.eqns[i]`` for ``i`` in ``indices``: under the plan's pins when there is
    a plan, else as traced."""
    indices = list(indices)
    if pinned is not None:
        pinned.run(jaxpr, indices, env.values, key_hook)
    else:
        assert key_hook is None
        env.run([jaxpr.eqns[i] for i in indices])


def _finish(pinned, outs):
    return outs if pinned is None else pinned.finish(outs)


def _rebind_marker(marker, values):
    return marker.primitive.bind(*values, **marker.params)


def reductions_of(marker) -> tuple[str, ...]:
    return tuple(marker.params.get("reductions") or ("mean",) * len(marker.invars))


class _Loop:
    """The micro-batch loop of one step: which equations loop, and how values combine."""

    def __init__(self, jaxpr, pre, marker, batch_invars, k, hooks: StepHooks, joined=()):
        self.jaxpr, self.marker, self.k, self.hooks = jaxpr, marker, k, hooks
        self.rows = [(src, d) for _, src, d in joined]
        """Per-row values the loop also returns, joined in row order: (variable, row dim)."""
        self.batch_invars = batch_invars
        self.batch_vars = [v for v, b in zip(jaxpr.invars, batch_invars, strict=True) if b]
        per_batch = per_micro_batch(pre, self.batch_vars)
        self.looped_at = [i for i, e in enumerate(pre) if any(o in per_batch for o in e.outvars)]
        self.hoisted_at = [i for i, e in enumerate(pre) if i not in set(self.looped_at)]
        self.looped = [pre[i] for i in self.looped_at]
        self.hoisted = [pre[i] for i in self.hoisted_at]
        self.marked_sites = marked_sites(jaxpr, len(pre))
        self.batch_at = [n for n, b in enumerate(batch_invars) if b]
        needed = used_vars(self.looped) | {v for v in marker.invars if isinstance(v, Var)} | {
            v for v, _ in self.rows}
        known = list(jaxpr.constvars) + list(jaxpr.invars) + [
            o for e in self.hoisted for o in e.outvars]
        self.outer_vars = [v for v in known if v in needed and v not in per_batch
                           and v not in set(self.batch_vars)]
        self.reductions = reductions_of(marker)
        self.axes = tuple(hooks.batch_axes) if hooks.mesh is not None else ()
        self.size = 1
        if self.axes:
            sizes = dict(zip(hooks.mesh.axis_names, hooks.mesh.devices.shape, strict=True))
            self.size = math.prod(sizes[a] for a in self.axes)
        self.gathered: set[str] = set()

    def __call__(self, env: Env, args: list, pinned: PlanEvaluator | None) -> list:
        for v, a, b in zip(self.jaxpr.invars, args, self.batch_invars, strict=True):
            if not b:
                env.write(v, a)
        _run(env, pinned, self.jaxpr, self.hoisted_at)
        outer = [env.read(v) for v in self.outer_vars]
        k = self.k
        # (B, ...) -> (B/k, k, ...): row r*k + j is micro-batch j; a device's block of rows
        # stays on the device for every j.
        micro = [a.reshape((a.shape[0] // k, k) + a.shape[1:])
                 for a, b in zip(args, self.batch_invars, strict=True) if b]
        if not self.axes:
            sums, ys = self._scan(outer, micro, LocalEval((), 1), pinned=pinned)
        else:
            if pinned is not None:  # the per-device evaluation places the loop's values
                pinned.mark_used(self.jaxpr, self.looped_at)
            sums, ys = self._local_scan(outer, micro)
            if self.gathered:
                warnings.warn(
                    "Gradient accumulation gathers a micro-batch's rows on every device for "
                    f"{', '.join(sorted(self.gathered))} (no per-row rule): the step is "
                    "correct, but these operations run on the whole micro-batch everywhere.",
                    RuntimeWarning, stacklevel=2)
        out = []
        for s, v, r in zip(sums, self.marker.invars, self.reductions, strict=True):
            out.append(combined(s, r, k).astype(v.aval.dtype))
        # (k, ..., rows, ...): row r of micro-batch j is row r * k + j of the batch
        rows = [jnp.moveaxis(y, 0, d + 1).reshape(
            y.shape[1:d + 1] + (y.shape[d + 1] * k,) + y.shape[d + 2:])
            for y, (_, d) in zip(ys, self.rows, strict=True)]
        return out, rows

    def _local_scan(self, outer, micro):
        mesh, axes = self.hooks.mesh, self.axes
        batch = PartitionSpec(axes if len(axes) > 1 else axes[0])

        entry = axes if len(axes) > 1 else axes[0]

        def body(outer, micro):
            partial, ys = self._scan(outer, micro, LocalEval(axes, self.size), partial=True)
            return [p[None] for p in partial], ys  # one row per device: the partial sums

        stacked, ys = jax.shard_map(
            body, mesh=mesh, in_specs=([PartitionSpec()] * len(outer), [batch] * len(micro)),
            out_specs=([batch] * len(self.marker.invars),
                       [PartitionSpec(*([None] * (d + 1) + [entry])) for _, d in self.rows]),
            axis_names=set(axes), check_vma=False)(outer, micro)
        return [s.sum(axis=0) for s in stacked], ys

    def _scan(self, outer, micro, local: LocalEval, partial: bool = False,
              pinned: PlanEvaluator | None = None):
        xs = [jnp.moveaxis(m, 1, 0) for m in micro]
        init = [jnp.zeros(v.aval.shape, _acc_dtype(v.aval.dtype)) for v in self.marker.invars]
        if pinned is not None:
            xs = [pinned.pin_input(n, x, stacked=True)
                  for n, x in zip(self.batch_at, xs, strict=True)]
            init = self._pin_marked(pinned, init)

        def body(acc, scanned):
            j, rows = scanned
            env = dict(zip(self.outer_vars, outer, strict=True))
            kinds = {}
            if pinned is not None:  # the plan of one micro-batch's step places every value
                for n, v, x in zip(self.batch_at, self.batch_vars, rows, strict=True):
                    env[v] = pinned.pin_input(n, x)
                pinned.run(self.jaxpr, self.looped_at, env, fold_keys(j))
            else:
                for v, x in zip(self.batch_vars, rows, strict=True):
                    env[v], kinds[v] = x, (split(0) if local.axes else R)
                local.key_hook = fold_keys(j)
                local.run(self.looped, env, kinds)
                self.gathered |= local.gathered
            new = []
            for a, v, r in zip(acc, self.marker.invars, self.reductions, strict=True):
                if r == combine.ROWS:  # joined from ``ys`` instead
                    new.append(a)
                    continue
                val = v.val if isinstance(v, Literal) else env[v]
                kind = R if isinstance(v, Literal) else kinds.get(v, R)
                if partial:
                    val = local.to_p(val, kind)
                new.append(a + val.astype(a.dtype))
            if pinned is not None:
                new = self._pin_marked(pinned, new)
            ys = [local.to_split(env[v], kinds.get(v, R), d) if partial else env[v]
                  for v, d in self.rows]
            return new, ys

        total, ys = lax.scan(body, init, (jnp.arange(self.k), xs))
        return total, ys

    def _pin_marked(self, pinned: PlanEvaluator, values):
        """Accumulators with the plan's spec of the marked value each one sums."""
        return [x if key is None else pinned.pin(key, x)
                for key, x in zip(self.marked_sites, values, strict=True)]



def fold_keys(j):
    """A ``LocalEval`` key hook: every key a random draw uses gets the micro-batch index ``j``
    folded in (at any depth), so micro-batches draw different numbers."""
    def hook(e, ins):
        if e.primitive.name in KEY_USERS:
            ins = [jax.random.fold_in(ins[0], j)] + list(ins[1:])
        return ins
    return hook


def combined(total, reduction: str, k: int):
    """An accumulated marked value: ``total`` over ``k`` micro-batches by its reduction
    (an integer mean is of ``k`` equal values, see ``combine``: exact)."""
    if reduction != "mean":
        return total
    return total // k if jnp.issubdtype(total.dtype, jnp.integer) else total / k


def _acc_dtype(dtype):
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
        return jnp.float32
    return dtype


def _check_split(jaxpr, pre, post, marker, batch_vars, batch_paths, whole_update=False):
    per_batch = per_micro_batch(pre, batch_vars)
    for i, (v, r) in enumerate(zip(marker.invars, reductions_of(marker), strict=True)):
        if r == combine.ROWS:
            if whole_update:
                continue  # joined in row order for the whole-batch update
            raise ValueError(combine.per_row_error(jaxpr, i))
        dtype = getattr(v.aval, "dtype", None)
        if dtype is not None and not jnp.issubdtype(dtype, jnp.number):
            raise ValueError(
                f"Gradient accumulation combines marked values over micro-batches, but marked "
                f"value {i}{_at(v, pre)} has dtype {dtype}, which cannot be summed. Return it "
                "as a number (e.g. jnp.sum(mask) for a count), or outside "
                "autoshard.value_and_grad's aux.")
    if whole_update:
        return  # the update reads the whole batch (after_grad checks what it cannot rebuild)
    marked_out = set(marker.outvars)
    outs = {v for v in jaxpr.outvars if isinstance(v, Var)}
    leaks = [v for v in used_vars(post) | outs
             if v in per_batch and v not in marked_out and v not in batch_vars]
    if leaks:
        names = "; ".join(f"{v.aval.str_short()}{_at(v, pre)}" for v in leaks[:3])
        raise ValueError(
            f"{len(leaks)} value(s) computed from the batch before the gradient marker are "
            f"used after it without passing through the marker ({names}), so they cannot be "
            "accumulated over micro-batches. Return them as the value or aux of "
            "autoshard.value_and_grad.")
    direct = [v for v in used_vars(post) | outs if v in batch_vars]
    if direct:
        names = ", ".join(batch_paths) or "a batch argument"
        users = [e for e in post if any(isinstance(u, Var) and u in direct for u in e.invars)]
        where = source_line(users[0]) if users else None
        raise ValueError(
            f"The part of the step after the gradient marker uses the batch ({names}) "
            f"directly{' at ' + where if where else ''}; with num_micro_batches > 1 it only "
            "sees one micro-batch. Compute batch-dependent values (metrics from the labels) "
            "inside the loss function and return them as aux (means, sums and counts "
            "combine over micro-batches), or use PipeshardParallel, whose update runs on the "
            "whole batch.")


def _at(v, eqns) -> str:
    """`` (computed at file:line)`` for the equation producing ``v``, or nothing."""
    for e in eqns:
        if v in e.outvars:
            where = source_line(e)
            return f" (computed at {where})" if where else ""
    return ""


__all__ = ["StepHooks", "build_step", "reductions_of", "P", "R"]
