"""audit() reports a compiled program that diverges from its plan, and AUTOSHARD_AUDIT=1 warns.

Divergence: compiled collective bytes under 0.5x or over 1.1x of the predicted ones, or
compiled memory over 1.25x the estimate (issue 21, item 10). Issue 21 item 1 showed an audit
of compiled/predicted 0.00 (262,148 B predicted, none compiled) that reported nothing wrong.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
from autoshard.pipeline.audit import PipelineAudit, TaskAudit
from autoshard.sharding.audit import Audit, AuditRow, audit


def step(w, x):
    def loss(w):
        return jnp.mean(jnp.tanh(x @ w) ** 2)
    value, g = autoshard.value_and_grad(loss)(w)
    return w - 0.1 * g, value


W, X = jnp.ones((128, 128)) / 10, jnp.ones((256, 128))
OPTION = autoshard.AutoShardingOption(show_progress=False, logical_mesh_shape=(8,),
                                      force_data_parallel=True)


def scaled(plan, *, bytes_by: float = 1.0, memory_by: float = 1.0):
    """The plan predicting ``bytes_by`` times its collectives, ``memory_by`` times its memory."""
    return dataclasses.replace(
        plan,
        collectives=tuple(dataclasses.replace(c, count=c.count * bytes_by)
                          for c in plan.collectives),
        objective=dataclasses.replace(
            plan.objective,
            peak_bytes_per_device=int(plan.objective.peak_bytes_per_device * memory_by)))


@dataclasses.dataclass(frozen=True, eq=False)
class ScaledPrediction(autoshard.ShardParallel):
    """ShardParallel whose plan claims other collective bytes and memory than it runs."""

    bytes_by: float = 1.0
    memory_by: float = 1.0

    def compile(self, program, call):
        compiled = super().compile(program, call)
        return dataclasses.replace(compiled, plan=scaled(
            compiled.plan, bytes_by=self.bytes_by, memory_by=self.memory_by))


def scaled_method(bytes_by=1.0, memory_by=1.0):
    return ScaledPrediction(auto_sharding_option=OPTION, bytes_by=bytes_by, memory_by=memory_by)


@pytest.fixture(scope="module")
def executable():
    f = autoshard.parallelize(step, method=autoshard.ShardParallel(auto_sharding_option=OPTION))
    return f.get_executable(W, X)


def test_a_normal_step_has_no_divergence(executable):
    a = executable.audit()
    assert a.has_prediction and a.predicted_bytes > 0
    assert a.bytes_ratio() == pytest.approx(1.0, rel=0.10), a.explain()
    assert a.divergences() == ()
    assert "no divergence" in a.explain() and "DIVERGENCE" not in a.explain()
    assert str(a) == a.explain()  # print(ex.audit()) prints the table, not a dataclass dump


def test_predicted_collectives_that_did_not_compile_are_a_divergence(executable):
    # issue 21 item 1: the plan predicts collectives, the compiled program has none (XLA
    # computed the step whole on each device). Here: the plan against the HLO of one device.
    single = jax.jit(step).lower(W, X).compile()
    a = audit(executable.plan, single.as_text(), executable.get_total_allocation_size())
    assert a.predicted_bytes > 0 and a.compiled_bytes == 0 and a.bytes_ratio() == 0.0
    assert not a.within(0.10)
    (found,) = a.divergences()
    assert f"predicts {a.predicted_bytes:,} B of collectives per step" in found
    assert "has none (compiled/predicted 0.00)" in found
    text = a.explain()
    assert "DIVERGENCE: the plan predicts" in text and "no divergence" not in text
    assert "ex.dump_debug_info(dir)" in text


@pytest.mark.parametrize("bytes_by, diverges", [
    (3.0, True),     # compiled 0.33x the predicted
    (2.0, False),    # 0.5x: the lowest ratio that passes
    (0.95, False),   # 1.05x
    (0.85, True),    # 1.18x
])
def test_collective_bytes_outside_half_to_1_1_times_the_prediction_diverge(
        executable, bytes_by, diverges):
    plan = scaled(executable.plan, bytes_by=bytes_by)
    a = audit(plan, executable.get_hlo_text(), executable.get_total_allocation_size())
    assert a.bytes_ratio() == pytest.approx(1 / bytes_by, rel=0.01), a.explain()
    if diverges:
        (found,) = a.divergences()
        assert f"compiled collectives are {a.bytes_ratio():.2f}x the predicted bytes" in found
        assert "0.5x-1.1x expected" in found and f"DIVERGENCE: {found}" in a.explain()
    else:
        assert a.divergences() == (), a.explain()


@pytest.mark.parametrize("memory_ratio, diverges", [(1.3, True), (1.2, False)])
def test_compiled_memory_over_1_25_times_the_estimate_diverges(
        executable, memory_ratio, diverges):
    compiled = executable.get_total_allocation_size()
    estimate = executable.plan.objective.peak_bytes_per_device
    plan = scaled(executable.plan, memory_by=compiled / memory_ratio / estimate)
    a = audit(plan, executable.get_hlo_text(), compiled)
    assert a.memory_ratio() == pytest.approx(memory_ratio, rel=1e-3)
    if diverges:
        (found,) = a.divergences()
        assert found.startswith("compiled memory per device is 1.30x the estimate")
        assert f"({compiled:,} B against" in found and "DIVERGENCE: compiled memory" in str(a)
    else:
        assert a.divergences() == (), a.explain()


def test_a_few_bytes_off_are_not_a_divergence():
    # a pipeline forward task predicted its 4-byte loss all-reduce, XLA folded it away
    def one(predicted, compiled):
        row = AuditRow(kind="all-reduce", axes=("x",), predicted_bytes=predicted,
                       compiled_bytes=compiled, compiled_count=int(compiled > 0))
        return Audit(rows=(row,), unpredicted=(), predicted_memory=1000, compiled_memory=900,
                     has_prediction=True)
    assert one(4, 0).divergences() == () and one(4, 0).within(0.10)
    # and XLA's fixed buffers outweigh a program of a few KiB: 2.2x its estimate is noise
    small = dataclasses.replace(one(0, 0), predicted_memory=1056, compiled_memory=2320)
    assert small.divergences() == ()
    assert one(0, 1000).divergences() == () and one(1152, 128).divergences() == ()
    assert one(4096, 0).divergences() and not one(4096, 0).within(0.10)
    assert one(0, 4096).divergences() == ("the compiled program runs 4,096 B of collectives "
                                          "per step, the plan predicts none",)


def test_methods_without_a_prediction_never_diverge():
    f = autoshard.parallelize(step, method=autoshard.DataParallel())
    a = f.get_executable(W, X).audit()
    assert not a.has_prediction and a.compiled_bytes > 0
    assert a.divergences() == () and "DIVERGENCE" not in a.explain()


def test_pipeline_audit_names_the_task_that_diverges(executable):
    single = jax.jit(step).lower(W, X).compile()
    bad = audit(executable.plan, single.as_text(), executable.get_total_allocation_size())
    good = executable.audit()
    pa = PipelineAudit(tasks=(TaskAudit(name="F0", stage=0, runs=4, audit=good),
                              TaskAudit(name="B0", stage=0, runs=4, audit=bad)))
    (found,) = pa.divergences()
    assert found.startswith("task B0: the plan predicts")
    assert f"DIVERGENCE: {found}" in pa.explain() and str(pa) == pa.explain()
    assert not pa.within(0.10)
    fine = PipelineAudit(tasks=(TaskAudit(name="F0", stage=0, runs=4, audit=good),))
    assert fine.divergences() == () and "no divergence" in str(fine)


# -- AUTOSHARD_AUDIT=1: a warning at the first call -----------------------------------------------
def test_audit_env_warns_at_the_first_call_of_a_diverging_step(monkeypatch):
    monkeypatch.setenv("AUTOSHARD_AUDIT", "1")
    f = autoshard.parallelize(step, method=scaled_method(bytes_by=3.0))
    with pytest.warns(RuntimeWarning, match=r"autoshard audit of step: the compiled program "
                      r"diverges from its plan: compiled collectives are 0\.33x the predicted "
                      r"bytes .*print\(step\.get_last_executable\(\)\.explain\(\)\)") as record:
        w, loss = f(W, X)
    assert [r.filename for r in record] == [__file__]  # points at the call above
    w_ref, loss_ref = jax.jit(step)(W, X)   # the step still runs, and runs right
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-5)
    np.testing.assert_allclose(w, w_ref, rtol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f(w, X)                              # once per executable, not per call


def test_audit_env_warns_about_memory_too(monkeypatch):
    monkeypatch.setenv("AUTOSHARD_AUDIT", "1")
    f = autoshard.parallelize(step, method=scaled_method(memory_by=0.5))
    with pytest.warns(RuntimeWarning, match=r"compiled memory per device is \d\.\d\dx the "
                      r"estimate"):
        f(W, X)


def test_audit_env_is_silent_for_a_normal_step(monkeypatch):
    monkeypatch.setenv("AUTOSHARD_AUDIT", "1")
    f = autoshard.parallelize(step, method=autoshard.ShardParallel(auto_sharding_option=OPTION))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f(W, X)


def test_without_the_env_a_diverging_step_does_not_warn(monkeypatch):
    monkeypatch.delenv("AUTOSHARD_AUDIT", raising=False)
    f = autoshard.parallelize(step, method=scaled_method(bytes_by=3.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f(W, X)
    assert f.get_last_executable().audit().divergences()  # explain() still reports it


def test_audit_env_value_is_validated(monkeypatch):
    monkeypatch.setenv("AUTOSHARD_AUDIT", "yes")
    f = autoshard.parallelize(step, method=autoshard.ShardParallel(auto_sharding_option=OPTION))
    with pytest.raises(ValueError, match=r"AUTOSHARD_AUDIT \('yes'\) must be 0 or 1"):
        f(W, X)
