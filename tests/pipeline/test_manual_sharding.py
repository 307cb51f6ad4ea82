"""PipeshardParallel with a ManualShardingOption: the user's specs in every task's plan."""

import collections
import re

import jax
import optax
import pytest
from jax.sharding import PartitionSpec as P
from pipeline_models import assert_trees_close, mlp_batch, mlp_loss, mlp_params

import autoshard
from autoshard.pipeline import ManualStageOption, PipeshardParallel

WIDTHS = (8, 32, 32, 32, 4)
SPECS = {
    "w0": P(None, "model"),
    "w1": P("model", None),
    "w2": P(None, "model"),
    "w3": P("model", None),
}


def adam_step(p, opt_state, batch):
    g = autoshard.grad(mlp_loss)(p, *batch)
    updates, opt_state = optax.adam(1e-2).update(g, opt_state, p)
    return optax.apply_updates(p, updates), opt_state


def method(option, shapes=((2, 2), (2, 2)), devices=None):
    physical = [(1, a * b) for a, b in shapes]
    stage = ManualStageOption([[0, 1], [2, 3]], physical, list(shapes), [{}, {}])
    return PipeshardParallel(
        devices=devices,
        num_micro_batches=2,
        layer_option="manual",
        stage_option=stage,
        manual_sharding_option=option,
        blocking=True,
    )


def option(**kw):
    specs = dict(SPECS)
    opt = (optax.ScaleByAdamState(count=P(), mu=specs, nu=specs), optax.EmptyState())
    kw.setdefault("pipeline_intermediate_axes", (("data", 0),))
    return autoshard.ManualShardingOption(
        ("data", "model"), (specs, opt, (P("data", None), P("data"))), **kw
    )


def entry_param_shapes(hlo_text: str) -> collections.Counter:
    entry = hlo_text[hlo_text.index("\nENTRY") :]
    entry = entry[: entry.index("\n}")]
    return collections.Counter(re.findall(r"= (\w+\[[\d,]*\])\S* parameter\(", entry))


def run(m, num_steps=3):
    p = mlp_params(widths=WIDTHS)
    state, batch = (p, optax.adam(1e-2).init(p)), mlp_batch()
    f = autoshard.parallelize(adam_step, method=m, batch_argnums=(2,))
    ref = jax.jit(adam_step)
    got, want = state, state
    for _ in range(num_steps):
        got, want = f(*got, batch), ref(*want, batch)
    return got, want, f.get_last_executable()


def test_specs_fixed_in_every_stage_and_numerics_match_jit():
    got, want, ex = run(method(option()))
    assert_trees_close(got, want)
    assert ex.plan.submesh_axis_names == (("data", "model"), ("data", "model"))
    assert all(m.axis_names == ("data", "model") for m in ex.meshes)
    # every task that reads a parameter takes it in the given spec (F, B and apply)
    params = dict(zip(ex.part.jaxpr.invars[:4], ("w0", "w1", "w2", "w3"), strict=True))
    seen = collections.Counter()
    for t in ex._ordered_tasks():
        for v, sh in zip(t.invars, t.in_shardings, strict=False):
            if v in params:
                assert sh.spec == SPECS[params[v]], (t.task.name, params[v], sh.spec)
                seen[params[v]] += 1
    assert set(seen) == set(SPECS)
    # the new parameters and moments come back in their inputs' specs
    assert got[0]["w0"].sharding.spec == P(None, "model")
    assert got[1][0].mu["w3"].sharding.spec == P("model", None)
    # per-device shapes in the compiled forward tasks: w0 (8, 32) split on model -> [8,16],
    # w1 (32, 32) -> [16,32], the micro-batch's x (16, 8) on data -> [8,8]; stage 1 takes the
    # activation (16, 32) split on data (pipeline_intermediate_axes) -> [8,32], w2 -> [32,16],
    # w3 (32, 4) -> [16,4], the targets (16, 4) -> [8,4]
    f0 = entry_param_shapes(ex.tasks[("F", 0)].compiled.as_text())
    f1 = entry_param_shapes(ex.tasks[("F", 1)].compiled.as_text())
    assert f0 >= collections.Counter(["f32[8,16]", "f32[16,32]", "f32[8,8]"]), f0
    assert f1 >= collections.Counter(["f32[8,32]", "f32[32,16]", "f32[16,4]", "f32[8,4]"]), f1
    # the activation leaves stage 0 in that layout, and its cotangent comes back in it
    h = next(v for v in ex.tasks[("F", 1)].invars if v.aval.shape == (16, 32))
    out0 = ex.tasks[("F", 0)]
    assert out0.out_shardings[out0.outvars.index(h)].spec == P("data")
    b1 = ex.tasks[("B", 1)]
    ct = [
        sh.spec
        for v, sh in zip(b1.outvars, b1.out_shardings, strict=False)
        if v.aval.shape == (16, 32) and v not in b1.accumulated
    ]
    assert ct == [P("data")], ct
    assert ex.audit().unpredicted == ()


def test_intermediate_axes_apply_on_the_sub_meshes_that_have_the_axis(monkeypatch):
    """Alpa's example: stage 0 names its axes (dummy, model), stage 1 (dummy, data); the
    activation is split over data only where it arrives."""
    specs = {"w0": P(None, "model"), "w1": P("model", None), "w2": P(), "w3": P()}
    opt = (optax.ScaleByAdamState(count=P(), mu=specs, nu=specs), optax.EmptyState())
    man = autoshard.ManualShardingOption(
        None,
        (specs, opt, (P(), P("data"))),
        submesh_axis_names=(("dummy", "model"), ("dummy", "data")),
        pipeline_intermediate_axes=(("data", 0),),
    )
    from autoshard.pipeline import tasks

    asked, decide = {}, tasks._decide

    def spy(kind, task, part, target, option, arriving, **kw):  # the specs a task is asked for
        asked[task.name] = arriving
        return decide(kind, task, part, target, option, arriving, **kw)

    monkeypatch.setattr(tasks, "_decide", spy)
    got, want, ex = run(method(man, shapes=((1, 2), (1, 2)), devices=jax.devices()[:4]), 2)
    assert_trees_close(got, want)
    f1 = ex.tasks[("F", 1)]
    h = next(v for v in f1.invars if v.aval.shape == (16, 32))
    assert f1.in_shardings[f1.invars.index(h)].spec == P("data")
    assert "f32[8,32]" in entry_param_shapes(f1.compiled.as_text())
    f0 = ex.tasks[("F", 0)]  # stage 0 has no data axis: its output is planned freely
    assert "data" not in str(f0.out_shardings[f0.outvars.index(h)].spec)
    assert "axes ('dummy', 'data')" in ex.plan.explain()
    # a replicated spec (P()) is a pin too: stage 1 takes w2 and w3 whole, not as planned
    w2, w3 = ex.part.jaxpr.invars[2:4]
    assert [f1.in_shardings[f1.invars.index(w)].spec for w in (w2, w3)] == [P(), P()]
    assert [asked["F1"][f1.invars.index(w)] for w in (w2, w3)] == [P(), P()]
    assert entry_param_shapes(f1.compiled.as_text())["f32[32,32]"] >= 1


@pytest.mark.parametrize(
    "kw,match",
    [
        (
            dict(
                in_axis_resources=(
                    {"w0": P(None, "modle"), "w1": P(), "w2": P(), "w3": P()},
                    None,
                    None,
                )
            ),
            r"in_axis_resources for arg0\['w0'\].*names mesh axis 'modle'.*\('data', 'model'\)",
        ),
        (
            dict(pipeline_intermediate_axes=(("batch", 0),)),
            r"pipeline_intermediate_axes names axis 'batch', which no sub-mesh has",
        ),
        (
            dict(pipeline_intermediate_axes=("data", 0)),
            r"pipeline_intermediate_axes entry 'data' must be an \(axis name, dim\) pair",
        ),
        (
            dict(submesh_axis_names=(("data", "model"),)),
            r"submesh_axis_names has 1 entries but the pipeline has 2 sub-meshes",
        ),
        (
            dict(mesh_axis_names=("data",)),
            r"mesh_axis_names \('data',\) must name each axis of sub-mesh 0.*\(2, 2\)",
        ),
    ],
)
def test_bad_manual_sharding_option_is_a_clear_error(kw, match):
    base = dict(mesh_axis_names=("data", "model"), in_axis_resources=None)
    base.update(kw)
    names = base.pop("mesh_axis_names")
    if "submesh_axis_names" in base:
        names = None
    man = autoshard.ManualShardingOption(names, **base)
    p = mlp_params(widths=WIDTHS)
    f = autoshard.parallelize(adam_step, method=method(man), batch_argnums=(2,))
    with pytest.raises(ValueError, match=match):
        f(p, optax.adam(1e-2).init(p), mlp_batch())


def test_shard_parallel_refuses_the_pipeline_fields():
    with pytest.raises(ValueError, match="takes no submesh_axis_names"):
        autoshard.ShardParallel(
            manual_sharding_option=autoshard.ManualShardingOption(
                ("x",), submesh_axis_names=(("x",),)
            )
        )


def test_autoshard_plan_refuses_a_pipeline_manual_sharding_option():
    p = mlp_params(widths=WIDTHS)
    with pytest.raises(
        ValueError, match="does not price PipeshardParallel's manual_sharding_option yet"
    ):
        autoshard.plan(
            adam_step,
            p,
            optax.adam(1e-2).init(p),
            mlp_batch(),
            method=method(option()),
            batch_argnums=(2,),
        )


def test_alpas_positional_submesh_axis_names_is_a_clear_error():
    with pytest.raises(TypeError, match=r"submesh_axis_names=\.\.\. \(a keyword"):
        autoshard.ManualShardingOption(None, (("dummy", "model"), ("dummy", "data")))
