"""Orbax checkpoints: round trip onto another mesh and plan; an interrupted save is invisible."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autoshard
from autoshard.checkpoint import checkpoint_steps
from models import assert_trees_close, copy_tree, make_case, make_state, train_step


def _trained(method, steps=1):
    model, x, y = make_case("mlp")
    state = make_state(model, x)
    step = autoshard.parallelize(train_step, method=method)
    for _ in range(steps):
        state, loss = step(state, (x, y))
        float(loss)
    return state, step, (x, y)


def test_round_trip_from_8_way_zero3_into_a_2x4_plan(tmp_path):
    saved, _, batch = _trained(autoshard.Zero3Parallel())
    expected = jax.tree.map(np.asarray, saved)
    autoshard.save_checkpoint(tmp_path, saved, step=1)
    assert checkpoint_steps(tmp_path) == [1]
    plan_2x4 = autoshard.ShardParallel(auto_sharding_option=autoshard.AutoShardingOption(
        logical_mesh_shape=(2, 4)))
    model, x, y = make_case("mlp")
    target = autoshard.parallelize(train_step, method=plan_2x4)
    ex = target.get_executable(make_state(model, x), batch)
    specs = ex.get_input_placement_specs()[0]
    assert ex.plan.mesh_shape == (2, 4)
    restored = autoshard.restore_checkpoint(tmp_path, 1, specs)
    assert type(restored) is type(saved)
    assert_trees_close(restored, expected, rtol=0, atol=0)
    for leaf, spec in zip(jax.tree.leaves(restored), jax.tree.leaves(specs), strict=True):
        assert leaf.sharding.is_equivalent_to(spec, leaf.ndim)
    # the restored state trains on: one more step equals one more step of the original
    ref_state, _ = jax.jit(train_step)(copy_tree(saved), batch)
    state, _ = target(restored, batch)
    assert_trees_close(state.params, ref_state.params)


def test_restore_errors_name_the_step_and_leaf(tmp_path):
    mesh = jax.make_mesh((8,), ("data",))
    tree = {"w": jax.device_put(np.arange(16.0), NamedSharding(mesh, P("data")))}
    autoshard.save_checkpoint(tmp_path, tree, step=3)
    with pytest.raises(ValueError, match=r"step 3 already exists"):
        autoshard.save_checkpoint(tmp_path, tree, step=3)
    replicated = NamedSharding(mesh, P())
    with pytest.raises(FileNotFoundError, match=r"step 4 is not a complete checkpoint .* "
                                                r"complete steps: \[3\]"):
        autoshard.restore_checkpoint(tmp_path, 4, {"w": replicated})
    with pytest.raises(ValueError, match=r"placement_specs\['v'\] has no leaf in checkpoint "
                                         r"step 3 \(saved leaves: w\)"):
        autoshard.restore_checkpoint(tmp_path, 3, {"v": replicated})
    wrong = jax.ShapeDtypeStruct((8,), np.float32, sharding=replicated)
    with pytest.raises(ValueError, match=r"placement_specs\['w'\] is float32\[8\], but step 3 "
                                         r"saved float32\[16\]"):
        autoshard.restore_checkpoint(tmp_path, 3, {"w": wrong})
    with pytest.raises(ValueError, match=r"step \(-1\) must be a non-negative int"):
        autoshard.save_checkpoint(tmp_path, tree, step=-1)
    latest = autoshard.restore_checkpoint(tmp_path, None, {"w": replicated})
    np.testing.assert_array_equal(np.asarray(latest["w"]), np.arange(16.0))


_KILLED_SAVE = textwrap.dedent("""
    import os, sys, threading, time
    import numpy as np
    import autoshard
    root = sys.argv[1]
    autoshard.save_checkpoint(root, {"w": np.arange(1000.0)}, step=1)

    def kill_when_writing():  # SIGKILL ourselves once step 2's temporary directory exists
        while not any(".orbax-checkpoint-tmp" in n for n in os.listdir(root)):
            time.sleep(0.0005)
        time.sleep(0.05)
        os.kill(os.getpid(), 9)

    threading.Thread(target=kill_when_writing, daemon=True).start()
    big = np.ones((64, 1024, 1024), np.float32)  # 256 MiB: still writing when killed
    autoshard.save_checkpoint(root, {"w": big}, step=2)
    print("SAVE FINISHED")
""")


def test_a_save_killed_midway_leaves_the_previous_step_intact(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    proc = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == -9, proc.stdout + proc.stderr
    assert "SAVE FINISHED" not in proc.stdout
    assert checkpoint_steps(tmp_path) == [1]
    assert any(".orbax-checkpoint-tmp" in n for n in os.listdir(tmp_path))  # the partial save
    mesh = jax.make_mesh((8,), ("data",))
    restored = autoshard.restore_checkpoint(tmp_path, None, {"w": NamedSharding(mesh, P())})
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(1000.0))
    # saving step 2 again removes the interrupted attempt
    autoshard.save_checkpoint(tmp_path, {"w": np.zeros(3)}, step=2)
    assert checkpoint_steps(tmp_path) == [1, 2]
    assert not any(".orbax-checkpoint-tmp" in n for n in os.listdir(tmp_path))
