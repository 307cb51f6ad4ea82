"""Values crossing between sub-meshes: which move, how often, and what the plan prices."""

import jax
import optax
import pytest
from pipeline_models import assert_trees_close, mlp_batch, mlp_loss, mlp_params, sgd_step

import autoshard
from autoshard.pipeline import PipeshardParallel, UniformStageOption


def adam_step(p, opt_state, batch):
    tx = optax.adam(1e-2)
    g = autoshard.grad(mlp_loss)(p, *batch)
    updates, opt_state = tx.update(g, opt_state, p)
    return optax.apply_updates(p, updates), opt_state


def test_optimizer_moments_stay_on_their_parameters_stage():
    """Adam's ``b1 * mu`` reads only the step's input ``mu``: it runs where the gradient it is
    added to lives, so a step copies nothing between sub-meshes in the optimizer but the
    scalar step count's powers, and the moments come back on the sub-mesh that reads them."""
    p, batch = mlp_params(), mlp_batch()
    state = (p, optax.adam(1e-2).init(p))
    method = PipeshardParallel(
        devices=jax.devices()[:4],
        num_micro_batches=2,
        layer_option="manual",
        blocking=True,
        stage_option=UniformStageOption(num_stages=2),
    )
    f = autoshard.parallelize(adam_step, method=method, batch_argnums=(2,))
    ref = jax.jit(adam_step)
    got, want = f(*state, batch), ref(*state, batch)
    ex = f.get_last_executable()
    before = dict(ex.move.counts)
    got, want = f(*got, batch), ref(*want, batch)
    got, want = f(*got, batch), ref(*want, batch)
    assert_trees_close(got, want)
    per_step = {k: (ex.move.counts[k] - before[k]) // 2 for k in before}
    crossing = [t for t in ex.audit().transfers if t.src.startswith("apply")]
    # what crosses in the optimizer: scalars only (the step count's bias corrections)
    assert crossing and all(t.value.endswith("[]") for t in crossing), crossing
    assert len(crossing) == 2, crossing
    # per step: the activation and its cotangent per micro-batch (2 + 2) and the two scalars;
    # the batch's inputs and targets are placed on the stage that reads them; no resharding
    assert per_step == {"reshard": 0, "copy": 4 + 2, "placed": 2}, per_step


def test_plan_prices_the_cut_between_sub_meshes_of_other_device_counts():
    """The activation between a 4-device and a 2-device stage is gathered and copied whole;
    the plan prices that (and its cotangent back) and explain() shows it, as the audit sees
    the resharded copy at run time."""
    from autoshard.pipeline import ManualStageOption
    from autoshard.pipeline.stages import cut_seconds

    stage = ManualStageOption([[0, 1], [2, 3]], [(1, 4), (1, 2)], [(4,), (2,)], [{}, {}])
    method = PipeshardParallel(
        devices=jax.devices()[:6],
        num_micro_batches=2,
        layer_option="manual",
        stage_option=stage,
        blocking=True,
    )
    f = autoshard.parallelize(sgd_step(mlp_loss), method=method)
    f(mlp_params(), mlp_batch())
    ex = f.get_last_executable()
    (cut,) = ex.plan.crossings
    # the (16, 16) float32 activation of a 16-row micro-batch
    assert (cut.src_stage, cut.dst_stage, cut.num_bytes) == (0, 1, 16 * 16 * 4)
    assert (cut.src_devices, cut.dst_devices, cut.resharded) == (4, 2, True)
    assert cut.seconds == pytest.approx(cut_seconds(1024, 4, 2) + cut_seconds(1024, 2, 4))
    assert ex.plan.transfer_s == pytest.approx(2 * cut.seconds)
    text = ex.explain()
    assert "cut stage 0 -> 1: 1,024 B per micro-batch, 4 -> 2 devices, gathered" in text
    resharded = [t for t in ex.audit().transfers if t.resharded]
    assert {(t.src, t.dst) for t in resharded} == {("F0", "F1"), ("B1", "B0")}


def test_auto_stages_avoid_a_resharding_cut_when_cheaper():
    """choose_stages with AutoStageOption: a heavy then a light layer on 4 devices go on 3 + 1
    devices by compute alone; with the activation between them priced, on 2 + 2."""
    from autoshard.pipeline import AutoStageOption
    from autoshard.pipeline.build import choose_stages, cut_seconds_both

    option = AutoStageOption(
        submesh_physical_shape_space="manual", manually_specified_submeshes=[(1, 1), (1, 2), (1, 3)]
    )
    cost = ([1e14, 1e13], [0.0, 0.0])  # FLOPs of the two layers (1 s and 0.1 s on one device)
    _, sizes, _, _ = choose_stages(option, 2, 4, 4, cost)
    assert sizes == [3, 1]

    def cut_cost(j, n, m):
        return cut_seconds_both([0, 3e9, 0][j], n, m, True)

    _, sizes, _, _ = choose_stages(option, 2, 4, 4, cost, cut_cost)
    assert sizes == [2, 2]


def test_audit_counts_every_copy_the_runtime_makes_with_tied_embeddings():
    """The audit's transfers are every copy between sub-meshes in a step, step inputs
    included: the tied embedding read on both stages, the targets read by the last."""
    from flax.training.train_state import TrainState
    from pipeline_models import GPT, gpt_lm_step

    model = GPT(layers=1)
    tokens = jax.numpy.asarray(
        __import__("numpy").random.default_rng(0).integers(0, 32, size=(8, 8)), "int32"
    )
    params = model.init(jax.random.key(0), tokens[:, :-1])
    # eps as in the other GPT tests: the attention key bias has a zero gradient up to rounding
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2, eps=1e-3))
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    step = gpt_lm_step

    method = PipeshardParallel(
        devices=jax.devices()[:4],
        num_micro_batches=2,
        blocking=True,
        layer_option="manual",
        stage_option=UniformStageOption(num_stages=2),
    )
    f = autoshard.parallelize(step, method=method)
    got, want = f(state, tokens), jax.jit(step)(state, tokens)
    ex = f.get_last_executable()
    before = dict(ex.move.counts)
    got, want = f(got, tokens), jax.jit(step)(want, tokens)
    assert_trees_close(got.params, want.params)
    copies = ex.move.counts["copy"] - before["copy"]
    audit = ex.audit()
    assert sum(t.runs for t in audit.transfers) == copies
    inputs = {
        (t.dst, t.value.split(":")[-1].split()[0], t.runs)
        for t in audit.transfers
        if t.src == "input"
    }
    # the embedding (32, 16) once per step; the token micro-batches (4, 8) once each
    assert {(d, r) for d, v, r in inputs if v == "float32[32,16]"} == {("F1", 1)}
    assert {(d, r) for d, v, r in inputs if v == "int32[4,8]"} == {("F1", 2)}


def test_only_the_cpu_receiver_waits_for_cross_process_arrivals(monkeypatch):
    """``settle`` (the XLA:CPU workaround) blocks on received CPU arrays only: a GPU pipeline's
    transfers (NCCL) stay asynchronous."""
    from types import SimpleNamespace

    from autoshard.pipeline import _cross_process

    waited = []
    monkeypatch.setattr(_cross_process.jax, "block_until_ready", waited.append)

    def received(platform):
        shard = SimpleNamespace(device=SimpleNamespace(platform=platform))
        return SimpleNamespace(addressable_shards=[shard])

    _cross_process.settle([received("gpu"), received("gpu")])
    assert waited == []
    cpu = [received("cpu")]
    _cross_process.settle(cpu)
    assert waited == [cpu]
