"""Replay a schedule with per-action costs: check it, time it, and draw it.

``simulate`` runs every rank's actions in order, each starting when its rank is free and the
actions it depends on (``actions.dependencies``) have finished. It raises when a schedule
misses an action, repeats one, or can never make progress (a dependency cycle), and reports
the makespan, the bubble (idle time of all ranks) and the peak number of micro-batches in
flight per stage (forward started, last backward part not finished).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .actions import Action, ScheduleLike, dependency_table

Costs = Mapping | Callable[[Action], float] | None
"""Per-action costs: None (every action 1), ``{kind: cost}``, ``{(kind, stage): cost}``, or a
function of the action."""


@dataclass(frozen=True, kw_only=True)
class Simulation:
    """The replay of a schedule: when each action ran, idle time and memory in flight."""

    schedule: ScheduleLike
    """The replayed schedule."""
    start: dict
    """Action -> start time."""
    end: dict
    """Action -> end time."""
    makespan: float
    """Time from the first action's start to the last one's end."""
    busy: tuple[float, ...]
    """Per rank, the time spent running actions."""
    peak_in_flight: tuple[int, ...]
    """Per model stage, the most micro-batches whose activations are alive at once."""

    @property
    def bubble(self) -> float:
        """Idle time summed over ranks (rank-time units)."""
        return self.schedule.num_ranks * self.makespan - sum(self.busy)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all rank time."""
        total = self.schedule.num_ranks * self.makespan
        return self.bubble / total if total else 0.0

    def order(self) -> list[Action]:
        """One global order of all actions (by start time, then rank): what a controller walks."""
        s = self.schedule
        return sorted(self.start, key=lambda a: (self.start[a], s.rank_of(a.stage)))

    def explain(self) -> str:
        """The replay's numbers (makespan, bubble, busy time and micro-batches in flight, in
        the units of the costs), then each rank's actions by start time (``render``)."""
        s = self.schedule
        stages = ", ".join(f"{p}" for p in self.peak_in_flight)
        busy = ", ".join(f"{b:g}" for b in self.busy)
        return "\n".join([
            f"simulation of {s.name}: {s.num_stages} stages on {s.num_ranks} ranks, "
            f"{s.num_micro_batches} micro-batches",
            f"  makespan {self.makespan:g}; bubble {self.bubble:g} rank-time "
            f"({self.bubble_fraction:.1%} of all rank time idle)",
            f"  busy time per rank: {busy}",
            f"  peak micro-batches in flight per stage (activations kept): {stages}",
            *self.render().splitlines()[1:]])

    def __str__(self) -> str:
        return self.explain()

    def render(self) -> str:
        """A text table: one row per rank, one column per distinct start time."""
        s = self.schedule
        times = sorted({self.start[a] for a in self.start})
        col = {t: i for i, t in enumerate(times)}
        width = max([len(str(a)) for a in self.start] + [3])
        rows = [f"{s.name}: {s.num_ranks} ranks, {s.num_stages} stages, "
                f"{s.num_micro_batches} micro-batches; makespan {self.makespan:g}, "
                f"bubble {self.bubble_fraction:.1%}"]
        for r, acts in enumerate(s.ranks):
            cells = ["." * 1] * len(times)
            for a in acts:
                cells[col[self.start[a]]] = str(a)
            rows.append(f"rank {r}: " + " ".join(c.ljust(width) for c in cells).rstrip())
        return "\n".join(rows)


def cost_of(costs: Costs, a: Action) -> float:
    if costs is None:
        return 1.0
    if callable(costs):
        return float(costs(a))
    if (a.kind, a.stage) in costs:
        return float(costs[(a.kind, a.stage)])
    if a.kind in costs:
        return float(costs[a.kind])
    if a.kind in ("Ba", "Bw") and "B" in costs:
        return float(costs["B"]) / 2
    raise ValueError(f"costs has no entry for {a} (kind {a.kind!r}, stage {a.stage}); give "
                     "a cost per kind or per (kind, stage).")


def check_complete(schedule: ScheduleLike) -> None:
    """Every stage runs F (and B, or Ba and Bw) once per micro-batch, on the right rank."""
    seen: set[Action] = set()
    for r, acts in enumerate(schedule.ranks):
        for a in acts:
            if schedule.rank_of(a.stage) != r:
                raise ValueError(f"{a} is listed on rank {r} but stage {a.stage} runs on rank "
                                 f"{schedule.rank_of(a.stage)}.")
            if a in seen:
                raise ValueError(f"{a} appears twice in schedule {schedule.name!r}.")
            seen.add(a)
    kinds = {"F"} if not schedule.has_backward else (
        {"F", "Ba", "Bw"} if any(a.kind == "Ba" for a in seen) else {"F", "B"})
    for s in range(schedule.num_stages):
        for j in range(schedule.num_micro_batches):
            for k in sorted(kinds):
                if Action(k, s, j) not in seen:
                    raise ValueError(f"schedule {schedule.name!r} never runs {Action(k, s, j)}.")


def simulate(schedule: ScheduleLike, costs: Costs = None) -> Simulation:
    """Replay ``schedule``; raises ValueError if it is incomplete or deadlocks.

    Linear in the number of actions: each action's dependencies are listed once, and a rank
    that waits is woken by the action it waits for (not found again by rescanning)."""
    check_complete(schedule)
    deps_of = dependency_table(schedule)
    start: dict[Action, float] = {}
    end: dict[Action, float] = {}
    nxt = [0] * schedule.num_ranks
    free = [0.0] * schedule.num_ranks
    busy = [0.0] * schedule.num_ranks
    waiting: dict[Action, list[int]] = {}   # an action not run yet -> ranks waiting on it
    ready = list(range(schedule.num_ranks))
    while ready:
        r = ready.pop()
        acts = schedule.ranks[r]
        while nxt[r] < len(acts):
            a = acts[nxt[r]]
            deps = deps_of[a]
            missing = next((d for d in deps if d not in end), None)
            if missing is not None:
                waiting.setdefault(missing, []).append(r)
                break
            t0 = max([free[r]] + [end[d] for d in deps])
            c = cost_of(costs, a)
            start[a], end[a] = t0, t0 + c
            free[r] = t0 + c
            busy[r] += c
            nxt[r] += 1
            ready.extend(waiting.pop(a, ()))
    if any(nxt[r] < len(acts) for r, acts in enumerate(schedule.ranks)):
        stuck = [str(acts[nxt[r]]) for r, acts in enumerate(schedule.ranks)
                 if nxt[r] < len(acts)]
        raise ValueError(f"schedule {schedule.name!r} deadlocks: each rank waits on an "
                         f"action that never runs first (next actions: {stuck}).")
    makespan = max(end.values()) - min(start.values()) if end else 0.0
    return Simulation(schedule=schedule, start=start, end=end, makespan=makespan,
                      busy=tuple(busy), peak_in_flight=_peak_in_flight(schedule, start, end))


def _peak_in_flight(schedule: ScheduleLike, start, end) -> tuple[int, ...]:
    peaks = []
    last = "F" if not schedule.has_backward else None
    for s in range(schedule.num_stages):
        events = []
        for j in range(schedule.num_micro_batches):
            f = Action("F", s, j)
            done = [a for a in (Action("B", s, j), Action("Bw", s, j)) if a in end]
            events.append((start[f], 1))
            events.append((end[f] if last == "F" else end[done[0]], -1))
        count = peak = 0
        for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
            count += delta
            peak = max(peak, count)
        peaks.append(peak)
    return tuple(peaks)


__all__ = ["Costs", "Simulation", "check_complete", "cost_of", "simulate"]
