"""Stages: which layers each stage holds, and the sub-mesh it runs on.

``UniformStageOption``: one stage per layer (or ``num_stages`` stages of equal layer counts),
devices split evenly. ``ManualStageOption``: layer ids, sub-mesh shapes and planner options per
stage. ``AutoStageOption``: a dynamic program over (layer range, sub-mesh) minimising
``sum(stage times) + (num_micro_batches - 1) * max(stage time)`` (Alpa's objective), for
every candidate maximum stage time, with stages that do not fit in memory excluded.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class UniformStageOption:
    """Stages of equal layer counts on sub-meshes of equal size."""

    num_stages: int | None = None
    """Number of stages; None: one per layer."""
    submesh_physical_shape: tuple[int, int] | None = None
    """(hosts, devices per host) of every sub-mesh; None: devices split evenly."""
    submesh_logical_shape: tuple[int, ...] | None = None
    """Logical mesh shape inside each sub-mesh; None: one axis over its devices."""
    submesh_autosharding_option: dict | None = None
    """Planner options (``AutoShardingOption`` fields) for every stage."""

    def __post_init__(self):
        n = self.num_stages
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"UniformStageOption.num_stages ({n!r}) must be a positive int or "
                             "None (one stage per layer).")


@dataclass(frozen=True)
class ManualStageOption:
    """Per stage: its forward layer ids, sub-mesh shapes and planner options."""

    forward_stage_layer_ids: Sequence[Sequence[int]]
    """Per stage, the (contiguous, increasing) layer ids it holds."""
    submesh_physical_shapes: Sequence[tuple[int, int]]
    """Per stage, (hosts, devices per host)."""
    submesh_logical_shapes: Sequence[tuple[int, ...]]
    """Per stage, the logical mesh shape of its sub-mesh."""
    submesh_autosharding_option_dicts: Sequence[dict]
    """Per stage, planner options such as ``{"force_batch_dim_to_mesh_dim": 0}``."""

    def __post_init__(self):
        n = len(self.forward_stage_layer_ids)
        for what in ("submesh_physical_shapes", "submesh_logical_shapes",
                     "submesh_autosharding_option_dicts"):
            if len(getattr(self, what)) != n:
                raise ValueError(
                    f"ManualStageOption.{what} has {len(getattr(self, what))} entries for {n} "
                    "stages (forward_stage_layer_ids); give one per stage.")
        flat = [i for ids in self.forward_stage_layer_ids for i in ids]
        if flat != list(range(len(flat))):
            raise ValueError(
                f"ManualStageOption.forward_stage_layer_ids ({self.forward_stage_layer_ids}) must "
                "list every layer once, in order, e.g. [[0, 1], [2, 3]].")
        for phys, logical in zip(self.submesh_physical_shapes, self.submesh_logical_shapes,
                                 strict=True):
            if math.prod(phys) != math.prod(logical):
                raise ValueError(
                    f"ManualStageOption: logical shape {tuple(logical)} has "
                    f"{math.prod(logical)} devices but its physical sub-mesh {tuple(phys)} has "
                    f"{math.prod(phys)}. Use shapes with equal device counts.")


@dataclass(frozen=True, kw_only=True)
class AutoStageOption:
    """Search over layer ranges and sub-meshes (Alpa's stage dynamic program)."""

    submesh_physical_shape_space: Literal["power_of_two", "small_power_of_two", "manual"] = (
        "power_of_two")
    """Sub-mesh sizes tried: powers of two up to a host, up to 4, or ``manually_specified``."""
    manually_specified_submeshes: Sequence[tuple[int, int]] | None = None
    """The (hosts, devices per host) shapes tried when the space is ``manual``."""
    submesh_logical_shape_space: Literal["single_node_model_parallel", "same_as_physical",
                                         "model_parallel_only", "all"] = (
        "single_node_model_parallel")
    """Logical shapes tried per sub-mesh (Alpa's meanings)."""
    layer_profile_mode: Literal["composition", "individual"] = "composition"
    """Cost a layer range as one program, or as the sum of its layers."""
    stage_imbalance_tolerance: float = math.inf
    """Reject stages slower than this factor times the fastest candidate maximum."""
    memory_budget_per_device: int | None = None
    """Bytes a stage may use per device; None: no limit."""
    profile: bool = False
    """Measure stage times by compiling and running the candidates; False: FLOP counts."""
    profile_cache_dir: str | None = None
    """Directory keeping measured stage times (``stage_profiles.json``); None: not kept."""
    cached_profile_result: str | None = None
    """File of measured stage times to reuse and extend (overrides ``profile_cache_dir``)."""

    def __post_init__(self):
        if self.submesh_physical_shape_space == "manual" and not (
                self.manually_specified_submeshes):
            raise ValueError(
                "AutoStageOption(submesh_physical_shape_space='manual') needs "
                "manually_specified_submeshes, e.g. [(1, 2), (1, 4)].")


StageOption = UniformStageOption | ManualStageOption | AutoStageOption


def submesh_choices(option: AutoStageOption, num_devices: int) -> list[tuple[int, int]]:
    """(hosts, devices per host) shapes the search tries on one host of ``num_devices``."""
    if option.submesh_physical_shape_space == "manual":
        return [tuple(s) for s in option.manually_specified_submeshes]
    top = num_devices if option.submesh_physical_shape_space == "power_of_two" else min(
        4, num_devices)
    return [(1, 2 ** k) for k in range(int(math.log2(top)) + 1) if 2 ** k <= top]


def logical_choices(option: AutoStageOption, n: int) -> list[tuple[int, int]]:
    space = option.submesh_logical_shape_space
    if space == "same_as_physical" or space == "model_parallel_only":
        return [(1, n)]
    if space == "single_node_model_parallel":
        return sorted({(n, 1), (1, n)})
    return [(a, n // a) for a in range(1, n + 1) if n % a == 0]


def stage_dp(num_layers: int, num_devices: int, sizes: Sequence[int],
             cost: Callable[[int, int, int], float], num_micro_batches: int
             ) -> tuple[float, list[tuple[int, int, int]]]:
    """Best cut of layers into stages on sub-meshes using exactly ``num_devices`` devices.

    ``cost(i, j, k)``: time of layers ``[i, j)`` on sub-mesh choice ``k`` of ``sizes[k]``
    devices (``math.inf`` if it does not fit). Returns the objective
    ``sum(times) + (num_micro_batches - 1) * max(times)`` and the stages ``(i, j, k)``.
    """
    table = {(i, j, k): cost(i, j, k) for i in range(num_layers)
             for j in range(i + 1, num_layers + 1) for k in range(len(sizes))}
    candidates = sorted({t for t in table.values() if t < math.inf})
    best: tuple[float, list] = (math.inf, [])
    for tmax in candidates:
        if (num_micro_batches - 1) * tmax >= best[0]:
            break
        # f[i][d]: least total time for layers [i, L) on exactly d devices, stages <= tmax.
        f = [[math.inf] * (num_devices + 1) for _ in range(num_layers + 1)]
        arg: dict = {}
        f[num_layers][0] = 0.0
        for i in range(num_layers - 1, -1, -1):
            for d in range(1, num_devices + 1):
                for j in range(i + 1, num_layers + 1):
                    for k, n in enumerate(sizes):
                        t = table[(i, j, k)]
                        if n > d or t > tmax or f[j][d - n] == math.inf:
                            continue
                        if t + f[j][d - n] < f[i][d]:
                            f[i][d] = t + f[j][d - n]
                            arg[(i, d)] = (j, k)
        total = f[0][num_devices]
        if total == math.inf:
            continue
        stages, i, d = [], 0, num_devices
        while i < num_layers:
            j, k = arg[(i, d)]
            stages.append((i, j, k))
            i, d = j, d - sizes[k]
        obj = sum(table[s] for s in stages) + (num_micro_batches - 1) * max(
            table[s] for s in stages)
        if obj < best[0]:
            best = (obj, stages)
    return best


def stage_exhaustive(num_layers, num_devices, sizes, cost, num_micro_batches):
    """The same objective by enumerating every cut and sub-mesh choice (for tests)."""
    best: tuple[float, Any] = (math.inf, [])

    def rec(i, d, stages):
        nonlocal best
        if i == num_layers:
            if d == 0:
                times = [cost(*s) for s in stages]
                obj = sum(times) + (num_micro_batches - 1) * max(times)
                if obj < best[0]:
                    best = (obj, list(stages))
            return
        for j in range(i + 1, num_layers + 1):
            for k, n in enumerate(sizes):
                if n <= d and cost(i, j, k) < math.inf:
                    rec(j, d - n, stages + [(i, j, k)])
    rec(0, num_devices, [])
    return best


__all__ = ["AutoStageOption", "ManualStageOption", "StageOption", "UniformStageOption",
           "logical_choices", "stage_dp", "stage_exhaustive", "submesh_choices"]
