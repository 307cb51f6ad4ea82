"""Every process runs process 0's plan; a process that traced another program is named."""

from __future__ import annotations

import pytest
import workers

import autoshard
from autoshard import distributed
from models import make_case, make_state, train_step


def test_two_processes_agree_and_plan_once():
    results = autoshard.launch(workers.plans, num_processes=2, devices_per_process=2,
                               timeout_s=150)
    (fp0, agreed0, once0), (fp1, agreed1, once1) = results
    assert fp0 == fp1
    assert agreed0 and agreed1 and once0 and once1  # rank 1 never called the planner


def test_different_programs_name_both_processes():
    with pytest.raises(distributed.PlanMismatchError,
                       match=r"process [01] and process [01] traced different programs") as info:
        autoshard.launch(workers.plans, {0: 16, 1: 8}, num_processes=2, devices_per_process=2,
                         timeout_s=150)
    message = str(info.value)
    assert "input arg1[0]:float32[" in message and "16,16] on process" in message


def test_one_process_returns_its_own_plan_and_fingerprints_are_stable():
    model, x, y = make_case("mlp")
    state = make_state(model, x)
    f = autoshard.parallelize(train_step, method=autoshard.DataParallel())
    ex = f.get_executable(state, (x, y))
    assert distributed.agree_on_plan("step", ex.program, ex.plan) is ex.plan
    assert distributed.agree_on_plan("step", ex.program, lambda: ex.plan) is ex.plan
    again = autoshard.parallelize(train_step, method=autoshard.DataParallel())
    assert distributed.program_fingerprint(
        again.get_executable(state, (x, y)).program) == distributed.program_fingerprint(ex.program)
    _, x8, y8 = make_case("mlp", batch=8)
    assert distributed.program_fingerprint(
        again.get_executable(state, (x8, y8)).program) != distributed.program_fingerprint(
            ex.program)
