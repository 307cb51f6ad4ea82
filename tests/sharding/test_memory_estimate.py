"""The planner's memory estimate against XLA's compiled memory, and memory budgets.

Small versions of the families benchmark's blocks (``benchmarks/families_models.py``): a
grouped-query attention decoder block with RoPE and a SwiGLU MLP, and a U-Net of convolutions
with group norm, each trained with AdamW (donated state), on two meshes. The decoder's
estimate (``Objective.peak_bytes_per_device``) must be within 1.10x of the compiled memory
(arguments + outputs + temporaries - aliased) either way; the U-Net's at least 1/1.10 of it. A budget is met by the compiled program (within
``audit.BUDGET_RATIO_MAX``) or refused with an error that says by how much.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import pytest

import autoshard
from autoshard.sharding.audit import BUDGET_RATIO_MAX, Audit

BENCH = Path(__file__).parent.parent.parent / "benchmarks"
SIZES = {
    # One decoder block (GQA attention with RoPE, SwiGLU MLP) and a two-level U-Net.
    "llama": dict(vocab=512, dim=64, heads=4, kv_heads=2, hidden=176, layers=1, seq=32,
                  batch=16),
    "unet": dict(image=16, in_channels=4, channels=(16, 32), layers=1, groups=4, batch=16),
}


def _case(name):
    sys.path.insert(0, str(BENCH))
    import families_models as fm

    return fm.make_case(name, "tiny", **SIZES[name])


def _executable(case, **option):
    opt = autoshard.AutoShardingOption(show_progress=False, **option)
    f = autoshard.parallelize(case.step, method=autoshard.ShardParallel(
        devices=jax.devices()[:8], auto_sharding_option=opt))
    return f.get_executable(case.init_state(), case.batch)


@pytest.mark.parametrize("mesh", [(8,), (2, 4)])
def test_estimate_within_10_percent_of_compiled_memory(mesh):
    a = _executable(_case("llama"), logical_mesh_shape=mesh).audit()
    assert 1 / 1.10 <= a.memory_ratio() <= 1.10, a.explain()


@pytest.mark.parametrize("mesh", [(8,), (2, 4)])
def test_conv_groupnorm_estimate_is_not_below_compiled_memory(mesh):
    # The convolution + group norm block: XLA recomputes the normalisation's element-wise
    # chain in the backward pass instead of keeping it, which the estimate does not model
    # yet (compiled/estimate about 0.8): the estimate errs on the side that keeps budgets.
    a = _executable(_case("unet"), logical_mesh_shape=mesh).audit()
    assert 0.7 <= a.memory_ratio() <= 1.10, a.explain()


def test_budget_is_met_by_the_compiled_program():
    case = _case("llama")
    free = _executable(case, logical_mesh_shape=(2, 4), memory_tradeoff=0.0).audit()
    budget = int(0.8 * free.predicted_memory)
    ex = _executable(case, logical_mesh_shape=(2, 4), memory_budget_per_device=budget)
    a = ex.audit()
    assert ex.plan.objective.memory_budget_per_device == budget
    assert ex.plan.objective.peak_bytes_per_device <= budget
    assert a.compiled_memory <= BUDGET_RATIO_MAX * budget, a.explain()
    assert a.budget_miss() is None and f"budget {budget:,} B" in a.explain()


def test_budget_below_every_plan_says_by_how_much():
    case = _case("llama")
    free = _executable(case, logical_mesh_shape=(2, 4)).audit()
    budget = free.predicted_memory // 4   # below the inputs' share of some meshes' plans
    with pytest.raises(ValueError, match=r"memory_budget_per_device \([\d,]+ B\).*"
                                         r"(x the budget, [\d,]+ B over|inputs .* alone)"):
        _executable(case, logical_mesh_shape=(2, 4), memory_budget_per_device=budget)


def test_audit_reports_a_missed_budget_with_the_budget_that_would_fit():
    a = Audit(rows=(), unpredicted=(), predicted_memory=1_000_000, compiled_memory=1_200_000,
              has_prediction=True, memory_budget=1_000_000)
    miss = a.budget_miss()
    assert miss is not None and "1.200x memory_budget_per_device" in miss
    assert "200,000 B over" in miss and "about 833,333 B" in miss
    assert any(d == miss for d in a.divergences())
    within = Audit(rows=(), unpredicted=(), predicted_memory=1_000_000,
                   compiled_memory=1_019_000, has_prediction=True, memory_budget=1_000_000)
    assert within.budget_miss() is None and within.divergences() == ()
