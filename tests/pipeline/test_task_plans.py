"""Tasks planned in their producers' layouts, the pipeline audit, the exact forward/backward
split and profiling in the planned layout.

Every test runs with ``blocking=True`` (see test_pipeshard.py).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from pipeline_models import assert_trees_close, mlp_batch, mlp_loss, mlp_params, sgd_step

import autoshard
from autoshard.pipeline import (
    AutoLayerOption,
    AutoStageOption,
    ManualStageOption,
    PipeshardParallel,
    UniformStageOption,
)
from autoshard.pipeline.partition import forward_end
from autoshard.sharding import plan_auto
from autoshard.sharding.options import AutoShardingOption

OPTION = AutoShardingOption(logical_mesh_shape=(2, 2), show_progress=False)


def run_steps(step, method, args, num_steps=3):
    f = autoshard.parallelize(step, method=method)
    ref = jax.jit(step)
    got, want = args[0], args[0]
    for _ in range(num_steps):
        got, want = f(got, *args[1:]), ref(want, *args[1:])
    return got, want, f.get_last_executable()


# plan_auto: pinned inputs, the empty program ---------------------------------------------------
def _mlp_jaxpr():
    return jax.make_jaxpr(lambda x, w: jnp.tanh(x @ w) @ w.T)(jnp.ones((16, 32)),
                                                             jnp.ones((32, 64)))


def _plan(closed, fixed, aliases=()):
    return plan_auto(closed, num_devices=4, option=OPTION, in_paths=["x", "w"],
                     out_paths=[f"o{i}" for i in range(len(closed.out_avals))],
                     batch_invars=[True, False], axis_names=("a", "b"), aliases=aliases,
                     fixed_in_specs=fixed)


def test_plan_auto_takes_inputs_in_the_fixed_specs():
    closed = _mlp_jaxpr()
    free = _plan(closed, None)
    assert free.in_specs[1] == P()              # alone, the planner replicates the weight
    pinned = _plan(closed, [P(None, "a"), P("b")])
    assert pinned.in_specs == (P(None, "a"), P("b"))
    half = _plan(closed, [None, P(None, ("a", "b"))])
    assert half.in_specs[1] == P(None, ("a", "b"))
    # A donated input and its replacement share the pinned spec.
    step = jax.make_jaxpr(lambda x, w: (w - 0.1 * (x.T @ jnp.tanh(x @ w)),))(
        jnp.ones((16, 32)), jnp.ones((32, 64)))
    donated = _plan(step, [None, P("a", "b")], aliases=[(1, 0)])
    assert donated.in_specs[1] == donated.out_specs[0] == P("a", "b")


@pytest.mark.parametrize("fixed, match", [
    ([P("z"), None], r"fixed_in_specs entry 0 \(P\('z',\)\) does not fit input 0 "
                     r".* it names \['z'\]"),
    ([P(None, None, "a"), None], "entry 0 .* more dims than the input"),
    ([None, P(None, ("b", "a"))], r"fixed_in_specs entry 1 .* is not a layout of input w "
                                  r"\(shape \(32, 64\)\) on mesh \(2, 2\)"),
    ([P("a", "b")], "fixed_in_specs has 1 entries but the jaxpr has 2 inputs"),
])
def test_plan_auto_rejects_bad_fixed_specs(fixed, match):
    with pytest.raises(ValueError, match=match):
        _plan(_mlp_jaxpr(), fixed)


def test_plan_auto_gives_an_empty_program_the_trivial_plan():
    plan = plan_auto(jax.make_jaxpr(lambda: [])(), num_devices=4, option=OPTION, in_paths=[],
                     out_paths=[], batch_invars=[], axis_names=("a", "b"))
    assert plan.in_specs == () and plan.out_specs == () and plan.objective.total_s == 0.0
    assert plan.mesh_shape == (2, 2) and plan.collectives == ()


def test_a_task_without_equations_is_planned_too():
    """A parameter-free first stage has a backward with nothing to compute."""
    def loss(p, x, y):
        h = jnp.tanh(2.0 * x)
        autoshard.mark_pipeline_boundary()
        return jnp.mean((jnp.tanh(h @ p["w0"]) @ p["w1"] - y) ** 2)
    method = PipeshardParallel(num_micro_batches=2, layer_option="manual", blocking=True,
                               stage_option=UniformStageOption(num_stages=2))
    got, want, ex = run_steps(sgd_step(loss), method, (mlp_params(widths=(8, 16, 4)),
                                                       mlp_batch()), 2)
    assert_trees_close(got, want)
    assert ex.part.backward[0].eqns == []
    assert set(ex.task_plans) == {"F0", "F1", "B0", "B1", "apply1.0"}


# Producer-aware plans --------------------------------------------------------------------------
def _entry_params_resharded(hlo_text: str) -> list[str]:
    """Collectives of the entry computation that read an entry parameter directly."""
    entry = hlo_text[hlo_text.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    params = set(re.findall(r"%([\w.\-]+) = [^=]*? parameter\(", entry))
    found = []
    for line in entry.splitlines():
        m = re.search(r"(all-gather|all-to-all|collective-permute|all-reduce)(-start)?\((.*)",
                      line)
        if m and set(re.findall(r"%([\w.\-]+)", m.group(3))) & params:
            found.append(line.strip())
    return found


@pytest.fixture(scope="module")
def two_stages_2x2():
    """Two stages on (2, 2) sub-meshes, 2 micro-batches, 3 SGD steps against jax.jit."""
    stage = ManualStageOption([[0, 1], [2, 3]], [(1, 4), (1, 4)], [(2, 2), (2, 2)], [{}, {}])
    method = PipeshardParallel(num_micro_batches=2, layer_option="manual", stage_option=stage,
                               blocking=True)
    params = mlp_params(widths=(8, 32, 32, 32, 4))
    return run_steps(sgd_step(mlp_loss), method, (params, mlp_batch()))


def test_backward_and_next_stage_take_the_layouts_their_producers_give(two_stages_2x2):
    got, want, ex = two_stages_2x2
    assert_trees_close(got, want)
    made = {}
    for t in ex._ordered_tasks():
        for v, sh in zip(t.invars, t.in_shardings, strict=False):
            if v in made:  # a value from another task: taken as its producer left it
                assert sh.spec == made[v][1], (t.task.name, made[v][0], v)
        for v, sh in zip(t.outvars, t.out_shardings, strict=False):
            made[v] = (t.task.name, sh.spec)
    params = {}                                    # step inputs: one layout per stage
    for t in ex._ordered_tasks():
        for v, sh in zip(t.invars, t.in_shardings, strict=False):
            if v in ex.part.jaxpr.invars and v not in ex.batch_vars:
                assert params.setdefault((v, t.stage), sh.spec) == sh.spec, t.task.name
    residuals = set(ex.tasks[("F", 1)].outvars) & set(ex.tasks[("B", 1)].invars)
    assert residuals                              # B1 reads what F1 kept for it
    for t in ex._ordered_tasks():
        # a backward task runs per device over the batch axes (its gradients stay partial,
        # test_partial_grads.py); every other task is planned
        assert t.plan is not None or t.batch_axes, t.task.name
        if t.plan is not None:  # (a per-device task's accumulators are stacked partial sums)
            n = len(t.invars) if t.batch_axes else len(t.in_shardings)
            assert tuple(s.spec for s in t.in_shardings[:n]) == tuple(t.plan.in_specs[:n])
        assert _entry_params_resharded(t.compiled.as_text()) == [], t.task.name
    audit = ex.audit()
    assert audit.unpredicted == ()                # every reshard is in a task's plan
    for t in audit.tasks:
        assert t.audit.compiled_bytes <= t.audit.predicted_bytes, t.name


def test_carried_spec_finds_the_same_shards_on_a_sub_mesh_of_another_shape():
    from autoshard.ir import _compat
    from autoshard.pipeline.layouts import carried_spec

    devs = np.array(jax.devices()[:4], dtype=object)
    square = _compat.make_auto_mesh(devs.reshape(2, 2), ("x0", "x1"))
    line = _compat.make_auto_mesh(np.array(jax.devices()[4:8], dtype=object), ("x",))
    pair = _compat.make_auto_mesh(np.array(jax.devices()[4:6], dtype=object), ("x",))
    on = functools.partial(NamedSharding, square)
    assert carried_spec(on(P(("x0", "x1"))), line, (8, 4)) == P("x")
    assert carried_spec(on(P(None, ("x0", "x1"))), line, (8, 4)) == P(None, "x")
    assert carried_spec(on(P("x0")), line, (8, 4)) is None      # halves held twice: no match
    assert carried_spec(on(P()), pair, (8, 4)) == P()              # replicated: any count
    assert carried_spec(on(P("x0", "x1")), pair, (8, 4)) is None


def test_values_cross_to_another_sub_mesh_shape_in_their_producers_layout():
    """(4,) -> (2, 2): stage 1 takes stage 0's activations shard for shard: no reshard."""
    from autoshard.pipeline.layouts import carried_spec

    stage = ManualStageOption([[0, 1], [2, 3]], [(1, 4), (1, 4)], [(4,), (2, 2)], [{}, {}])
    method = PipeshardParallel(num_micro_batches=2, layer_option="manual", stage_option=stage,
                               blocking=True)
    step = sgd_step(mlp_loss)
    f = autoshard.parallelize(step, method=method)
    params, batch = f.preshard_dynamic_args(mlp_params(widths=(8, 32, 32, 32, 4)), mlp_batch())
    got = f(params, batch)
    ex = f.get_last_executable()
    before = dict(ex.move.counts)
    got = f(got, batch)
    moved = {k: ex.move.counts[k] - before[k] for k in before}
    assert moved == {"reshard": 0, "copy": 4, "placed": 0}  # 2 micro-batches x (act, cotangent)
    ref = jax.jit(step)
    assert_trees_close(got, ref(ref(mlp_params(widths=(8, 32, 32, 32, 4)), mlp_batch()),
                                mlp_batch()))
    f0, f1 = ex.tasks[("F", 0)], ex.tasks[("F", 1)]
    (act,) = set(f0.outvars) & set(f1.invars)
    src = f0.out_shardings[f0.outvars.index(act)]
    dst = f1.in_shardings[f1.invars.index(act)]
    assert src.spec == P("x") and dst.spec == P(("x0", "x1"))
    assert carried_spec(src, f1.mesh, act.aval.shape) == dst.spec
    audit = ex.audit()
    assert audit.unpredicted == ()
    # The audit's transfers are the runtime's copies: 2 values x 2 micro-batches, none resharded.
    assert [(t.src, t.dst, t.runs, t.resharded) for t in audit.transfers] == [
        ("F0", "F1", 2, False), ("B1", "B0", 2, False)]
    assert audit.transfer_bytes == 2 * 2 * 16 * 32 * 4  # (16, 32) f32 per micro-batch
    assert "4 copies of 8,192 B in all; 0 of 2 values resharded" in audit.explain()


# Audit and explain -----------------------------------------------------------------------------
def test_pipeline_audit_weights_tasks_by_runs_and_explains(two_stages_2x2):
    _, _, ex = two_stages_2x2
    audit = ex.audit()
    names = [t.name for t in audit.tasks]
    assert names == ["F0", "F1", "B1", "B0", "apply0.0", "apply1.0", "reduce0", "reduce1"]
    assert [t.runs for t in audit.tasks] == [2, 2, 2, 2, 1, 1, 1, 1]
    assert audit.predicted_bytes == sum(t.runs * t.audit.predicted_bytes for t in audit.tasks)
    assert audit.compiled_bytes == sum(t.runs * t.audit.compiled_bytes for t in audit.tasks)
    assert audit.compiled_bytes > 0 and audit.has_prediction and audit.within(0.10)
    b1, reduce1 = audit.tasks[2].audit, audit.tasks[7].audit
    assert b1.compiled_bytes == b1.predicted_bytes == 0  # gradients stay partial in B1
    # and are all-reduced once per step (the weight gradients of stage 1: 32x32 and 32x4)
    assert reduce1.compiled_bytes == reduce1.predicted_bytes == (32 * 32 + 32 * 4) * 4
    memory = audit.stage_memory()
    assert set(memory) == {0, 1}
    for stage, (predicted, compiled) in memory.items():
        largest = max(t.audit.compiled_memory for t in audit.tasks if t.stage == stage)
        assert compiled == largest and predicted > 0
    text = ex.explain()
    assert text.startswith("PipeshardParallel: 2 stages")
    assert "task F1:" in text and "pipeline audit" in text
    assert re.search(r"B1\s+1\s+2\s+[\d,]+\s+[\d,]+", text)


def test_audit_lists_a_task_without_a_plan(monkeypatch):
    from autoshard.pipeline import tasks as pipeline_tasks

    real = pipeline_tasks.plan_auto

    def fail_apply(closed, **kw):
        if kw["in_paths"] and kw["in_paths"][0].startswith("apply1.0."):
            raise RuntimeError("no plan for this test")
        return real(closed, **kw)
    monkeypatch.setattr(pipeline_tasks, "plan_auto", fail_apply)
    method = PipeshardParallel(num_micro_batches=2, layer_option="manual", blocking=True,
                               stage_option=UniformStageOption(num_stages=2))
    with pytest.warns(UserWarning, match="apply1.0: planner failed"):
        got, want, ex = run_steps(sgd_step(mlp_loss), method, (mlp_params(), mlp_batch()), 1)
    assert_trees_close(got, want)
    audit = ex.audit()
    task = next(t for t in audit.tasks if t.name == "apply1.0")
    assert not task.audit.has_prediction and not audit.has_prediction
    assert re.search(r"apply1\.0\s+1\s+1\s+\(no plan\)", audit.explain())


# The exact forward/backward split --------------------------------------------------------------
def _rmse(p, x, y):
    # sqrt's derivative reads its output: the loss is read by the backward, so "the first
    # float scalar nothing reads" is no longer the loss.
    return jnp.sqrt(mlp_loss(p, x, y))


def test_forward_ends_at_the_loss_marker_where_the_heuristic_fails():
    def step(p, x, y, grad):
        return grad(_rmse)(p, x, y)
    args = (mlp_params(), *mlp_batch())
    marked = jax.make_jaxpr(functools.partial(step, grad=autoshard.grad))(*args).jaxpr
    plain = jax.make_jaxpr(functools.partial(step, grad=jax.grad))(*args).jaxpr
    loss_at = next(i for i, e in enumerate(marked.eqns) if e.primitive.name == "pipeline_marker"
                   and e.params["name"] == "loss" and e.params["mark_type"] == "end")
    assert "sqrt" in [e.primitive.name for e in marked.eqns[loss_at - 3:loss_at]]
    assert forward_end(marked.eqns, False) == loss_at + 1
    backward = [e.primitive.name for e in marked.eqns[loss_at + 1:]]
    assert backward[0] == "pipeline_marker" and backward.count("dot_general") == 7
    # Without the marker the heuristic counts the whole backward as forward.
    assert forward_end(plain.eqns, False) == len(plain.eqns)


def test_exact_split_pipelines_a_loss_the_backward_reads():
    method = PipeshardParallel(num_micro_batches=1, layer_option="manual", blocking=True,
                               stage_option=UniformStageOption(num_stages=2))
    got, want, ex = run_steps(sgd_step(_rmse), method, (mlp_params(), mlp_batch()), 2)
    assert_trees_close(got, want)
    assert ex.plan.schedule == "1f1b"
    part = ex.part
    assert all(b.eqns for b in part.backward)      # each stage runs its own backward
    dots = [e for e in part.forward[1].eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 2                          # F1: the forward of layers 2 and 3 only
    w0_grad = part.marker.invars[0]
    assert w0_grad in part.backward[0].outvars     # w0's gradient is made on stage 0


def test_split_backward_computes_each_equation_once_and_passes_cotangents():
    """zero_bubble: Ba and Bw share no work; Bw reads the cotangents Ba computed."""
    from autoshard.pipeline.partition import free_eqns, split_pre_post

    method = PipeshardParallel(num_micro_batches=2, layer_option="manual", blocking=True,
                               pipeline_schedule="zero_bubble",
                               stage_option=UniformStageOption(num_stages=2))
    got, want, ex = run_steps(sgd_step(mlp_loss), method, (mlp_params(), mlp_batch()), 1)
    assert_trees_close(got, want)
    part = ex.part
    pre, _, post = split_pre_post(part.jaxpr)
    free = free_eqns(pre, post, part.jaxpr.constvars)
    for b, (ba, bw) in zip(part.backward, part.split_backward, strict=True):
        work = {id(e) for e in b.eqns if id(e) not in free}
        a = {id(e) for e in ba.eqns if id(e) not in free}
        w = {id(e) for e in bw.eqns if id(e) not in free}
        assert w and not a & w and a | w == work
        handed = set(ba.outvars) & set(bw.invars)
        assert not handed & set(b.outvars)         # intermediate cotangents, not outputs
        assert bool(handed) == (b.stage > 0)       # stage 0 sends no input cotangent
        dots = sum(e.primitive.name == "dot_general" for e in ba.eqns + bw.eqns)
        assert dots == sum(e.primitive.name == "dot_general" for e in b.eqns)


# Profiling in the planned layout ---------------------------------------------------------------
def test_profiled_candidates_run_in_their_planned_layout(tmp_path, monkeypatch):
    """A candidate stage is profiled as the runtime would run it: its forward and backward
    tasks planned by tasks.plan_tasks with the stage's options, on the candidate's mesh."""
    from autoshard.pipeline.profile import StageProfiler

    seen = {}
    real_measure = StageProfiler.measure

    def spy(self, i, j, n):
        out = real_measure(self, i, j, n)
        seen[(i, j, n)] = self.plans[(i, j, n)]
        return out
    monkeypatch.setattr(StageProfiler, "measure", spy)
    option = AutoStageOption(profile=True, profile_cache_dir=str(tmp_path),
                             submesh_physical_shape_space="manual",
                             manually_specified_submeshes=[(1, 2)])
    default = AutoShardingOption(allow_replicated_parameters=False)
    method = PipeshardParallel(num_micro_batches=2, blocking=True, devices=jax.devices()[:4],
                               layer_option=AutoLayerOption(layer_num=2), stage_option=option,
                               default_auto_sharding_option=default)
    step = sgd_step(functools.partial(mlp_loss, markers=False))
    got, want, _ = run_steps(step, method, (mlp_params(), mlp_batch(batch=48)), 1)
    assert_trees_close(got, want)
    assert len(seen) == 3                            # 3 layer ranges on 2 devices
    for (_, _, n), planned in seen.items():
        assert [tp.kind for tp in planned] == ["F", "B"]
        assert all(tp.plan is not None and tp.plan.mesh_shape == (n,) for tp in planned)
        # allow_replicated_parameters=False reached the profile: no weight is replicated,
        # where the data-parallel layout replicated every one of them (micro-batch: 24 rows).
        f = planned[0]
        weights = [spec for spec, leaf in zip(f.in_specs, f.plan.inputs, strict=False)
                   if len(leaf.shape) == 2 and leaf.shape[0] != 24]
        assert weights and all(spec != P() for spec in weights)


# Bad input -------------------------------------------------------------------------------------
def test_a_stage_over_the_memory_budget_names_the_stage_and_the_fixes():
    method = PipeshardParallel(
        num_micro_batches=2, layer_option="manual", blocking=True,
        stage_option=UniformStageOption(num_stages=2),
        default_auto_sharding_option=AutoShardingOption(memory_budget_per_device=1000))
    with pytest.raises(ValueError, match=r"Stage 0 does not fit in memory: its task F0 has no "
                                         r"plan within its budget \(No plan fits "
                                         r"memory_budget_per_device \(1,000 B\).*Use more "
                                         r"stages.*remat.*num_micro_batches"):
        autoshard.parallelize(sgd_step(mlp_loss), method=method)(mlp_params(), mlp_batch())
