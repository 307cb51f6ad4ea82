"""Pipeline actions and their data dependencies (what each action waits for)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

Kind = Literal["F", "B", "Ba", "Bw"]


class ScheduleLike(Protocol):
    """What a replay needs of a schedule (``schedules.Schedule`` has it)."""

    name: str
    num_stages: int
    num_ranks: int
    num_micro_batches: int
    ranks: tuple

    @property
    def has_backward(self) -> bool: ...

    def rank_of(self, stage: int) -> int: ...


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work: ``kind`` of model stage ``stage`` on micro-batch ``micro_batch``."""

    kind: str
    """``F``, ``B``, ``Ba`` (input-gradient part of B) or ``Bw`` (weight-gradient part)."""
    stage: int
    """Model stage (0 is the first forward stage)."""
    micro_batch: int
    """Micro-batch index."""

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.micro_batch}"


def _deps(a: Action, num_stages: int, backward_kind: str) -> list[Action]:
    """Actions that must finish before ``a``; ``backward_kind`` is the next stage's B or Ba."""
    j = a.micro_batch
    if a.kind == "F":
        return [Action("F", a.stage - 1, j)] if a.stage > 0 else []
    if a.kind == "Bw":
        return [Action("Ba", a.stage, j)]
    deps = [Action("F", a.stage, j)]
    if a.stage < num_stages - 1:
        deps.append(Action(backward_kind, a.stage + 1, j))
    return deps


def dependencies(a: Action, schedule: ScheduleLike) -> list[Action]:
    """What ``a`` waits for: the previous forward stage, the next backward stage, its own F/Ba.
    (Scans the schedule once; ``dependency_table`` answers for every action at once.)"""
    return _deps(a, schedule.num_stages, backward_kind(schedule))


def backward_kind(schedule: ScheduleLike) -> str:
    """``Ba`` when the schedule splits backwards into Ba and Bw, else ``B``."""
    return "Ba" if any(x.kind == "Ba" for r in schedule.ranks for x in r) else "B"


def dependency_table(schedule: ScheduleLike) -> dict[Action, list[Action]]:
    """``dependencies`` of every action of ``schedule``, in one pass over it."""
    kind = backward_kind(schedule)
    return {a: _deps(a, schedule.num_stages, kind) for r in schedule.ranks for a in r}
