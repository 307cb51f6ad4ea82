"""The schedule replay (``pipeline.simulate``) is linear in the actions and gives the times a
plain round-robin replay gives (issue 26, item 3: the replay rescanned the schedule for every
action, 204 s at 65,536 actions)."""

import random

import pytest

from autoshard.pipeline import schedules
from autoshard.pipeline.actions import Action, dependency_table
from autoshard.pipeline.simulate import cost_of, simulate


def round_robin_replay(schedule, costs):
    """Start and end of every action: ranks in turn, each running what it can (the replay as
    first written, quadratic but obviously right)."""
    deps = dependency_table(schedule)
    start, end, nxt = {}, {}, [0] * schedule.num_ranks
    free = [0.0] * schedule.num_ranks
    left = sum(len(r) for r in schedule.ranks)
    while left:
        moved = False
        for r, acts in enumerate(schedule.ranks):
            while nxt[r] < len(acts) and all(d in end for d in deps[acts[nxt[r]]]):
                a = acts[nxt[r]]
                start[a] = max([free[r]] + [end[d] for d in deps[a]])
                end[a] = free[r] = start[a] + cost_of(costs, a)
                nxt[r] += 1
                left -= 1
                moved = True
        assert moved, "deadlock"
    return start, end


SCHEDULES = [
    ("gpipe", lambda: schedules.gpipe(4, 6)),
    ("1f1b", lambda: schedules.one_f_one_b(4, 7)),
    ("interleaved_1f1b", lambda: schedules.interleaved_1f1b(2, 4, 2)),
    ("zero_bubble", lambda: schedules.zero_bubble(3, 5)),
    ("inference", lambda: schedules.inference(3, 4)),
]


@pytest.mark.parametrize("name,make", SCHEDULES, ids=[n for n, _ in SCHEDULES])
def test_replay_times_equal_a_round_robin_replay(name, make):
    schedule = make()
    rng = random.Random(0)
    costs = {(k, s): rng.uniform(0.5, 2.0) for k in ("F", "B", "Ba", "Bw")
             for s in range(schedule.num_stages)}
    sim = simulate(schedule, costs)
    start, end = round_robin_replay(schedule, costs)
    assert sim.start == pytest.approx(start) and sim.end == pytest.approx(end)
    order = sim.order()
    assert len(order) == len(start) and len(set(order)) == len(order)
    assert all(sim.start[a] <= sim.start[b] for a, b in zip(order, order[1:], strict=False))


def test_a_deadlocked_schedule_is_an_error_naming_the_waiting_actions():
    good = schedules.one_f_one_b(2, 2)
    # rank 1 asks for the backward of micro-batch 1 before its forward ran
    swapped = tuple(tuple(reversed(r)) if i == 1 else r for i, r in enumerate(good.ranks))
    bad = type(good)(**{**good.__dict__, "ranks": swapped})
    with pytest.raises(ValueError, match=r"deadlocks.*next actions: \[.*B1\.1"):
        simulate(bad)


def test_a_long_schedule_replays_from_one_dependency_table():
    """Each action is looked at a bounded number of times: the dependency table is built once
    (one entry per action) and the replay visits each action once after it can run."""
    schedule = schedules.one_f_one_b(32, 1024)
    table = dependency_table(schedule)
    assert len(table) == 65536 and all(len(d) <= 2 for d in table.values())
    sim = simulate(schedule)
    assert len(sim.start) == 65536
    assert sim.end[Action("B", 0, 1023)] == max(sim.end.values())


def test_schedule_traits_answer_what_modules_asked_of_names():
    """Modules ask a schedule's traits, never its name (issue 23)."""
    from autoshard.pipeline.schedules import SCHEDULES, TRAITS, get_schedule, traits

    assert set(TRAITS) == set(SCHEDULES)
    for name in SCHEDULES:
        virtual = 2 if traits(name).virtual else 1
        s = get_schedule(name, num_stages=2, num_micro_batches=4, virtual=virtual)
        assert s.traits == traits(name)
        assert s.has_backward == traits(name).trains
        assert any(a.kind == "Ba" for r in s.ranks for a in r) == traits(name).splits_backward
        assert (s.virtual > 1) == traits(name).virtual
    with pytest.raises(ValueError, match=r"pipeline_schedule \('1F1B'\) must be one of"):
        traits("1F1B")
    with pytest.raises(ValueError, match=r"virtual \(2\) applies to 'interleaved_1f1b' only"):
        get_schedule("gpipe", num_stages=2, num_micro_batches=4, virtual=2)
