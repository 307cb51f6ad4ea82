"""What runs is what was costed: slices before dots are pinned, gathers over several axes are
one collective, a resharding shared by consumers counts once; ``memory_tradeoff``."""

import sys
from pathlib import Path

import pytest

import autoshard

SUITE = Path(__file__).parent.parent.parent / "benchmarks"


def _executable(model, mesh, sizes=None, **option):
    """The suite's ``model`` (its quick sizes unless ``sizes``) planned on ``mesh``."""
    sys.path.insert(0, str(SUITE))
    from suite_models import SIZES, make_case
    from suite_plans import autoshard_step

    case = make_case(model, **(sizes or SIZES["quick"][model]))
    opt = autoshard.AutoShardingOption(show_progress=False, logical_mesh_shape=mesh, **option)
    f = autoshard.parallelize(autoshard_step,
                              method=autoshard.ShardParallel(auto_sharding_option=opt))
    return f.get_executable(case.init_state(), (case.inputs, case.labels))


def test_dot_operand_sliced_for_a_contracting_split_is_pinned():
    # The head's input gradient contracts over the class dim, split over x. Left unpinned,
    # XLA gathered the (smaller) kernel instead of slicing the replicated gradient and
    # all-reducing the result: compiled 0.88x of the prediction, one all-reduce missing.
    ex = _executable("mlp", (8,))
    a = ex.audit()
    rows = {(r.kind, r.axes): (r.predicted_bytes, r.compiled_bytes) for r in a.rows}
    assert rows == {("all-gather", ("x",)): (2560, 2560), ("all-reduce", ("x",)): (6144, 6144)}
    assert a.unpredicted == ()


def test_a_gather_over_two_axes_is_predicted_as_the_one_collective_xla_runs():
    a = _executable("gpt", (2, 4)).audit()
    gathers = {r.axes: (r.predicted_bytes, r.compiled_bytes)
               for r in a.rows if r.kind == "all-gather"}
    assert gathers == {("x", "y"): (32768, 32768)}
    assert a.bytes_ratio() == 1.0, a.explain()


def test_expert_layer_all_to_alls_are_predicted_exactly():
    # Experts split over the mesh move tokens with all-to-alls; a resharding two consumers
    # share is counted once (XLA computes it once): at the suite's default size the plan
    # listed 9 all-to-alls where XLA ran 6 before this was so.
    a = _executable("moe", (8,), sizes=dict(vocab=128, dim=64, heads=8, layers=2, seq=32,
                                           batch=16, num_experts=8, moe_every=2)).audit()
    rows = {r.kind: (r.predicted_bytes, r.compiled_bytes) for r in a.rows}
    assert rows["all-to-all"][0] == rows["all-to-all"][1] > 0, a.explain()
    assert a.bytes_ratio() == 1.0 and a.unpredicted == (), a.explain()


def test_memory_tradeoff_takes_a_plan_of_less_memory_within_the_time_given():
    fastest = _executable("wresnet", (2, 4))
    lean = _executable("wresnet", (2, 4), memory_tradeoff=0.1)
    f_obj, l_obj = fastest.plan.objective, lean.plan.objective
    assert l_obj.peak_bytes_per_device <= 0.99 * f_obj.peak_bytes_per_device
    assert l_obj.total_s <= 1.1 * f_obj.total_s
    assert any("least memory among plans within memory_tradeoff" in n for n in lean.plan.notes)
    a = lean.audit()
    assert a.compiled_memory < fastest.audit().compiled_memory
    assert a.bytes_ratio() == pytest.approx(1.0, rel=0.10) and a.memory_ratio() <= 1.10
    assert not any("least memory" in n for n in fastest.plan.notes)


def test_memory_tradeoff_must_be_a_fraction():
    with pytest.raises(ValueError, match=r"memory_tradeoff \(-0.5\)"):
        autoshard.AutoShardingOption(memory_tradeoff=-0.5)
