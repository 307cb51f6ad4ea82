"""``benchmarks/cluster.py``'s ``link_bytes``: the bytes one GPU of each stage of a priced
pipeline sends per step over NVLink and through its NIC (issue 24's per-link accounting).

A 2-stage PipeshardParallel of a deep MLP priced on described clusters of 8 GPUs, each stage's
tasks on a 1-D logical mesh of its 4 GPUs (one phase per collective, so a collective's ring
bytes per GPU are ``VOLUME[kind](4)`` times its bytes, computed here from the plans alone).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import autoshard
from autoshard import AutoShardingOption, Cluster, ManualStageOption, PipeshardParallel
from autoshard.sharding.cost import VOLUME
from models import marked_mlp_args, marked_mlp_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import cluster as bench  # noqa: E402

ROWS, MICRO = 48, 4  # 12 rows per micro-batch: no weight dim has that size


def priced(cluster: Cluster, physical):
    params, batch = marked_mlp_args((64, 512, 512, 512, 64), rows=ROWS, scale=0.05)
    method = PipeshardParallel(
        num_micro_batches=MICRO, layer_option="manual",
        default_auto_sharding_option=AutoShardingOption(show_progress=False),
        stage_option=ManualStageOption([[0, 1], [2, 3]], [physical] * 2, [(4,)] * 2,
                                       [{}, {}]))
    return autoshard.plan(marked_mlp_step, params, batch, method=method, cluster=cluster)


# (cluster, each stage's sub-mesh (hosts, GPUs per host), share of a collective's ring bytes
# through the NIC, whether the copies between the stages go through the NIC)
CASES = {
    "2 hosts x 4, a stage per host": (Cluster.a100_80gb(2, devices_per_host=4), (1, 4), 0.0,
                                      True),
    "4 hosts x 2, a stage per 2 hosts": (Cluster.a100_80gb(4, devices_per_host=2), (2, 2), 0.5,
                                         True),
    "1 host x 8": (Cluster.a100_80gb(1, devices_per_host=8), (1, 4), 0.0, False),
}


@pytest.mark.parametrize("case", CASES)
def test_link_bytes_are_the_plans_ring_bytes_on_the_links_they_cross(case):
    cluster, physical, nic_share, sends_cross = CASES[case]
    est = priced(cluster, physical)
    links = bench.link_bytes(est, cluster, ROWS // MICRO)
    assert links["num_micro_batches"] == MICRO
    assert [st["stage"] for st in links["stages"]] == [0, 1]
    for stage, got in zip(est.stages, links["stages"], strict=True):
        parts = got["parts"]
        assert got["mesh"] == [4]
        # the micro-batch rows are split over the stage's one axis: its data axis
        assert got["data_axes"] == list(stage.plans[0][1].axis_names)
        # every collective of every task, once per micro-batch (F, B) or per step (apply),
        # plus the once-per-step gradient all-reduce: a ring over 4 GPUs each
        ring = sum(VOLUME[c.kind](4) * c.num_bytes * c.count
                   * (1 if name.startswith("apply") else MICRO)
                   for name, plan in stage.plans for c in plan.collectives)
        reduce = VOLUME["all-reduce"](4) * stage.reduce_bytes
        assert stage.reduce_bytes > 0
        collectives = [parts[p] for p in ("tensor", "data")]
        assert sum(p["nvlink_bytes"] + p["nic_bytes"] for p in collectives) == pytest.approx(
            ring)
        assert parts["reduce"]["nvlink_bytes"] + parts["reduce"]["nic_bytes"] == (
            pytest.approx(reduce))
        # a 4-GPU axis over 2 hosts sends half its ring bytes through each GPU's NIC
        for p in [*collectives, parts["reduce"]]:
            assert p["nic_bytes"] == pytest.approx(nic_share * (p["nic_bytes"]
                                                                + p["nvlink_bytes"]))
        assert parts["reduce"]["model_s"] == stage.reduce_s
        # the copies to the other stage: once per micro-batch, on the link joining them
        sent = sum(b * (1 if kind == "apply" else MICRO) for kind, b in stage.send_bytes.items())
        assert sent > 0
        pipe = parts["pipeline"]
        assert (pipe["nic_bytes"], pipe["nvlink_bytes"]) == ((sent, 0) if sends_cross
                                                             else (0, sent))
        assert pipe["model_s"] == pytest.approx(
            sum(t * (1 if kind == "apply" else MICRO) for kind, t in stage.send_s.items()))
        assert got["nvlink_bytes"] + got["nic_bytes"] == pytest.approx(ring + reduce + sent)
        assert pipe["nic_s"] == pytest.approx(pipe["nic_bytes"] / cluster.inter_host_bandwidth)
