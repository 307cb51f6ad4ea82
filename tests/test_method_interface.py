"""One method interface (issue 23): ``parallelize`` and ``autoshard.plan`` reach every method
through ``compile_executable`` and ``plan_for``, and every method agrees on its plans across
processes through ``Call.agree`` only."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
from autoshard.methods import _base


def step(w, x):
    return w - 0.1 * jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w), jnp.sum(x)


W, X = jnp.ones((4, 4)), jnp.arange(64.0).reshape(16, 4) / 64


@dataclasses.dataclass(frozen=True, eq=False)
class Counting(autoshard.DataParallel):
    calls: list = dataclasses.field(default_factory=list)

    def compile_executable(self, program, call):
        self.calls.append(("compile_executable", call.name, call.static_argnums))
        return super().compile_executable(program, call)


def test_parallelize_compiles_through_compile_executable():
    method = Counting()
    f = autoshard.parallelize(step, method=method)
    w, s = f(W, X)
    want_w, want_s = jax.jit(step)(W, X)
    np.testing.assert_allclose(w, want_w, rtol=1e-6)
    np.testing.assert_allclose(s, want_s, rtol=1e-6)
    f(W, X)  # cached: no second compile
    assert method.calls == [("compile_executable", "step", ())]


def test_plan_reaches_methods_through_plan_for():
    cluster = autoshard.Cluster.from_devices(jax.devices())
    plan = autoshard.plan(step, W, X, cluster=cluster)
    assert isinstance(plan, autoshard.ShardingPlan) and plan.objective is not None
    with pytest.raises(TypeError, match=r"autoshard.plan plans ShardParallel or "
                                        r"PipeshardParallel \(got DataParallel\)"):
        autoshard.plan(step, W, X, method=autoshard.DataParallel(), cluster=cluster)
    with pytest.raises(TypeError, match=r"method \(3\) must be a ParallelMethod"):
        autoshard.plan(step, W, X, method=3, cluster=cluster)


@pytest.mark.parametrize("method", [
    autoshard.DataParallel(), autoshard.Zero3Parallel(), autoshard.ShardParallel(),
    autoshard.ShardParallel(manual_sharding_option=autoshard.ManualShardingOption(
        ("d",), in_axis_resources=(jax.sharding.PartitionSpec(), jax.sharding.PartitionSpec(
            "d")))),
    autoshard.PipeshardParallel(num_micro_batches=2, stage_option=autoshard.UniformStageOption(
        num_stages=2)),
], ids=["data", "zero3", "auto", "manual", "pipeline"])
def test_every_method_agrees_on_its_plans_through_call_agree(monkeypatch, method):
    seen = []
    real = _base.agree_on_plan

    def spy(name, program, plan):
        seen.append(name)
        return real(name, program, plan)
    monkeypatch.setattr(_base, "agree_on_plan", spy)
    f = autoshard.parallelize(step, method=method)
    w, _ = f(W, X)
    np.testing.assert_allclose(w, jax.jit(step)(W, X)[0], rtol=1e-5)
    assert seen and set(seen) == {"step"}
