"""Pipeline schedules as plain data: per rank (stage group), the ordered actions it runs.

An action is a forward (``F``), a backward (``B``), or a backward split into its
input-gradient part (``Ba``: the cotangents the previous stage needs) and its weight-gradient
part (``Bw``: the parameter gradients, fed with the intermediate cotangents ``Ba`` computed,
so nothing is recomputed). Every action names a model stage and a micro-batch. A rank runs
its actions in order; model stage ``s`` lives on rank ``s % num_ranks`` (with virtual stages
each rank holds ``num_stages // num_ranks`` chunks, as in Megatron's interleaved schedule).

Schedules:
``gpipe``             all forwards, then all backwards.
``1f1b``              ``num_ranks - i - 1`` warm-up forwards on rank i, then one forward one
                      backward; at most ``num_stages - i`` micro-batches in flight on stage i.
``inference``         forwards only.
``interleaved_1f1b``  ``virtual`` chunks per rank (Megatron): the bubble shrinks by ``virtual``.
``zero_bubble``       ZB-H1: 1F1B order of forwards and input-gradients, weight-gradient work
                      fills the idle slots; in-flight activations as 1F1B.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .actions import Action, _deps, dependencies
from .simulate import simulate

ScheduleName = Literal["gpipe", "1f1b", "inference", "interleaved_1f1b", "zero_bubble"]
SCHEDULES = ("gpipe", "1f1b", "inference", "interleaved_1f1b", "zero_bubble")


@dataclass(frozen=True, kw_only=True)
class ScheduleTraits:
    """What the rest of the pipeline needs to know of a schedule, so that no module tests a
    schedule by its name."""

    trains: bool
    """Runs backward tasks (every schedule but ``inference``)."""
    splits_backward: bool
    """Runs each backward as an input-gradient part ``Ba`` and a weight-gradient part ``Bw``."""
    virtual: bool
    """Places several model stages (chunks) on each sub-mesh."""


TRAITS = {
    "gpipe": ScheduleTraits(trains=True, splits_backward=False, virtual=False),
    "1f1b": ScheduleTraits(trains=True, splits_backward=False, virtual=False),
    "inference": ScheduleTraits(trains=False, splits_backward=False, virtual=False),
    "interleaved_1f1b": ScheduleTraits(trains=True, splits_backward=False, virtual=True),
    "zero_bubble": ScheduleTraits(trains=True, splits_backward=True, virtual=False),
}


def traits(name: str) -> ScheduleTraits:
    """The traits of schedule ``name`` (checked)."""
    if name not in TRAITS:
        raise ValueError(f"pipeline_schedule ({name!r}) must be one of {SCHEDULES}.")
    return TRAITS[name]


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """Per rank, the ordered actions; plain data that a simulator or a runtime replays."""

    name: str
    """Schedule name (one of ``SCHEDULES``)."""
    num_ranks: int
    """Stage groups (sub-meshes) running in parallel."""
    num_stages: int
    """Model stages (``num_ranks * virtual``)."""
    num_micro_batches: int
    """Micro-batches per step."""
    ranks: tuple[tuple[Action, ...], ...] = field(repr=False)
    """Per rank, its actions in execution order."""

    def __post_init__(self):
        assert len(self.ranks) == self.num_ranks
        assert self.num_stages % self.num_ranks == 0

    def rank_of(self, stage: int) -> int:
        """The rank that runs model stage ``stage``."""
        return stage % self.num_ranks

    @property
    def virtual(self) -> int:
        """Chunks (model stages) per rank."""
        return self.num_stages // self.num_ranks

    @property
    def has_backward(self) -> bool:
        return any(a.kind != "F" for r in self.ranks for a in r)

    @property
    def traits(self) -> ScheduleTraits:
        return traits(self.name)

    def render(self, costs=None) -> str:
        """The schedule as a text table: one row per rank, one column per time step."""
        return simulate(self, costs).render()


def get_schedule(name: str, *, num_stages: int, num_micro_batches: int,
                 virtual: int = 1) -> Schedule:
    """The schedule ``name`` for ``num_stages`` ranks (times ``virtual`` chunks for interleaved)."""
    virtual_chunks = traits(name).virtual
    for what, n in (("num_stages", num_stages), ("num_micro_batches", num_micro_batches),
                    ("virtual", virtual)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{what} ({n!r}) must be a positive int.")
    if not virtual_chunks and virtual != 1:
        raise ValueError(f"virtual ({virtual}) applies to 'interleaved_1f1b' only; use "
                         "virtual=1 or pipeline_schedule='interleaved_1f1b'.")
    make = {"gpipe": gpipe, "1f1b": one_f_one_b, "inference": inference,
            "zero_bubble": zero_bubble}.get(name)
    if make is not None:
        return make(num_stages, num_micro_batches)
    return interleaved_1f1b(num_stages, num_micro_batches, virtual)


def _schedule(name, r, m, ranks, stages=None) -> Schedule:
    return Schedule(name=name, num_ranks=r, num_stages=stages or r, num_micro_batches=m,
                    ranks=tuple(tuple(a) for a in ranks))


def inference(num_stages: int, num_micro_batches: int) -> Schedule:
    ranks = [[Action("F", i, j) for j in range(num_micro_batches)] for i in range(num_stages)]
    return _schedule("inference", num_stages, num_micro_batches, ranks)


def gpipe(num_stages: int, num_micro_batches: int) -> Schedule:
    m = num_micro_batches
    ranks = [[Action("F", i, j) for j in range(m)] + [Action("B", i, j) for j in range(m)]
             for i in range(num_stages)]
    return _schedule("gpipe", num_stages, m, ranks)


def one_f_one_b(num_stages: int, num_micro_batches: int) -> Schedule:
    s, m = num_stages, num_micro_batches
    ranks = []
    for i in range(s):
        warm = min(s - i - 1, m)
        acts = [Action("F", i, j) for j in range(warm)]
        for j in range(m - warm):
            acts += [Action("F", i, warm + j), Action("B", i, j)]
        acts += [Action("B", i, j) for j in range(m - warm, m)]
        ranks.append(acts)
    return _schedule("1f1b", s, m, ranks)


def interleaved_1f1b(num_ranks: int, num_micro_batches: int, virtual: int) -> Schedule:
    """Megatron's interleaved 1F1B: model stage ``c * num_ranks + i`` is chunk c of rank i."""
    r, m, v = num_ranks, num_micro_batches, virtual
    if m % r:
        raise ValueError(
            f"interleaved_1f1b needs num_micro_batches ({m}) divisible by the number of "
            f"stage groups ({r}). Choose a multiple of {r}.")
    total = m * v

    def unit(k: int, forward: bool) -> tuple[int, int]:
        group, pos = divmod(k, r * v)
        chunk, offset = divmod(pos, r)
        if not forward:
            chunk = v - 1 - chunk
        return chunk, group * r + offset

    ranks = []
    for i in range(r):
        warm = min(total, (r - i - 1) * 2 + (v - 1) * r)
        # warm-up forwards, then one forward one backward, then the remaining backwards
        order = ["F"] * warm + ["F", "B"] * (total - warm) + ["B"] * warm
        acts, done = [], {"F": 0, "B": 0}
        for kind in order:
            c, j = unit(done[kind], kind == "F")
            acts.append(Action(kind, c * r + i, j))
            done[kind] += 1
        ranks.append(acts)
    return _schedule("interleaved_1f1b", r, m, ranks, stages=r * v)


def zero_bubble(num_stages: int, num_micro_batches: int) -> Schedule:
    """ZB-H1: 1F1B's order of F and Ba; each Bw fills a slot where the next F/Ba must wait.

    Built by replaying unit costs (F = Ba = Bw = 1): a rank whose next F or Ba is not ready
    runs its oldest pending Bw instead, and rank i never holds more than ``i`` pending Bw.
    With equal costs it takes ``3 * num_micro_batches + num_stages - 1`` steps (1F1B with the
    same split takes ``3 * (num_micro_batches + num_stages - 1)``): the bubble per rank is
    ``(num_stages - 1) * (F + Ba - Bw)``, and at most ``num_stages`` micro-batches are in
    flight on any stage (1F1B's peak).
    """
    s, m = num_stages, num_micro_batches
    order = [[a if a.kind == "F" else Action("Ba", a.stage, a.micro_batch) for a in r]
             for r in one_f_one_b(s, m).ranks]
    done: dict[Action, int] = {}
    ranks: list[list[Action]] = [[] for _ in range(s)]
    nxt, pending = [0] * s, [[] for _ in range(s)]
    t = 0
    while any(nxt[i] < len(order[i]) or pending[i] for i in range(s)):
        for i in range(s):
            act = order[i][nxt[i]] if nxt[i] < len(order[i]) else None
            ready = act is not None and all(done.get(d, t + 1) <= t
                                            for d in _deps(act, s, "Ba"))
            if pending[i] and (not ready or len(pending[i]) > i):
                act = pending[i].pop(0)
            elif ready:
                nxt[i] += 1
                if act.kind == "Ba":
                    pending[i].append(Action("Bw", i, act.micro_batch))
            else:
                continue
            ranks[i].append(act)
            done[act] = t + 1
        t += 1
    return _schedule("zero_bubble", s, m, ranks)


__all__ = ["Action", "Schedule", "SCHEDULES", "get_schedule", "dependencies", "gpipe",
           "one_f_one_b", "inference", "interleaved_1f1b", "zero_bubble"]
