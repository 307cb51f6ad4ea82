"""PipeshardParallel across processes: 2 processes x 2 CPU devices, one stage per process.

Every process walks the same action list and moves activations and gradients between the
processes with JAX's cross-host ``jax.device_put``; the runs must equal a single-device
``jax.jit`` run, and the one-stage-per-process run the same pipeline run by one process on 4
devices (same arithmetic, tight tolerance).
"""

from __future__ import annotations

import jax
import numpy as np
import pipeline_workers as pw
import pytest

import autoshard
from autoshard.distributed import PlanMismatchError

VOCAB, DIM = pw.VOCAB, pw.DIM

TIMEOUT_S = 240


def launch(*args):
    return autoshard.launch(
        pw.train_pipeline, *args, num_processes=2, devices_per_process=2, timeout_s=TIMEOUT_S
    )


def test_two_stage_pipeline_across_two_processes_equals_one_process_run():
    layouts = ("uniform", "2+1")
    results = launch(layouts)
    reference = pw.train_pipeline(("uniform",), devices=jax.devices()[:4])["uniform"]
    jitted = pw.train_jit()
    assert jitted["grad_norm"] > 0.5  # clipping by the global norm (over both stages) acts
    assert [r["process"] for r in results] == [0, 1]
    addresses = [r["transfer_address"] for r in results]  # set by autoshard.init, one each
    assert all(a.startswith("127.0.0.1:") for a in addresses) and len(set(addresses)) == 2
    for layout in layouts:
        runs = [r[layout] for r in results]
        # stage 0 on process 0's devices, stage 1 on process 1's
        assert runs[0]["stage_devices"] == ([2, 2] if layout == "uniform" else [2, 1])
        assert runs[0]["stage_processes"] == [[0], [1]]
        # every task planned once, on process 0; process 1 received the plans
        assert runs[0]["planner_calls"] > 0 and runs[1]["planner_calls"] == 0
        # the tied embedding's gradient and the global norm: one all-reduce over both
        # processes' devices each (gloo), no partial value copied between the stages
        for run in runs:
            assert [(s["shape"], s["all_reduces"], s["moved_terms"]) for s in run["sums"]] == [
                ((VOCAB, DIM), 1, 0),
                ((), 1, 0),
            ]
            assert {s["devices"] for s in run["sums"]} == {4 if layout == "uniform" else 3}
        for run in runs:  # the loss is on every device: both processes read all of it
            np.testing.assert_allclose(run["losses"], jitted["losses"], rtol=1e-5)
            assert run["moves"]["copy"] > 0
        # each process reads the parameters of its own stage; together, every parameter once
        mine = [set(run["params"]) for run in runs]
        assert mine[0] and mine[1] and not mine[0] & mine[1]
        assert mine[0] | mine[1] == set(jitted["params"])
        assert "['params']['Embed_0']['embedding']" in mine[0]  # tied: used by both stages
        for run in runs:
            for path, value in run["params"].items():
                np.testing.assert_allclose(value, jitted["params"][path], rtol=1e-4, atol=1e-5)
                if layout == "uniform":  # the same pipeline in one process: same arithmetic
                    np.testing.assert_allclose(
                        value, reference["params"][path], rtol=1e-5, atol=1e-6
                    )
            if layout == "uniform":
                np.testing.assert_allclose(run["losses"], reference["losses"], rtol=1e-6)


@pytest.mark.parametrize(
    "other, match",
    [
        (
            "1x2+1",
            r"process 1 cut the pipeline differently from process 0 for the same program: "
            r"submesh_shapes \(\(1, 2\), \(1,\)\) here, \(\(2,\), \(1,\)\) on process 0",
        ),
        ("2+1 rows on x", r"F0: process [01] and process [01] would plan different things for it"),
    ],
)
def test_processes_that_plan_different_pipelines_get_an_error_naming_both(other, match):
    with pytest.raises(PlanMismatchError, match=match):
        launch({0: ("2+1",), 1: (other,)}, 1)


def test_stages_on_several_processes_need_a_transfer_address():
    with pytest.raises(
        RuntimeError,
        match=r"jax_cross_host_transfer_socket_address is not set "
        r"in process [01].*autoshard.init\(cluster='distributed'\)",
    ):
        autoshard.launch(
            pw.pipeline_without_transfer_address,
            num_processes=2,
            devices_per_process=2,
            timeout_s=TIMEOUT_S,
        )
