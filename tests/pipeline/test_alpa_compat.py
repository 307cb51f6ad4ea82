"""Alpa's pipeline behaviour, ported from Alpa's ``tests/pipeline_parallel`` (written anew here).

Upstream tests covered:

* ``test_pipeline_marker.py`` ``test_jax_graph``, ``test_transpose``: ``pipeline_p.bind`` with
  Alpa's parameters only, eager and under jit (here also grad and vmap, every mark type).
* ``test_reduce_scatter.py`` ``test_mlp_grad_acc_friendly``: ``get_hlo_text()`` is Alpa's
  six-entry list for two stages; no collective in the forwards, exactly one (combined)
  all-reduce per data-parallel stage in its backward entry (the once-per-step reduction);
  with ``prefer_reduce_scatter`` exactly one all-gather per apply entry (the update runs on
  shards, ZeRO-2), without it none; numerics equal to jax.jit. ``test_bert_grad_acc_friendly``
  in small: the same counts with biases and layer-norm scales (vector gradients).
* ``test_scatter_gather.py`` ``test_2_layer_bert``: ``force_batch_dim_to_mesh_dim=0`` on a
  ``(1, 2)`` sub-mesh is accepted (a warning), an axis that does not exist is an error.
* ``test_set_input_shard.py``: ``jax.core.ShapedArray`` arguments, stage input specs reused;
  Alpa's rng dicts: an empty dict as a batch argument.
* ``test_schedules.py`` ``test_schedules``: Alpa's ``GpipeSchedule``/``PipeDreamFlush``
  tables (clock count, placement, in-flight micro-batches) and the exact GPipe table.
* ``test_dynamic_programming.py``, ``test_old_dp_vs_new_dp.py``: ``training_dp`` and
  ``training_dp_2`` against an exhaustive search with Alpa's memory limit.
"""

import itertools
import math
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState
from pipeline_models import assert_trees_close, mlp_batch, mlp_loss, mlp_params, sgd_step

import autoshard
from autoshard.markers import MARK_TYPES, pipeline_p
from autoshard.pipeline import ManualStageOption, PipeshardParallel, UniformStageOption
from autoshard.pipeline.alpa_compat import (
    GpipeSchedule,
    InferenceSchedule,
    PipeDreamFlush,
    gen_linear_pipeline_dependency,
    get_submesh_choices,
    training_dp,
    training_dp_2,
)

ALPA_MARK_TYPES = ("start", "end", "jvp_start", "jvp_end", "boundary", "grad")


# markers ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mark_type", ALPA_MARK_TYPES)
def test_bind_with_alpa_parameters_is_identity(mark_type):
    assert mark_type in MARK_TYPES
    x = np.random.default_rng(0).random((10, 8), np.float32)
    y = np.random.default_rng(1).random((10, 8), np.float32)

    def f(x, y):
        a, b = pipeline_p.bind(x + y, x * y, name="1", mark_type=mark_type)
        z, = pipeline_p.bind(a + b, name="1", mark_type=mark_type)
        return jnp.transpose(z)

    want = (x + y + x * y).T
    np.testing.assert_allclose(f(x, y), want, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(f)(x, y), want, rtol=1e-6)
    np.testing.assert_allclose(jax.vmap(f)(x[None], y[None])[0], want, rtol=1e-6)
    g = jax.grad(lambda x: jnp.sum(f(x, y) ** 2))(x)
    g_ref = jax.grad(lambda x: jnp.sum(((x + y + x * y).T) ** 2))(x)
    np.testing.assert_allclose(g, g_ref, rtol=1e-5)


def test_bind_without_reductions_has_no_reductions_param():
    jaxpr = jax.make_jaxpr(lambda x: pipeline_p.bind(x, name="1", mark_type="start"))(1.0)
    (eqn,) = jaxpr.jaxpr.eqns
    assert eqn.params == {"name": "1", "mark_type": "start"}


# get_hlo_text: Alpa's list ---------------------------------------------------------------------
_COLLECTIVE = re.compile(r"=\s*(.+?)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute)(-start)?\(")


def collectives(text: str) -> list[str]:
    """The collective ops of an HLO text, scalar all-reduces left out."""
    out = []
    for line in text.splitlines():
        m = _COLLECTIVE.search(line)
        if m and not (m.group(2) == "all-reduce" and re.fullmatch(r"\(?f32\[\]\S*", m.group(1))):
            out.append(m.group(2))
    return out


def test_get_hlo_text_is_alpas_list_with_one_reduction_per_data_parallel_stage():
    method = PipeshardParallel(
        num_micro_batches=4, layer_option="manual",
        stage_option=UniformStageOption(num_stages=2),
        default_auto_sharding_option=autoshard.AutoShardingOption(force_data_parallel=True),
        blocking=True)
    step = sgd_step(mlp_loss)
    state, batch = mlp_params(), mlp_batch()
    f = autoshard.parallelize(step, method=method)
    got, want = state, state
    for _ in range(2):
        got, want = f(got, batch), jax.jit(step)(want, batch)
    assert_trees_close(got, want)
    ex = f.get_last_executable()
    texts = ex.get_hlo_text()
    assert len(texts) == 6  # F0 F1 B1 B0 A0 A1
    tasks = ex.get_task_hlo_texts()
    assert list(tasks)[:4] == ["F0", "F1", "B1", "B0"]
    assert texts[0] == tasks["F0"] and texts[1] == tasks["F1"]
    assert texts[2].startswith(tasks["B1"]) and tasks["reduce1"] in texts[2]
    assert texts[3].startswith(tasks["B0"]) and tasks["reduce0"] in texts[3]
    assert tasks["apply0.0"] in texts[4] and tasks["apply1.0"] in texts[5]
    assert [collectives(t) for t in texts] == [[], [], ["all-reduce"], ["all-reduce"], [], []]
    assert collectives(tasks["B0"]) == collectives(tasks["B1"]) == []  # partial sums


ZERO2_COLLECTIVES = [[], [], ["all-reduce"], ["all-reduce"], ["all-gather"], ["all-gather"]]
"""Alpa's grad_acc_friendly counts for two ZeRO-2 stages: nothing in the forwards, one
(combined) all-reduce in each backward entry, one all-gather in each apply entry."""


def _zero2_pipeline(loss, state, batch, steps: int = 3):
    """Two data-parallel stages with ZeRO-2 (``force_data_parallel`` and
    ``prefer_reduce_scatter``), 4 micro-batches, trained ``steps`` steps beside ``jax.jit``:
    (state, jax.jit's state, the executable)."""
    def step(state, batch):
        grads = autoshard.grad(lambda p: loss(p, *batch))(state.params)
        return state.apply_gradients(grads=grads)

    method = PipeshardParallel(
        num_micro_batches=4, layer_option="manual",
        stage_option=UniformStageOption(num_stages=2),
        default_auto_sharding_option=autoshard.AutoShardingOption(
            force_data_parallel=True, prefer_reduce_scatter=True),
        blocking=True)
    f = autoshard.parallelize(step, method=method)
    got, want = state, state
    for _ in range(steps):
        got, want = f(got, batch), jax.jit(step)(want, batch)
    return got, want, f.get_last_executable()


def test_prefer_reduce_scatter_shards_a_data_parallel_stages_update():
    """``test_mlp_grad_acc_friendly`` in full: with prefer_reduce_scatter the update runs on
    gradient and momentum shards and the new parameters come back in one all-gather."""
    tx = optax.sgd(0.1, momentum=0.9)
    state = TrainState.create(apply_fn=None, params=mlp_params(), tx=tx)
    got, want, ex = _zero2_pipeline(mlp_loss, state, mlp_batch())
    assert_trees_close(got.params, want.params)
    assert_trees_close(got.opt_state, want.opt_state)
    assert [collectives(t) for t in ex.get_hlo_text()] == ZERO2_COLLECTIVES
    assert "apply0.0: ZeRO-2 update" in ex.explain()
    # each of a stage's 4 devices keeps a quarter of every momentum buffer
    for leaf, p in zip(jax.tree.leaves(got.opt_state), jax.tree.leaves(got.params),
                       strict=False):
        if leaf.shape == p.shape:
            assert leaf.sharding.shard_shape(leaf.shape) == (leaf.shape[0] // 4,) + (
                leaf.shape[1:])


def test_prefer_reduce_scatter_keeps_backward_accumulators_whole():
    """``test_bert_grad_acc_friendly`` in small: layers with biases and a layer norm. The
    backward tasks' gradient accumulators are not the update's state: ZeRO-2's resharding of
    a step's update (``zero_update``) must not shard them (it did, and each stage's backward
    then all-gathered a bias gradient every micro-batch: two collectives where Alpa asserts
    one all-reduce)."""
    rng = np.random.default_rng(3)
    dims = (16, 32, 32, 32, 8)
    params = {}
    for i, (a, b) in enumerate(itertools.pairwise(dims)):
        params[f"w{i}"] = jnp.asarray(rng.normal(size=(a, b)) / math.sqrt(a), jnp.float32)
        params[f"b{i}"] = jnp.zeros((b,), jnp.float32)
        params[f"g{i}"] = jnp.ones((b,), jnp.float32)
    batch = (jnp.asarray(rng.normal(size=(32, 16)), jnp.float32),
             jnp.asarray(rng.normal(size=(32, 8)), jnp.float32))
    state = TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2))

    def layer(p, i, h):
        h = h @ p[f"w{i}"] + p[f"b{i}"]
        h = (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-5)
        return jnp.tanh(h * p[f"g{i}"])

    def loss(p, x, y):
        h = layer(p, 1, layer(p, 0, x))
        autoshard.mark_pipeline_boundary()
        return jnp.mean((layer(p, 3, layer(p, 2, h)) - y) ** 2)

    got, want, ex = _zero2_pipeline(loss, state, batch)
    assert_trees_close(got.params, want.params)
    assert [collectives(t) for t in ex.get_hlo_text()] == ZERO2_COLLECTIVES


def test_inference_get_hlo_text_is_the_forwards():
    method = PipeshardParallel(num_micro_batches=2, layer_option="manual",
                               pipeline_schedule="inference",
                               stage_option=UniformStageOption(num_stages=2))
    params = mlp_params()
    x = mlp_batch()[0]

    def infer(p, x):
        h = jnp.tanh(jnp.tanh(x @ p["w0"]) @ p["w1"])
        autoshard.mark_pipeline_boundary()
        return jnp.tanh(h @ p["w2"]) @ p["w3"]

    f = autoshard.parallelize(infer, method=method)
    np.testing.assert_allclose(f(params, x), jax.jit(infer)(params, x), rtol=1e-5, atol=1e-5)
    texts = f.get_last_executable().get_hlo_text()
    assert len(texts) == 2 and all("HloModule" in t for t in texts)


def test_shaped_array_arguments_and_reused_stage_input_shardings():
    """``test_set_input_shard.py``: abstract ``jax.core.ShapedArray`` arguments, and the stage
    input specs of one executable reproduced by another batch size's."""
    params = jax.eval_shape(mlp_params)

    def infer(p, batch):
        h = jnp.tanh(jnp.tanh(batch["x"] @ p["w0"]) @ p["w1"])
        autoshard.mark_pipeline_boundary()
        return jnp.tanh(h @ p["w2"]) @ p["w3"]

    def method(**kw):
        return PipeshardParallel(num_micro_batches=1, pipeline_schedule="inference",
                                 layer_option="manual",
                                 stage_option=UniformStageOption(num_stages=2), **kw)
    f = autoshard.parallelize(infer, batch_argnums=(1,), method=method())
    ex1 = f.get_executable(params, {"x": jax.core.ShapedArray((1, 8), jnp.float32)})
    assert f.get_executable(params, {"x": jax.ShapeDtypeStruct((1, 8), jnp.float32)}) is ex1
    g = autoshard.parallelize(infer, batch_argnums=(1,), method=method(
        stage_input_shardings=ex1.stage_input_shard_specs))
    ex3 = g.get_executable(params, {"x": jax.core.ShapedArray((8, 8), jnp.float32)})
    assert ex3.stage_input_shard_specs == ex1.stage_input_shard_specs


# force_batch_dim_to_mesh_dim on an axis of size 1 ----------------------------------------------
def _two_stage(dicts):
    return PipeshardParallel(
        devices=jax.devices()[:4], num_micro_batches=2, layer_option="manual",
        stage_option=ManualStageOption(
            forward_stage_layer_ids=[[0, 1], [2, 3]], submesh_physical_shapes=[(1, 2), (1, 2)],
            submesh_logical_shapes=[(1, 2), (2, 1)], submesh_autosharding_option_dicts=dicts),
        blocking=True)


def test_force_batch_dim_on_a_size_one_axis_is_ignored_with_a_warning():
    step = sgd_step(mlp_loss)
    state, batch = mlp_params(), mlp_batch()
    f = autoshard.parallelize(step, method=_two_stage([{"force_batch_dim_to_mesh_dim": 0}, {}]))
    with pytest.warns(UserWarning, match=r"force_batch_dim_to_mesh_dim \(0\) names an axis of "
                                         r"size 1 of the stage's sub-mesh \(1, 2\)"):
        got = f(state, batch)
    assert_trees_close(got, jax.jit(step)(state, batch))


def test_force_batch_dim_on_a_missing_axis_stays_an_error():
    f = autoshard.parallelize(sgd_step(mlp_loss),
                              method=_two_stage([{"force_batch_dim_to_mesh_dim": 2}, {}]))
    with warnings.catch_warnings(), pytest.raises(ValueError, match=r"names no axis"):
        f(mlp_params(), mlp_batch())


# batch_argnums naming an empty dict ------------------------------------------------------------
def test_empty_dict_batch_argument_is_accepted():
    def step(w, x, rngs):
        return jnp.sum(jnp.tanh(x @ w)) + len(rngs)

    w, x = jnp.ones((4, 4)) * 0.1, jnp.arange(32.0).reshape(8, 4) / 32
    f = autoshard.parallelize(step, batch_argnums=(1, 2))
    np.testing.assert_allclose(f(w, x, {}), step(w, x, {}), rtol=1e-6)
    g = autoshard.parallelize(step, batch_argnums=(1, 2))
    with pytest.raises(ValueError, match=r"names argument 2, which holds no array \(got int\)"):
        g(w, x, 3)


# Alpa's schedule tables ------------------------------------------------------------------------
def _make(cls, num_mesh, num_batch):
    num_stage = 2 * num_mesh
    return cls(dependency=gen_linear_pipeline_dependency(num_stage), meshes=[None] * num_mesh,
               apply_grad_placement={num_stage + i: i for i in range(num_mesh)},
               num_batch=num_batch)


def test_gpipe_table_two_meshes_two_micro_batches():
    s = _make(GpipeSchedule, 2, 2)
    assert s.schedules == [
        [(0, 0), None], [(1, 0), (0, 1)], [None, (1, 1)],      # forwards
        [None, (0, 2)], [(0, 3), (1, 2)], [(1, 3), None],      # backwards (stage 2n-1-i)
        [(1, 4), (1, 5)]]                                      # apply, last micro-batch
    assert s.num_clock == 7 and s.num_stage == 4 and s.num_mesh == 2
    assert s.stage_placement(3) == [0] and s.mesh_placement(1) == [1, 2, 5]
    assert s.should_skip_grad_sync((0, 2)) and not s.should_skip_grad_sync((1, 2))


@pytest.mark.parametrize("cls", [GpipeSchedule, PipeDreamFlush])
@pytest.mark.parametrize("num_mesh,num_batch", [(2, 1), (2, 8), (3, 4), (4, 16), (8, 3)])
def test_schedule_tables_as_alpas_test_checks(cls, num_mesh, num_batch):
    s = _make(cls, num_mesh, num_batch)
    assert s.num_clock == (num_mesh + num_batch - 1) * 2 + 1
    for i in range(2 * num_mesh):
        assert len(s.stage_placement(i)) == 1
    for m in range(num_mesh):
        f, b, a = sorted(s.mesh_placement(m))
        assert f == m and b == 2 * num_mesh - 1 - f and a == 2 * num_mesh + f
    # every (micro-batch, stage) exactly once
    tasks = [t for clock in s.schedules[:-1] for t in clock if t]
    assert sorted(tasks) == sorted(itertools.product(range(num_batch), range(2 * num_mesh)))
    in_flight, peak = [0] * num_mesh, [0] * num_mesh
    for clock in s.schedules[:-1]:
        for m, t in enumerate(clock):
            if t:
                in_flight[m] += 1 if t[1] < num_mesh else -1
                peak[m] = max(peak[m], in_flight[m])
    if cls is PipeDreamFlush:
        assert all(peak[m] <= num_mesh - m for m in range(num_mesh))
    else:
        assert peak == [num_batch] * num_mesh


def test_inference_schedule_table():
    s = InferenceSchedule(dependency=np.zeros((3, 3), int), meshes=[None] * 3,
                          apply_grad_placement={}, num_batch=2)
    assert s.schedules == [[(0, 0), None, None], [(1, 0), (0, 1), None],
                           [None, (1, 1), (0, 2)], [None, None, (1, 2)], [None, None, None]]


def test_schedule_errors():
    with pytest.raises(ValueError, match=r"dependency of shape \(2, 2\) must be a square matrix "
                                         r"over the 4 compute stages of 2 meshes"):
        GpipeSchedule(dependency=np.zeros((2, 2)), meshes=[None] * 2, apply_grad_placement={})
    with pytest.raises(ValueError, match=r"apply_grad_placement puts stage 4 on mesh 2"):
        _make(PipeDreamFlush, 2, 1).__class__(
            dependency=gen_linear_pipeline_dependency(4), meshes=[None] * 2,
            apply_grad_placement={4: 2})
    with pytest.raises(ValueError, match=r"num_stage \(3\) must be even"):
        gen_linear_pipeline_dependency(3)


# Alpa's training_dp ----------------------------------------------------------------------------
def exhaustive(num_layers, num_devices, num_mb, submeshes, cost, limit):
    """Every cut into contiguous stages, each on a (sub-mesh, config), devices all used."""
    best = math.inf
    sizes = [int(np.prod(s)) for s in submeshes]

    def rec(i, d, stages):
        nonlocal best
        if i == num_layers:
            if d == 0:
                n = len(stages)
                if all(n - 1 - q <= limit[a, b - 1, m, c] for q, (a, b, m, c) in
                       enumerate(stages)):
                    t = [cost[a, b - 1, m, c] for a, b, m, c in stages]
                    best = min(best, sum(t) + (num_mb - 1) * max(t))
            return
        for j in range(i + 1, num_layers + 1):
            for m, c in itertools.product(range(len(sizes)), range(cost.shape[3])):
                if sizes[m] <= d:
                    rec(j, d - sizes[m], stages + [(i, j, m, c)])
    rec(0, num_devices, [])
    return best


@pytest.mark.parametrize("seed", range(8))
def test_training_dp_equals_exhaustive_search_with_the_memory_limit(seed):
    rng = np.random.default_rng(seed)
    num_layers, num_devices = int(rng.integers(2, 5)), int(rng.choice([2, 4]))
    submeshes = get_submesh_choices(1, num_devices, "all")
    num_configs = int(rng.integers(1, 3))
    shape = (num_layers, num_layers, len(submeshes), num_configs)
    cost = rng.random(shape) + 0.1
    limit = rng.integers(0, num_layers, shape)
    num_mb = int(rng.choice([1, 4, 16]))
    got, stages = training_dp(num_layers, num_devices, num_mb, submeshes, num_configs, cost,
                              limit)
    want = exhaustive(num_layers, num_devices, num_mb, submeshes, cost, limit)
    if math.isinf(want):
        assert math.isinf(got) and stages is None
        return
    assert got == pytest.approx(want)
    # Alpa's solution format: ((start, end exclusive), submesh index, config index)
    assert [s[0][0] for s in stages] == [0] + [s[0][1] for s in stages[:-1]]
    assert stages[-1][0][1] == num_layers
    assert sum(np.prod(submeshes[m]) for _, m, _ in stages) == num_devices
    times = [cost[a, b - 1, m, c] for (a, b), m, c in stages]
    assert sum(times) + (num_mb - 1) * max(times) == pytest.approx(got)
    assert training_dp_2(num_devices, num_mb, submeshes, cost, limit) == (got, stages)


def test_training_dp_infeasible_and_shape_errors():
    submeshes = get_submesh_choices(1, 2, "all")
    cost = np.ones((2, 2, 2, 1))
    assert training_dp(2, 2, 4, submeshes, 1, cost, np.full(cost.shape, -1)) == (math.inf, None)
    with pytest.raises(ValueError, match=r"compute_cost has shape \(2, 2, 2, 1\); it must be "
                                         r"\(num_layers, num_layers"):
        training_dp(3, 2, 4, submeshes, 1, cost, cost)


def test_get_submesh_choices():
    assert get_submesh_choices(1, 8, "all") == ((1, 1), (1, 2), (1, 4), (1, 8))
    assert get_submesh_choices(4, 4, "all") == ((1, 1), (1, 2), (1, 4), (2, 4), (3, 4), (4, 4))
    assert get_submesh_choices(8, 2, "power_of_two") == ((1, 1), (1, 2), (2, 2), (4, 2), (8, 2))
    assert get_submesh_choices(8, 2, "small_power_of_two") == ((1, 1), (1, 2), (2, 2), (4, 2))
    with pytest.raises(ValueError, match=r"num_devices_per_host \(3\) must be a power of two"):
        get_submesh_choices(1, 3, "all")
