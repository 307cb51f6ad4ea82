"""Fixed-plan methods on an MLP, a CNN and a transformer: equal to single-device jit, placed right."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import autoshard
from models import assert_trees_close, copy_tree, make_case, make_state, train_step

N = 8


def manual_dp():
    return autoshard.ShardParallel(manual_sharding_option=autoshard.ManualShardingOption(
        ("data",), in_axis_resources=(None, P("data"))))


METHODS = {
    "data": autoshard.DataParallel,
    "zero2": autoshard.Zero2Parallel,
    "zero3": autoshard.Zero3Parallel,
    "manual": manual_dp,
}


def run_reference(state, batch, steps=3):
    step = jax.jit(train_step)
    losses = []
    for _ in range(steps):
        state, loss = step(state, batch)
        losses.append(loss)
    return state, losses


@pytest.mark.parametrize("kind", ["mlp", "cnn", "transformer"])
@pytest.mark.parametrize("method", list(METHODS))
def test_matches_single_device(kind, method):
    model, x, y = make_case(kind)
    state = make_state(model, x)
    ref_state, ref_losses = run_reference(copy_tree(state), (x, y))
    step = autoshard.parallelize(train_step, method=METHODS[method]())
    losses = []
    for _ in range(3):
        state, loss = step(state, (x, y))
        losses.append(loss)
    np.testing.assert_allclose(np.array(losses), np.array(ref_losses), rtol=1e-4)
    assert_trees_close(state.params, ref_state.params)
    assert_trees_close(state.opt_state, ref_state.opt_state)
    assert int(state.step) == 3


def _compiled(method, hidden=64):
    import jax.numpy as jnp

    from models import MLP
    model = MLP(hidden=hidden)
    x, y = jnp.ones((32, 16)), jnp.ones((32, 8))
    state = make_state(model, x)
    f = autoshard.parallelize(train_step, method=method)
    new_state, _ = f(state, (x, y))
    return f.get_last_executable(), new_state


def test_data_parallel_all_reduces_gradients_and_replicates_state():
    ex, state = _compiled(autoshard.DataParallel())
    hlo = ex.get_hlo_text()
    assert hlo.count("all-reduce(") >= 1
    assert "all-gather(" not in hlo
    for leaf in jax.tree.leaves(state):
        assert leaf.sharding.is_fully_replicated
    kernel = state.params["params"]["Dense_0"]["kernel"]
    assert kernel.addressable_shards[0].data.shape == (16, 64)
    specs = ex.get_input_placement_specs()
    assert specs[1][0].spec == P("data") and specs[0].params["params"]["Dense_0"]["kernel"].spec == P()


def test_zero2_shards_optimizer_state_and_all_gathers_parameters():
    ex, state = _compiled(autoshard.Zero2Parallel())
    mu = state.opt_state[0].mu["params"]["Dense_0"]["kernel"]  # 16 x 64
    assert mu.addressable_shards[0].data.shape == (16 // N, 64)
    kernel = state.params["params"]["Dense_0"]["kernel"]
    assert kernel.sharding.is_fully_replicated
    assert ex.get_hlo_text().count("all-gather(") >= 1
    # the gradient is used as a shard: the update's per-device shape is 1/N of the kernel
    assert f"f32[{16 // N},64]" in ex.get_hlo_text()


def test_zero3_keeps_parameters_sharded_between_steps():
    ex, state = _compiled(autoshard.Zero3Parallel())
    kernel = state.params["params"]["Dense_0"]["kernel"]
    assert kernel.addressable_shards[0].data.shape == (16 // N, 64)
    bias = state.params["params"]["Dense_1"]["bias"]  # 8 elements: 1 per device
    assert bias.addressable_shards[0].data.shape == (1,)
    assert ex.get_hlo_text().count("all-gather(") >= 1
    assert ex.plan.inputs[0].note.startswith("replicated: no dim of scalar")  # the step counter


def test_zero3_uses_less_memory_than_data_parallel():
    dp, _ = _compiled(autoshard.DataParallel(), hidden=512)
    z3, _ = _compiled(autoshard.Zero3Parallel(), hidden=512)
    z2, _ = _compiled(autoshard.Zero2Parallel(), hidden=512)
    assert z3.get_total_allocation_size() < z2.get_total_allocation_size()
    assert z2.get_total_allocation_size() < dp.get_total_allocation_size()


def test_manual_two_dim_mesh_megatron_specs():
    import jax.numpy as jnp

    from models import MLP
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    model = MLP(hidden=64)
    x, y = jnp.ones((16, 16)), jnp.ones((16, 8))
    state = make_state(model, x)
    params_spec = {"params": {"Dense_0": {"kernel": P(None, "model"), "bias": P("model")},
                              "Dense_1": {"kernel": P("model", None), "bias": P()}}}
    state_spec = state.replace(params=params_spec, step=P(),
                               opt_state=jax.tree.map(lambda _: P(), state.opt_state))
    method = autoshard.ShardParallel(devices=mesh, manual_sharding_option=(
        autoshard.ManualShardingOption(("data", "model"),
                                       in_axis_resources=(state_spec, P("data")))))
    ref, _ = jax.jit(train_step)(copy_tree(state), (x, y))
    f = autoshard.parallelize(train_step, method=method)
    new_state, _ = f(state, (x, y))
    assert_trees_close(new_state.params, ref.params)
    k = new_state.params["params"]["Dense_0"]["kernel"]
    assert k.addressable_shards[0].data.shape == (16, 64 // 4)  # state keeps its input spec
    assert "ShardParallel(manual)" in f.get_last_executable().plan.explain()
