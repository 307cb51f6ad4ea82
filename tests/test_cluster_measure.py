"""Cluster.measure (what the devices at hand deliver) and ShardParallel(cluster=...)."""

import dataclasses

import jax
import numpy as np
import pytest
from tests.test_cluster import QUIET, real, shapes, train_step

import autoshard
from autoshard import Cluster, ShardParallel


@pytest.fixture(scope="module")
def measured():
    return Cluster.measure(repeats=3)


def test_measure_describes_the_cpu_devices_as_they_run(measured):
    assert measured.num_devices == len(jax.devices())
    assert (measured.num_hosts, measured.devices_per_host) == (1, 8)
    assert measured.name.endswith("measured")
    assert measured.flops_efficiency == 1.0
    # XLA:CPU: GFLOP/s to a few TFLOP/s per virtual device, never the accelerator-like
    # default of 100 TFLOP/s; memory and links between MB/s and TB/s; latency under 10 ms.
    assert 1e8 < measured.peak_flops < 5e12
    assert 1e7 < measured.memory_bandwidth < 1e13
    assert 1e6 < measured.intra_host_bandwidth < 1e13
    assert 0 < measured.intra_host_latency_s < 1e-2
    default = Cluster.from_devices(jax.devices())
    assert measured.peak_flops < default.peak_flops
    # one host: the inter-host figures are the description's, not measured
    assert measured.inter_host_bandwidth == default.inter_host_bandwidth


def test_measure_rejects_bad_repeats():
    with pytest.raises(ValueError, match=r"repeats \(0\) must be a positive int"):
        Cluster.measure(repeats=0)


def test_shard_parallel_plans_for_its_cluster_and_matches_jit():
    slow = Cluster(num_hosts=1, devices_per_host=8, peak_flops=1e10, memory_bandwidth=1e9,
                   intra_host_bandwidth=1e9, intra_host_latency_s=5e-5, name="slow cpu-like")
    params, batch = real(shapes(batch=64))
    priced = autoshard.plan(train_step, params, batch, cluster=slow,
                            method=ShardParallel(auto_sharding_option=QUIET))
    default = autoshard.plan(train_step, params, batch,
                             method=ShardParallel(auto_sharding_option=QUIET))
    step = autoshard.parallelize(
        train_step, method=ShardParallel(auto_sharding_option=QUIET, cluster=slow))
    (new, loss) = step(params, batch)
    ran = step.get_last_executable().plan
    assert ran.objective.total_s == pytest.approx(priced.objective.total_s)
    assert ran.objective.total_s > 10 * default.objective.total_s  # priced on the slow one
    assert "slow cpu-like" in ran.explain()
    want_new, want_loss = jax.jit(train_step)(params, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(new), jax.tree.leaves(want_new), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    # the method's cluster is the one plan() uses when none is given
    again = autoshard.plan(train_step, params, batch,
                           method=ShardParallel(auto_sharding_option=QUIET, cluster=slow))
    assert again.objective.total_s == pytest.approx(priced.objective.total_s)


def test_cluster_errors_name_the_argument_and_the_fix():
    small = Cluster(num_hosts=1, devices_per_host=4, peak_flops=1e10)
    params, batch = real(shapes())
    with pytest.raises(TypeError, match=r"cluster \('fast'\) must be an autoshard.Cluster"):
        ShardParallel(cluster="fast")
    with pytest.raises(ValueError, match="with plan=... or manual_sharding_option=... nothing "
                                         "is planned"):
        ShardParallel(cluster=small, manual_sharding_option=autoshard.ManualShardingOption(
            mesh_axis_names=("d",)))
    step = autoshard.parallelize(train_step, method=ShardParallel(cluster=small))
    with pytest.raises(ValueError, match=r"has 4 devices but the step runs on 8"):
        step(params, batch)
    other = dataclasses.replace(small, devices_per_host=8, name="other")
    with pytest.raises(ValueError, match=r"cluster \(other\) and the method's cluster .* differ"):
        autoshard.plan(train_step, params, batch, cluster=other,
                       method=ShardParallel(cluster=dataclasses.replace(other, name="mine")))
