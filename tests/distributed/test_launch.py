"""autoshard.launch with the local backend: 2 processes x 2 CPU devices on loopback."""

from __future__ import annotations

import os
import time

import jax
import pytest
import workers

import autoshard

TIMEOUT_S = 150


def launch(fn, *args, timeout_s=TIMEOUT_S):
    return autoshard.launch(fn, *args, num_processes=2, devices_per_process=2,
                            timeout_s=timeout_s)


def test_data_and_shard_parallel_across_two_processes_equal_one_process_run():
    workers.assert_equal_to_one_process_run(launch(workers.train))


def test_zero_and_gradient_accumulation_across_two_processes_equal_one_process_run():
    results = launch(workers.train, workers.MORE_METHODS)
    reference = workers.train(workers.MORE_METHODS, devices=jax.devices()[:4])
    for method in workers.MORE_METHODS:
        for r in results:
            workers.assert_same_run(r[method], reference[method])


def test_worker_exception_is_reraised_with_rank_and_traceback():
    with pytest.raises(ValueError, match="bad shard 7") as info:
        launch(workers.fail_on, 1, "bad shard 7", timeout_s=60)
    assert info.value.autoshard_rank == 1
    cause = str(info.value.__cause__)
    assert "process 1 of 2" in cause and "in fail_on" in cause and "raise ValueError" in cause


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes
        return f.read().split()[2] != "Z"


def _pids(pid_dir) -> list[int]:
    return [int(p.read_text()) for p in pid_dir.iterdir()]


def test_dead_worker_stops_the_others_and_raises_within_timeout(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(autoshard.WorkerError, match=r"process 1 of 2 .* died \(killed by SIGKILL"):
        launch(workers.die_mid_step, str(tmp_path), timeout_s=60)
    assert time.monotonic() - t0 < 60
    pids = _pids(tmp_path)
    assert len(pids) == 2 and not any(_alive(p) for p in pids)


def test_stuck_job_times_out_and_leaves_no_orphans(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not finish within timeout_s=8 s"):
        launch(workers.hang, str(tmp_path), timeout_s=8)
    assert time.monotonic() - t0 < 8 + 15
    pids = _pids(tmp_path)
    assert len(pids) == 2 and not any(_alive(p) for p in pids)


def test_shutdown_then_init_again_in_the_same_processes():
    results = launch(workers.reinit_round_trip)
    assert results == [(3.0, 20.0, 2, 4)] * 2


@pytest.mark.parametrize("kwargs, match", [
    ({"num_processes": 0}, r"num_processes \(0\) must be a positive int"),
    ({"num_processes": 2, "devices_per_process": 0}, r"devices_per_process \(0\)"),
    ({"num_processes": 2, "backend": "mpi"}, r"backend \('mpi'\) must be 'local' or 'ray'"),
    ({"num_processes": 2, "ray_address": "auto"}, r"only used with backend='ray'"),
    ({"num_processes": 2, "timeout_s": -1}, r"timeout_s \(-1\) must be a positive number"),
])
def test_launch_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        autoshard.launch(print, **kwargs)


def test_unpicklable_function_is_named():
    import threading
    lock = threading.Lock()
    with pytest.raises(TypeError, match="could not pickle fn"):
        autoshard.launch(lambda: lock, num_processes=2)
