"""From a traced Program to a pipeline plan: layers, stages, sub-meshes and tasks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..after_grad import AfterGrad, row_dims, whole_batch_update
from ..ir._compat import Var
from ..ir._markers import pipeline_p
from ..methods._mesh import resolve_devices
from ..sharding.cost import FLOP_COST_S
from . import balance
from .compile import stage_auto_option
from .layers import AutoLayerOption, auto_layers, check_no_nested_markers, manual_layers
from .partition import (
    Partition,
    boundary_positions,
    build_partition,
    forward_end,
    is_loss_marker,
    needs_whole_batch,
    split_pre_post,
)
from .profile import StageProfiler, cache_file_of
from .schedules import traits
from .stages import (
    AutoStageOption,
    ManualStageOption,
    UniformStageOption,
    cut_seconds,
    logical_choices,
    stage_dp,
    submesh_choices,
)


@dataclass(frozen=True, kw_only=True)
class Crossing:
    """The values crossing the cut between two consecutive stages, as the plan prices them."""

    src_stage: int
    """The stage before the cut."""
    dst_stage: int
    """The stage after it."""
    num_bytes: int
    """Bytes per micro-batch of the forward values crossing (their cotangents cross back)."""
    src_devices: int
    """Devices of the sending sub-mesh."""
    dst_devices: int
    """Devices of the receiving sub-mesh."""
    seconds: float
    """Estimated time per micro-batch, both ways (``stages.cut_seconds``)."""

    @property
    def resharded(self) -> bool:
        """Sub-meshes of other device counts: gathered on the source, then copied whole."""
        return self.src_devices != self.dst_devices


@dataclass(frozen=True, kw_only=True)
class PipelinePlan:
    """Where every part of the step runs: layers per stage, sub-meshes, schedule."""

    num_layers: int
    """Layers the forward was cut into."""
    stage_layer_ids: tuple[tuple[int, ...], ...]
    """Per stage, the layers it holds."""
    submesh_shapes: tuple[tuple[int, ...], ...]
    """Per stage, the logical shape of its sub-mesh."""
    stage_devices: tuple[tuple[int, ...], ...]
    """Per stage, the ids of its devices."""
    schedule: str
    """Schedule name."""
    num_micro_batches: int
    """Micro-batches per step."""
    method: str = "PipeshardParallel"
    """The method that produced the plan."""
    notes: tuple[str, ...] = ()
    """Free-form remarks, as on a ShardingPlan."""
    submesh_axis_names: tuple[tuple[str, ...], ...] | None = None
    """Per stage, the axis names of its sub-mesh (a ``ManualShardingOption``'s; None: ``x``
    or ``x0, x1, ...``)."""
    crossings: tuple[Crossing, ...] = ()
    """Per cut between consecutive stages, the values crossing it and their estimated cost."""
    stage_flops: tuple[float, ...] = ()
    """Per stage, the FLOPs of its forward and backward tasks for one micro-batch
    (``balance.stage_flops``)."""

    @property
    def transfer_s(self) -> float:
        """Estimated seconds per step of the copies between stages (every micro-batch)."""
        return self.num_micro_batches * sum(c.seconds for c in self.crossings)
    objective: None = None
    """No ILP objective for the pipeline as a whole (readers of ShardingPlan check it)."""

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """(stages, devices of the largest sub-mesh): the pipeline's shape at a glance."""
        return (len(self.stage_devices), max(len(d) for d in self.stage_devices))

    def explain(self) -> str:
        lines = [f"{self.method}: {len(self.stage_layer_ids)} stages, {self.num_layers} layers, "
                 f"schedule {self.schedule}, {self.num_micro_batches} micro-batches"]
        for s, (ids, shape, devs) in enumerate(zip(self.stage_layer_ids, self.submesh_shapes,
                                                   self.stage_devices, strict=True)):
            names = "" if self.submesh_axis_names is None else (
                f" axes {self.submesh_axis_names[s]}")
            lines.append(f"  stage {s}: layers {list(ids)} on sub-mesh {shape}{names} devices "
                         f"{list(devs)}")
        for c in self.crossings:
            how = ("gathered on the source and copied whole to every device (different "
                   "device counts)" if c.resharded else "shard for shard")
            lines.append(f"  cut stage {c.src_stage} -> {c.dst_stage}: {c.num_bytes:,} B per "
                         f"micro-batch, {c.src_devices} -> {c.dst_devices} devices, {how}: "
                         f"est. {c.seconds * 1e6:.1f} us per micro-batch")
        if self.stage_flops:
            lines.append(f"  {balance.describe(self.stage_flops)}")
        if self.crossings:
            lines.append(f"  copies between stages: est. {self.transfer_s * 1e3:.4f} ms per step")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def inline_identity_markers(closed):
    """The step with parameter/layer markers removed (their outputs renamed to their inputs);
    the ``loss`` markers of ``autoshard.grad`` stay: they split forward from backward."""
    jaxpr = closed.jaxpr
    rename: dict = {}
    eqns = []
    for e in jaxpr.eqns:
        invars = [rename.get(v, v) if isinstance(v, Var) else v for v in e.invars]
        if (e.primitive is pipeline_p and not is_loss_marker(e) and e.params["mark_type"] in (
                "params", "start", "end", "jvp_start", "jvp_end", "hook")):
            rename.update(zip(e.outvars, invars, strict=True))
            continue
        eqns.append(e.replace(invars=invars) if invars != list(e.invars) else e)
    outvars = [rename.get(v, v) if isinstance(v, Var) else v for v in jaxpr.outvars]
    return closed.replace(jaxpr=jaxpr.replace(eqns=eqns, outvars=outvars))


def choose_layers(pre, fwd_end: int, layer_option) -> tuple[dict, int]:
    if isinstance(layer_option, AutoLayerOption):
        return auto_layers(pre, fwd_end, layer_option.layer_num, layer_option.eps)
    return manual_layers(pre, fwd_end)


def choose_stages(stage_option, num_layers: int, num_devices: int, k: int, layer_cost=None,
                  cut_cost=None):
    """(stage of each layer, devices per stage, logical shape per stage, option dict per stage).

    ``cut_cost(j, n, m)``: seconds per micro-batch of the values crossing the cut before layer
    ``j`` from a sub-mesh of ``n`` devices to one of ``m`` (``AutoStageOption`` adds it to the
    time of the stage before the cut)."""
    if isinstance(stage_option, ManualStageOption):
        stage_of_layer, sizes, logical = manual_stages(stage_option, num_layers)
        dicts = [dict(d or {}) for d in stage_option.submesh_autosharding_option_dicts]
        check_cover(sizes, num_devices, "ManualStageOption.submesh_physical_shapes")
        return stage_of_layer, sizes, logical, dicts
    if isinstance(stage_option, AutoStageOption):
        return _auto_stages(stage_option, num_layers, num_devices, k, layer_cost, cut_cost)
    opt = stage_option or UniformStageOption()
    n = opt.num_stages or num_layers
    if num_layers < n:
        raise ValueError(
            f"The step has {num_layers} layer(s) but UniformStageOption(num_stages={n}) asks "
            f"for {n} stages; a stage needs at least one layer. Add "
            "autoshard.mark_pipeline_boundary() calls, use layer_option=AutoLayerOption("
            f"layer_num={n}), or fewer stages.")
    if num_devices % n:
        raise ValueError(
            f"{num_devices} devices cannot be split evenly into {n} stages "
            "(UniformStageOption). Choose a num_stages that divides the device count, or "
            "pass devices=.")
    per = num_devices // n
    if opt.submesh_physical_shape is not None:
        per = math.prod(opt.submesh_physical_shape)
        check_cover([per] * n, num_devices, "UniformStageOption.submesh_physical_shape")
    logical = tuple(opt.submesh_logical_shape or (per,))
    if math.prod(logical) != per:
        raise ValueError(f"UniformStageOption.submesh_logical_shape {logical} has "
                         f"{math.prod(logical)} devices but each sub-mesh has {per}.")
    stage_of_layer = [layer * n // num_layers for layer in range(num_layers)]
    dicts = [dict(opt.submesh_autosharding_option or {}) for _ in range(n)]
    return stage_of_layer, [per] * n, [logical] * n, dicts


def manual_stages(option: ManualStageOption, num_layers: int):
    """(stage of each layer, devices per stage, logical shape per stage) of a manual option."""
    ids = [list(x) for x in option.forward_stage_layer_ids]
    if sum(len(x) for x in ids) != num_layers:
        raise ValueError(
            f"ManualStageOption.forward_stage_layer_ids covers {sum(len(x) for x in ids)} "
            f"layers but the step has {num_layers}. List every layer id in "
            f"range({num_layers}) once.")
    sizes = [math.prod(s) for s in option.submesh_physical_shapes]
    logical = [tuple(s) for s in option.submesh_logical_shapes]
    return [s for s, x in enumerate(ids) for _ in x], sizes, logical


@dataclass(frozen=True, eq=False)
class Cut:
    """The step as the pipeline cuts it (``cut_program``)."""

    closed: Any
    """ClosedJaxpr with identity markers inlined (and the update on the whole batch when it
    reads the batch: ``after``)."""
    pre: list
    """Equations before the gradient marker."""
    marker: Any
    """The gradient marker (None without one)."""
    post: list
    """Equations after it."""
    inference: bool
    """The inference schedule: everything is forward."""
    fwd_end: int
    """Index in ``pre`` where the forward ends."""
    layer_of: dict
    """Layer of every forward equation (index in ``pre``)."""
    num_layers: int
    """Layers of the forward."""
    after: AfterGrad | None = None
    """The whole-batch update and the values the runtime provides it (None: the update reads
    no batch)."""
    row_dims: dict | None = None
    """The dim holding the rows of each value (``after_grad.row_dims``), where a dim of
    another size equals the micro-batch's rows; None: dim 0 holds them wherever it has their
    size."""
    spans: dict = field(default_factory=dict, repr=False)
    """``span``'s partitions, made once each (the stage search asks for a layer's several
    times: its measurement, the representative layer's choice)."""

    def span(self, i: int, j: int, batch_invars, remat: bool) -> tuple[Partition, int]:
        """The partition with layers ``[i, j)`` as one stage (the layers before and after
        it one stage each), and that stage's index: a candidate of the stage search."""
        key = (i, j, tuple(batch_invars), remat)
        if key not in self.spans:
            self.spans[key] = self._span(i, j, batch_invars, remat)
        return self.spans[key]

    def _span(self, i: int, j: int, batch_invars, remat: bool) -> tuple[Partition, int]:
        stage_of_layer = [0] * i + [1] * (j - i) + [2] * (self.num_layers - j)
        ids = {s: k for k, s in enumerate(dict.fromkeys(stage_of_layer))}
        part = build_partition(self.closed, layer_of_fwd=self.layer_of, fwd_end=self.fwd_end,
                               stage_of_layer=[ids[s] for s in stage_of_layer],
                               batch_invars=batch_invars, remat=remat, after=self.after,
                               row_dims=self.row_dims)
        return part, ids[1]


def cut_program(program, method) -> Cut:
    """The step as the pipeline cuts it: identity markers inlined, the update after the
    gradient marker on the whole batch when it reads the batch or per-row aux values
    (``after_grad``), the forward cut into layers."""
    closed = inline_identity_markers(program.closed)
    check_no_nested_markers(closed.jaxpr)
    after = None
    if needs_whole_batch(closed, program.batch_invars):
        k = program.num_micro_batches
        whole = closed if k == 1 else inline_identity_markers(program.whole_batch_closed())
        after = whole_batch_update(closed, whole, program.batch_invars, k)
        closed = after.closed
    pre, marker, post = split_pre_post(closed.jaxpr)
    inference = not traits(method.pipeline_schedule).trains
    fwd_end = forward_end(pre, inference)
    layer_of, num_layers = choose_layers(pre, fwd_end, method.layer_option)
    return Cut(closed=closed, pre=pre, marker=marker, post=post, inference=inference,
               fwd_end=fwd_end, layer_of=layer_of, num_layers=num_layers, after=after,
               row_dims=_row_dims(program, pre))


def _row_dims(program, pre) -> dict | None:
    """Which dim of each value holds the micro-batch's rows, from the step traced on more
    rows, when the size of the rows is also the size of another dim (the batch's sequence
    length, a parameter's width, a value's other dim): there the size alone does not say
    (a time-major scan's [steps, rows, ...] residuals would be split over their steps)."""
    traced = program.closed.jaxpr.invars   # on one micro-batch (in_avals: the whole batch)
    rows = next((v.aval.shape[0] for v, b in zip(traced, program.batch_invars, strict=True)
                 if b and v.aval.shape), None)
    if rows is None:
        return None
    sizes = {n for v, b in zip(traced, program.batch_invars, strict=True)
             for n in (tuple(v.aval.shape)[1:] if b else tuple(v.aval.shape))}
    sizes |= {n for e in pre for o in e.outvars
              for n in tuple(getattr(o.aval, "shape", ()))[1:]}
    if rows not in sizes:
        return None
    scaled = program.scaled_batch_closed()   # None: the size alone, as without this check
    return None if scaled is None else row_dims(program.closed, *scaled)


def check_cover(sizes, num_devices: int, what: str):
    if sum(sizes) != num_devices:
        raise ValueError(
            f"{what} uses {sum(sizes)} devices in all but the method has {num_devices}: the "
            "sub-meshes must cover the devices exactly, without overlap. Choose shapes whose "
            f"device counts add up to {num_devices}, or pass devices= with that many devices.")


def _auto_stages(option: AutoStageOption, num_layers, num_devices, k, layer_cost,
                 cut_cost=None):
    shapes = submesh_choices(option, num_devices)
    sizes = [math.prod(s) for s in shapes]
    budget = option.memory_budget_per_device
    if callable(layer_cost):  # a profiler: measured seconds and bytes per device
        spans = ([(i, i + 1) for i in range(num_layers)]
                 if option.layer_profile_mode == "individual" else
                 [(i, j) for i in range(num_layers) for j in range(i + 1, num_layers + 1)])
        measured = layer_cost([(i, j, n) for i, j in spans for n in sorted(set(sizes))])

        def cost(i, j, c):
            n = sizes[c]
            parts = ([measured[(x, x + 1, n)] for x in range(i, j)]
                     if option.layer_profile_mode == "individual" else [measured[(i, j, n)]])
            if budget is not None and sum(b for _, b in parts) > budget:
                return math.inf
            return sum(t for t, _ in parts)
    else:
        flops, mem = layer_cost

        def cost(i, j, c):
            n = sizes[c]
            if budget is not None and sum(mem[i:j]) / n > budget:
                return math.inf
            return (sum(flops[i:j]) / n * (1 + 0.05 * (n - 1)) + 1.0) * FLOP_COST_S

    def boundary(j, a, b):  # the values crossing the cut, priced as the runtime moves them
        return cut_cost(j, sizes[a], sizes[b])
    obj, stages = stage_dp(num_layers, num_devices, sizes, cost, k,
                           None if cut_cost is None else boundary)
    if not stages:
        raise ValueError(
            f"AutoStageOption found no stage layout: every candidate stage needs more than "
            f"memory_budget_per_device ({option.memory_budget_per_device} bytes) on "
            f"sub-meshes of {sizes} devices. Raise the budget, use more devices, or "
            "enable remat (layer_option remat).")
    stage_of_layer = [s for s, (i, j, _) in enumerate(stages) for _ in range(i, j)]
    per = [sizes[c] for _, _, c in stages]
    return stage_of_layer, per, [auto_logical_shape(option, n) for n in per], [{} for _ in per]


def auto_logical_shape(option: AutoStageOption, n: int) -> tuple[int, ...]:
    """The logical shape AutoStageOption gives a sub-mesh of ``n`` devices (1-D if one axis
    would have one device)."""
    shape = logical_choices(option, n)[0]
    return (n,) if shape[0] in (1, n) else tuple(shape)


def plan_partition(program, method, devices) -> tuple[Partition, PipelinePlan, list, list]:
    cut = cut_program(program, method)
    closed, pre, fwd_end, layer_of, num_layers = (cut.closed, cut.pre, cut.fwd_end,
                                                  cut.layer_of, cut.num_layers)
    if not isinstance(method.layer_option, AutoLayerOption) and not boundary_positions(
            pre[:fwd_end]) and _num_requested_stages(method.stage_option) > 1:
        raise ValueError(
            "layer_option='manual' found no autoshard.mark_pipeline_boundary() call in the "
            "forward, so there is one layer and not enough for "
            f"{_num_requested_stages(method.stage_option)} stages. Add boundary markers "
            "between layers at the top level of the step (a marker inside a lax.scan or "
            "fori_loop body is dropped when JAX differentiates the loop), or use "
            "layer_option=AutoLayerOption(layer_num=...).")
    layer_cost = _layer_costs(pre, layer_of, num_layers)
    cut_bytes = _cut_bytes(pre, fwd_end, layer_of, num_layers)
    backward = fwd_end < len(pre)

    def cut_cost(j, n, m):
        return cut_seconds_both(cut_bytes[j], n, m, backward)
    if isinstance(method.stage_option, AutoStageOption) and method.stage_option.profile:
        option = method.stage_option
        layer_cost = StageProfiler(
            lambda i, j: cut.span(i, j, program.batch_invars, method.layer_option.remat),
            program, devices, cache_file=cache_file_of(option),
            logical_shape=lambda n: auto_logical_shape(option, n),
            option_of=lambda mesh: stage_auto_option(method.default_auto_sharding_option,
                                                     mesh, {})).measure_all
    virtual = virtual_of(method)
    stage_of_layer, sizes, logical, dicts = choose_stages(
        method.stage_option, num_layers, len(devices) * virtual, program.num_micro_batches,
        layer_cost, cut_cost)
    num_stages = len(sizes)
    num_ranks = ranks_of(num_stages, virtual)  # interleaved: stage s on sub-mesh s % num_ranks
    sizes, logical, dicts = sizes[:num_ranks], logical[:num_ranks], dicts[:num_ranks]
    part = build_partition(closed, layer_of_fwd=layer_of, fwd_end=fwd_end,
                           stage_of_layer=stage_of_layer, batch_invars=program.batch_invars,
                           remat=method.layer_option.remat, after=cut.after,
                           row_dims=cut.row_dims)
    ids, start, rank_devs = [], 0, []
    for r in range(num_ranks):
        rank_devs.append(tuple(d.id for d in devices[start:start + sizes[r]]))
        start += sizes[r]
    devs = [rank_devs[s % num_ranks] for s in range(num_stages)]
    logical = [logical[s % num_ranks] for s in range(num_stages)]
    for s in range(num_stages):
        ids.append(tuple(layer for layer, x in enumerate(stage_of_layer) if x == s))
    crossings = []
    for s in range(num_stages - 1):
        if not ids[s + 1]:
            continue
        a, b = len(devs[s]), len(devs[s + 1])
        j = min(ids[s + 1])
        crossings.append(Crossing(src_stage=s, dst_stage=s + 1, num_bytes=int(cut_bytes[j]),
                                  src_devices=a, dst_devices=b, seconds=cut_cost(j, a, b)))
    flops = balance.stage_flops(part)
    balance.warn_idle_stages(flops, method.layer_option, ids)
    plan = PipelinePlan(num_layers=num_layers, stage_layer_ids=tuple(ids),
                        submesh_shapes=tuple(tuple(x) for x in logical),
                        stage_devices=tuple(devs), crossings=tuple(crossings),
                        stage_flops=flops,
                        schedule=method.pipeline_schedule if part.has_backward else "inference",
                        num_micro_batches=program.num_micro_batches)
    return part, plan, sizes, dicts


def ranks_of(num_stages: int, virtual: int) -> int:
    """Sub-meshes of ``num_stages`` model stages, ``virtual`` on each (interleaved_1f1b)."""
    if num_stages % virtual:
        raise ValueError(
            f"interleaved_1f1b with virtual_stages={virtual} needs a stage count divisible by "
            f"{virtual}, but there are {num_stages} stages. Choose UniformStageOption("
            f"num_stages=...) as a multiple of {virtual}.")
    return num_stages // virtual


def virtual_of(method) -> int:
    """Model stages per sub-mesh: ``virtual_stages`` for interleaved_1f1b, else 1."""
    if not traits(method.pipeline_schedule).virtual:
        return 1
    if not isinstance(method.stage_option, UniformStageOption):
        raise ValueError(
            "pipeline_schedule='interleaved_1f1b' places model stage s on sub-mesh "
            "s % num_sub_meshes and supports UniformStageOption(num_stages=...) only; got "
            f"{type(method.stage_option).__name__}.")
    return method.virtual_stages


def _num_requested_stages(option) -> int:
    if isinstance(option, UniformStageOption):
        return option.num_stages or 1
    if isinstance(option, ManualStageOption):
        return len(option.forward_stage_layer_ids)
    return 1


def _cut_bytes(pre, fwd_end: int, layer_of: dict, num_layers: int) -> list[float]:
    """Per cut before layer ``j``: bytes per micro-batch of the forward values made in layers
    below ``j`` and read at or above it (their cotangents cross back in the backward)."""
    made: dict = {}
    for i in range(fwd_end):
        if i in layer_of:
            for v in pre[i].outvars:
                made[v] = layer_of[i]
    last_reader: dict = {}
    for i in range(fwd_end):
        if i not in layer_of:
            continue
        for v in pre[i].invars:
            if isinstance(v, Var) and v in made and layer_of[i] > made[v]:
                last_reader[v] = max(last_reader.get(v, 0), layer_of[i])
    out = [0.0] * (num_layers + 1)
    for v, top in last_reader.items():
        aval = v.aval
        size = math.prod(getattr(aval, "shape", ())) * getattr(
            getattr(aval, "dtype", None), "itemsize", 4)
        for j in range(made[v] + 1, top + 1):
            out[j] += size
    return out


def cut_seconds_both(num_bytes: float, a: int, b: int, backward: bool) -> float:
    """``num_bytes`` across a cut from ``a`` to ``b`` devices, and back when ``backward``."""
    there = cut_seconds(num_bytes, a, b)
    return there + cut_seconds(num_bytes, b, a) if backward else there


def _layer_costs(pre, layer_of, num_layers):
    from ..ir._prims import eqn_flops

    flops, mem = [0.0] * num_layers, [0.0] * num_layers
    for i, layer in layer_of.items():
        flops[layer] += eqn_flops(pre[i])
        for v in pre[i].outvars:
            aval = v.aval
            mem[layer] += math.prod(getattr(aval, "shape", ())) * getattr(
                getattr(aval, "dtype", None), "itemsize", 4)
    return flops, mem


def method_devices(method):
    devices, mesh = resolve_devices(method.devices)
    return list(devices)


__all__ = ["Cut", "PipelinePlan", "choose_stages", "cut_program", "inline_identity_markers", "method_devices",
           "plan_partition"]
