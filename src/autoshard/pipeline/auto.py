"""``AutoParallel``: the method that chooses tensor, pipeline and data parallelism itself.

Contract (as DESIGN.md states one for every method):

* **Input**: a traced step (``Program``) and either the devices at hand (``parallelize``) or
  a described ``Cluster`` (``autoshard.plan``). The candidates, all priced by the one cost
  model, on the cluster (on devices: ``Cluster.from_devices`` of them):

  - one stage: ``ShardParallel``'s plan on the whole mesh (its own mesh search: data,
    tensor and ZeRO-style splits, micro-batches as gradient accumulation);
  - ``s`` stages for every ``s`` from 2 to the layer count (``max_num_stages``): the stage
    dynamic program (``AutoStageOption``: layer ranges x sub-meshes, each range planned on
    each sub-mesh, its apply task included, ranges over the memory budget excluded) run for
    exactly ``s`` stages; the ``num_priced`` layouts of least DP objective are then priced
    in full as ``PipeshardParallel(stage_option=ManualStageOption(...))``: every task
    planned by ``tasks.plan_tasks`` (as the runtime plans it) and the schedule replayed.

* **Choice**: the candidate of least estimated step time whose memory per device fits the
  cluster; ties go to fewer stages.
* **Output**: ``autoshard.plan`` returns an ``AutoEstimate`` (``explain()``: every candidate
  with its estimated step time and memory, or why it was dropped, then the chosen plan's own
  explanation). ``parallelize`` runs the chosen method: ``ShardParallel(plan=...)`` with the
  priced plan, or ``PipeshardParallel`` with the priced stages, sub-meshes and logical
  shapes, so the compiled task plans are the priced ones.
* **Errors**: when no candidate fits, one ``ValueError`` names the smallest memory per device
  found (and by which candidate), the cluster's, the largest arrays, and which of more
  devices, more micro-batches, remat or a pipeline would fit (the planner's rule).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any

from .._program import with_micro_batches
from ..cluster import GIB, Cluster
from ..methods._auto import plan_program
from ..methods._base import ParallelMethod
from ..methods._mesh import resolve_devices
from ..methods._methods import ShardParallel
from ..sharding.highs import concurrently
from ..sharding.options import AutoShardingOption
from ..sharding.plan import ShardingPlan
from ..sharding.planner import Outpriced, mesh_candidates
from .build import cut_program
from .estimate import PipelineEstimate
from .layers import layer_option_of
from .method import PipeshardParallel
from .price import price_pipeline
from .schedules import SCHEDULES, traits
from .spans import SpanPricer
from .stages import AutoStageOption, ManualStageOption


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One split ``AutoParallel`` compared."""

    num_stages: int
    """Pipeline stages (1: ``ShardParallel`` on the whole mesh)."""
    num_micro_batches: int = 1
    """Micro-batches per step it was priced with."""
    step_s: float
    """Estimated seconds per step (inf when it has no plan within the memory)."""
    memory_bytes: int | None
    """Estimated peak bytes per device (None when not priced)."""
    search_s: float | None = None
    """The stage DP's objective (``sum + (micro-batches - 1) * max`` of stage F+B times)."""
    split: str = ""
    """The split in words: mesh shape, or per stage its layers and sub-mesh."""
    dropped: str = ""
    """Why it was not chosen when it could not be (no plan within the memory, not priced)."""
    estimate: Any = None
    """Its ``ShardingPlan`` or ``PipelineEstimate`` (None when not priced)."""
    method: Any = None
    """The method that runs it (``ShardParallel(plan=...)`` or ``PipeshardParallel``)."""

    @property
    def fits(self) -> bool:
        return not self.dropped and math.isfinite(self.step_s)

    def describe(self) -> str:
        what = ("1 stage: ShardParallel on the whole mesh" if self.num_stages == 1 else
                f"{self.num_stages} stages") + f", {self.num_micro_batches} micro-batches"
        found = (f"step {self.step_s:.4g} s, memory {self.memory_bytes / GIB:.3g} GiB per device"
                 if self.memory_bytes is not None and math.isfinite(self.step_s) else "")
        dp = f", stage DP objective {self.search_s:.4g} s" if self.search_s is not None else ""
        why = f"; dropped: {self.dropped}" if self.dropped else ""
        split = f" ({self.split})" if self.split else ""
        return f"{what}{split}: {found or 'not priced'}{dp}{why}"


@dataclass(frozen=True, kw_only=True)
class AutoEstimate:
    """What ``autoshard.plan`` returns for ``AutoParallel``: every candidate and the choice."""

    cluster: str
    """``Cluster.describe()`` of the cluster priced."""
    candidates: tuple[Candidate, ...]
    """Every split compared, by stage count."""
    chosen: Candidate
    """The fastest that fits."""
    planning_s: float = 0.0
    """Seconds the search took."""
    notes: tuple[str, ...] = ()
    """How much the search planned (spans and sub-meshes planned, pruned or skipped)."""

    @property
    def estimate(self) -> ShardingPlan | PipelineEstimate:
        """The chosen plan's own estimate."""
        return self.chosen.estimate

    @property
    def method(self) -> ParallelMethod:
        """The method that runs the chosen plan."""
        return self.chosen.method

    @property
    def num_stages(self) -> int:
        return self.chosen.num_stages

    @property
    def step_s(self) -> float:
        return self.chosen.step_s

    @property
    def peak_bytes_per_device(self) -> int:
        return self.chosen.memory_bytes

    def explain(self) -> str:
        c = self.chosen
        fitting = sorted((x for x in self.candidates if x.fits), key=lambda x: x.step_s)
        runner_up = next((x for x in fitting if x is not c), None)
        why = (f"the fastest of {len(fitting)} that fit memory" + (
            f", {runner_up.step_s / c.step_s:.3g}x faster than the next "
            f"({runner_up.num_stages} stage{'s' if runner_up.num_stages > 1 else ''})"
            if runner_up else ""))
        lines = [f"AutoParallel priced for {self.cluster} in {self.planning_s:.3g} s: "
                 f"{len(self.candidates)} candidates compared",
                 *[f"  {'*' if x is c else '-'} {x.describe()}" for x in self.candidates],
                 f"  chosen: {c.num_stages} stage{'s' if c.num_stages > 1 else ''}, {why}",
                 *[f"  note: {n}" for n in self.notes], ""]
        return "\n".join(lines) + self.estimate.explain()


@dataclass(frozen=True, eq=False)
class AutoParallel(ParallelMethod):
    """Chooses tensor, pipeline and data parallelism itself: ``ShardParallel`` on the whole
    mesh or a pipeline of 2 or more stages on sub-meshes, whichever is priced fastest within
    the memory (module doc: the contract)."""

    devices: Any = None
    """None (all devices), a list of devices, or a Mesh (its devices in order)."""
    num_micro_batches: int = 1
    """Micro-batches per step: streamed through a pipeline's stages, or accumulated by the
    whole-mesh plan."""
    micro_batch_counts: tuple[int, ...] | None = None
    """More micro-batch counts the pipeline candidates are searched with, beside
    ``num_micro_batches`` (each count a stage search of its own; each must divide the batch).
    The chosen candidate's count is the one the step runs with (``AutoEstimate.method``).
    More micro-batches shrink a pipeline's bubble (1F1B idles ``(stages - 1) / (micro-batches
    + stages - 1)`` of its time) and its live activations, at smaller products per
    micro-batch. The whole-mesh candidate accumulates ``num_micro_batches``. None:
    ``num_micro_batches`` only."""
    default_auto_sharding_option: Any = None
    """Planner options for the whole-mesh plan and every stage (an ``AutoShardingOption``)."""
    layer_option: Any = None
    """How the forward is cut into layers for the stages: ``"manual"`` (at
    ``mark_pipeline_boundary`` calls), ``ManualLayerOption`` or ``AutoLayerOption``; None:
    ``AutoLayerOption(layer_num=4)``."""
    pipeline_schedule: str = "1f1b"
    """Schedule of the pipeline candidates (not ``interleaved_1f1b``)."""
    stage_option: Any = None
    """The stage search's options (an ``AutoStageOption``: sub-mesh shapes, logical shapes,
    layer profile mode, memory budget); None: ``AutoStageOption(layer_profile_mode=
    "individual")`` (each layer planned once per sub-mesh, a span's time the sum of its
    layers', as Alpa composes them; the ``num_priced`` layouts are then priced as whole
    stages)."""
    max_num_stages: int | None = None
    """Most pipeline stages tried; None: one per layer."""
    num_priced: int = 3
    """Stage counts priced in full (those of least stage DP objective)."""
    whole_mesh_solver_budget_s: float | None = 600.0
    """Wall seconds the whole-mesh candidate's solves may take in all: each of its candidate
    meshes gets ``budget / (2 * meshes)`` as ``solver_time_limit_s`` (its LP bound and its
    ILP), unless ``default_auto_sharding_option`` sets ``solver_time_limit_s`` itself.
    Without it a 3-D mesh of a 48-layer step on 512 devices ran 600 s per mesh at a 98% gap
    (``benchmarks/results/cluster_auto.md``). A solve stopped by the clock warns (its plan
    can differ between runs). None: the option's limit per mesh."""
    plan: Any = None
    """A choice made earlier (``autoshard.plan(..., method=AutoParallel(...))``'s
    ``AutoEstimate``): run it on the devices without searching again."""

    def __post_init__(self):
        self._validate_common()
        if self.num_micro_batches is None:
            object.__setattr__(self, "num_micro_batches", 1)
        counts = self.micro_batch_counts
        if counts is not None:
            if not isinstance(counts, (tuple, list)) or not counts or any(
                    not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in counts):
                raise ValueError(
                    f"AutoParallel.micro_batch_counts ({counts!r}) must be a non-empty tuple "
                    "of positive ints (micro-batch counts that divide the batch), or None.")
            object.__setattr__(self, "micro_batch_counts", tuple(counts))
        if self.pipeline_schedule not in SCHEDULES or traits(self.pipeline_schedule).virtual:
            raise ValueError(
                f"AutoParallel.pipeline_schedule ({self.pipeline_schedule!r}) must be one of "
                f"{tuple(s for s in SCHEDULES if not traits(s).virtual)} (the stage search "
                "places one model stage per sub-mesh).")
        b = self.whole_mesh_solver_budget_s
        if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float))
                              or not 0 < b < math.inf):
            raise ValueError(f"AutoParallel.whole_mesh_solver_budget_s ({b!r}) must be positive "
                             "seconds, or None (each mesh the planner option's "
                             "solver_time_limit_s).")
        for name in ("max_num_stages", "num_priced"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"AutoParallel.{name} ({v!r}) must be a positive int.")
        if self.plan is not None and not isinstance(self.plan, AutoEstimate):
            raise TypeError(f"AutoParallel.plan ({type(self.plan).__name__}) must be the "
                            "AutoEstimate that autoshard.plan(..., method=AutoParallel()) "
                            "returns.")
        if self.plan is not None and (
                self.plan.method.micro_batches not in self.pipeline_micro_batches):
            raise ValueError(
                f"AutoParallel.plan was made with num_micro_batches="
                f"{self.plan.method.micro_batches} but this method has "
                f"{self.num_micro_batches} (micro_batch_counts={self.micro_batch_counts}). "
                "Pass the num_micro_batches and micro_batch_counts the plan was made with.")
        opt = self.default_auto_sharding_option
        if opt is not None and not isinstance(opt, AutoShardingOption):
            raise TypeError(f"default_auto_sharding_option ({opt!r}) must be an "
                            "autoshard.AutoShardingOption.")
        layer = layer_option_of(self.layer_option, default_layers=4)
        object.__setattr__(self, "layer_option", layer)
        stage = (AutoStageOption(layer_profile_mode="individual") if self.stage_option is None
                 else self.stage_option)
        if not isinstance(stage, AutoStageOption):
            raise TypeError(f"AutoParallel.stage_option ({stage!r}) must be an "
                            "autoshard.AutoStageOption (the stage search's options).")
        if stage.profile:
            raise ValueError("AutoParallel prices stages with the cost model: "
                             "AutoStageOption(profile=True) is not supported here. Pass "
                             "AutoStageOption(profile=False).")
        object.__setattr__(self, "stage_option", stage)

    @property
    def pipeline_micro_batches(self) -> tuple[int, ...]:
        """The micro-batch counts the pipeline candidates are searched with, fewest first."""
        return tuple(sorted({self.num_micro_batches, *(self.micro_batch_counts or ())}))

    def pipeline(self, stage_option) -> PipeshardParallel:
        """The pipeline method of this one's options with ``stage_option``."""
        return PipeshardParallel(
            devices=self.devices, num_micro_batches=self.num_micro_batches,
            default_auto_sharding_option=self.default_auto_sharding_option,
            pipeline_schedule=self.pipeline_schedule, layer_option=self.layer_option,
            stage_option=stage_option)

    # The two entry points ------------------------------------------------------------------------
    def plan_for(self, program, cluster: Cluster) -> AutoEstimate:
        if self.plan is not None:
            raise ValueError("autoshard.plan: the method already carries a choice "
                             "(AutoParallel(plan=...)); its estimate is plan.explain(). Pass "
                             "AutoParallel() to search again.")
        return choose(self, program, cluster)

    def compile_executable(self, program, call):
        devices = resolve_devices(self.devices)[0]
        if self.plan is not None:
            chosen = dataclasses.replace(self.plan.method, devices=self.devices)
        else:
            chosen = call.agree(program, lambda: choose(self, program, Cluster.from_devices(
                devices)).method)
        return chosen.compile_executable(_traced_for(self, program, chosen.micro_batches), call)


def _traced_for(method: AutoParallel, program, k: int):
    """``program`` traced for ``k`` micro-batches (one of ``method``'s counts)."""
    return with_micro_batches(
        program, k, f"(AutoParallel's micro-batch counts {method.pipeline_micro_batches}). "
        "Choose counts that divide {size}.")


def choose(method: AutoParallel, program, cluster: Cluster) -> AutoEstimate:
    """Every candidate of ``method`` priced on ``cluster``; the fastest that fits (module
    doc)."""
    t0 = time.perf_counter()
    notes: list[str] = []
    programs = {k: _traced_for(method, program, k) for k in method.pipeline_micro_batches}
    pipelines = []
    for k, traced in programs.items():
        each = dataclasses.replace(method, num_micro_batches=k, micro_batch_counts=None)
        found = _pipelines(each, traced, cluster, notes if len(programs) == 1 else None)
        pipelines += found
        if len(programs) > 1 and notes is not None:
            priced = [c for c in found if c.fits]
            best = min(priced, key=lambda c: c.step_s, default=None)
            notes.append(f"{k} micro-batches: {len(found)} stage counts searched" + (
                f", the fastest {best.num_stages} stages, {best.step_s:.4g} s" if best else
                ", none priced within the memory"))
    fastest = min((c.step_s for c in pipelines if c.fits), default=None)
    candidates = [_whole_mesh(method, program, cluster, notes, cutoff_s=fastest), *pipelines]
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        raise _no_fit(method, program, cluster, candidates)
    chosen = min(fitting, key=lambda c: (c.step_s, c.num_stages, c.num_micro_batches))
    return AutoEstimate(cluster=cluster.describe(), candidates=tuple(candidates),
                        chosen=chosen, planning_s=time.perf_counter() - t0,
                        notes=tuple(notes))


WHOLE_MESH_MIP_GAP = 1e-3
"""The whole-mesh candidate's ILP stops within 0.1% of its mesh's best plan: candidates are
compared by estimated step times the cost model does not resolve to 0.1%, and on a 48-layer
step the default gap (1e-4) took the (32, 16) mesh's branch and bound 71 s where 1e-2 took 11 s
to the same plan."""


def whole_mesh_option(option: AutoShardingOption | None, cluster: Cluster,
                      budget_s: float | None = None) -> AutoShardingOption:
    """The planner options of the whole-mesh candidate.

    * ``memory_tradeoff`` 0 where ``option`` leaves it None: candidates are compared by step
      time within the memory, and a pipeline's task plans are the fastest within it (their
      default is 0), so the whole-mesh plan is too; this also skips the least-memory
      re-solve and its trade-off table (``sharding/least_memory.py``, ``pareto.py``), about
      half of that plan's time on a small model;
    * ``solver_time_limit_s``: ``budget_s`` shared by the candidate meshes (the planner's
      ``mesh_candidates`` on ``cluster``), an LP bound and an ILP each, where ``option``
      leaves the limit at its default;
    * ``solver_mip_gap`` ``WHOLE_MESH_MIP_GAP`` where ``option`` leaves it at its default.
    """
    option = option if option is not None else AutoShardingOption()
    if option.memory_tradeoff is None:
        option = dataclasses.replace(option, memory_tradeoff=0.0)
    fields = AutoShardingOption.__dataclass_fields__
    if option.solver_mip_gap == fields["solver_mip_gap"].default:
        option = dataclasses.replace(option, solver_mip_gap=WHOLE_MESH_MIP_GAP)
    default = fields["solver_time_limit_s"].default
    if budget_s is not None and option.solver_time_limit_s == default:
        meshes = mesh_candidates(cluster.num_devices, option, None, cluster.devices_per_host)
        share = budget_s / (2 * len(meshes))
        option = dataclasses.replace(option, solver_time_limit_s=min(default, share))
    return option


def _whole_mesh(method: AutoParallel, program, cluster: Cluster,
                notes: list | None = None, cutoff_s: float | None = None) -> Candidate:
    """The one-stage candidate: ``ShardParallel``'s plan on the whole mesh. ``cutoff_s``
    (the fastest pipeline's step time): meshes whose bounds show no plan of theirs can beat
    it are not solved (``plan_auto``'s cutoff; exact), and the candidate is dropped when none
    can."""
    option = whole_mesh_option(method.default_auto_sharding_option, cluster,
                               method.whole_mesh_solver_budget_s)
    if notes is not None:
        notes.append(f"whole-mesh candidate: each mesh's solves stopped after "
                     f"{option.solver_time_limit_s:.3g} s or {option.solver_node_limit:,} "
                     "branch-and-bound nodes (whole_mesh_solver_budget_s, solver_node_limit)")
    shard = ShardParallel(devices=method.devices, num_micro_batches=method.num_micro_batches,
                          auto_sharding_option=option)
    try:
        plan = plan_program(shard, program, cluster, cutoff_s=cutoff_s)
    except Outpriced as err:
        return Candidate(num_stages=1, num_micro_batches=method.num_micro_batches,
                         step_s=math.inf, memory_bytes=None,
                         dropped=f"no plan on the whole mesh can beat the fastest pipeline's "
                                 f"{cutoff_s:.4g} s (the planner's bounds on "
                                 f"{len(err.reasons)} mesh(es))")
    except (ValueError, RuntimeError) as err:
        if "memory" not in str(err):
            raise
        return Candidate(num_stages=1, num_micro_batches=method.num_micro_batches,
                         step_s=math.inf, memory_bytes=None,
                         dropped=_first_sentence(err))
    o = plan.objective
    peak, limit = o.peak_bytes_per_device, cluster.memory_bytes
    # The planner keeps its ILP's memory rows within the budget, but its estimate of the
    # whole step (the micro-batch loop's variants, a solve stopped by the clock) can exceed
    # it: such a plan is no candidate (a pipeline over the memory is dropped the same way).
    over = (f"its estimated memory, {peak / GIB:.3g} GiB per device, is over the cluster's "
            f"{limit / GIB:.3g} GiB" if limit is not None and peak is not None and peak > limit
            else "")
    return Candidate(num_stages=1, num_micro_batches=method.num_micro_batches,
                     step_s=o.total_s, memory_bytes=peak,
                     split=f"mesh {'x'.join(map(str, plan.mesh_shape))}", estimate=plan,
                     method=dataclasses.replace(shard, plan=plan), dropped=over)


def _pipelines(method: AutoParallel, program, cluster: Cluster,
               notes: list | None = None) -> list[Candidate]:
    option = method.stage_option
    search = method.pipeline(option)
    cut = cut_program(program, search)
    top = min(cut.num_layers, method.max_num_stages or cut.num_layers)
    if top < 2:
        return []
    pricer = SpanPricer(search, program, cut, cluster)
    k = program.num_micro_batches
    layouts, out = {}, {}
    every = pricer.stage_layouts(option, cut.num_layers, k, range(2, top + 1))
    for s in range(2, top + 1):
        found = every[s]
        if found is None:
            out[s] = Candidate(num_stages=s, num_micro_batches=k, step_s=math.inf, memory_bytes=None,
                               dropped="no layout: every cut into this many stages has a "
                                       "stage without a plan within the memory, or the "
                                       "sub-mesh sizes cannot cover the devices")
        else:
            layouts[s] = found
    ranked = sorted(layouts, key=lambda s: (layouts[s][3], s))
    runners, splits = {}, {}
    for rank, s in enumerate(ranked):
        stage_of_layer, placement, mesh, obj = layouts[s]
        manual = ManualStageOption(
            forward_stage_layer_ids=[[i for i, x in enumerate(stage_of_layer) if x == t]
                                     for t in range(s)],
            submesh_physical_shapes=[phys for _, phys in placement],
            submesh_logical_shapes=[tuple(m) for m in mesh],
            submesh_autosharding_option_dicts=[{} for _ in range(s)])
        splits[s] = "; ".join(
            f"layers {_span(stage_of_layer, t)} on {phys[0]}x{phys[1]} as "
            f"{'x'.join(map(str, m))}" for t, ((_, phys), m) in enumerate(zip(
                placement, mesh, strict=True)))
        if rank >= method.num_priced:
            out[s] = Candidate(num_stages=s, num_micro_batches=k, step_s=math.inf, memory_bytes=None,
                               search_s=obj, split=splits[s],
                               dropped=f"not priced in full (num_priced={method.num_priced}: "
                                       "the stage counts of least DP objective are)")
        else:
            runners[s] = method.pipeline(manual)

    def price(s):
        try:
            return price_pipeline(runners[s], program, cluster, cache=pricer.cache)
        except ValueError as err:
            if "memory" not in str(err):
                raise
            return err
    # the candidates priced side by side (most of their time is HiGHS's, which releases the
    # GIL; they share the task-plan cache); idle-stage warnings: the chosen one's come at run
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        priced = concurrently([functools.partial(price, s) for s in runners])
    for s, est in zip(runners, priced, strict=True):
        obj = layouts[s][3]
        if isinstance(est, ValueError):
            out[s] = Candidate(num_stages=s, num_micro_batches=k, step_s=math.inf, memory_bytes=None,
                               search_s=obj, split=splits[s], dropped=_first_sentence(est))
        else:
            out[s] = Candidate(num_stages=s, num_micro_batches=k, step_s=est.step_s,
                               memory_bytes=est.peak_bytes_per_device, search_s=obj,
                               split=splits[s], estimate=est, method=runners[s])
    if notes is not None:
        st = pricer.span_stats
        notes.append(
            f"stage search ({option.layer_profile_mode}): spans planned: {st['planned']} of "
            f"{st['planned'] + st['pruned']} (layer span, sub-mesh) pairs, the others never a "
            "stage of 2 or more (identical spans planned once); spans' apply tasks planned: "
            f"{st['apply_planned']} of {st['apply_planned'] + st['apply_skipped']} (the others "
            "within the memory limit whatever their plan)")
    return [out[s] for s in sorted(out)]


def _span(stage_of_layer, t) -> str:
    ids = [i for i, x in enumerate(stage_of_layer) if x == t]
    return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0])


def _first_sentence(err: Exception) -> str:
    text = str(err)
    return text if len(text) < 300 else text[:297] + "..."


def _no_fit(method: AutoParallel, program, cluster: Cluster, candidates) -> ValueError:
    """One error for a cluster too small: each candidate's memory planned without the limit,
    the smallest of them, and what would fit (the planner's rule on the whole mesh)."""
    from ..grad_accum import loop_costs
    from ..sharding.graph import build_graph
    from ..sharding.no_plan import largest_inputs, what_would_fit

    free = dataclasses.replace(cluster, memory_bytes=None)
    again = _unlimited(method, program, free, [c.num_stages for c in candidates])
    found = []
    for c in again:
        if c.memory_bytes is not None:
            found.append((c.memory_bytes, c.num_stages, c.split))
    graph = build_graph(program.closed, list(program.in_paths), list(program.out_paths),
                        loop_costs(program.closed, program.batch_invars,
                                   program.num_micro_batches))
    budget = cluster.memory_bytes
    tried = ", ".join(f"{s} stage{'s' if s > 1 else ''}" for s in sorted(
        {c.num_stages for c in candidates}))
    if not found:
        return ValueError(
            f"AutoParallel found no plan within the memory of {cluster.describe()} "
            f"({budget:,} B per device) for any candidate ({tried}), nor without the limit. "
            f"The largest arrays: {largest_inputs(graph)}. Use more devices, more "
            "num_micro_batches, or remat.")
    smallest, stages, split = min(found)
    whole = next((m for m, s, _ in found if s == 1), None)
    mesh = again[0].estimate.mesh_shape if again[0].estimate is not None else (
        cluster.num_devices,)
    advice = what_would_fit(graph, mesh, whole or smallest, budget)
    each = "; ".join(f"{s} stage{'s' if s > 1 else ''}: {m:,} B" for m, s, _ in sorted(
        found, key=lambda x: x[1]))
    return ValueError(
        f"AutoParallel found no plan within the memory of {cluster.describe()} ({budget:,} B "
        f"per device): the smallest estimate found is {smallest:,} B per device "
        f"({stages} stage{'s' if stages > 1 else ''}{f', {split}' if split else ''}; planned "
        f"without the limit; each candidate: {each}). Within the limit: "
        f"{_why_dropped(candidates)}. The largest arrays: {largest_inputs(graph)}. " + advice)


def _why_dropped(candidates) -> str:
    """Why the candidates were dropped, candidates with one reason named together."""
    several = len({c.num_micro_batches for c in candidates}) > 1
    by_reason: dict = {}
    for c in candidates:
        name = f"{c.num_stages}" + (f" x {c.num_micro_batches} micro-batches" if several
                                    else "")
        by_reason.setdefault(c.dropped or "over the memory", []).append(name)
    return "; ".join(f"{', '.join(names)} stage(s): {why}" for why, names in by_reason.items())


def _unlimited(method, program, free: Cluster, stage_counts) -> list[Candidate]:
    """The candidates again on ``free`` (the cluster without its memory limit), for their
    memory only."""
    whole = _whole_mesh(method, program, free)
    quick = dataclasses.replace(method, num_priced=len(stage_counts))
    return [whole] + _pipelines(quick, program, free)


__all__ = ["AutoEstimate", "AutoParallel", "Candidate"]
