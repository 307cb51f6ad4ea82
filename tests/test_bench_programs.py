"""The training-program benchmark: its models, its micro-batch reference and one cell end to end.

The end-to-end run is a subprocess (its own 8 virtual devices and its own SIGALRM timeouts).
Which cells fail today is what the benchmark reports; here only a cell that must work is
checked (DataParallel with k = 1 equals ``jax.jit``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import programs  # noqa: E402
import programs_models as models  # noqa: E402

RNG = np.asarray(jax.random.PRNGKey(0))


@pytest.mark.slow   # four compiles of a conv net: about 15 s on an idle 2-core machine
def test_resnet_micro_batch_reference_is_the_rule():
    """k = 1 is the whole-batch step; k = 4 averages each micro-batch's BatchNorm statistics."""
    p = models.make_program("resnet", "quick")
    whole_state, whole = jax.jit(p.step)(p.state, p.batch, RNG)
    one_state, one = jax.jit(p.micro_batch_reference(1))(p.state, p.batch, RNG)
    for path, d in programs.tree_diff((one_state.params, one_state.batch_stats, one),
                                      (whole_state.params, whole_state.batch_stats,
                                       whole)).items():
        assert d < 1e-5, path
    four_state, four = jax.jit(p.micro_batch_reference(4))(p.state, p.batch, RNG)
    # BatchNorm normalises per micro-batch: the loss is not the whole batch's, the running
    # mean is the mean of the four micro-batches' updates, not the whole batch's update.
    assert abs(float(four["loss"]) - float(whole["loss"])) > 1e-6
    step = jax.jit(p.step)
    mean_of_micro = np.mean([np.asarray(step(p.state, jax.tree.map(   # micro-batch j: rows
        lambda a, j=j: a.reshape((a.shape[0] // 4, 4) + a.shape[1:])[:, j], p.batch),  # j, j+4..
        RNG)[0].batch_stats["BatchNorm_0"]["mean"]) for j in range(4)], axis=0)
    np.testing.assert_allclose(four_state.batch_stats["BatchNorm_0"]["mean"], mean_of_micro,
                               rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["lm", "lstm", "gpt"])
def test_hand_written_loop_is_the_whole_batch_step(name):
    """The k = 4 loop a user writes by hand (timed beside the cells as their baseline)
    computes the whole-batch step: same loss, metrics and parameters."""
    p = models.make_program(name, "quick")
    want_state, want = jax.jit(p.step)(p.state, p.batch, RNG)
    got_state, got = jax.jit(p.hand_loop(4))(p.state, p.batch, RNG)
    diffs = programs.tree_diff((got_state.params, got), (want_state.params, want))
    assert set(diffs) == set(programs.tree_diff((want_state.params, want),
                                                (want_state.params, want)))
    assert max(diffs.values()) < 1e-5, {k: v for k, v in diffs.items() if v >= 1e-5}


def test_rel_diff_and_tree_diff():
    assert programs.rel_diff(np.float32(2.0), np.float32(2.0)) == 0.0
    assert programs.rel_diff(np.array([1.0, 2.0]), np.array([1.0, 4.0])) == 0.5
    assert programs.rel_diff(np.array(8), np.array(32)) == 0.75      # a count of a micro-batch
    assert programs.rel_diff(np.zeros(3), np.zeros(2)) == float("inf")
    diffs = programs.tree_diff({"a": {"b": 1.0}, "c": 2.0}, {"a": {"b": 1.0}, "d": 2.0})
    assert diffs == {"a/b": 0.0, "c": float("inf"), "d": float("inf")}


@pytest.mark.parametrize("cell,method", [
    ("DataParallel:4", "DataParallel"),
    ("PipeshardParallel:1", "PipeshardParallel"),
    ("default", None)])
def test_make_method(cell, method):
    m = programs.make_method(cell, SimpleNamespace(has_markers=True))
    assert (m is None) if method is None else type(m).__name__ == method
    if cell == "DataParallel:4":
        assert m.num_micro_batches == 4


def test_each_size_writes_its_own_results():
    """A large or xlarge run writes programs_<size>.*, not over the default's programs.*."""
    assert programs.results_stem("default") == programs.results_stem("quick") == "programs"
    assert programs.results_stem("large") == "programs_large"
    assert programs.results_stem("xlarge") == "programs_xlarge"


def test_one_cell_end_to_end(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "programs.py"), "--quick", "--programs",
         "lstm", "--cells", "DataParallel:1", "--steps", "2", "--warmup", "0", "--repeats", "1",
         "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "programs.json").read_text())
    assert (tmp_path / "programs.md").read_text().startswith("# Real training programs")
    (record,) = result["records"]
    assert record["status"] == "ok", record["error"]
    assert record["compared"] and record["matches"], record
    assert record["matches_stepwise"] and record["replay_rel_diff"] < 1e-4, record
    assert set(record["metric_rel_diff"]) == {"loss_sum", "correct", "count"}
    assert record["step_time_s"] > 0 and record["audit"]["compiled_bytes"] > 0
    assert result["machine"]["num_devices"] == 8


def test_replay_tells_a_sensitive_trajectory_from_another_step():
    """The reference replayed from a cell's own states: a cell whose every step is the
    reference's step matches step-wise even when its trajectory left the reference's; a cell
    that computes another step does not."""
    class State(NamedTuple):
        params: np.ndarray

    def step(state, batch, rng):
        w = state.params - 0.1 * jnp.mean(batch * state.params)
        return State(w), {"loss": jnp.sum(w)}

    def other(state, batch, rng):       # another step: a different learning rate
        w = state.params - 0.1001 * jnp.mean(batch * state.params)
        return State(w), {"loss": jnp.sum(w)}

    program = SimpleNamespace(state=State(np.ones(4, np.float32)), state_fields=("params",),
                              batch=np.arange(4.0, dtype=np.float32))
    args = SimpleNamespace(steps=3)
    _, same = programs.run_steps(jax.jit(step), program, None, args)
    assert len(same["states"]) == 4
    assert programs.replay(program, same, jax.jit(step), None)["replay_rel_diff"] == 0.0
    _, wrong = programs.run_steps(jax.jit(other), program, None, args)
    found = programs.replay(program, wrong, jax.jit(step), None)
    assert not found["matches_stepwise"] and found["replay_rel_diff"] > 1e-4, found
    assert found["replay_worst"].startswith("step "), found


def test_replay_accepts_a_step_as_exact_as_the_reference():
    """A step whose float32 result loses digits to cancellation: a cell that returns the float64
    value (rounded to float32) differs from the float32 reference by 4e-3 of the value, but is
    closer to the exact step than the reference; a cell off by more does not pass."""
    class State(NamedTuple):
        params: np.ndarray

    def step(state, batch, rng):
        w = state.params
        out = (w * 1e4 + batch) - w * 1e4            # exactly batch; float32 keeps 0.0996
        return State(out), {"loss": jnp.sum(out)}

    program = SimpleNamespace(state=State(np.ones(1, np.float32)), state_fields=("params",),
                              batch=np.full(1, 0.1, np.float32))
    exact = programs.float64_step(program, jax.jit(step), program.state, None)
    assert exact["params"].dtype == np.float64   # the batch's float32 0.1, added exactly
    np.testing.assert_allclose(exact["params"], [np.float32(0.1)], rtol=1e-12)

    def trace_of(value):
        out = State(np.full(1, value, np.float32))
        return {"metrics": [{"loss": np.float32(value)}], "states": [program.state, out]}
    good = programs.replay(program, trace_of(0.1), jax.jit(step), None)
    assert good["matches_stepwise"] and good["replay_float64_ratio"] < 1e-3, good
    bad = programs.replay(program, trace_of(0.105), jax.jit(step), None)
    assert not bad["matches_stepwise"] and bad["replay_float64_ratio"] > 2, bad
