"""autoshard.launch(backend="ray"): Ray actors on a local Ray cluster the test starts."""

from __future__ import annotations

import pytest
import workers

import autoshard

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'autoshard[ray]')")


def test_ray_launch_starts_and_stops_its_own_local_cluster():
    assert not ray.is_initialized()
    assert autoshard.launch(workers.fail_on, -1, "never", num_processes=2,
                            devices_per_process=1, backend="ray", timeout_s=180) == [0, 1]
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True,
             object_store_memory=80 * 1024 * 1024)
    yield
    ray.shutdown()


def test_ray_data_and_shard_parallel_equal_one_process_run(local_ray):
    workers.assert_equal_to_one_process_run(autoshard.launch(
        workers.train, num_processes=2, devices_per_process=2, backend="ray", timeout_s=240))


def test_ray_worker_exception_and_death(local_ray, tmp_path):
    with pytest.raises(ValueError, match="bad shard 3") as info:
        autoshard.launch(workers.fail_on, 0, "bad shard 3", num_processes=2,
                         devices_per_process=2, backend="ray", timeout_s=120)
    assert info.value.autoshard_rank == 0
    with pytest.raises(autoshard.WorkerError, match=r"process 1 of 2 .* died"):
        autoshard.launch(workers.die_mid_step, str(tmp_path), num_processes=2,
                         devices_per_process=2, backend="ray", timeout_s=120)
