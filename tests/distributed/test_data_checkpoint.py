"""DataLoader feeding a 2-process step; checkpoints moving between 1 and 2 processes."""

from __future__ import annotations

import jax
import numpy as np
import workers

import autoshard
from models import assert_trees_close, make_case, make_state, train_step


def test_loader_feeds_two_processes_and_checkpoints_move_between_meshes(tmp_path):
    model, x, y = make_case("mlp", batch=16)
    step = autoshard.parallelize(train_step, method=autoshard.DataParallel())  # 8 devices
    state, _ = step(make_state(model, x), (x, y))
    autoshard.save_checkpoint(tmp_path, state, step=1)
    reference = jax.jit(train_step)
    ref_state, ref_losses = state, []
    for _ in range(2):
        ref_state, loss = reference(ref_state, (x, y))
        ref_losses.append(float(loss))

    results = autoshard.launch(workers.loader_and_checkpoints, str(tmp_path), num_processes=2,
                               devices_per_process=2, timeout_s=150)

    for losses in results:
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    plan_2x4 = autoshard.ShardParallel(auto_sharding_option=autoshard.AutoShardingOption(
        logical_mesh_shape=(2, 4)))
    specs = autoshard.parallelize(train_step, method=plan_2x4).get_executable(
        make_state(model, x), (x, y)).get_input_placement_specs()[0]
    restored = autoshard.restore_checkpoint(tmp_path, 2, specs)
    assert_trees_close(restored.params, ref_state.params)
    assert int(restored.step) == 3
