"""Alpa's schedule and stage-DP interfaces, as views over ``schedules`` and ``stages``.

For code written against Alpa's ``alpa.pipeline_parallel.schedules`` and
``stage_construction``: ``GpipeSchedule``, ``PipeDreamFlush`` and ``InferenceSchedule`` take
Alpa's constructor arguments and expose its clock table (``.schedules``: per clock, per mesh,
``(micro_batch, stage)`` or None, forward stage ``i`` and its backward stage ``2n - 1 - i``,
then one clock of apply-gradient stages), built from our schedule of the same name replayed
with unit costs. ``training_dp``/``training_dp_2`` take Alpa's arguments and return its
``(cost, [((start, end), submesh_index, config_index), ...])``, solved by
``stages.stage_dp_table``. The order of micro-batches follows our schedules (GPipe's backward
runs micro-batch 0 first; Alpa's runs the last first).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .schedules import Schedule, get_schedule
from .simulate import simulate
from .stages import stage_dp_table


def gen_linear_pipeline_dependency(num_stage: int) -> np.ndarray:
    """Alpa's dependency matrix of ``num_stage // 2`` forward stages and their backwards:
    ``d[i, j] = 1`` when stage ``i`` reads stage ``j``."""
    if num_stage % 2:
        raise ValueError(f"num_stage ({num_stage}) must be even: forward stages and their "
                         "backward stages.")
    d = np.zeros((num_stage, num_stage), dtype=int)
    for i in range(num_stage - 1):
        d[i + 1, i] = 1
    for i in range(num_stage // 2):
        d[num_stage - 1 - i, i] = 1
    return d


class _AlpaSchedule:
    """Alpa's ``PipelineSchedule`` interface over one of our schedules."""

    name = ""
    backward = True

    def __init__(self, *, dependency, meshes, apply_grad_placement, num_batch=1):
        self.dependency = np.asarray(dependency)
        self.meshes = meshes
        self.apply_grad_placement = dict(apply_grad_placement)
        self.num_batch = num_batch
        n = len(meshes)
        if n < 1:
            raise ValueError("meshes must hold at least one mesh (one per pipeline rank).")
        rows = self.dependency.shape[0]
        compute = 2 * n if self.backward else n
        if self.dependency.ndim != 2 or rows != self.dependency.shape[1] or rows < compute:
            raise ValueError(
                f"dependency of shape {self.dependency.shape} must be a square matrix over "
                f"the {compute} compute stages of {n} meshes (and any apply-gradient stages).")
        for stage, mesh in self.apply_grad_placement.items():
            if not 0 <= mesh < n:
                raise ValueError(f"apply_grad_placement puts stage {stage} on mesh {mesh}; "
                                 f"there are {n} meshes.")
        self.schedule: Schedule = get_schedule(self.name, num_stages=n,
                                               num_micro_batches=num_batch)
        self._schedules = self._table()

    def _table(self) -> list[list]:
        n = len(self.meshes)
        sim = simulate(self.schedule)
        table = [[None] * n for _ in range(int(round(sim.makespan)))]
        for a, t in sim.start.items():
            stage = a.stage if a.kind == "F" else 2 * n - 1 - a.stage
            table[int(round(t))][self.schedule.rank_of(a.stage)] = (a.micro_batch, stage)
        last = [None] * n
        for stage, mesh in self.apply_grad_placement.items():
            last[mesh] = (self.last_backward_batch_index, stage)
        return table + [last]

    @property
    def schedules(self) -> list[list]:
        """Per clock, per mesh: ``(micro_batch, stage)`` or None."""
        return self._schedules

    @property
    def num_stage(self) -> int:
        return self.dependency.shape[0]

    @property
    def num_mesh(self) -> int:
        return len(self.meshes)

    @property
    def num_clock(self) -> int:
        return len(self._schedules)

    @property
    def stage_mesh_mapping(self) -> dict:
        out: dict = {}
        for clock in self._schedules:
            for mesh, task in enumerate(clock):
                if task:
                    out.setdefault(task[1], {})[mesh] = None
        return {s: list(m) for s, m in out.items()}

    @property
    def mesh_stage_mapping(self) -> dict:
        out: dict = {}
        for clock in self._schedules:
            for mesh, task in enumerate(clock):
                if task:
                    out.setdefault(mesh, {})[task[1]] = None
        return {m: list(s) for m, s in out.items()}

    def stage_placement(self, stage_idx: int) -> list:
        """The meshes that run stage ``stage_idx``."""
        return self.stage_mesh_mapping[stage_idx]

    def mesh_placement(self, mesh_idx: int) -> list:
        """The stages mesh ``mesh_idx`` runs."""
        return self.mesh_stage_mapping[mesh_idx]

    @property
    def first_backward_batch_index(self) -> int:
        return 0

    @property
    def last_backward_batch_index(self) -> int:
        return self.num_batch - 1

    def previous_backward_batch_index(self, batch_idx: int) -> int:
        if batch_idx <= 0:
            raise ValueError(f"micro-batch {batch_idx} has no backward before it.")
        return batch_idx - 1

    def should_skip_grad_sync(self, task) -> bool:
        """True except on the last backward micro-batch (where gradients are reduced)."""
        return task[0] != self.last_backward_batch_index

    def pprint_schedule(self, to_print: bool = False) -> str:
        lines = ["Clock k : " + " ".join(f"d{d:<8}" for d in range(self.num_mesh))]
        for k, clock in enumerate(self._schedules):
            lines.append(f"Clock {k:<2}: " + " ".join(f"{str(t):<8}" for t in clock))
        text = "\n" + "\n".join(lines) + "\n"
        if to_print:
            print(text)
        return text


class GpipeSchedule(_AlpaSchedule):
    """Alpa's ``GpipeSchedule`` over ``schedules.gpipe``."""

    name = "gpipe"


class PipeDreamFlush(_AlpaSchedule):
    """Alpa's ``PipeDreamFlush`` (1F1B) over ``schedules.one_f_one_b``."""

    name = "1f1b"


class InferenceSchedule(_AlpaSchedule):
    """Alpa's ``InferenceSchedule`` (forwards only) over ``schedules.inference``."""

    name = "inference"
    backward = False


def get_submesh_choices(num_hosts: int, num_devices_per_host: int, space: str,
                        manually_specified_submeshes: Sequence[tuple[int, int]] | None = None
                        ) -> tuple[tuple[int, int], ...]:
    """Alpa's sub-mesh shapes: ``(1, 2**i)`` up to a host, then whole hosts by ``space``
    (``all``: every count, ``power_of_two``, ``small_power_of_two``: up to 4; ``manual``)."""
    if space == "manual":
        if not manually_specified_submeshes:
            raise ValueError("space='manual' needs manually_specified_submeshes.")
        return tuple(tuple(s) for s in manually_specified_submeshes)
    if num_devices_per_host < 1 or num_devices_per_host & (num_devices_per_host - 1):
        raise ValueError(f"num_devices_per_host ({num_devices_per_host}) must be a power of "
                         "two.")
    out = [(1, 2 ** i) for i in range(int(math.log2(num_devices_per_host)) + 1)]
    hosts = {"all": range(2, num_hosts + 1),
             "power_of_two": [2 ** i for i in range(1, 32) if 2 ** i <= num_hosts],
             "small_power_of_two": [h for h in (2, 4) if h <= num_hosts]}.get(space)
    if hosts is None:
        raise ValueError(f"space ({space!r}) must be 'all', 'power_of_two', "
                         "'small_power_of_two' or 'manual'.")
    return tuple(out + [(h, num_devices_per_host) for h in hosts])


def _solve(num_devices, num_microbatches, submesh_choices, compute_cost, max_n_succ_stages):
    compute_cost = np.asarray(compute_cost, dtype=np.float64)
    num_layers, _, num_submeshes, num_configs = compute_cost.shape
    if num_submeshes != len(submesh_choices):
        raise ValueError(f"compute_cost has {num_submeshes} sub-mesh entries for "
                         f"{len(submesh_choices)} submesh_choices.")
    # choice k = (sub-mesh m, config c); layers [i, j) are Alpa's [i, j - 1]
    cost = np.full((num_layers, num_layers + 1, num_submeshes * num_configs), math.inf)
    limit = np.full(cost.shape, -1)
    upper = np.triu_indices(num_layers)
    flat = compute_cost.reshape(num_layers, num_layers, -1)
    cost[upper[0], upper[1] + 1] = flat[upper]
    limit[upper[0], upper[1] + 1] = np.asarray(max_n_succ_stages).reshape(
        num_layers, num_layers, -1)[upper]
    sizes = [int(np.prod(submesh_choices[k // num_configs])) for k in range(cost.shape[2])]
    obj, stages = stage_dp_table(cost, sizes, num_devices, num_microbatches, limit)
    if not stages:
        return math.inf, None
    return obj, [((i, j), k // num_configs, k % num_configs) for i, j, k in stages]


def training_dp(num_layers, num_devices, num_microbatches, submesh_choices,
                num_autosharding_configs, compute_cost, max_n_succ_stages):
    """Alpa's ``training_dp``: ``(cost, [((start, end), submesh, config), ...])`` with
    ``end`` exclusive, or ``(inf, None)``. ``compute_cost[start, end_inclusive, submesh,
    config]``; ``max_n_succ_stages`` (same shape): the most stages allowed after that one."""
    shape = np.shape(compute_cost)
    if len(shape) != 4 or shape[:2] != (num_layers, num_layers) or (
            shape[3] != num_autosharding_configs):
        raise ValueError(
            f"compute_cost has shape {shape}; it must be (num_layers, num_layers, "
            f"len(submesh_choices), num_autosharding_configs) = ({num_layers}, {num_layers}, "
            f"{len(submesh_choices)}, {num_autosharding_configs}).")
    return _solve(num_devices, num_microbatches, submesh_choices, compute_cost,
                  max_n_succ_stages)


def training_dp_2(num_devices, num_microbatches, submesh_choices, compute_cost,
                  max_n_succ_stages):
    """Alpa's second ``training_dp`` signature (layer and config counts from the shape)."""
    return _solve(num_devices, num_microbatches, submesh_choices, compute_cost,
                  max_n_succ_stages)


__all__ = ["GpipeSchedule", "InferenceSchedule", "PipeDreamFlush",
           "gen_linear_pipeline_dependency", "get_submesh_choices", "training_dp",
           "training_dp_2"]
