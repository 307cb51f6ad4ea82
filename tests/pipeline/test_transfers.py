"""Values crossing between sub-meshes: which move, how often, and what the plan prices."""

import jax
import optax
from pipeline_models import assert_trees_close, mlp_batch, mlp_loss, mlp_params

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
