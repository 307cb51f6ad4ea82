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

import numpy as np

from ..sharding.cost import DEFAULT_ALPHA_S, DEFAULT_BETA_S_PER_BYTE


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

    submesh_physical_shape_space: Literal["power_of_two", "small_power_of_two", "divisors",
                                          "manual"] = "power_of_two"
    """Sub-mesh sizes tried: powers of two (devices within a host, then whole hosts; Alpa's),
    those up to 4 devices, ``divisors`` (device counts that divide a host, then host counts
    that divide the cluster: 6 or 24 of 384 hosts, as Megatron-LM's stages), or
    ``manually_specified_submeshes``."""
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
        spaces = ("power_of_two", "small_power_of_two", "divisors", "manual")
        if self.submesh_physical_shape_space not in spaces:
            raise ValueError(
                f"AutoStageOption.submesh_physical_shape_space "
                f"({self.submesh_physical_shape_space!r}) must be one of {spaces}.")
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
    if option.submesh_physical_shape_space == "divisors":
        return [(1, d) for d in divisors(num_devices)]
    top = num_devices if option.submesh_physical_shape_space == "power_of_two" else min(
        4, num_devices)
    return [(1, 2 ** k) for k in range(int(math.log2(top)) + 1) if 2 ** k <= top]


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def logical_choices(option: AutoStageOption, n: int) -> list[tuple[int, int]]:
    space = option.submesh_logical_shape_space
    if space == "same_as_physical" or space == "model_parallel_only":
        return [(1, n)]
    if space == "single_node_model_parallel":
        return sorted({(n, 1), (1, n)})
    return [(a, n // a) for a in range(1, n + 1) if n % a == 0]


def cut_seconds(num_bytes: float, n: int, m: int, *, alpha: float = DEFAULT_ALPHA_S,
                beta: float = DEFAULT_BETA_S_PER_BYTE) -> float:
    """Time to move a value of ``num_bytes`` from a sub-mesh of ``n`` devices to one of ``m``.

    As ``runtime``'s ``Mover`` moves it: between sub-meshes of one device count, device i
    sends its shard to device i (all at once: ``num_bytes / n`` each, the layout carried
    over); between other counts the value is first gathered on the source (an all-gather
    over its ``n`` devices), then every destination device receives all of it.
    """
    if num_bytes <= 0:
        return 0.0
    if n == m:
        return alpha + beta * num_bytes / n
    gather = 0.0 if n == 1 else alpha + beta * (n - 1) / n * num_bytes
    return gather + alpha + beta * num_bytes


def stage_dp(num_layers: int, num_devices: int, sizes: Sequence[int],
             cost: Callable[[int, int, int], float], num_micro_batches: int,
             boundary: Callable[[int, int, int], float] | None = None,
             num_stages: int | None = None,
             placeable: Callable[[int, int], bool] | None = None
             ) -> tuple[float, list[tuple[int, int, int]]]:
    """Best cut of layers into stages on sub-meshes using exactly ``num_devices`` devices.

    ``cost(i, j, k)``: time of layers ``[i, j)`` on sub-mesh choice ``k`` of ``sizes[k]``
    devices (``math.inf`` if it does not fit). ``boundary(j, k, k2)``: time per micro-batch
    of the values crossing the cut before layer ``j`` from sub-mesh choice ``k`` to ``k2``
    (both ways in training; ``cut_seconds``), added to the time of the stage that ends at
    ``j``. Returns the objective ``sum(times) + (num_micro_batches - 1) * max(times)`` and
    the stages ``(i, j, k)``. ``num_stages``: exactly that many stages (None: any number;
    not with ``boundary``). ``placeable``: as in ``stage_dp_table`` (not with ``boundary``).
    """
    if boundary is not None:
        assert num_stages is None and placeable is None, "searched without cut costs only"
        return _stage_dp_cuts(num_layers, num_devices, sizes, cost, num_micro_batches,
                              boundary)
    return stage_dp_table(cost_table(num_layers, len(sizes), cost), sizes, num_devices,
                          num_micro_batches, num_stages=num_stages, placeable=placeable)


def cost_table(num_layers: int, num_choices: int,
               cost: Callable[[int, int, int], float]) -> np.ndarray:
    """``cost(i, j, k)`` for every span ``[i, j)`` and sub-mesh choice: ``stage_dp_table``'s
    array (``inf`` where ``j <= i``)."""
    table = np.full((num_layers, num_layers + 1, num_choices), math.inf)
    for i in range(num_layers):
        for j in range(i + 1, num_layers + 1):
            for k in range(num_choices):
                table[i, j, k] = cost(i, j, k)
    return table


def stage_dp_table(cost: np.ndarray, sizes: Sequence[int], num_devices: int,
                   num_micro_batches: int, max_following: np.ndarray | None = None,
                   num_stages: int | None = None,
                   placeable: Callable[[int, int], bool] | None = None
                   ) -> tuple[float, list[tuple[int, int, int]]]:
    """``stage_dp`` on a cost array, optionally limiting how many stages may follow each one.

    ``cost[i, j, k]``: time of layers ``[i, j)`` on sub-mesh choice ``k`` of ``sizes[k]``
    devices (``inf``: not allowed). ``max_following[i, j, k]``: the most stages that may come
    after that stage (the stages after it keep their micro-batches in flight in its memory;
    Alpa's ``max_n_succ_stages``); None: no limit. For each candidate maximum stage time
    ``tmax`` (every distinct finite cost, ascending) the least total time with every stage
    ``<= tmax`` is found, over the number of stages too; the objective of that cut is
    ``sum + (num_micro_batches - 1) * max``, and candidates stop once ``num_micro_batches *
    tmax`` (a lower bound of any cut whose slowest stage is ``tmax``) reaches the best.
    ``num_stages``: only cuts into exactly that many stages (None: any number).
    ``placeable(n, first)``: whether a sub-mesh of ``n`` devices may start at device ``first``
    (stages take consecutive devices in order; None: anywhere).
    Returns the objective and the stages ``(i, j, k)`` (``(inf, [])`` when none fits).
    """
    return stage_dp_counts(cost, sizes, num_devices, num_micro_batches, max_following,
                           counts=(num_stages,), placeable=placeable)[num_stages]


def stage_dp_counts(cost: np.ndarray, sizes: Sequence[int], num_devices: int,
                    num_micro_batches: int, max_following: np.ndarray | None = None,
                    counts: Sequence[int | None] = (None,),
                    placeable: Callable[[int, int], bool] | None = None) -> dict:
    """``stage_dp_table`` for several stage counts at once: ``counts`` -> (objective, stages)
    (None: any number of stages). One pass of the DP per candidate maximum stage time serves
    every count (``AutoParallel`` asks for each count from 2 to the number of layers: one DP
    each took minutes on Table 1's 529.6B row). A first pass at the largest candidate finds
    the counts no cut reaches, which then sweep no candidates.
    """
    cost = np.asarray(cost, dtype=np.float64)
    num_layers = cost.shape[0]
    assert cost.shape == (num_layers, num_layers + 1, len(sizes)), cost.shape
    unit, sizes, num_devices = _in_units(sizes, num_devices)
    if unit > 1 and placeable is not None:
        outer = placeable

        def placeable(n, first):
            return outer(n * unit, first * unit)
    big_s = num_layers  # at most one stage per layer
    groups = sorted(set(int(n) for n in sizes if n <= num_devices))
    members = [np.array([k for k, n in enumerate(sizes) if n == g]) for g in groups]
    # allowed[i, j, k, s]: the stage may have s stages after it
    following = np.arange(big_s)
    allowed = (np.full(cost.shape + (big_s,), True) if max_following is None else
               np.asarray(max_following)[..., None] >= following)
    candidates = np.unique(cost[np.isfinite(cost)])
    # whether a stage of each group's size may start num_devices - d devices in
    ok = {n: (None if placeable is None else
              np.array([placeable(n, num_devices - d) for d in range(n, num_devices + 1)]))
          for n in groups}

    def one_pass(tmax):
        masked = np.where(cost <= tmax, cost, math.inf)[..., None]
        masked = np.where(allowed, masked, math.inf)  # (i, j, k, following)
        # per size group: the cheapest choice and which one it is
        eff = [(masked[:, :, m, :].min(axis=2), m[masked[:, :, m, :].argmin(axis=2)])
               for m in members]
        # f[i, d, s]: least total time of layers [i, L) on exactly d devices in s stages
        f = np.full((num_layers + 1, num_devices + 1, big_s + 1), math.inf)
        f[num_layers, 0, 0] = 0.0
        arg = np.zeros((num_layers, num_devices + 1, big_s + 1, 2), dtype=np.int64)
        for i in range(num_layers - 1, -1, -1):
            for n, (t, which) in zip(groups, eff, strict=True):
                # the stage [i, j) on n devices with s - 1 stages after it
                cand = f[i + 1:, :num_devices + 1 - n, :big_s] + t[i, i + 1:, None, :]
                j = cand.argmin(axis=0)
                val = np.take_along_axis(cand, j[None], axis=0)[0]
                if ok[n] is not None:  # the stage starts at device num_devices - d
                    val = np.where(ok[n][:, None], val, math.inf)
                cur = f[i, n:, 1:]
                better = val < cur
                f[i, n:, 1:] = np.where(better, val, cur)
                k = which[i, i + 1:][j, np.arange(big_s)[None, :]]
                arg[i, n:, 1:, 0] = np.where(better, j + i + 1, arg[i, n:, 1:, 0])
                arg[i, n:, 1:, 1] = np.where(better, k, arg[i, n:, 1:, 1])
        return f, arg

    def stages_of(f, arg, count):
        s = int(f[0, num_devices].argmin()) if count is None else count
        if s > big_s or not np.isfinite(f[0, num_devices, s]):
            return None
        stages, i, d = [], 0, num_devices
        while i < num_layers:
            j, k = (int(x) for x in arg[i, d, s])
            stages.append((i, j, k))
            i, d, s = j, d - int(sizes[k]), s - 1
        return stages

    best: dict = {c: (math.inf, []) for c in counts}
    live = set(best)
    if len(candidates):
        f, arg = one_pass(candidates[-1])
        live = {c for c in live if stages_of(f, arg, c) is not None}
    for tmax in candidates:
        if all(num_micro_batches * tmax >= best[c][0] for c in live):
            break
        f, arg = one_pass(tmax)
        for c in live:
            stages = stages_of(f, arg, c)
            if stages is None:
                continue
            times = [float(cost[st]) for st in stages]
            obj = sum(times) + (num_micro_batches - 1) * max(times)
            if obj < best[c][0]:
                best[c] = (obj, stages)
    return best


def _in_units(sizes: Sequence[int], num_devices: int) -> tuple[int, list[int], int]:
    """(unit, sizes, num_devices) with devices counted in units of the greatest common divisor
    of the device count and the sizes that fit in it: every count the DP reaches is a multiple
    of it, so the search is the same, over far fewer counts (Table 1's 529.6B row: 2,520 GPUs
    in sub-meshes of whole hosts, 315 units of 8; swept GPU by GPU, a 35-layer DP took minutes
    per stage count). A size over the device count stays over it."""
    unit = math.gcd(num_devices, *(int(n) for n in sizes if n <= num_devices))
    return (unit, [int(n) // unit if n <= num_devices else num_devices // unit + 1
                   for n in sizes], num_devices // unit)


def _stage_times(stages, cost, boundary):
    """Each stage's time: its layers' plus its outgoing cut's (``boundary``)."""
    times = []
    for n, (i, j, k) in enumerate(stages):
        t = cost(i, j, k)
        if boundary is not None and n + 1 < len(stages):
            t += boundary(j, k, stages[n + 1][2])
        times.append(t)
    return times


def _stage_dp_cuts(num_layers, num_devices, sizes, cost, num_micro_batches, boundary):
    """``stage_dp`` where a stage's time depends on the next stage's sub-mesh (its cut)."""
    _, sizes, num_devices = _in_units(sizes, num_devices)
    big_l, kk = num_layers, range(len(sizes))
    table = {(i, j, k): cost(i, j, k) for i in range(big_l)
             for j in range(i + 1, big_l + 1) for k in kk}
    cut = {(j, k, k2): boundary(j, k, k2) for j in range(1, big_l) for k in kk for k2 in kk}

    def time(i, j, k, k2):
        t = table[(i, j, k)]
        return t if k2 is None else t + cut[(j, k, k2)]
    candidates = sorted({t for (i, j, k), c in table.items() if c < math.inf
                         for k2 in ([None] if j == big_l else kk)
                         if (t := time(i, j, k, k2)) < math.inf})
    best: tuple[float, list] = (math.inf, [])
    for tmax in candidates:
        if (num_micro_batches - 1) * tmax >= best[0]:
            break
        # f[(i, d, k)]: least total for layers [i, L) on exactly d devices, the stage starting
        # at i on choice k, every stage's time (cut included) <= tmax.
        f: dict = {(big_l, 0, None): 0.0}
        arg: dict = {}
        for i in range(big_l - 1, -1, -1):
            for d in range(1, num_devices + 1):
                for k in kk:
                    n = sizes[k]
                    if n > d:
                        continue
                    val = math.inf
                    for j in range(i + 1, big_l + 1):
                        for k2 in ([None] if j == big_l else kk):
                            rest = f.get((j, d - n, k2), math.inf)
                            t = time(i, j, k, k2)
                            if rest == math.inf or t > tmax or t + rest >= val:
                                continue
                            val, arg[(i, d, k)] = t + rest, (j, k2)
                    if val < math.inf:
                        f[(i, d, k)] = val
        starts = [k for k in kk if (0, num_devices, k) in f]
        if not starts:
            continue
        k = min(starts, key=lambda c: f[(0, num_devices, c)])
        stages, i, d = [], 0, num_devices
        while i < big_l:
            j, k2 = arg[(i, d, k)]
            stages.append((i, j, k))
            i, d, k = j, d - sizes[k], k2
        times = _stage_times(stages, lambda a, b, c: table[(a, b, c)], boundary)
        obj = sum(times) + (num_micro_batches - 1) * max(times)
        if obj < best[0]:
            best = (obj, stages)
    return best


def stage_exhaustive(num_layers, num_devices, sizes, cost, num_micro_batches, boundary=None):
    """The same objective by enumerating every cut and sub-mesh choice (for tests)."""
    best: tuple[float, Any] = (math.inf, [])

    def rec(i, d, stages):
        nonlocal best
        if i == num_layers:
            if d == 0:
                times = _stage_times(stages, cost, boundary)
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
           "cost_table", "cut_seconds", "logical_choices", "stage_dp", "stage_dp_counts",
           "stage_dp_table", "stage_exhaustive", "divisors", "submesh_choices"]
