"""A pipeline planned and priced for a described cluster, with no device of it at hand.

``autoshard.plan(step, *shapes, method=PipeshardParallel(...), cluster=...)`` lands here. The
step is cut as ``PipeshardParallel`` cuts it (layers from markers or ``AutoLayerOption``,
stages from the stage option, the same ``Partition`` of tasks); then, instead of compiling:

* every sub-mesh is a slice of the cluster (consecutive devices, host by host): a sub-mesh
  inside one host is a one-host ``Cluster`` of its devices, a larger one whole hosts;
* every task (``F``, ``B`` or ``Ba``/``Bw``, ``apply``) is planned by ``tasks.plan_tasks``,
  the runtime's own walk: traced as it runs, in the order values flow, with the input layouts
  it would receive, on its sub-mesh's cluster (links, FLOP/s and memory); so on the devices
  at hand the priced plans are the compiled ones. A stage's first task chooses the sub-mesh's
  logical shape unless the stage option fixes it (the runtime uses a 1-D sub-mesh there);
* ``interleaved_1f1b``: model stage ``s`` on sub-mesh ``s % (stages / virtual_stages)``, as
  the runtime places it; a sub-mesh runs the apply tasks of all its stages and holds their
  memory (each stage's peak summed: an upper bound);
* a backward task whose micro-batch rows arrive split over batch axes is priced as the runtime
  runs it, per device over them (``reduce.without_batch_reductions``: its gradient reductions
  over them leave its plan; rows arriving split otherwise pay their reshard), and its stage's
  once-per-step reduction of those gradients is added to the stage's apply time
  (``StageEstimate.reduce_bytes``/``reduce_s``); a backward that would move rows per device
  (an operation without a per-row rule) stays planned and reduces per micro-batch, as at run
  time (``tasks.plan_tasks`` decides both);
* a value read on another stage is copied once per micro-batch (``F``/``B`` outputs) or per
  step (``apply``): each sending device sends its shard (the producer plan's spec) over the
  link joining the two sub-meshes (inside a host, or between hosts); the copy is charged to
  the action that produces the value (the sender waits for it: no overlap is assumed);
* the step time is the schedule replayed (``simulate``) with those per-action times, plus the
  slowest stage's apply tasks after the last backward; the bubble is the replay's idle share;
* memory per stage is its largest task's peak plus the residuals ``F`` keeps for ``B`` of the
  other micro-batches in flight at once (the replay's ``peak_in_flight``).

``AutoStageOption`` runs the stage dynamic program (``stages.stage_dp``) with the time of
layers ``[i, j)`` on a sub-mesh = the planned ``F`` + ``B`` of those layers on that sub-mesh's
cluster (``layer_profile_mode='individual'``: each layer planned alone and summed, identical
layers planned once; ``'composition'``: every range planned as one stage), and a range that
has no plan within the device memory excluded. Sub-mesh shapes tried: ``(1, 2**k)`` inside a
host and ``(2**k, devices_per_host)`` whole hosts (``small_power_of_two``: at most 4 devices;
``manual``: ``manually_specified_submeshes``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax

from ..cluster import GIB, Cluster
from ..sharding.highs import once
from ..sharding.options import AutoShardingOption
from ..sharding.plan import ShardingPlan
from . import balance
from .build import cut_program, ranks_of, virtual_of
from .compile import shape_auto_option
from .estimate import PipelineEstimate, StageEstimate
from .layers import AutoLayerOption
from .layouts import step_aliases
from .partition import build_partition
from .per_device import per_device_plan, rows_taken
from .placement import (
    axis_names,
    given_stages,
    shape_cluster,
    stage_layers,
    stage_overrides,
    sub_cluster_of,
    submesh_shapes,
)
from .reduce import reduce_seconds
from .schedules import get_schedule, traits
from .simulate import simulate
from .stages import AutoStageOption, cost_table, stage_dp_counts
from .taskfn import task_fn
from .tasks import FIXES, Target, plan_task, plan_tasks, task_costs, task_signature
from .zero import forward_backward_option


def price_pipeline(method, program, cluster: Cluster, *,
                   cache: dict | None = None) -> PipelineEstimate:
    """``method`` (a PipeshardParallel) planned and priced on ``cluster`` (see module doc).
    ``cache``: task plans of an earlier pricing of ``program`` to reuse (``_Pricer.cache``;
    keyed by everything a plan depends on)."""
    cut = cut_program(program, method)
    num_layers = cut.num_layers
    k = program.num_micro_batches
    pricer = _Pricer(method, program, cut, cluster, cache=cache)
    notes = []
    option = method.stage_option
    virtual = virtual_of(method)  # interleaved: model stage s on sub-mesh s % (stages / virtual)
    if isinstance(option, AutoStageOption):
        stage_of_layer, placement, fixed_shapes = pricer.search_stages(option, num_layers, k)
        notes.append(f"stages searched by the stage DP on planned layer times "
                     f"({option.layer_profile_mode}) over sub-meshes (hosts x devices) "
                     f"{submesh_shapes(option, cluster)}; each stage planned on the logical "
                     "mesh the search priced it on (per sub-mesh, the one the forward of the "
                     "step's most common layer chooses there)")
    else:
        # interleaved: stages as the runtime cuts them, over `virtual` times the devices
        stage_of_layer, placement, fixed_shapes = given_stages(
            option, num_layers, cluster if virtual == 1 else dataclasses.replace(
                cluster, num_hosts=cluster.num_hosts * virtual))
    num_stages = max(stage_of_layer) + 1
    num_ranks = ranks_of(num_stages, virtual)
    if virtual > 1:  # the ranks' sub-meshes, each holding `virtual` model stages
        _, ranks, rank_shapes = given_stages(
            dataclasses.replace(option, num_stages=num_ranks), num_layers, cluster)
        placement = [ranks[s % num_ranks] for s in range(num_stages)]
        fixed_shapes = [rank_shapes[s % num_ranks] for s in range(num_stages)]
    part = build_partition(cut.closed, layer_of_fwd=cut.layer_of, fwd_end=cut.fwd_end,
                           stage_of_layer=stage_of_layer, batch_invars=program.batch_invars,
                           remat=method.layer_option.remat, after=cut.after,
                           row_dims=cut.row_dims)
    work = balance.stage_flops(part)
    balance.warn_idle_stages(work, method.layer_option, [
        stage_layers(stage_of_layer, s) for s in range(num_stages)])
    split = traits(method.pipeline_schedule).splits_backward
    stage_plans = pricer.plan_tasks(part, placement, fixed_shapes, split, num_ranks)
    sends = _sends(part, stage_plans, placement, cluster, split)
    costs = {}
    for s, sp in enumerate(stage_plans):
        for kind, t in sp.times.items():
            if kind != "apply":
                costs[(kind, s)] = t + sends[s][kind][0]
    name = method.pipeline_schedule if part.has_backward else "inference"
    interleaved = traits(name).virtual
    schedule = get_schedule(name, num_stages=num_ranks if interleaved else num_stages,
                            num_micro_batches=k, virtual=virtual if interleaved else 1)
    sim = simulate(schedule, costs)
    apply_by_rank: dict = {}  # a rank runs the apply tasks of all its model stages
    for s, sp in enumerate(stage_plans):
        apply_by_rank[s % num_ranks] = (apply_by_rank.get(s % num_ranks, 0.0)
                                        + sp.times.get("apply", 0.0) + sends[s]["apply"][0])
    apply_s = max(apply_by_rank.values(), default=0.0)
    memories = [max(sp.peak_bytes + max(0, sim.peak_in_flight[s] - 1) * sp.residual_bytes,
                    sp.apply_peak_bytes) for s, sp in enumerate(stage_plans)]
    rank_memory: dict = {}  # a rank holds all its model stages (their peaks summed: an upper
    for s, m in enumerate(memories):  # bound, a rank runs one task at a time)
        rank_memory[s % num_ranks] = rank_memory.get(s % num_ranks, 0) + m
    stages = []
    for s, sp in enumerate(stage_plans):
        in_flight = sim.peak_in_flight[s]
        memory = rank_memory[s % num_ranks]
        if cluster.memory_bytes is not None and memory > cluster.memory_bytes:
            raise ValueError(
                f"Stage {s} (layers {stage_layers(stage_of_layer, s)}) does not fit in memory: about "
                f"{memory / GIB:.3g} GiB per device (largest task {sp.peak_bytes / GIB:.3g} GiB "
                f"+ {in_flight - 1} more micro-batches' residuals of "
                f"{sp.residual_bytes / GIB:.3g} GiB"
                f"{', and the other model stages of its sub-mesh' if virtual > 1 else ''}) "
                f"over the cluster's "
                f"{cluster.memory_bytes / GIB:.3g} GiB. " + FIXES)
        stages.append(StageEstimate(
            stage=s, layers=stage_layers(stage_of_layer, s), devices=placement[s][0],
            physical_shape=placement[s][1], mesh_shape=sp.mesh_shape, task_s=dict(sp.times),
            send_s={kind: v[0] for kind, v in sends[s].items()},
            send_bytes={kind: v[1] for kind, v in sends[s].items()},
            memory_bytes=int(memory), plans=tuple(sp.plans), reduce_bytes=sp.reduce_bytes,
            reduce_s=sp.reduce_s))
    flops = sum(p.objective.flops * (1 if name.startswith("apply") else k)
                for sp in stage_plans for name, p in sp.plans)
    notes += [
        "each task planned by sharding.plan_auto on its sub-mesh's cluster; a copy between "
        "stages is charged to the action producing the value (no overlap with compute assumed)",
        "a backward task whose micro-batch rows arrive split over batch axes keeps its "
        "gradients partial over them and the stage reduces them once per step before its "
        "apply tasks (priced in apply), as the pipeline runtime runs them",
        *pricer.notes]
    return PipelineEstimate(
        method=_describe(method), cluster=cluster.describe(), schedule=schedule.name,
        num_micro_batches=k, num_layers=num_layers, stages=tuple(stages),
        makespan_s=sim.makespan, apply_s=apply_s, bubble_fraction=sim.bubble_fraction,
        flops=flops, num_devices=cluster.num_devices,
        timeline=sim.render() if k * num_stages <= 64 else "", notes=tuple(notes),
        stage_flops=work)


@dataclass
class _StagePlans:
    times: dict
    plans: list
    mesh_shape: tuple
    peak_bytes: int
    residual_bytes: int
    out_bytes: dict  # var -> bytes per device in its producer's spec
    producer_kind: dict  # var -> kind of the task that makes it
    reduce_bytes: int = 0  # partial gradients reduced once per step (bytes per device)
    reduce_s: float = 0.0  # seconds of that reduction (in times["apply"])
    apply_peak_bytes: int = 0  # apply tasks run after the last backward: no residuals live


class _Pricer:
    """Plans tasks of a partition on sub-mesh clusters; caches identical tasks."""

    def __init__(self, method, program, cut, cluster, cache: dict | None = None):
        self.method, self.program, self.cluster = method, program, cluster
        self.cut = cut
        self.option(None, {})  # a bad default_auto_sharding_option fails here
        self.cache: dict = {} if cache is None else cache
        # plans of identical tasks in the walk (plan_tasks), shared by the pricings of one
        # cache (its keys hold everything a plan depends on): a search's candidate pipelines
        # repeat stages (GPT-3 175B's 4, 5 and 6 stages share their 2-layer stages' tasks)
        self.walk_cache: dict = self.cache.setdefault(("walk",), {})
        self.notes: list[str] = []

    def sub_cluster(self, first: int, n: int) -> tuple[Cluster, tuple[int, int]]:
        return sub_cluster_of(self.cluster, first, n)

    def plan_task(self, part, task, sub: Cluster, shape, overrides, *, fixed=None,
                  aliases=(), axis_names=None) -> ShardingPlan:
        """``task`` planned on ``sub`` as the runtime plans it: traced with its micro-batch
        index where it draws random numbers, with the stage's options (``shape_auto_option``),
        its inputs pinned to ``fixed`` (``tasks.plan_task``); identical tasks once."""
        closed, invars, outvars, acc, random = _traced(part, task)
        n, extra = len(invars), len(acc) + random
        batch = [part.holds_rows(v) for v in invars] + [False] * extra
        aliases = list(aliases) + [(n + i, len(outvars) + i) for i in range(len(acc))]
        option = self.option(shape, overrides)
        if task not in part.apply:
            option = forward_backward_option(option)
        fixed_in = None if fixed is None else list(fixed) + [None] * extra
        key = (str(closed), tuple(batch), tuple(aliases), sub, repr(option), repr(fixed_in),
               axis_names)
        return once(self.cache, key, lambda: plan_task(
            closed, task.name, num_devices=sub.num_devices, option=option, batch=batch,
            aliases=aliases, fixed=fixed_in, cluster=sub, axis_names=axis_names,
            notes=self.notes, compare_data_parallel=False))

    def option(self, shape, overrides) -> AutoShardingOption:
        """The planner options of a stage on a sub-mesh of logical ``shape``, as the runtime
        builds them (None: the planner chooses the shape)."""
        return shape_auto_option(self.method.default_auto_sharding_option, shape, overrides)

    def plan_tasks(self, part, placement, shapes, split, num_ranks) -> list[_StagePlans]:
        """Every task planned by ``tasks.plan_tasks``, as the runtime plans it, on its
        sub-mesh's cluster; then priced. A stage whose logical shape is not given takes the
        one its forward task's plan chooses (the model stages of one interleaved rank share
        it)."""
        num_stages = part.num_stages
        subs = [self.sub_cluster(*placement[s][0])[0] for s in range(num_stages)]
        overrides = [stage_overrides(self.method.stage_option, s) for s in range(num_stages)]
        mesh = [None if shapes[s] is None else tuple(shapes[s]) for s in range(num_stages)]
        names = [None if m is None else axis_names(m) for m in mesh]
        for s in range(num_stages):
            if mesh[s] is None and s >= num_ranks:
                mesh[s], names[s] = mesh[s % num_ranks], names[s % num_ranks]
            elif mesh[s] is None:
                plan = self._plan_or_fail(part, part.forward[s], subs[s], None, overrides[s], s)
                mesh[s], names[s] = tuple(plan.mesh_shape), tuple(plan.axis_names)
        targets = [Target(s % num_ranks, mesh[s], names[s], subs[s]) for s in range(num_stages)]
        options = [self.option(mesh[s], overrides[s]) for s in range(num_stages)]
        out = [_StagePlans(times={}, plans=[], mesh_shape=mesh[s], peak_bytes=0,
                           residual_bytes=0, out_bytes={}, producer_kind={})
               for s in range(num_stages)]

        def price(tp):
            t, kind, s, plan = tp.task, tp.kind, tp.task.stage, tp.plan
            if plan is None:
                raise ValueError(f"{tp.note}. autoshard.plan prices planned tasks only: "
                                 "check the stage's planner options.")
            if tp.note:
                self.notes.append(tp.note)
            sp, n, n_acc = out[s], len(tp.invars), len(tp.accumulated)
            if tp.batch_axes:  # per device over them: its gradients reduced once per step
                secs, nbytes = _once_per_step(plan, tp.batch_axes, n, n_acc,
                                              task_costs(mesh[s], options[s], subs[s]))
                sp.times["apply"] = sp.times.get("apply", 0.0) + secs
                sp.reduce_s += secs
                sp.reduce_bytes += nbytes
            outs = tp.outvars
            for v, leaf in zip(t.accumulated, plan.outputs[len(outs):], strict=False):
                o = part.marker.outvars[list(part.marker.invars).index(v)]
                # read by another stage's apply: copied once per step, after the last B
                sp.out_bytes[o] = leaf.bytes_per_device(plan.mesh_sizes)
                sp.producer_kind[o] = "apply"
            for v, leaf in zip(outs, plan.outputs, strict=False):
                sp.out_bytes[v] = leaf.bytes_per_device(plan.mesh_sizes)
                sp.producer_kind[v] = kind
            if kind in ("B", "Ba", "Bw"):
                sp.residual_bytes += sum(sp.out_bytes.get(v, 0) for v in tp.invars
                                         if sp.producer_kind.get(v) == "F")
            sp.plans.append((t.name, plan))
            sp.times[kind] = sp.times.get(kind, 0.0) + plan.objective.total_s
            if kind == "apply":
                sp.apply_peak_bytes = max(sp.apply_peak_bytes,
                                          plan.objective.peak_bytes_per_device or 0)
            else:
                sp.peak_bytes = max(sp.peak_bytes, plan.objective.peak_bytes_per_device or 0)

        plan_tasks(part, targets, split, options, program=self.program, realize=price,
                   cache=self.walk_cache, compare_data_parallel=False)
        return out

    def _plan_or_fail(self, part, t, sub, mesh, overrides, s, **kw):
        try:
            return self.plan_task(part, t, sub, mesh, overrides, **kw)
        except ValueError as err:
            if "memory_budget_per_device" in str(err):
                raise ValueError(f"Stage {s} does not fit in memory: its task {t.name} has no "
                                 f"plan within the device memory ({err}). " + FIXES) from err
            raise

    # The stage search ------------------------------------------------------------------------
    def search_stages(self, option: AutoStageOption, num_layers: int, k: int,
                      num_stages: int | None = None):
        """(stage of each layer, placement, logical mesh shape per stage) of the stage DP's
        best layout (with exactly ``num_stages`` stages when given; None when that many have
        no layout)."""
        found = self.stage_layout(option, num_layers, k, num_stages)
        if found is None and num_stages is None:
            shapes = submesh_shapes(option, self.cluster)
            raise ValueError(
                f"AutoStageOption found no stage layout for {self.cluster.describe()}: every "
                f"candidate stage on sub-meshes {shapes} has no plan within the memory "
                "budget, or the sub-mesh sizes cannot cover the devices exactly. " + FIXES)
        return None if found is None else found[:3]

    def stage_layout(self, option: AutoStageOption, num_layers: int, k: int,
                     num_stages: int | None = None):
        """The stage DP on planned stage times (each candidate planned once per pricer):
        (stage of each layer, placement, logical mesh shape per stage, DP objective in
        seconds), or None when no layout (of ``num_stages`` stages, when given) fits."""
        return self.stage_layouts(option, num_layers, k, (num_stages,))[num_stages]

    def stage_layouts(self, option: AutoStageOption, num_layers: int, k: int,
                      counts) -> dict:
        """``stage_layout`` for each number of stages in ``counts`` (None: any number), from
        one DP (``stages.stage_dp_counts``)."""
        shapes = submesh_shapes(option, self.cluster)
        sizes = [math.prod(s) for s in shapes]
        individual = option.layer_profile_mode == "individual"
        budget = option.memory_budget_per_device
        measured = self.measure_spans(option, num_layers)

        def parts(i, j, c):
            return ([measured[(x, x + 1, c)] for x in range(i, j)] if individual
                    else [measured[(i, j, c)]])

        def cost(i, j, c):
            mem = sum(m[1] for m in parts(i, j, c))
            limit = budget if budget is not None else self.cluster.memory_bytes
            if limit is not None and mem > limit:
                return math.inf
            return sum(m[0] for m in parts(i, j, c))
        dph = self.cluster.devices_per_host

        def placeable(n, first):  # inside one host, or whole hosts (sub_cluster_of)
            return (n <= dph and first // dph == (first + n - 1) // dph
                    or n % dph == 0 and first % dph == 0)
        found = stage_dp_counts(cost_table(num_layers, len(sizes), cost), sizes,
                                self.cluster.num_devices, k, counts=tuple(counts),
                                placeable=placeable)
        out = {}
        for count, (obj, stages) in found.items():
            if not stages:
                out[count] = None
                continue
            stage_of_layer = [s for s, (i, j, _) in enumerate(stages) for _ in range(i, j)]
            placement, first, mesh = [], 0, []
            for i, j, c in stages:
                _, phys = self.sub_cluster(first, sizes[c])
                placement.append(((first, sizes[c]), phys))
                mesh.append(parts(i, j, c)[0][2])
                first += sizes[c]
            out[count] = (stage_of_layer, placement, mesh, obj)
        return out

    def measure_spans(self, option: AutoStageOption, num_layers: int) -> dict:
        """(i, j, sub-mesh choice) -> (F + B seconds, peak bytes, logical mesh shape) of
        layers ``[i, j)`` planned as one stage on that sub-mesh (inf when it has no plan
        within the memory budget); planned once per pricer and option."""
        key = ("spans", repr(option), num_layers, self.cluster)
        if key in self.cache:
            return self.cache[key]
        shapes = submesh_shapes(option, self.cluster)
        individual = option.layer_profile_mode == "individual"
        spans = ([(i, i + 1) for i in range(num_layers)] if individual else
                 [(i, j) for i in range(num_layers) for j in range(i + 1, num_layers + 1)])
        budget = option.memory_budget_per_device
        option_c = {"memory_budget_per_device": budget} if budget is not None else {}
        measured: dict = {}
        for i, j in spans:
            part, s = self.cut.span(i, j, self.program.batch_invars,
                                    self.method.layer_option.remat)
            for c, shape in enumerate(shapes):
                sub = shape_cluster(self.cluster, shape)
                try:
                    sp = self.plan_span(part, s, (i, j), sub, option_c, num_layers)
                    measured[(i, j, c)] = (sum(v for kd, v in sp.times.items()
                                               if kd != "apply"), sp.peak_bytes, sp.mesh_shape)
                except ValueError as err:
                    if "memory" not in str(err):
                        raise
                    measured[(i, j, c)] = (math.inf, math.inf, None)
        self.cache[key] = measured
        return measured

    def plan_span(self, part, s, span, sub, overrides, num_layers) -> _StagePlans:
        """Layers ``span`` as stage ``s`` of ``part`` on ``sub`` (``plan_stage_on``), on the
        sub-mesh's logical mesh (``submesh_mesh``); on a mesh of its own where the span has
        no plan within the memory there."""
        with_apply = bool(part.apply)  # the forward's outputs include what apply reads
        mesh = self.submesh_mesh(sub, overrides, num_layers, with_apply)
        if mesh is not None and span[1] - span[0] == 1 and str(
                _traced(part, part.forward[s])[0]) == self._representative(
                    num_layers, with_apply)[1]:
            mesh = None  # the representative's own plan (searched), from the cache
        try:
            return self.plan_stage_on(part, s, sub, overrides, mesh)
        except ValueError as err:
            if mesh is None or "memory" not in str(err):
                raise
            return self.plan_stage_on(part, s, sub, overrides)

    def representative_layer(self, num_layers: int) -> int:
        """The first of the layers whose forward occurs most often in the step (identical
        jaxprs): its plan chooses each sub-mesh's logical mesh in the stage search."""
        key = ("representative layer", num_layers)
        if key in self.cache:
            return self.cache[key]
        count: dict = {}
        first: dict = {}
        for i in range(num_layers):
            part, s = self.cut.span(i, i + 1, self.program.batch_invars,
                                    self.method.layer_option.remat)
            kind = str(_traced(part, part.forward[s])[0])
            count[kind] = count.get(kind, 0) + 1
            first.setdefault(kind, i)
        self.cache[key] = found = first[max(count, key=lambda k: (count[k], -first[k]))]
        return found

    def _representative(self, num_layers: int, with_apply: bool):
        """((partition, stage) of the representative layer alone, its forward's jaxpr)."""
        key = ("representative", num_layers, with_apply)
        if key in self.cache:
            return self.cache[key]
        i = self.representative_layer(num_layers)
        part, s = self.cut.span(i, i + 1, self.program.batch_invars,
                                self.method.layer_option.remat)
        if not with_apply:
            part = dataclasses.replace(part, apply=[])
        self.cache[key] = found = ((part, s), str(_traced(part, part.forward[s])[0]))
        return found

    def submesh_mesh(self, sub: Cluster, overrides, num_layers: int,
                     with_apply: bool = True) -> tuple | None:
        """The logical mesh every span on sub-mesh ``sub`` is planned on in the stage search:
        the one the representative layer's forward chooses there (``plan_auto``'s mesh
        search, once per sub-mesh; None where that layer has no plan within the memory).

        A stage runs on one logical mesh, so its layers are priced on one; searching the
        meshes for every distinct layer and span was most of the search's time (39.1B on
        sub-meshes of 16, 32 and 64 hosts: 466 s). ``with_apply``: the layer's partition
        keeps its apply tasks (the forward then also outputs what they read)."""
        key = ("submesh mesh", num_layers, sub, repr(overrides), with_apply)

        def search():
            part, s = self._representative(num_layers, with_apply)[0]
            try:
                return tuple(self.plan_task(part, part.forward[s], sub, None,
                                            overrides).mesh_shape)
            except ValueError as err:
                if "memory" not in str(err):
                    raise
                return None
        return once(self.cache, key, search)

    def plan_stage_on(self, part, s, sub, overrides, shape=None) -> _StagePlans:
        """Times of stage ``s``'s F and B planned on ``sub`` (on the logical mesh ``shape``;
        None: the forward's plan chooses it), and the peak memory of every task of the stage,
        its apply (optimizer) tasks included (for the stage search)."""
        times, peak = {}, 0
        f = self.plan_task(part, part.forward[s], sub, shape, overrides)
        times["F"], peak = f.objective.total_s, f.objective.peak_bytes_per_device or 0
        names = tuple(f.axis_names)
        if part.has_backward:
            b = self.plan_task(part, part.backward[s], sub, f.mesh_shape, overrides,
                               axis_names=names)
            b, times["apply"] = _per_device_backward(
                part, part.backward[s], b, task_costs(f.mesh_shape, self.option(
                    f.mesh_shape, overrides), sub))
            times["B"] = b.objective.total_s
            peak = max(peak, b.objective.peak_bytes_per_device or 0)
        for t in part.apply:
            if t.stage == s:
                a = self.plan_task(part, t, sub, f.mesh_shape, overrides, axis_names=names,
                                   aliases=step_aliases(t, part.jaxpr, self.program.aliases))
                peak = max(peak, a.objective.peak_bytes_per_device or 0)
        return _StagePlans(times=times, plans=[], mesh_shape=f.mesh_shape, peak_bytes=peak,
                           residual_bytes=0, out_bytes={}, producer_kind={})


def _traced(part, task):
    """(closed jaxpr, inputs, outputs, accumulators, draws random) of ``task`` as it runs."""
    random = task.kind != "apply" and task.draws_random
    consts, invars, outvars, acc, abstract = task_signature(task, part, random)
    fn = task_fn(task.eqns, invars, outvars, acc, consts, random)
    return jax.make_jaxpr(fn)(*abstract), invars, outvars, acc, random


def _once_per_step(plan, axes, n: int, n_acc: int, costs) -> tuple[float, int]:
    """(seconds, bytes per device) of reducing a backward plan's accumulators (its inputs
    ``n .. n + n_acc``), kept partial over the batch ``axes``, once per step."""
    sizes = dict(zip(plan.axis_names, plan.mesh_shape, strict=True))
    shards = [(leaf.bytes_per_device({a: 1 if a in axes else m for a, m in sizes.items()}),
               axes) for leaf in plan.inputs[n:n + n_acc]]
    return reduce_seconds(costs, plan.axis_names, shards), sum(b for b, _ in shards)


def _per_device_backward(part, task, plan, costs) -> tuple[ShardingPlan, float]:
    """A candidate stage's backward ``plan`` as the runtime runs it when its plan takes the
    micro-batch rows over one set of axes (``tasks._decide``: per device over them, its
    gradients reduced once per step), and the seconds of that reduction; else ``plan`` and 0.

    The stage search plans a candidate stage alone, so the layouts its rows arrive in are not
    known: they are taken to arrive as the plan takes them (the runtime's test,
    ``row_axes == rows_taken``, then holds). Without this the search charged a data-parallel
    stage's gradient all-reduce once per micro-batch, where the pipeline reduces it once per
    step: at 512 micro-batches a 1T layer on 48 GPUs was rated 2.8x slower than as priced in
    full, and the stage counts ranked from that (issue 24)."""
    _, invars, outvars, acc, _ = task_signature(task, part, task.draws_random)
    rows = frozenset(v for v in invars if part.holds_rows(v))
    taken = rows_taken(invars, rows, plan.in_specs)
    if not acc or len(taken) != 1:
        return plan, 0.0
    axes = next(iter(taken))
    per = per_device_plan(task, plan, axes, costs, invars, outvars, acc, rows)
    return per, _once_per_step(plan, axes, len(invars), len(acc), costs)[0]


def _sends(part, stage_plans, placement, cluster: Cluster, split: bool) -> list[dict]:
    """Per stage and task kind: (seconds, bytes per device) of its outputs read elsewhere."""
    dph = cluster.devices_per_host
    hosts = [set(range(f // dph, (f + n - 1) // dph + 1)) for (f, n), _ in placement]
    kinds = ["F"] + (["Ba", "Bw"] if split else ["B"]) + ["apply"]
    out = [{kd: [0.0, 0] for kd in kinds} for _ in stage_plans]
    tasks = part.forward + ([t for pair in part.split_backward for t in pair] if split
                            else part.backward) + part.apply
    seen = set()
    for t in tasks:
        for v in t.invars:
            src = part.home.get(v)
            if src is None or src == t.stage or (v, t.stage) in seen:
                continue
            seen.add((v, t.stage))
            sp = stage_plans[src]
            kind = sp.producer_kind.get(v)
            if kind is None:  # not made by a task (a step input)
                continue
            nbytes = sp.out_bytes.get(v, 0)
            one_host = len(hosts[src] | hosts[t.stage]) == 1
            bw = cluster.intra_host_bandwidth if one_host else cluster.inter_host_bandwidth
            lat = cluster.intra_host_latency_s if one_host else cluster.inter_host_latency_s
            out[src][kind][0] += lat + nbytes / bw
            out[src][kind][1] += nbytes
    return [{kd: (v[0], v[1]) for kd, v in d.items()} for d in out]


def _describe(method) -> str:
    layer = method.layer_option
    layer = (f"AutoLayerOption(layer_num={layer.layer_num})" if isinstance(layer, AutoLayerOption)
             else "manual layers")
    return (f"PipeshardParallel({type(method.stage_option).__name__}, {layer}, "
            f"{method.pipeline_schedule}, num_micro_batches={method.num_micro_batches})")


__all__ = ["PipelineEstimate", "StageEstimate", "price_pipeline"]
