"""The stage search's span measurements for ``AutoParallel``: ``SpanPricer`` plans only the
(layer span, sub-mesh) pairs a pipeline of 2 or more stages can use, and an apply task only
where its memory can decide the search's memory test (``_apply_bytes_bound``)."""

from __future__ import annotations

import dataclasses
import functools
import math

from ..sharding.highs import concurrently
from .placement import shape_cluster, submesh_shapes
from .price import _Pricer
from .stages import AutoStageOption


class SpanPricer(_Pricer):
    """``price._Pricer`` measuring only what a pipeline of 2 or more stages can use.

    The stage DP reads ``measure_spans``: per (layer span, sub-mesh shape) the planned F + B
    time and the peak memory of the span as one stage. Here, with the same DP results:

    * a sub-mesh holding more devices than the cluster less its smallest sub-mesh, and (in
      ``composition`` mode) the span of every layer, are never a stage of 2 or more: not
      planned (``inf``);
    * identical spans (the same F, B and apply jaxprs: repeated layers) are planned once:
      ``plan_task``'s cache, keyed by the task's jaxpr, its inputs' roles and the sub-mesh
      (``highs.once``: a span planned side by side with an identical one waits for its plans);
    * every (span, sub-mesh) pair is planned side by side (``highs.concurrently``), and then
      every apply task that is planned (below), repeated spans after the others. One span at a
      time (its sub-meshes side by side, the apply tasks one by one), Table 1's 76.1B row ran
      a single HiGHS solve for most of its stage search: its planning used 1.31-1.32 CPU
      seconds per second over three runs, side by side 1.45-1.47 (wall 366-490 s before,
      356-431 s after, the same choice: the machine's speed varied by a third that day);
    * a span's apply (optimizer) tasks are planned only where their memory can decide the
      DP's memory test (``cost``: the span's peak against the limit). Their peak is at most
      ``_apply_bytes_bound`` (every value of the task replicated, live at once, plus a
      resharded copy of each); where the span's F/B peak plus that bound, summed over the
      parts the DP adds (one span, or every layer in ``individual`` mode), is within the
      limit, every test passes either way, and the apply tasks are not planned. With no limit
      (no budget, unbounded device memory) they never are.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.span_stats = {"planned": 0, "pruned": 0, "apply_planned": 0, "apply_skipped": 0}

    def measure_spans(self, option: AutoStageOption, num_layers: int) -> dict:
        key = ("pipeline spans", repr(option), num_layers, self.cluster)
        if key in self.cache:
            return self.cache[key]
        shapes = submesh_shapes(option, self.cluster)
        sizes = [math.prod(s) for s in shapes]
        individual = option.layer_profile_mode == "individual"
        spans = ([(i, i + 1) for i in range(num_layers)] if individual else
                 [(i, j) for i in range(num_layers) for j in range(i + 1, num_layers + 1)])
        budget = option.memory_budget_per_device
        limit = budget if budget is not None else self.cluster.memory_bytes
        overrides = {"memory_budget_per_device": budget} if budget is not None else {}
        usable = [n <= self.cluster.num_devices - min(sizes) for n in sizes]
        measured: dict = {}
        jobs = []  # ((i, j, c), part, s, sub, apply bound): the spans to plan
        for i, j in spans:
            if j - i == num_layers and num_layers > 1:
                for c in range(len(shapes)):
                    measured[(i, j, c)] = (math.inf, math.inf, None)
                self.span_stats["pruned"] += len(shapes)
                continue
            part, s = self.cut.span(i, j, self.program.batch_invars,
                                    self.method.layer_option.remat)
            bound = sum(_apply_bytes_bound(t) for t in part.apply if t.stage == s)
            for c, shape in enumerate(shapes):
                if usable[c]:
                    jobs.append(((i, j, c), part, s, shape_cluster(self.cluster, shape), bound))
                else:
                    measured[(i, j, c)] = (math.inf, math.inf, None)
                    self.span_stats["pruned"] += 1
        # Every span on every sub-mesh side by side (most of their time is HiGHS's, which
        # releases the GIL), in ``_job_order``: the largest sub-meshes first, repeated spans
        # last (their tasks are the first one's, which they wait for rather than plan again).
        jobs = _job_order(jobs, with_apply=False)
        found = concurrently([functools.partial(
            self._measure, dataclasses.replace(part, apply=[]), s, (i, j), sub, overrides,
            num_layers) for (i, j, c), part, s, sub, _ in jobs])
        pending = []  # the jobs whose apply tasks can decide a memory test, F/B peak each
        for job, sp in zip(jobs, found, strict=True):
            self.span_stats["planned"] += 1
            measured[job[0]] = sp
            if sp is not None and limit is not None:
                pending.append((job, sp[1]))
        # the apply tasks where their memory could decide a memory test
        by_choice: dict = {}
        for job, peak in pending:
            by_choice.setdefault(job[0][2] if individual else job[0], []).append((job, peak))
        again = []
        for group in by_choice.values():
            if sum(peak + job[4] for job, peak in group) <= limit:
                self.span_stats["apply_skipped"] += len(group)
            else:
                again += [job for job, _ in group]
        again = _job_order(sorted(again, key=lambda job: job[0]), with_apply=True)
        found = concurrently([functools.partial(self._measure, part, s, (i, j), sub,
                                                overrides, num_layers)
                              for (i, j, c), part, s, sub, _ in again])
        for job, sp in zip(again, found, strict=True):
            self.span_stats["apply_planned"] += 1
            measured[job[0]] = sp
        for k, v in measured.items():
            if v is None:
                measured[k] = (math.inf, math.inf, None)
        self.cache[key] = measured
        return measured

    def _measure(self, part, s, span, sub, overrides, num_layers):
        """(F + B seconds, peak bytes, logical mesh shape) of stage ``s`` (layers ``span``)
        on ``sub`` (``plan_span``); None when it has no plan within the memory."""
        try:
            sp = self.plan_span(part, s, span, sub, overrides, num_layers)
        except ValueError as err:
            if "memory" not in str(err):
                raise
            return None
        return (sum(v for kd, v in sp.times.items() if kd != "apply"), sp.peak_bytes,
                sp.mesh_shape)


def _job_order(jobs: list, with_apply: bool) -> list:
    """``jobs`` (``((i, j, c), part, stage, sub-mesh cluster, ...)``) in the order the threads
    of ``concurrently`` take them; the same plans in any order.

    Each span whose stage has the same F and B (and, ``with_apply``, apply) equations as an
    earlier job's span on the same sub-mesh (a repeated layer) goes last, in order: it waits
    for that job's plans (``once``). Before them, the first job on each sub-mesh (it searches
    the sub-mesh's logical mesh, ``submesh_mesh``, which the sub-mesh's other jobs wait for),
    largest sub-mesh first, then the other jobs, largest sub-mesh first: larger sub-meshes
    have more candidate meshes and larger ILPs (a longest-first order; started in span order,
    GPT-3 175B's 64-host sub-mesh ran alone for the last 50 s of its stage search)."""
    kinds, meshes = set(), set()
    searching, others, repeats = [], [], []
    for job in jobs:
        (_, _, c), part, s = job[:3]
        kind = (c, _span_shape(part, s, with_apply))
        if kind in kinds:
            repeats.append(job)
        elif c in meshes:
            others.append(job)
        else:
            searching.append(job)
        kinds.add(kind)
        meshes.add(c)

    def larger(job):
        return -job[3].num_devices
    return sorted(searching, key=larger) + sorted(others, key=larger) + repeats


def _span_shape(part, s, with_apply: bool) -> tuple:
    """Stage ``s``'s F and B (and apply) equations of ``part`` as (primitive, operand types,
    result types): equal for repeated layers, whatever their variables are named."""
    tasks = [part.forward[s]] + ([part.backward[s]] if part.has_backward else []) + (
        [t for t in part.apply if t.stage == s] if with_apply else [])
    return tuple((e.primitive.name, tuple(str(v.aval) for v in e.invars),
                  tuple(str(v.aval) for v in e.outvars)) for t in tasks for e in t.eqns)


def _apply_bytes_bound(task) -> int:
    """Bytes per device an apply task's plan holds at most: every value it reads or makes
    (inside nested jaxprs too) replicated and live at once, twice (a resharded copy of
    each). Apply tasks are element-wise updates: a value is not resharded to two layouts."""
    seen, total = set(), 0
    for v in list(task.invars) + _made(task.eqns):
        aval = getattr(v, "aval", None)
        if id(v) in seen or aval is None or not hasattr(aval, "shape"):
            continue
        seen.add(id(v))
        try:
            itemsize = aval.dtype.itemsize
        except (AttributeError, TypeError):
            itemsize = 16
        total += math.prod(aval.shape) * max(itemsize, 1)
    return 2 * total


def _made(eqns) -> list:
    """The values ``eqns`` make, those of the jaxprs in their parameters included."""
    out = []
    for e in eqns:
        out += list(e.outvars)
        for p in e.params.values():
            for j in p if isinstance(p, (list, tuple)) else [p]:
                inner = getattr(j, "jaxpr", j)
                if hasattr(inner, "eqns"):
                    out += _made(inner.eqns)
    return out


__all__ = ["SpanPricer"]
