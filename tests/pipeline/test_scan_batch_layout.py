"""A backward task run per device keeps a scan's stacked residuals on each device's own rows
(issue 21: data parallelism must never gather the batch).

An RNN scanned over time (time steps first, as ``nn.scan(..., in_axes=1)`` lays them out)
stacks its residuals as ``(time, batch, hidden)``: the rows are on dim 1. Stage 0's backward
task runs per device over its batch axis (its micro-batch rows arrive split over it on dim 0),
and the residuals arrive from the forward task split over the same axis on dim 1. The
per-device run took every input that is not a dim-0 row value whole, so XLA all-gathered the
residuals on entry (the whole batch's activations, 5 arrays here; 27 in the benchmark's
bidirectional LSTM at batch 256: 14.2 MB per step against 1 MB predicted) and every device ran
the whole batch's backward (3.6x the estimated memory). A value computed from the rows that
arrives split over the batch axes on another dim now stays split there inside the run.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from pipeline_models import fan_in_normal, marked_train_step, run_beside_jit

import autoshard
from autoshard import AutoShardingOption, PipeshardParallel, UniformStageOption
from autoshard.pipeline.per_device import rows_dim
from autoshard.pipeline.taskfn import reads

BATCH, TIME, DIM, HIDDEN = 64, 8, 16, 16
STEPS = 3
TX = optax.sgd(0.1)


def rnn(x, p):
    """``x``: (batch, time, dim), scanned over time with time first: residuals (time, batch, .)."""
    def cell(h, xt):
        h = jnp.tanh(xt @ p["wx"] + h @ p["wh"])
        return h, h
    _, hs = jax.lax.scan(cell, jnp.zeros((x.shape[0], HIDDEN)), jnp.swapaxes(x, 0, 1))
    return jnp.swapaxes(hs, 0, 1)


def loss_fn(params, x, y):
    h = rnn(jnp.tanh(x @ params["w0"]), params["rnn"])  # w0's gradient reads the rows (dim 0)
    autoshard.mark_pipeline_boundary()
    out = jnp.tanh(h.mean(1) @ params["w1"]) @ params["w2"]
    return jnp.mean((out[:, 0] - y) ** 2)


train_step = marked_train_step(loss_fn, TX)


def make_args(time: int = TIME):
    rng = np.random.default_rng(0)
    w = fan_in_normal(rng)
    params = {"w0": w(DIM, DIM), "rnn": {"wx": w(DIM, HIDDEN), "wh": w(HIDDEN, HIDDEN)},
              "w1": w(HIDDEN, HIDDEN), "w2": w(HIDDEN, 1)}
    x = jnp.asarray(rng.normal(size=(BATCH, time, DIM)).astype(np.float32))
    y = jnp.asarray(rng.normal(size=(BATCH,)).astype(np.float32))
    return (params, TX.init(params)), x, y


METHOD = PipeshardParallel(
    num_micro_batches=1, layer_option="manual", stage_option=UniformStageOption(num_stages=2),
    default_auto_sharding_option=AutoShardingOption(show_progress=False))


@pytest.fixture(scope="module")
def ran():
    state, x, y = make_args()
    return run_beside_jit(train_step, METHOD, state, (x, y), STEPS)


def all_gathers(text: str) -> list[tuple[int, ...]]:
    """Shapes of the results of every all-gather in an HLO module (tuple results too)."""
    shapes = []
    for line in text.splitlines():
        if " all-gather(" not in line and " all-gather-start(" not in line:
            continue
        result = line.split("=", 1)[1].split("all-gather", 1)[0]
        shapes += [tuple(int(d) for d in dims.split(",") if d)
                   for dims in re.findall(r"[a-z]\w*\[([\d,]*)\]", result)]
    return shapes


def test_the_backward_task_runs_per_device_on_its_own_rows(ran):
    ex, *_ = ran
    tasks = {t.task.name: t for t in ex.tasks.values()}
    assert tasks["B0"].batch_axes == ("x",)
    texts = ex.get_task_hlo_texts()
    # the residuals (time, batch, hidden) arrive split over x on the batch dim and stay so
    b0 = texts["B0"]
    assert re.search(rf"f32\[{TIME},{BATCH // 4},{HIDDEN}\]\S* parameter\(", b0)
    assert [s for s in all_gathers(b0) if BATCH in s] == []
    assert all_gathers(b0) == []


MICRO = 4
"""Micro-batches of the second case: BATCH // MICRO rows each, as many as its time steps."""


@pytest.fixture(scope="module")
def ran_square():
    """Micro-batches with as many rows as time steps: the residuals are (16, 16, hidden), and
    dim 0, the time steps, has the rows' size. Taken for the rows, it was split over the
    devices in the per-device run while the residuals arrive split on dim 1: the run gathered
    them (an all-gather per residual per micro-batch), found that it communicates, and reduced
    its gradients per micro-batch (the LSTM benchmark's PipeshardParallel:4 cell: 15x the
    bytes of its k=1 cell, 3.4x its step time). The dim that grows with the rows, from the
    step traced on the whole batch, tells them apart."""
    state, x, y = make_args(time=BATCH // MICRO)
    method = PipeshardParallel(
        num_micro_batches=MICRO, layer_option="manual",
        stage_option=UniformStageOption(num_stages=2),
        default_auto_sharding_option=AutoShardingOption(show_progress=False))
    return run_beside_jit(train_step, method, state, (x, y), STEPS)


def test_rows_as_many_as_time_steps_stay_on_their_devices(ran_square):
    ex, *_ = ran_square
    tasks = {t.task.name: t for t in ex.tasks.values()}
    assert tasks["B0"].batch_axes == ("x",)
    assert tasks["B1"].batch_axes == ("x",)
    rows = BATCH // MICRO
    b0 = ex.get_task_hlo_texts()["B0"]
    assert re.search(rf"f32\[{rows},{rows // 4},{HIDDEN}\]\S* parameter\(", b0)
    assert all_gathers(b0) == []
    assert "reduced per micro-batch" not in ex.explain()
    assert ex.audit().divergences() == ()


def test_the_audit_finds_what_the_plans_predict(ran):
    ex, *_ = ran
    audit = ex.audit()
    b0 = next(t.audit for t in audit.tasks if t.name == "B0")
    assert b0.has_prediction
    assert b0.compiled_bytes == b0.predicted_bytes == 0
    assert b0.compiled_memory <= 1.25 * b0.predicted_memory
    assert audit.divergences() == ()
    assert 0.5 <= audit.bytes_ratio() <= 1.1


@pytest.mark.parametrize("case", ["ran", "ran_square"])
def test_losses_and_parameters_equal_jax_jit(case, request):
    _, got, want, losses = request.getfixturevalue(case)
    for loss, want_loss in losses:
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_the_dim_a_value_keeps_its_rows_on():
    assert rows_dim(P(None, "x", None), ("x",), (8, 64, 16), 4) == 1
    assert rows_dim(P("x"), ("x",), (64, 16), 4) == 0
    assert rows_dim(P(), ("x",), (8, 64, 16), 4) is None
    assert rows_dim(P(None, ("x", "y")), ("x",), (8, 64), 4) is None   # more than the axes
    assert rows_dim(P("x", "x"), ("x",), (8, 64), 4) is None
    assert rows_dim(P(None, "x"), ("x",), (8, 6), 4) is None           # does not divide


def test_an_operand_a_call_never_reads_is_not_read():
    """``jnp.where(mask, x, 0)`` traces a call that takes an operand it never reads; the
    per-device run predicts no move for such an input (XLA drops it: the LSTM's B1 predicted
    a 4,096 B all-to-all of one that the compiled program does not have)."""
    def f(mask, unused, x):
        inner = jax.jit(lambda m, u, v: jnp.where(m, v, 0.0))
        return inner(mask, unused, x) * 2.0
    closed = jax.make_jaxpr(f)(jnp.ones(4, bool), jnp.ones(4), jnp.ones(4))
    mask, unused, x = closed.jaxpr.invars
    read = reads(closed.jaxpr.eqns, closed.jaxpr.outvars)
    assert mask in read and x in read
    assert unused not in read
