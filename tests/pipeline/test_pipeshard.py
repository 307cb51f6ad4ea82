"""PipeshardParallel against a single-device jax.jit run (8 virtual CPU devices).

Every test runs with ``blocking=True``: XLA:CPU can abort (collective rendezvous timeout) when
many multi-device executables are queued on this 2-core machine.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState
from pipeline_models import GPT, assert_trees_close, mlp_batch, mlp_loss, mlp_params, sgd_step

import autoshard
from autoshard.ir import _compat
from autoshard.pipeline import (
    AutoLayerOption,
    ManualLayerOption,
    ManualStageOption,
    PipeshardParallel,
    UniformStageOption,
)


def run_steps(step, method, state, batch, num_steps=3):
    f = autoshard.parallelize(step, method=method)
    ref = jax.jit(step)
    got, want = state, state
    for _ in range(num_steps):
        got, want = f(got, batch), ref(want, batch)
    return got, want, f.get_last_executable()


@pytest.mark.parametrize("schedule,num_stages", [("gpipe", 2), ("1f1b", 2), ("1f1b", 4),
                                                 ("gpipe", 4), ("zero_bubble", 4)])
def test_mlp_matches_single_device(schedule, num_stages):
    method = PipeshardParallel(num_micro_batches=4, layer_option="manual",
                               stage_option=UniformStageOption(num_stages=num_stages),
                               pipeline_schedule=schedule, blocking=True)
    got, want, ex = run_steps(sgd_step(mlp_loss), method, mlp_params(), mlp_batch())
    assert_trees_close(got, want)
    assert len(ex.plan.stage_layer_ids) == num_stages
    assert len(ex.get_task_hlo_texts()) == 2 * num_stages + len(ex.apply) + (
        num_stages if schedule == "zero_bubble" else 0) + len(ex.reduce_tasks)
    assert len(ex.get_hlo_text()) == 3 * num_stages  # Alpa's: forward, backward, apply
    # a data-parallel stage's gradients: one all-reduce per step, in its reduce task
    assert ex.reduce_tasks and all("all-reduce(" in t.compiled.as_text()
                                   for t in ex.reduce_tasks)


def test_gpt_tied_embeddings_adam_and_global_norm_clipping():
    model = GPT(layers=3)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 32, size=(16, 8)), jnp.int32)
    params = model.init(jax.random.key(0), tokens)
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2, eps=1e-3))
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def step(state, tokens):
        def loss(p):
            logits = state.apply_fn(p, tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, tokens[:, 1:]).mean()
        grads = autoshard.grad(loss)(state.params)
        return state.apply_gradients(grads=grads)

    method = PipeshardParallel(num_micro_batches=4, layer_option="manual",
                               stage_option=UniformStageOption(num_stages=4), blocking=True)
    got, want, ex = run_steps(step, method, state, tokens)
    assert_trees_close(got.params, want.params)
    # the embedding is read by stage 0 (lookup) and stage 3 (output projection)
    assert ex.plan.stage_layer_ids == ((0,), (1,), (2,), (3,))
    # the embedding's backward (a scatter-add of batch-split rows) is a partial sum over the
    # batch: B0 runs per device and reduces once per step; nothing unpredicted
    assert "B0: runs per device over the batch axes" in ex.plan.explain()
    assert ex.audit().unpredicted == ()


def test_auto_layers_and_remat_match():
    loss = functools.partial(mlp_loss, markers=False)
    for layer_option in (AutoLayerOption(layer_num=2),
                         AutoLayerOption(layer_num=4, remat_mode="coarse_grained_remat")):
        method = PipeshardParallel(num_micro_batches=2, layer_option=layer_option,
                                   blocking=True)
        got, want, ex = run_steps(sgd_step(loss), method, mlp_params(), mlp_batch(), 2)
        assert_trees_close(got, want)
        assert ex.plan.num_layers == layer_option.layer_num


def test_manual_remat_and_manual_stages():
    stage = ManualStageOption([[0, 1], [2], [3]], [(1, 4), (1, 2), (1, 2)],
                              [(4,), (2,), (2,)], [{}, {}, {}])
    method = PipeshardParallel(num_micro_batches=4, blocking=True,
                               layer_option=ManualLayerOption(remat_layer=True),
                               stage_option=stage)
    got, want, ex = run_steps(sgd_step(mlp_loss), method, mlp_params(), mlp_batch())
    assert_trees_close(got, want)
    assert ex.plan.submesh_shapes == ((4,), (2,), (2,))


def test_plain_jax_grad_returns_gradients():
    def step(p, batch):
        return jax.grad(mlp_loss)(p, *batch)

    method = PipeshardParallel(num_micro_batches=4, layer_option="manual",
                               stage_option=UniformStageOption(num_stages=4), blocking=True)
    f = autoshard.parallelize(step, method=method)
    assert_trees_close(f(mlp_params(), mlp_batch()), jax.jit(step)(mlp_params(), mlp_batch()))


def test_inference_joins_batch_outputs_and_means_the_loss():
    def step(p, batch):
        x, y = batch
        h = jnp.tanh(x @ p["w0"])
        autoshard.mark_pipeline_boundary()
        out = jnp.tanh(h @ p["w1"]) @ p["w2"] @ p["w3"]
        return {"out": out, "loss": jnp.mean((out - y) ** 2), "scale": 2.0}

    method = PipeshardParallel(num_micro_batches=4, layer_option="manual",
                               pipeline_schedule="inference", blocking=True)
    got = autoshard.parallelize(step, method=method)(mlp_params(), mlp_batch())
    want = jax.jit(step)(mlp_params(), mlp_batch())
    assert_trees_close(got, want)


def test_stage_boundaries_copy_device_to_device(monkeypatch):
    """No value crosses sub-meshes through the host: the resharding paths are never taken."""
    module, names = _compat.device_put_host_paths()
    calls = []
    for n in names:
        orig = getattr(module, n)
        monkeypatch.setattr(module, n, lambda *a, _o=orig, _n=n, **k: (calls.append(_n),
                                                                       _o(*a, **k))[1])
    method = PipeshardParallel(num_micro_batches=4, layer_option="manual",
                               stage_option=UniformStageOption(num_stages=4), blocking=True,
                               default_auto_sharding_option=autoshard.AutoShardingOption(
                                   force_batch_dim_to_mesh_dim=0))
    f = autoshard.parallelize(sgd_step(mlp_loss), method=method)
    params, batch = f.preshard_dynamic_args(mlp_params(), mlp_batch())
    x_spec = f.get_executable(params, batch).in_shardings[len(params)]
    assert x_spec.spec == jax.sharding.PartitionSpec("x")       # rows split on stage 0
    assert len(x_spec.device_set) == 2
    calls.clear()
    for _ in range(2):
        params = f(params, batch)
    assert calls == []


def test_bad_inputs_name_the_option():
    params, batch = mlp_params(), mlp_batch()
    step = sgd_step(functools.partial(mlp_loss, markers=False))
    with pytest.raises(ValueError, match="mark_pipeline_boundary"):
        autoshard.parallelize(step, method=PipeshardParallel(
            layer_option="manual", stage_option=UniformStageOption(num_stages=2)))(params, batch)
    with pytest.raises(ValueError, match="layer"):
        autoshard.parallelize(sgd_step(mlp_loss), method=PipeshardParallel(
            layer_option="manual", stage_option=UniformStageOption(num_stages=8)))(params, batch)
    with pytest.raises(ValueError, match="cover the devices"):
        autoshard.parallelize(sgd_step(mlp_loss), method=PipeshardParallel(
            layer_option="manual", stage_option=ManualStageOption(
                [[0, 1], [2, 3]], [(1, 4), (1, 2)], [(4,), (2,)], [{}, {}])))(params, batch)
    with pytest.raises(ValueError, match="num_micro_batches"):
        autoshard.parallelize(sgd_step(mlp_loss), method=PipeshardParallel(
            num_micro_batches=3, layer_option="manual"))(params, batch)

    def scan_loss(p, x, y):
        def body(h, w):
            autoshard.mark_pipeline_boundary()
            return jnp.tanh(h @ w), None
        h, _ = jax.lax.scan(body, x @ p["w0"], jnp.stack([p["w1"], p["w2"]]))
        return jnp.mean((h @ p["w3"] - y) ** 2)
    with pytest.raises(ValueError, match="inside a lax.scan"):  # differentiated: dropped
        autoshard.parallelize(sgd_step(scan_loss), method=PipeshardParallel(
            layer_option="manual", stage_option=UniformStageOption(num_stages=2)))(params, batch)
    with pytest.raises(ValueError, match="inside the body of scan"):
        autoshard.parallelize(scan_loss, method=PipeshardParallel(
            layer_option="manual", pipeline_schedule="inference"))(params, *batch)
    with pytest.raises(ValueError, match="pipeline_schedule"):
        PipeshardParallel(pipeline_schedule="2f2b")


def test_executable_inspection_trace_and_devices_list(tmp_path):
    import json

    method = PipeshardParallel(devices=jax.devices()[:4], num_micro_batches=2,
                               layer_option="manual", blocking=True,
                               stage_option=UniformStageOption(num_stages=2))
    f = autoshard.parallelize(sgd_step(mlp_loss), method=method)
    g = autoshard.parallelize(sgd_step(mlp_loss), method=method)
    params, batch = mlp_params(), mlp_batch()
    out = f(params, batch)
    ex = f.get_last_executable()
    g(params, batch)
    assert g.get_last_executable() is not ex
    assert ex.plan.stage_devices == ((0, 1), (2, 3))
    assert len(ex.stage_input_shard_specs) == 2
    ex.dump_stage_execution_trace(str(tmp_path / "trace.json"), out, batch)
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert {e["name"] for e in events} >= {"F0.0", "F1.1", "B1.0", "B0.1"}
    png = ex.dump_stage_execution_trace(str(tmp_path / "timeline.png"))  # the same run
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.endswith("timeline.png")
    assert "stage 1: layers" in ex.plan.explain()
