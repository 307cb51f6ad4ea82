"""The competitors: single-device jax.jit, hand-written jax.jit plans, autoshard methods.

Each ``prepare_*`` function builds, compiles and places one (model, plan) pair and returns a
``Prepared``: the step to call, its placed arguments, the jax ``Compiled`` to inspect, and the
planning and compile times. Hand-written plans are written the way an expert writes them with
plain ``jax.jit``: NamedShardings for every input and output, ``with_sharding_constraint`` on
the activations (through ``suite_models.activation_specs``), on the gathered parameters (ZeRO-3)
and on the gradients (ZeRO-2/3, so XLA reduce-scatters them).
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import autoshard
from suite_models import ModelCase, activation_specs, loss_fn


@dataclass(kw_only=True)
class Prepared:
    """A compiled (model, plan) pair, ready to be stepped."""

    step: Callable
    """step(state, batch) -> (state, loss)."""
    state: Any
    """The train state, placed where the step wants it."""
    batch: Any
    """The batch, placed where the step wants it."""
    compiled: Any
    """The jax ``Compiled`` (HLO text and memory analysis)."""
    mesh_shape: tuple[int, ...]
    """Shape of the device mesh the plan runs on."""
    compile_time_s: float
    """XLA compile time (``Lowered.compile``)."""
    planning_time_s: float | None = None
    """autoshard: tracing, planning and lowering (``Executable.timings`` less ``compile_s``)."""
    lower_time_s: float | None = None
    """Hand-written plans: tracing and lowering time of ``jax.jit(...).lower``."""
    extra: dict = field(default_factory=dict)
    """Plan-specific facts (ILP objective and columns, solver status, notes)."""


# Hand-written plans ----------------------------------------------------------------------------
def _names(path) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]


def _fit(spec_entries, shape, sizes) -> P:
    """Drop an axis from a dim it does not divide (an expert would keep that dim whole)."""
    out = []
    for entry, size in zip(spec_entries, shape, strict=False):
        axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
        n = int(np.prod([sizes[a] for a in axes])) if axes else 1
        out.append(entry if axes and size % n == 0 and size >= n else None)
    return P(*out)


def megatron_spec(names: list[str], shape, model: str | None, expert: str | None) -> tuple:
    """Megatron-LM tensor parallelism: column-split, then row-split; vocab-split embedding."""
    module, param = (names[-2], names[-1]) if len(names) >= 2 else ("", "")
    m = model
    kernels = {"qkv": (None, None, m, None), "out": (m, None, None), "fc1": (None, m), "fc2": (m, None), "head": (None, m),
               "conv1": (None, None, None, m), "conv2": (None, None, m, None)}
    biases = {"qkv": (None, m, None), "fc1": (m,),
              "head": (m,), "conv1": (m,)}
    if param == "kernel" and module in kernels:
        return kernels[module]
    if param == "bias" and module in biases:
        return biases[module]
    if param == "embedding" and module == "embed":
        return (m, None)
    if param in ("wi", "wo"):
        return (expert, None, None)
    return ()


def zero_spec(shape, axis: str, n: int) -> tuple:
    """ZeRO: split the first dim the device count divides; small leaves stay replicated."""
    for d, size in enumerate(shape):
        if size % n == 0 and size >= n:
            return (None,) * d + (axis,)
    return ()


@dataclass(frozen=True, kw_only=True)
class ManualPlan:
    """A hand-written plan: mesh, input specs, activation rules, ZeRO stage."""

    kind: str
    """dp, zero2, zero3, megatron, expert or 2d."""
    mesh_shape: tuple[int, ...]
    """Mesh shape."""
    axis_names: tuple[str, ...]
    """Mesh axis names."""
    batch_axis: str | None
    """Axis the batch dim is split over (None: replicated batch)."""
    model_axis: str | None = None
    """Axis of Megatron tensor parallelism."""
    expert_axis: str | None = None
    """Axis the MoE experts are split over."""
    zero_stage: int = 0
    """0, 2 or 3."""


def manual_plans(num_devices: int) -> dict[str, ManualPlan]:
    n = num_devices
    plans = {
        "manual:dp": ManualPlan(kind="dp", mesh_shape=(n,), axis_names=("data",),
                                batch_axis="data"),
        "manual:zero2": ManualPlan(kind="zero2", mesh_shape=(n,), axis_names=("data",),
                                   batch_axis="data", zero_stage=2),
        "manual:zero3": ManualPlan(kind="zero3", mesh_shape=(n,), axis_names=("data",),
                                   batch_axis="data", zero_stage=3),
        "manual:megatron": ManualPlan(kind="megatron", mesh_shape=(n,), axis_names=("model",),
                                      batch_axis=None, model_axis="model", expert_axis="model"),
        "manual:expert": ManualPlan(kind="expert", mesh_shape=(n,), axis_names=("expert",),
                                    batch_axis="expert", expert_axis="expert"),
    }
    if n >= 4 and n % 2 == 0:
        plans["manual:2d"] = ManualPlan(
            kind="2d", mesh_shape=(2, n // 2), axis_names=("data", "model"), batch_axis="data",
            model_axis="model", expert_axis="model")
    return plans


def activation_rules(plan: ManualPlan) -> dict:
    b, m, e = plan.batch_axis, plan.model_axis, plan.expert_axis
    if plan.kind in ("dp", "zero2", "zero3"):
        return {}          # the batch sharding of the inputs propagates; nothing to pin
    if plan.kind == "expert":  # GShard: tokens split by batch, experts by the same axis
        return {"embed": {0: b}, "dispatched": {1: b}, "expert": {0: e}}
    return {"embed": {0: b}, "heads": {0: b, -2: m}, "mlp": {0: b, -1: m},
            "conv": {0: b, -1: m}, "logits": {0: b, -1: m}, "dispatched": {1: b},
            "expert": {0: e, 1: b}}


def prepare_manual(case: ModelCase, plan: ManualPlan, devices) -> Prepared:
    n = int(np.prod(plan.mesh_shape))
    mesh = Mesh(np.array(devices[:n]).reshape(plan.mesh_shape), plan.axis_names)
    sizes = dict(zip(plan.axis_names, plan.mesh_shape, strict=True))
    state = case.init_state()
    zero_axis = plan.axis_names[0]

    def state_spec(path, x):
        names = _names(path)
        is_opt = "opt_state" in names
        if plan.zero_stage == 3 or (plan.zero_stage == 2 and is_opt):
            return NamedSharding(mesh, _fit(zero_spec(np.shape(x), zero_axis, n), np.shape(x),
                                            sizes))
        entries = megatron_spec(names, np.shape(x), plan.model_axis, plan.expert_axis)
        return NamedSharding(mesh, _fit(entries, np.shape(x), sizes))

    state_sh = jax.tree_util.tree_map_with_path(state_spec, state)
    grad_sh = jax.tree.map(
        lambda x: NamedSharding(mesh, _fit(zero_spec(x.shape, zero_axis, n), x.shape, sizes)),
        state.params)
    replicated = NamedSharding(mesh, P())
    batch_sh = tuple(NamedSharding(mesh, P(plan.batch_axis)) for _ in range(2))

    def step(state, batch):
        params = state.params
        if plan.zero_stage == 3:      # gather every parameter before its use
            params = jax.tree.map(lambda p: jax.lax.with_sharding_constraint(p, replicated),
                                  params)
        loss, grads = jax.value_and_grad(lambda p: loss_fn(state.apply_fn, p, batch))(params)
        if plan.zero_stage >= 2:      # keep only this device's gradient shard
            grads = jax.lax.with_sharding_constraint(grads, grad_sh)
        return state.apply_gradients(grads=grads), loss

    jitted = jax.jit(step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, replicated),
                     donate_argnums=0)
    batch = (case.inputs, case.labels)
    t0 = time.perf_counter()
    with activation_specs(mesh, activation_rules(plan)):
        lowered = jitted.lower(state, batch)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return Prepared(step=compiled, state=jax.device_put(state, state_sh),
                    batch=jax.device_put(batch, batch_sh), compiled=compiled,
                    mesh_shape=plan.mesh_shape, compile_time_s=t2 - t1, lower_time_s=t1 - t0)


def prepare_single(case: ModelCase, devices) -> Prepared:
    """Plain ``jax.jit`` on one device: the baseline a user starts from."""
    device = jax.sharding.SingleDeviceSharding(devices[0])

    def step(state, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(state.apply_fn, p, batch))(
            state.params)
        return state.apply_gradients(grads=grads), loss

    state = jax.device_put(case.init_state(), device)
    batch = jax.device_put((case.inputs, case.labels), device)
    t0 = time.perf_counter()
    lowered = jax.jit(step, donate_argnums=0).lower(state, batch)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return Prepared(step=compiled, state=state, batch=batch, compiled=compiled, mesh_shape=(1,),
                    compile_time_s=t2 - t1, lower_time_s=t1 - t0)


# autoshard -------------------------------------------------------------------------------------
def autoshard_step(state, batch):
    loss, grads = autoshard.value_and_grad(lambda p: loss_fn(state.apply_fn, p, batch))(
        state.params)
    return state.apply_gradients(grads=grads), loss


def autoshard_methods(num_devices: int, solver_time_limit_s: float) -> dict[str, Callable]:
    """Plan name -> devices -> ParallelMethod (or None when the method does not exist yet)."""
    n = num_devices

    def shard(shape):
        def make(devices):
            option = autoshard.AutoShardingOption(
                logical_mesh_shape=shape, show_progress=False,
                solver_time_limit_s=solver_time_limit_s)
            return autoshard.ShardParallel(devices=devices, auto_sharding_option=option)
        return make

    methods = {
        "autoshard:DataParallel": lambda d: autoshard.DataParallel(devices=d),
        "autoshard:Zero2Parallel": lambda d: autoshard.Zero2Parallel(devices=d),
        "autoshard:Zero3Parallel": lambda d: autoshard.Zero3Parallel(devices=d),
        "autoshard:ShardParallel-1d": shard((n,)),
        "autoshard:ShardParallel": shard(None),   # the planner picks the mesh shape
    }
    if n >= 4 and n % 2 == 0:
        methods["autoshard:ShardParallel-2d"] = shard((2, n // 2))
    # Hook: PipeshardParallel joins the suite as soon as autoshard exports it.
    pipeshard = getattr(autoshard, "PipeshardParallel", None)
    methods["autoshard:PipeshardParallel"] = (  # Alpa's defaults: 2 auto layers, 2 stages, 1F1B
        (lambda d: pipeshard(devices=d, num_micro_batches=2, blocking=True))
        if pipeshard is not None else None)
    methods["autoshard:PipeshardParallel-4st"] = (
        (lambda d: pipeshard(devices=d, num_micro_batches=4, blocking=True,
                             pipeline_schedule="1f1b",
                             layer_option=autoshard.AutoLayerOption(layer_num=4),
                             stage_option=autoshard.UniformStageOption(num_stages=4)))
        if pipeshard is not None else None)
    return methods


# Fallbacks for planners that report their ILP size only in the plan's notes.
_NOTE_ILP = re.compile(r"ILP: (\d+) columns(?:, (\d+) rows)?")
_NOTE_PLANNED = re.compile(r"planned in ([0-9.]+) s \((\d+) ILP columns\)")


def ilp_stats(plan) -> dict:
    """The planner's own figures: structured ``Objective`` fields, else parsed from the notes.

    Every field of the objective lands in the record as ``ilp_<field>`` (so fields the planner
    adds later show up without a change here); ``ilp_columns`` and ``ilp_rows`` come from
    ``num_columns`` / ``num_rows`` when the objective has them (non-zero), else from the notes.
    """
    extra = {"plan_notes": list(getattr(plan, "notes", ()))}
    objective = getattr(plan, "objective", None)
    if objective is not None:
        extra["ilp_objective_s"] = objective.total_s
        extra["ilp_solver_status"] = objective.solver_status
        extra["ilp_estimated_peak_bytes"] = objective.peak_bytes_per_device
        extra["ilp_data_parallel_objective_s"] = objective.data_parallel_s
        if dataclasses.is_dataclass(objective):
            for f in dataclasses.fields(objective):
                value = getattr(objective, f.name)
                if isinstance(value, bool | int | float | str | tuple | type(None)):
                    extra.setdefault(f"ilp_{f.name}", value)
        for key, name in (("ilp_columns", "num_columns"), ("ilp_rows", "num_rows")):
            value = getattr(objective, name, None)
            if value:            # 0: not filled in by this planner
                extra[key] = int(value)
    for note in getattr(plan, "notes", ()):
        match = _NOTE_ILP.search(note)
        if match:
            extra.setdefault("ilp_columns", int(match.group(1)))
            if match.group(2) is not None:
                extra.setdefault("ilp_rows", int(match.group(2)))
        match = _NOTE_PLANNED.search(note)
        if match:
            extra.setdefault("planner_reported_s", float(match.group(1)))
            extra.setdefault("ilp_columns", int(match.group(2)))
    return extra


class _Stages:
    """A pipeline executable seen as one compiled step: every stage's HLO, the largest task's
    memory (collectives inside a stage count once per task, not once per micro-batch)."""

    def __init__(self, executable):
        self.executable = executable

    def as_text(self) -> list[str]:
        return list(self.executable.get_task_hlo_texts().values())

    def memory_analysis(self):
        total = self.executable.get_total_allocation_size()
        return SimpleNamespace(argument_size_in_bytes=0, output_size_in_bytes=0,
                               temp_size_in_bytes=total, alias_size_in_bytes=0)


def prepare_autoshard(case: ModelCase, make_method: Callable, devices) -> Prepared:
    """Plan and compile once through ``get_executable``; its ``timings`` split the time."""
    f = autoshard.parallelize(autoshard_step, method=make_method(list(devices)))
    state = case.init_state()
    batch = (case.inputs, case.labels)
    t0 = time.perf_counter()
    executable = f.get_executable(state, batch)
    total = time.perf_counter() - t0
    plan = executable.plan
    extra = ilp_stats(plan)
    timings = dict(getattr(executable, "timings", None) or {})
    compile_s = timings.get("compile_s")
    if compile_s is None:        # no timings: the XLA compile is not told apart
        compile_s = 0.0
    if "planning_s" in timings:
        extra["planner_reported_s"] = timings["planning_s"]
    extra["autoshard_timings_s"] = timings
    extra["get_executable_s"] = total
    if hasattr(executable, "audit") and getattr(plan, "objective", None) is not None:
        audit = executable.audit()  # what the planner predicted next to what XLA compiled
        extra["predicted_collective_bytes"] = audit.predicted_bytes
        extra["audit_compiled_collective_bytes"] = audit.compiled_bytes
        extra["audit_bytes_ratio"] = audit.bytes_ratio()
        extra["audit_memory_ratio"] = audit.memory_ratio()
        extra["audit_unpredicted"] = len(audit.unpredicted)
    state, batch = f.preshard_dynamic_args(state, batch)   # the cached executable: no recompile
    compiled = getattr(executable, "compiled", None) or _Stages(executable)
    return Prepared(step=f, state=state, batch=batch, compiled=compiled,
                    mesh_shape=tuple(plan.mesh_shape), compile_time_s=compile_s,
                    planning_time_s=total - compile_s, extra=extra)
