"""The pipeline runtime: one controller walks one global action list.

Per step: batch arguments go to every stage that reads them, split on dim 0 over its sub-mesh,
and are cut into micro-batches there by a jit (micro-batch j is rows j, j + k, ... of every
device's own block: no gather). Then every F, B (or Ba/Bw) action of the schedule is dispatched
in the order a replay of the schedule gives, asynchronously; the values a task reads from
another stage move with one batched ``jax.device_put`` of matching layouts (device i to device
i). Gradient-marker inputs accumulate per stage in donated buffers; each value is dropped
after its last use. Then the accumulators are finalised, the apply-grad tasks run on the
stages that hold the parameters, and outputs are assembled as the caller's pytree. When the
update reads the batch (``after_grad``), it gets the whole batch argument, and the row-shaped
values it reads are the micro-batches' values joined in row order on the stage that made them
(one jit per value, no communication: each device joins its own rows).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .._executable import MISS, deleted_error, select_dynamic
from ..after_grad import row_dim
from ..ir import _compat
from ..ir._compat import Literal, Var
from ..ir._jaxpr import flatten_args
from . import _cross_process
from .audit import PipelineAudit, Transfer, task_audit
from .compile import CompiledTask, acc_dtype, finalize_fn, gathered_inputs, make_submeshes
from .layouts import carried_spec
from .manual import ManualSpecs
from .reduce import ReduceTask, reduce_prediction
from .schedules import get_schedule, traits
from .simulate import simulate
from .span import SpanReduce, run_sums
from .tasks import Target, mesh_cluster, plan_tasks
from .timeline import draw_timeline
from .transfer import Mover


class PipelineExecutable:
    """A compiled pipeline: per-stage jits on disjoint sub-meshes and the action list."""

    def __init__(self, *, part, plan, program, flat, out_tree, static_argnums, devices, sizes,
                 blocking: bool, name: str, timings: dict, agree, options=None,
                 virtual: int = 1, stage_input_shardings=None, manual_sharding_option=None):
        t0 = time.perf_counter()
        self.part, self.program, self.name = part, program, name
        # ``agree``: how processes agree on plans (``Call.agree``), once on the stages cut here
        # and once on the tasks' layouts below.
        _cross_process.agree_on_stages(name, program, plan, agree)  # as process 0
        self.static_argnums, self.blocking = static_argnums, blocking
        self._flat, self._out_tree = flat.abstract(), out_tree
        statics = not all(flat.is_dynamic)
        self._dynamic_sel = flat.is_dynamic if statics else None
        self._static_sel = tuple(not d for d in flat.is_dynamic) if statics else None
        self._static_leaves, self._num_dynamic = flat.static_leaves, len(flat.dynamic_leaves)
        self.k = k = program.num_micro_batches
        num_ranks = part.num_stages // virtual
        # Model stage s runs on sub-mesh s % num_ranks (interleaved: several per sub-mesh).
        self.rank_meshes = make_submeshes(
            devices, sizes[:num_ranks], plan.submesh_shapes[:num_ranks],
            None if plan.submesh_axis_names is None else plan.submesh_axis_names[:num_ranks])
        self.meshes = [self.rank_meshes[s % num_ranks] for s in range(part.num_stages)]
        self.manual = None if manual_sharding_option is None else ManualSpecs(
            manual_sharding_option, part, program, self.meshes)
        jaxpr = part.jaxpr
        self.batch_vars = {v for v, b in zip(jaxpr.invars, program.batch_invars, strict=True)
                           if b}
        options = options or [None] * part.num_stages
        if stage_input_shardings is not None and len(stage_input_shardings) != part.num_stages:
            raise ValueError(
                f"stage_input_shardings has {len(stage_input_shardings)} entries but the "
                f"pipeline has {part.num_stages} stages; pass executable.stage_input_shard_specs "
                "of the same step and options.")
        split = traits(plan.schedule).splits_backward
        interleaved = traits(plan.schedule).virtual
        self.schedule = get_schedule(plan.schedule,
                                     num_stages=num_ranks if interleaved else part.num_stages,
                                     num_micro_batches=k, virtual=virtual if interleaved else 1)
        self.order = simulate(self.schedule).order()

        # Tasks are planned in the order values flow, each taking its inputs in the layouts
        # they arrive in (``tasks.plan_tasks``: the pricing of a cluster plans them alike),
        # and compiled on their sub-mesh.
        self.tasks: dict = {}
        self.apply = []

        def compile_task(tp):
            c = CompiledTask(tp, self.meshes[tp.task.stage])
            c.check_memory(tp.option)
            if tp.kind == "apply":
                self.apply.append(c)
            else:
                self.tasks[(tp.kind, tp.task.stage)] = c

        targets = [Target(s % num_ranks, tuple(m.devices.shape), tuple(m.axis_names),
                          mesh_cluster(m), m) for s, m in enumerate(self.meshes)]
        layouts = plan_tasks(part, targets, split, options, program=program,
                             realize=compile_task, manual=self.manual,
                             given=stage_input_shardings,
                             once=_cross_process.planned_once)  # several processes: on one
        # accumulators a backward task keeps partial over its batch axes (one slice per group)
        batch_axes_of = {v: t.batch_axes for t in self.tasks.values() if t.batch_axes
                         for v in t.accumulated}
        stacked = set(batch_axes_of)
        self.joins = []  # (joined value, its source, jit, sharding): on the source's layout
        for w, src in part.joined.items():
            target, spec = layouts.entries[w][0]
            sh = NamedSharding(self.rank_meshes[target.rank], spec)
            self.joins.append((w, src, self._join_fn(w, src, sh), sh))
        self.sums = [SpanReduce(cs, part.home, self.meshes, self.rank_meshes)
                     for cs in part.sums]
        self.finalize = []
        acc_sh = {v: sh for t in self._all_tasks()
                  for v, sh in zip(t.accumulated, t.acc_shardings, strict=True)}
        self._acc_sh = acc_sh
        self._acc_shape = {v: shape for t in self._all_tasks()
                           for v, shape in zip(t.accumulated, t.acc_shapes, strict=True)}
        self.reduce_tasks = []  # per stage with partial accumulators: its one reduction
        for s in range(part.num_stages):
            fn, pairs = finalize_fn(part, s, k, stacked)
            if pairs:
                sh = [acc_sh[v] for v, _, _ in pairs]
                out_sh = [self._reader_sharding(o, self.meshes[s]) if v in stacked else a
                          for (v, o, _), a in zip(pairs, sh, strict=True)]
                donate = tuple(i for i, (v, _, _) in enumerate(pairs) if v not in stacked)
                compiled = jax.jit(fn, in_shardings=sh, out_shardings=out_sh,
                                   donate_argnums=donate).lower(*[
                    jax.ShapeDtypeStruct(self._acc_shape[v], acc_dtype(v.aval.dtype),
                                         sharding=x)
                    for (v, _, _), x in zip(pairs, sh, strict=True)]).compile()
                self.finalize.append((s, compiled, pairs, out_sh))
                if any(v in stacked for v, _, _ in pairs):
                    self.reduce_tasks.append(ReduceTask(
                        s, self.meshes[s], compiled, reduce_prediction(
                            [(v, a, x) for (v, _, _), a, x in zip(pairs, sh, out_sh, strict=True)
                             if v in stacked], batch_axes_of)))
        self.move = Mover()
        self._split_fns: dict = {}
        self._zeros_fns: dict = {}
        self._indices: dict = {}
        self._last_use = self._last_uses()
        self.in_shardings = tuple(self._input_sharding(v) for v in jaxpr.invars)
        notes = [t.note for t in self._ordered_tasks() if t.note]
        planned = [t for t in self._ordered_tasks() if t.plan is not None]
        if planned:
            notes.insert(0, f"{len(planned)} of {len(self._ordered_tasks())} tasks planned by "
                         "the intra-operator planner on their sub-mesh")
        self.plan = dataclasses.replace(plan, notes=plan.notes + tuple(notes))
        self.timings = dict(timings, compile_s=time.perf_counter() - t0)
        self.trace: list = []
        _cross_process.agree(self, agree)  # with several processes: the same tasks as process 0

    @property
    def task_plans(self) -> dict:
        """Task name -> the ShardingPlan it runs (tasks that fell back are left out)."""
        return {t.task.name: t.plan for t in self._ordered_tasks() if t.plan is not None}

    # Calling -----------------------------------------------------------------------------------
    def __call__(self, *args):
        out = self.call_leaves(jax.tree.leaves(args))
        return self.call_args(args) if out is MISS else out

    def call_leaves(self, leaves: list):
        leaves = select_dynamic(self, leaves)
        if leaves is MISS:
            return MISS
        for x, a in zip(leaves, self._flat.dynamic_leaves, strict=True):
            if tuple(getattr(x, "shape", ())) != tuple(a.shape):
                return MISS
        if _compat.any_deleted(leaves):
            raise deleted_error(leaves, self._flat.paths, self.name)
        return self._out_tree.unflatten(self.run(leaves))

    def call_args(self, args: tuple):
        flat = flatten_args(args, self.static_argnums)
        if flat.key()[:3] != self._flat.key()[:3]:
            raise TypeError(f"These arguments do not match the pipeline executable of "
                            f"{self.name}; call the parallelized function instead.")
        return self._out_tree.unflatten(self.run(list(flat.dynamic_leaves)))

    # One step ----------------------------------------------------------------------------------
    def run(self, leaves: list, record: bool = False) -> list:
        part = self.part
        jaxpr = part.jaxpr
        # Every value maps to its copies, one per sharding it has been placed in.
        self._mb: dict = {}     # (var, micro-batch) -> {sharding: array}
        self._step: dict = {}   # var -> {sharding: array}
        args = dict(zip(jaxpr.invars, leaves, strict=True))
        for v, x in args.items():
            if v in self.batch_vars:
                self._split_batch(v, x)
            else:
                self._step[v] = {getattr(x, "sharding", None): x}
        for w, i in part.whole_inputs.items():
            x = leaves[i]
            self._step[w] = {getattr(x, "sharding", None): x}
        accs = {s: self._zeros(s) for s in range(part.num_stages)}
        t_start = time.perf_counter()
        for n, a in enumerate(self.order):
            task = self.tasks.get((a.kind, a.stage))
            if task is None:
                continue
            t0 = time.perf_counter()
            ins = self._gather(task, a.micro_batch)
            acc = accs[a.stage]
            extra = [acc[v] for v in task.accumulated] + (
                [self._index(a.stage, a.micro_batch)] if task.random else [])
            outs = task(ins + extra)
            n_out = len(task.outvars)
            for v, o, sh in zip(task.outvars, outs[:n_out], task.out_shardings, strict=False):
                self._mb.setdefault((v, a.micro_batch), {})[sh] = o
            for v, o in zip(task.accumulated, outs[n_out:], strict=True):
                acc[v] = o
            if self.blocking or record:
                jax.block_until_ready(outs)
            if record:
                self.trace.append((str(a), a.stage, t0 - t_start, time.perf_counter() - t0))
            for key in self._last_use.get(n, ()):
                self._mb.pop(key, None)
        for w, src, fn, sh in self.joins:
            pieces = [self._in(self._mb.pop((src, j)), sh) for j in range(self.k)]
            self._step[w] = {sh: fn(*pieces)[0] if fn is not None else pieces[0]}
        for s, fn, pairs, shardings in self.finalize:
            vals = fn(*[accs[s][v] for v, _, _ in pairs])
            for (_, o, _), x, sh in zip(pairs, vals, shardings, strict=True):
                self._step[o] = {sh: x}
        for i, t in enumerate(self.apply):
            run_sums(self.sums, i, self._step)
            t0 = time.perf_counter()
            outs = t(self._gather(t, None))
            for v, o, sh in zip(t.outvars, outs, t.out_shardings, strict=True):
                self._step[v] = {sh: o}
            if self.blocking or record:
                jax.block_until_ready(outs)
            if record:
                self.trace.append((t.task.name, t.stage, t0 - t_start, time.perf_counter() - t0))
        run_sums(self.sums, len(self.apply), self._step)
        out = _cross_process.readable_outputs(self, [self._placed(v, self._output(v, args))
                                                     for v in jaxpr.outvars])
        self._mb, self._step = {}, {}
        return out

    def _gather(self, task, mb) -> list:
        """The task's inputs in the shardings it takes; the others moved there (and kept)."""
        vals = []
        for v, target in zip(task.invars, task.in_shardings, strict=False):
            copies = self._step.get(v) if mb is None or (v, mb) not in self._mb else (
                self._mb[(v, mb)])
            if copies is None:
                copies = self._mb[(v, mb)]
            x = copies.get(target)
            if x is None:
                src = next((c for sh, c in copies.items() if sh is not None
                            and sh.device_set == target.device_set), None)
                x = copies[target] = self.move(
                    src if src is not None else next(iter(copies.values())), target)
            vals.append(x)
        return vals

    def _in(self, copies: dict, target):
        """The copy of a value in sharding ``target`` (moved there if it has none)."""
        x = copies.get(target)
        return x if x is not None else self.move(next(iter(copies.values())), target)

    def _split_batch(self, v, x):
        """Place a batch argument where its first reader wants it and cut the micro-batches."""
        target = self._input_sharding(v)
        fn = self._split_fns.get(v)
        if fn is None:
            k = self.k

            def split(a, k=k):
                a = a.reshape((a.shape[0] // k, k) + a.shape[1:])
                return [a[:, j] for j in range(k)]
            fn = self._split_fns[v] = jax.jit(split, in_shardings=target,
                                              out_shardings=[target] * k)
        for j, piece in enumerate(fn(self.move(x, target))):
            self._mb.setdefault((v, j), {})[target] = piece

    def _join_fn(self, w, src, sh):
        """The jit joining ``src``'s micro-batch values into ``w`` in row order along their
        row dim (row ``r * k + j`` is row ``r`` of micro-batch ``j``), in and out in the layout
        ``sh``; None with one micro-batch."""
        if self.k == 1:
            return None
        d = row_dim(src.aval, w.aval, self.k)
        assert d is not None, (src.aval, w.aval)

        def join(*pieces):
            return [jnp.stack(pieces, axis=d + 1).reshape(w.aval.shape)]
        lowered = jax.jit(join, in_shardings=[sh] * self.k, out_shardings=[sh]).lower(
            *[jax.ShapeDtypeStruct(src.aval.shape, src.aval.dtype, sharding=sh)] * self.k)
        return _cross_process.compile_task(lowered, sh.mesh)

    def _zeros(self, s) -> dict:
        """Fresh accumulators of stage ``s``, made on its devices by a jit (no host copy)."""
        fn = self._zeros_fns.get(s)
        if fn is None:
            acc = list(dict.fromkeys(v for t in self._all_tasks() if t.stage == s
                                     for v in t.accumulated))
            make = jax.jit(lambda: [jnp.zeros(self._acc_shape[v], acc_dtype(v.aval.dtype))
                                    for v in acc],
                           out_shardings=[self._acc_sh[v] for v in acc])
            fn = self._zeros_fns[s] = (acc, make)
        acc, make = fn
        return dict(zip(acc, make(), strict=True)) if acc else {}

    def _index(self, s, j):
        """Micro-batch index ``j`` as a replicated array on stage ``s`` (made once)."""
        x = self._indices.get((s, j))
        if x is None:
            rep = NamedSharding(self.meshes[s], P())
            x = self._indices[(s, j)] = jax.jit(lambda: jnp.int32(j), out_shardings=rep)()
        return x

    def _output(self, v, args):
        if isinstance(v, Literal):
            return jnp.asarray(v.val, v.aval.dtype)
        if v in args and v not in self.batch_vars:
            return args[v]
        if v in self._step:
            return next(iter(self._step[v].values()))
        pieces = [next(iter(self._mb[(v, j)].values())) for j in range(self.k)]
        if self.k == 1:
            return pieces[0]
        if v not in self.part.batch_dependent:
            return pieces[0]
        # Forward values with the micro-batch's rows are joined back; everything else (a
        # scalar loss, gradients returned without a marker) is the mean over micro-batches.
        forward = any(v in t.outvars for t in self.part.forward)
        rows = forward and self.part.rows_first(v)
        if rows:
            stacked = jnp.stack(pieces, axis=1)
            return stacked.reshape((-1,) + stacked.shape[2:])
        return jnp.mean(jnp.stack(pieces), axis=0).astype(v.aval.dtype)

    def _placed(self, v, x):
        """A step output in the spec ``out_axis_resources`` gives it (moved there if not)."""
        where = None if self.manual is None or not isinstance(v, Var) else (
            self.manual.output_sharding_spec(v))
        if where is None:
            return x
        return self.move(x, NamedSharding(self.meshes[where[0]], where[1]))

    def _all_tasks(self):
        return list(self.tasks.values()) + self.apply

    def _last_uses(self) -> dict:
        last = {}
        outs = {v for v in self.part.jaxpr.outvars if isinstance(v, Var)}
        outs |= self.part.join_sources  # kept until they are joined
        for n, a in enumerate(self.order):
            task = self.tasks.get((a.kind, a.stage))
            if task is None:
                continue
            for v in task.invars:
                if not isinstance(v, Var) or v in outs:
                    continue
                if v in self.batch_vars or v in self.part.per_micro_batch:
                    last[(v, a.micro_batch)] = n
        by_action: dict = {}
        for key, n in last.items():
            by_action.setdefault(n, []).append(key)
        return by_action

    def _reader_sharding(self, v, mesh):
        """The sharding the first apply task on ``mesh`` reading ``v`` takes it in (else
        replicated on ``mesh``)."""
        for t in self.apply:
            if t.mesh == mesh and v in t.invars:
                return t.in_shardings[t.invars.index(v)]
        return NamedSharding(mesh, P())

    def _input_sharding(self, v):
        """Where a step input goes first: the sharding of its first reader in the schedule."""
        readers = [self.tasks[(a.kind, a.stage)] for a in self.order
                   if (a.kind, a.stage) in self.tasks] + self.apply
        for t in readers:
            if v in t.invars:
                return t.in_shardings[t.invars.index(v)]
        return NamedSharding(self.meshes[0], P())

    # Inspection --------------------------------------------------------------------------------
    def _ordered_tasks(self):
        s = self.part.num_stages
        fwd = [self.tasks[("F", i)] for i in range(s)]
        bwd = [t for i in reversed(range(s)) for kind in ("B", "Ba", "Bw")
               if (t := self.tasks.get((kind, i))) is not None]
        return fwd + bwd + self.apply

    def _all_ordered_tasks(self) -> list:
        """Every compiled task in the order values flow: forward stages, backward stages in
        reverse, the stages' once-per-step gradient reductions, the sums spanning stages,
        apply."""
        tasks = self._ordered_tasks()
        at = len(tasks) - len(self.apply)
        return tasks[:at] + self.reduce_tasks + self.sums + tasks[at:]

    def get_task_hlo_texts(self) -> dict[str, str]:
        """Task name -> its optimized HLO text, for every compiled task (``F0``, ``B1``,
        ``reduce0``, cross-stage sums, ``apply0.0``, ...) in the order values flow."""
        out = {t.task.name: t.compiled.as_text() for t in self._all_ordered_tasks()}
        assert len(out) == len(self._all_ordered_tasks()), "task names must be unique"
        return out

    def get_hlo_text(self) -> list[str]:
        """Alpa's list: the forward of each stage, the backward of each stage in reverse, the
        apply of each stage (training, 2 stages: ``[F0, F1, B1, B0, A0, A1]``; inference:
        the forwards). A stage's once-per-step gradient reduction is part of its backward
        entry (Alpa reduces in the backward of the last micro-batch), each sum spanning
        stages part of the apply entry of the stage whose update runs next, a stage's apply
        levels one entry; an entry of several modules is their texts one after the other
        (the stage's own tasks first). Every task alone: ``get_task_hlo_texts``."""
        n = self.part.num_stages
        text = {id(t): t.compiled.as_text() for t in self._all_ordered_tasks()}
        fwd = [text[id(self.tasks[("F", s)])] for s in range(n)]
        if not self.part.has_backward:
            return fwd
        bwd = []
        for s in reversed(range(n)):
            parts = [t for kind in ("B", "Ba", "Bw") if (t := self.tasks.get((kind, s)))]
            parts += [r for r in self.reduce_tasks if r.stage == s]
            bwd.append("\n".join(text[id(t)] for t in parts))
        own: list[list] = [[] for _ in range(n)]
        sums: list[list] = [[] for _ in range(n)]
        for i, t in enumerate(self.apply):
            own[t.stage].append(text[id(t)])
            sums[t.stage] += [text[id(c)] for c in self.sums if c.sum.before == i]
        last = self.apply[-1].stage if self.apply else n - 1
        sums[last] += [text[id(c)] for c in self.sums if c.sum.before >= len(self.apply)]
        return fwd + bwd + ["\n".join(a + b) for a, b in zip(own, sums, strict=True)]

    def get_total_allocation_size(self) -> int:
        """The largest per-device allocation (arguments + outputs + temporaries) of any task."""
        best = 0
        for t in self._ordered_tasks():
            m = t.compiled.memory_analysis()
            best = max(best, int(m.argument_size_in_bytes + m.output_size_in_bytes +
                                 m.temp_size_in_bytes - m.alias_size_in_bytes))
        return best

    def audit(self) -> PipelineAudit:
        """Per task, the plan's predicted collectives and memory against the compiled program,
        with step totals (``pipeline.audit.PipelineAudit``)."""
        runs: dict = {}
        for a in self.order:
            runs[(a.kind, a.stage)] = runs.get((a.kind, a.stage), 0) + 1
        keys = {id(t): key for key, t in self.tasks.items()}
        tasks = self._ordered_tasks()
        made = {v: (t, sh) for t in tasks
                for v, sh in zip(t.outvars, t.out_shardings, strict=False)}
        # step inputs arrive where their first reader takes them; readers on other sub-meshes
        # get a copy per step (per micro-batch for batch inputs)
        arrive = dict(zip(self.part.jaxpr.invars, self.in_shardings, strict=True))
        arrive.update((w, self.in_shardings[i]) for w, i in self.part.whole_inputs.items())
        made.update((w, made[src]) for w, src in self.part.joined.items() if src in made)
        transfers, seen = [], set()
        for t in tasks:
            for v, dst in zip(t.invars, t.in_shardings, strict=False):
                src_task, src = made.get(v, (None, None))
                src_name = None if src_task is None else src_task.task.name
                if src_task is None and v in arrive:
                    src_name, src = "input", arrive[v]
                if src_name is None or src.device_set == dst.device_set or (v, dst) in seen:
                    continue  # a copy in one sharding serves every reader that takes it
                seen.add((v, dst))
                moved = carried_spec(src, t.mesh, v.aval.shape)
                same = moved is not None and NamedSharding(t.mesh, moved).is_equivalent_to(
                    dst, len(v.aval.shape))
                n = runs.get(keys[id(t)], 0) if id(t) in keys else 1
                if src_name == "input":
                    n = self.k if v in self.batch_vars else 1
                transfers.append(Transfer(
                    value=f"{v} {v.aval.str_short()}", src=src_name, dst=t.task.name,
                    num_bytes=v.aval.size * getattr(v.aval.dtype, "itemsize", 4),
                    runs=n, resharded=not same))
        return PipelineAudit(tasks=tuple(
            task_audit(t, runs.get(keys[id(t)], 0) if id(t) in keys else 1)
            for t in tasks + self.reduce_tasks + self.sums), transfers=tuple(transfers))

    def explain(self) -> str:
        """The pipeline plan, each task's plan, then the audit of the compiled tasks."""
        parts = [self.plan.explain()]
        for name, plan in self.task_plans.items():
            parts.append(f"task {name}:\n" + plan.explain())
        parts.append(self.audit().explain())
        parts.append(self.weights_gathered())
        return "\n".join(parts)

    def weights_gathered(self) -> str:
        """Which forward and backward tasks gather the step's weights (non-batch step inputs)
        every time they run, from their compiled HLO, and why the plan may do so."""
        jaxpr = self.part.jaxpr
        weights = set(jaxpr.invars) - self.batch_vars
        lines = []
        for t in self._ordered_tasks():
            if t in self.apply:
                continue
            found = gathered_inputs(t.compiled.as_text(),
                                    [i for i, v in enumerate(t.invars) if v in weights])
            if found:
                budget = getattr(t.plan, "objective", None)
                budget = budget and budget.memory_budget_per_device
                why = (f"ZeRO-3 style: its plan keeps them split and gathers them, within "
                       f"memory_budget_per_device {budget:,} B" if budget else
                       "ZeRO-3 style: its plan's costs chose it, no memory budget")
                lines.append(f"  {t.task.name}: {len(found)} all-gather(s) of weights, "
                             f"{sum(found):,} B per device per micro-batch ({why})")
        head = "weights gathered per micro-batch (compiled forward and backward tasks):"
        return "\n".join([head] + (lines or ["  none: every stage keeps its weights in the "
                                              "layout its tasks use"]))

    @property
    def stage_input_shard_specs(self) -> list[list]:
        """Per forward stage, the PartitionSpec of each of its inputs."""
        return [[s.spec for s in t.in_shardings[:len(t.invars)]]
                for t in (self.tasks[("F", i)] for i in range(self.part.num_stages))]

    def get_input_placement_specs(self):
        it = iter(self.in_shardings)
        leaves = [next(it) if d else None for d in self._flat.is_dynamic]
        return jax.tree.unflatten(self._flat.treedef, leaves)

    def get_output_placement_specs(self):
        return jax.tree.unflatten(self._out_tree, [None] * self._out_tree.num_leaves)

    def dump_debug_info(self, dir_path: str | os.PathLike) -> list[str]:
        """Write what is needed to debug this pipeline into ``dir_path``; return the file
        names: one ``<task>.hlo`` per compiled task (``get_task_hlo_texts``), ``plan.txt``
        (``explain()``: the pipeline plan, each task's plan and the audit), ``jaxpr.txt``
        and ``timings.json``."""
        os.makedirs(dir_path, exist_ok=True)
        files = {f"{name}.hlo": text for name, text in self.get_task_hlo_texts().items()}
        files["plan.txt"] = self.explain() + "\n"
        files["jaxpr.txt"] = str(self.program.closed)
        files["timings.json"] = json.dumps(self.timings, indent=1)
        for name, text in files.items():
            with open(os.path.join(dir_path, name), "w") as f:
                f.write(text)
        return sorted(files)

    def dump_stage_execution_trace(self, path: str, *args) -> str:
        """Run one step (blocking per action) and write its trace: a ``.png`` timeline, else
        Chrome/Perfetto trace JSON. Without ``args`` the last recorded trace is written."""
        if args:
            self.trace = []
            self.run(list(flatten_args(args, self.static_argnums).dynamic_leaves), record=True)
        if str(path).endswith(".png"):
            return draw_timeline(self.trace, path, row_of=self.schedule.rank_of,
                                 title=f"{self.name}: {self.plan.schedule}, "
                                       f"{self.k} micro-batches")
        events = [{"name": name, "ph": "X", "pid": 0, "tid": self.schedule.rank_of(stage),
                   "ts": start * 1e6, "dur": dur * 1e6} for name, stage, start, dur in self.trace]
        with open(path, "w") as f:
            json.dump({"traceEvents": events}, f)
        return path


__all__ = ["PipelineExecutable"]
