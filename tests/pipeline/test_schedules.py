"""Schedules as data, replayed by the simulator: no devices involved."""

import pytest

from autoshard.pipeline.schedules import Action, Schedule, get_schedule
from autoshard.pipeline.simulate import simulate

CASES = [(2, 4), (4, 4), (4, 8), (3, 6), (8, 16)]


@pytest.mark.parametrize("num_stages,num_micro_batches", CASES)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_take_2_s_plus_m_minus_1_ticks(name, num_stages, num_micro_batches):
    sim = simulate(get_schedule(name, num_stages=num_stages,
                                num_micro_batches=num_micro_batches))
    assert sim.makespan == 2 * (num_stages + num_micro_batches - 1)
    assert sim.bubble == num_stages * 2 * (num_stages - 1)


@pytest.mark.parametrize("num_stages,num_micro_batches", CASES)
def test_1f1b_keeps_at_most_num_stages_minus_i_in_flight(num_stages, num_micro_batches):
    sim = simulate(get_schedule("1f1b", num_stages=num_stages,
                                num_micro_batches=num_micro_batches))
    for i, peak in enumerate(sim.peak_in_flight):
        assert peak <= num_stages - i
    gpipe = simulate(get_schedule("gpipe", num_stages=num_stages,
                                  num_micro_batches=num_micro_batches))
    assert gpipe.peak_in_flight == (num_micro_batches,) * num_stages


@pytest.mark.parametrize("num_stages,num_micro_batches", CASES)
def test_zero_bubble_h1_bubble_and_memory(num_stages, num_micro_batches):
    s, m = num_stages, num_micro_batches
    sim = simulate(get_schedule("zero_bubble", num_stages=s, num_micro_batches=m))
    assert sim.makespan == 3 * m + s - 1          # 1F1B with B = Ba + Bw: 3 * (m + s - 1)
    assert sim.bubble == s * (s - 1)              # (s - 1) * (F + Ba - Bw) per rank
    assert max(sim.peak_in_flight) <= s
    one = simulate(get_schedule("1f1b", num_stages=s, num_micro_batches=m), {"F": 1, "B": 2})
    assert sim.makespan < one.makespan


@pytest.mark.parametrize("num_ranks,num_micro_batches,virtual", [(2, 4, 2), (4, 8, 2), (4, 8, 3)])
def test_interleaved_1f1b_divides_the_bubble_by_virtual(num_ranks, num_micro_batches, virtual):
    r, m, v = num_ranks, num_micro_batches, virtual
    sched = get_schedule("interleaved_1f1b", num_stages=r, num_micro_batches=m, virtual=v)
    assert sched.num_stages == r * v
    sim = simulate(sched)  # one unit per chunk: a full stage costs v units
    assert sim.makespan == 2 * m * v + 2 * (r - 1)
    plain = simulate(get_schedule("1f1b", num_stages=r, num_micro_batches=m),
                     {"F": v, "B": v})
    assert plain.bubble == sim.bubble * v


def test_inference_runs_forwards_only():
    sim = simulate(get_schedule("inference", num_stages=3, num_micro_batches=4))
    assert sim.makespan == 3 + 4 - 1
    assert not sim.schedule.has_backward


def test_checker_rejects_broken_schedules():
    good = get_schedule("1f1b", num_stages=2, num_micro_batches=2)
    swapped = Schedule(name="bad", num_ranks=2, num_stages=2, num_micro_batches=2,
                       ranks=(good.ranks[0], tuple(reversed(good.ranks[1]))))
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(swapped)
    missing = Schedule(name="bad", num_ranks=2, num_stages=2, num_micro_batches=2,
                       ranks=(good.ranks[0][:-1], good.ranks[1]))
    with pytest.raises(ValueError, match="never runs B0.1"):
        simulate(missing)
    wrong_rank = Schedule(name="bad", num_ranks=2, num_stages=2, num_micro_batches=1,
                          ranks=((Action("F", 1, 0),), (Action("F", 0, 0),)))
    with pytest.raises(ValueError, match="runs on rank"):
        simulate(wrong_rank)


def test_costs_per_stage_and_render():
    sched = get_schedule("1f1b", num_stages=2, num_micro_batches=3)
    sim = simulate(sched, {("F", 0): 1, ("F", 1): 3, ("B", 0): 2, ("B", 1): 6})
    assert sim.makespan == 1 + 3 * (3 + 6) + 2
    text = sched.render()
    assert text.splitlines()[1].split()[2:4] == ["F0.0", "F0.1"]
    assert "bubble" in text.splitlines()[0]


def test_bad_schedule_names():
    with pytest.raises(ValueError, match="pipeline_schedule"):
        get_schedule("2f2b", num_stages=2, num_micro_batches=2)
    with pytest.raises(ValueError, match="divisible"):
        get_schedule("interleaved_1f1b", num_stages=2, num_micro_batches=3, virtual=2)
