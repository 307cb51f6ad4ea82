"""AutoShardingOption: knobs of the automatic intra-operator planner."""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass

DEFAULT_MEMORY_TRADEOFF = 0.1
"""``AutoShardingOption.memory_tradeoff`` of a whole step's plan when the option is None."""


@dataclass(frozen=True, kw_only=True)
class AutoShardingOption:
    """Options of the automatic planner (``ShardParallel()`` without a manual option)."""

    logical_mesh_shape: tuple[int, ...] | None = None
    """Shape of the logical device mesh; None tries 1-D and every 2-D factorization."""
    mesh_alpha: tuple[float, ...] | None = None
    """Per-axis latency in seconds; None uses the defaults of ``sharding.cost``."""
    mesh_beta: tuple[float, ...] | None = None
    """Per-axis inverse bandwidth in seconds per byte; None: from where the devices are (every
    axis inside one host costs the same; axes crossing hosts cost more; see ``sharding.cost``)."""
    memory_budget_per_device: int | None = None
    """Upper bound on the estimated bytes per device; None means unbounded."""
    force_data_parallel: bool = False
    """Split the batch over all devices and replicate everything else."""
    force_batch_dim_to_mesh_dim: int | None = None
    """Mesh axis the batch dim must be split over; None lets the solver choose. As in Alpa,
    an axis of one device keeps the batch inputs unsplit (a warning says so), and the only
    axis of more than one device makes the plan data parallel."""
    prefer_reduce_scatter: bool = False
    """Use reduce-scatter instead of all-reduce where the consumer can take a shard."""
    allow_all_gather: bool = True
    """Allow strategies that all-gather an operand."""
    allow_all_to_all: bool = True
    """Allow resharding through all-to-all."""
    allow_replicated_parameters: bool = True
    """Allow parameters to stay replicated."""
    memory_tradeoff: float | None = None
    """Estimated step time (a fraction) the planner may give up for less memory: the chosen
    mesh's ILP is solved again weighing a fraction of peak memory as much as the same fraction
    of time, and that plan is taken when its peak is at least 1% lower and its time within
    this fraction of the fastest (``sharding/least_memory.py``). None, for the plan of a whole
    step on devices of unbounded memory without a budget or a micro-batch loop: the default
    weighs memory (``pareto.expert_choice``: weight gradients may be reduce-scattered into
    sharded updates, and of the plans found the one of least bytes sent plus peak memory is
    taken, at most ``pareto.MAX_SLOWDOWN`` slower); elsewhere ``DEFAULT_MEMORY_TRADEOFF``
    (0.1, about the cost model's own error) for the plan of a whole step, 0 for a pipeline's
    task plans (a task's peak is not its stage's: trading each task's time for its own memory
    moved 5x the bytes on the pipeline benchmark). 0: the fastest plan whatever its memory, as
    Alpa did. Example: on the suite's GPT (2x4 mesh) 0.1 takes a plan with 18% less compiled
    memory (21.2 MB against 26.0 MB) for 7.6% more estimated time."""
    solver_node_limit: int = 20_000
    """Branch-and-bound nodes the ILP solver may explore per mesh. A deterministic stop: the
    same program, devices and options give the same plan on an idle or a loaded machine. On
    reaching it the best plan found is used and its optimality gap is noted."""
    solver_time_limit_s: float = 600.0
    """Wall-clock safety stop of the ILP solver. A plan it cuts short could differ between
    runs, so it warns with the gap; lower ``solver_node_limit`` to stop deterministically."""
    solver_mip_gap: float = 1e-4
    """Relative optimality gap at which the ILP solver stops (HiGHS's ``mip_rel_gap``): the
    plan returned costs at most this fraction more than the best plan of its mesh. Wider gaps
    end the branch and bound sooner on large ILPs (a 48-layer step on a (32, 16) mesh: 71 s
    at 1e-4, 11 s at 1e-2, the same plan)."""
    exact_resharding_columns: int = 20_000
    """ILP columns spent on exact pairwise resharding costs on meshes with several axes (the
    rest use per-axis terms); more is exact on more edges and slower to solve."""
    show_progress: bool | None = None
    """A progress bar while planning: None (default) when stderr is a terminal (never in a
    piped log), True always, False never."""

    def __post_init__(self):
        if self.show_progress not in (None, True, False):
            raise ValueError(
                f"show_progress ({self.show_progress!r}) must be None (a bar only on a "
                "terminal), True or False.")
        if self.logical_mesh_shape is not None:
            shape = tuple(self.logical_mesh_shape)
            if not shape or any(not isinstance(s, int) or s < 1 for s in shape):
                raise ValueError(
                    f"logical_mesh_shape ({self.logical_mesh_shape!r}) must be a tuple of "
                    "positive ints, e.g. (2, 4). Pass None to let the planner choose.")
            object.__setattr__(self, "logical_mesh_shape", shape)
        for name in ("mesh_alpha", "mesh_beta"):
            value = getattr(self, name)
            if value is not None:
                value = tuple(float(v) for v in value)
                if any(v < 0 or not math.isfinite(v) for v in value):
                    raise ValueError(f"{name} ({value!r}) must hold finite non-negative floats.")
                object.__setattr__(self, name, value)
        if self.memory_budget_per_device is not None and self.memory_budget_per_device <= 0:
            raise ValueError(
                f"memory_budget_per_device ({self.memory_budget_per_device}) must be a positive "
                "number of bytes, or None for no budget.")
        if self.memory_tradeoff is not None and not (
                isinstance(self.memory_tradeoff, (int, float))
                and 0 <= self.memory_tradeoff < math.inf):
            raise ValueError(
                f"memory_tradeoff ({self.memory_tradeoff!r}) must be a non-negative fraction of "
                "the estimated step time, e.g. 0.1 (0: the fastest plan; None: the default).")
        if self.exact_resharding_columns < 0:
            raise ValueError(
                f"exact_resharding_columns ({self.exact_resharding_columns}) must be a "
                "non-negative number of ILP columns (0: per-axis resharding terms only).")
        if not isinstance(self.solver_node_limit, int) or self.solver_node_limit < 1:
            raise ValueError(
                f"solver_node_limit ({self.solver_node_limit!r}) must be a positive int "
                "(branch-and-bound nodes).")
        a = self.force_batch_dim_to_mesh_dim
        if a is not None:
            rank = None if self.logical_mesh_shape is None else len(self.logical_mesh_shape)
            if not isinstance(a, int) or a < 0 or (rank is not None and a >= rank) or a > 1:
                raise ValueError(
                    f"force_batch_dim_to_mesh_dim ({a!r}) names no axis of the logical mesh "
                    f"{self.logical_mesh_shape or '(1-D or 2-D, chosen by the planner)'}. "
                    f"Give an axis index below {rank or 2}, or None.")
            if rank is not None and self.logical_mesh_shape[a] == 1:
                _warn_once(
                    f"force_batch_dim_to_mesh_dim ({a}) names an axis of size 1 in "
                    f"logical_mesh_shape {self.logical_mesh_shape}: the batch inputs are not "
                    "split over the other axes (as in Alpa). Name an axis of size > 1 to split "
                    "them.")
        g = self.solver_mip_gap
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 <= g < 1:
            raise ValueError(
                f"solver_mip_gap ({g!r}) must be a fraction in [0, 1), e.g. 1e-3 (the plan at "
                "most 0.1% above the best of its mesh).")
        if self.solver_time_limit_s <= 0:
            raise ValueError(
                f"solver_time_limit_s ({self.solver_time_limit_s}) must be positive seconds.")


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, UserWarning, stacklevel=4)


def for_task_plans(option: AutoShardingOption) -> AutoShardingOption:
    """``option`` as a pipeline plans its tasks with: an unset ``memory_tradeoff`` is 0 there
    (a task's peak is not its stage's); a value the user gave is kept."""
    if option.memory_tradeoff is not None:
        return option
    return dataclasses.replace(option, memory_tradeoff=0.0)
