"""Front end: caching, static and donated arguments, placement, executables, bad input."""

import gc
import json
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import autoshard
from autoshard import _api
from autoshard.ir._jaxpr import flatten_args as _flatten
from models import MLP, copy_tree, make_state, train_step


def dp_step():
    calls = []

    def step(state, batch):
        calls.append(1)
        return train_step(state, batch)
    return autoshard.parallelize(step, method=autoshard.DataParallel()), calls


def mlp_state(batch=16):
    model = MLP()
    x, y = jnp.ones((batch, 16)), jnp.ones((batch, 8))
    return make_state(model, x), (x, y)


def test_second_call_does_not_retrace_and_new_shapes_do():
    f, calls = dp_step()
    state, batch = mlp_state()
    state, _ = f(state, batch)
    state, _ = f(state, batch)
    assert len(calls) == 1
    f(state, (jnp.ones((32, 16)), jnp.ones((32, 8))))
    assert len(calls) == 2
    autoshard.clear_executable_cache()
    f(mlp_state()[0], batch)
    assert len(calls) == 3


def test_static_argnums_auto_makes_python_scalars_static():
    calls = []

    @autoshard.parallelize(method=autoshard.DataParallel(), batch_argnums=(0,))
    def scale(x, factor):
        calls.append(factor)
        return x * factor

    x = jnp.arange(16.0)
    np.testing.assert_allclose(scale(x, 2), x * 2)
    np.testing.assert_allclose(scale(x, 2), x * 2)
    np.testing.assert_allclose(scale(x, 3), x * 3)
    assert calls == [2, 3]


def test_donate_auto_donates_train_state_and_aliases_outputs():
    f, _ = dp_step()
    state, batch = mlp_state()
    ex = f.get_executable(state, batch)
    prog = ex.program
    n_state = len(jax.tree.leaves(state))
    assert all(prog.donated_invars[:n_state]) and not any(prog.donated_invars[n_state:])
    assert prog.aliases == tuple((i, i) for i in range(n_state))


def test_donate_auto_donates_only_train_states_explicit_argnums_as_jit():
    def sgd(params, x):
        g = autoshard.grad(lambda p: jnp.sum((x @ p["w"]) ** 2))(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), jnp.sum(x)
    f = autoshard.parallelize(sgd, method=autoshard.DataParallel())
    params = {"w": jnp.ones((4, 2))}
    ex = f.get_executable(params, jnp.ones((8, 4)))
    assert ex.program.donated_invars == (False, False)  # a plain dict is not a train state
    assert ex.program.aliases == ((0, 0),)  # but it is state: same spec in and out
    f(params, jnp.ones((8, 4)))
    assert not params["w"].is_deleted()
    f2 = autoshard.parallelize(sgd, method=autoshard.DataParallel(), donate_argnums=(0,))
    assert f2.get_executable(params, jnp.ones((8, 4))).program.donated_invars == (True, False)


def test_auto_donation_never_deletes_plain_arguments():
    f = autoshard.parallelize(lambda x, y: x * 2 + y, method=autoshard.DataParallel(),
                              batch_argnums=(0,))
    x, y = jnp.ones((16, 4)), jnp.ones((16, 4))
    f(x, y)
    grads_only = autoshard.parallelize(
        lambda p, x: autoshard.grad(lambda p: jnp.sum(x @ p))(p),
        method=autoshard.DataParallel())
    p = jnp.ones((4, 2))
    grads_only(p, x)
    assert not (x.is_deleted() or y.is_deleted() or p.is_deleted())
    np.testing.assert_allclose(f(x, y), 3 * np.ones((16, 4)))


@autoshard.register_state_type
class _MyState:
    def __init__(self, w):
        self.w = w


jax.tree_util.register_pytree_node(_MyState, lambda s: ((s.w,), None), lambda _, c: _MyState(*c))


def test_registered_state_type_is_donated():
    f = autoshard.parallelize(lambda s, x: (_MyState(s.w + x.sum()), x.sum()),
                              method=autoshard.DataParallel())
    s = _MyState(jnp.ones(3))
    new, _ = f(s, jnp.ones((8, 2)))
    assert s.w.is_deleted() and not new.w.is_deleted()


@pytest.mark.parametrize("method", ["data", "zero3", "auto"])
def test_reusing_a_donated_state_raises_naming_the_leaf(method):
    make = {"data": autoshard.DataParallel, "zero3": autoshard.Zero3Parallel,
            "auto": lambda: autoshard.ShardParallel(
                auto_sharding_option=autoshard.AutoShardingOption(show_progress=False))}[method]
    f = autoshard.parallelize(train_step, method=make())
    state, batch = mlp_state()
    state, batch = f.preshard_dynamic_args(state, batch)  # placed: the fast path would crash
    new, _ = f(state, batch)
    with pytest.raises(ValueError, match=r"arg0\.\S+ .*was donated to a previous call of "
                                         r"train_step .*pass the state that call returned"):
        f(state, batch)
    with pytest.raises(ValueError, match="was donated to a previous call of train_step"):
        f.get_executable(state, (batch[0][:8], batch[1][:8]))  # a cache miss checks too
    f(new, batch)  # the returned state works


def test_preshard_dynamic_args_places_inputs_so_calls_move_nothing():
    f, _ = dp_step()
    state, batch = mlp_state()
    state, batch = f.preshard_dynamic_args(state, batch)
    ex = f.get_executable(state, batch)
    assert batch[0].sharding == ex.get_input_placement_specs()[1][0]
    assert batch[0].addressable_shards[0].data.shape == (2, 16)
    with jax.transfer_guard("disallow"):
        state, loss = f(state, batch)
    out_specs = ex.get_output_placement_specs()
    assert out_specs[1].spec == P()
    assert f.get_last_executable() is ex


def test_executable_inspection():
    f, _ = dp_step()
    state, batch = mlp_state()
    ex = f.get_executable(state, batch)
    assert "HloModule" in ex.get_hlo_text()
    assert ex.get_total_allocation_size() > 0
    assert ex.auto_sharding_objective is None
    assert set(ex.timings) == {"trace_s", "planning_s", "lowering_s", "compile_s"}
    assert all(t >= 0 for t in ex.timings.values()) and ex.timings["compile_s"] > 0
    text = ex.plan.explain()
    assert "DataParallel plan on mesh (data=8)" in text
    assert "arg1[0]" in text and "(data)" in text
    assert ex.plan.inputs[-1].bytes_per_device(ex.plan.mesh_sizes) == 16 * 8 * 4 // 8


def test_devices_list_and_mesh():
    state, batch = mlp_state()
    ref = jax.jit(train_step)(copy_tree(state), batch)[1]
    f = autoshard.parallelize(train_step,
                              method=autoshard.DataParallel(devices=jax.devices()[:4]))
    _, loss = f(copy_tree(state), batch)
    np.testing.assert_allclose(loss, ref, rtol=1e-5)
    assert f.get_last_executable().plan.mesh_shape == (4,)
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    g = autoshard.parallelize(train_step, method=autoshard.DataParallel(devices=mesh))
    _, loss = g(copy_tree(state), batch)
    np.testing.assert_allclose(loss, ref, rtol=1e-5)
    assert g.get_last_executable().plan.inputs[-1].spec == P(("a", "b"))


# Bad input -------------------------------------------------------------------------------------
def test_keyword_arguments_rejected():
    f, _ = dp_step()
    state, batch = mlp_state()
    with pytest.raises(TypeError, match=r"keyword argument\(s\) \['batch'\].*positionally"):
        f(state, batch=batch)


def test_micro_batches_must_divide_batch():
    f = autoshard.parallelize(train_step, method=autoshard.DataParallel(num_micro_batches=3))
    with pytest.raises(ValueError, match=r"num_micro_batches \(3\) must divide the batch size "
                                         r"\(16\) of arg1\[0\] \(batch_argnums=\(1,\)\)"):
        f(*mlp_state())


def test_batch_not_divisible_by_devices():
    f = autoshard.parallelize(train_step, method=autoshard.DataParallel())
    with pytest.raises(ValueError, match=r"batch size \(12\) of arg1\[0\] must be divisible by "
                                         r"the number of devices \(8\)"):
        f(*mlp_state(batch=12))


def test_batch_argnums_out_of_range_or_not_array():
    state, batch = mlp_state()
    f = autoshard.parallelize(train_step, batch_argnums=(5,), method=autoshard.DataParallel())
    with pytest.raises(ValueError, match=r"batch_argnums \(\(5,\)\) names argument 5, but .* 2 "
                                         "positional"):
        f(state, batch)
    g = autoshard.parallelize(lambda s, n: s, method=autoshard.DataParallel())
    with pytest.raises(ValueError, match=r"names argument 1, which holds no array \(got int\)"):
        g(state, 3)


def test_mesh_size_must_match_device_count():
    opt = autoshard.AutoShardingOption(logical_mesh_shape=(3,))
    f = autoshard.parallelize(train_step, method=autoshard.ShardParallel(auto_sharding_option=opt))
    with pytest.raises(ValueError, match=r"logical_mesh_shape \(3,\) has 3 devices but the "
                                         "method uses 8"):
        f(*mlp_state())
    man = autoshard.ShardParallel(
        auto_sharding_option=autoshard.AutoShardingOption(logical_mesh_shape=(3, 3)),
        manual_sharding_option=autoshard.ManualShardingOption(("a", "b")))
    with pytest.raises(ValueError, match=r"product equal to the device count \(8\)"):
        autoshard.parallelize(train_step, method=man)(*mlp_state())


def test_partition_spec_unknown_axis_and_indivisible():
    state, batch = mlp_state()
    bad_axis = autoshard.ShardParallel(manual_sharding_option=autoshard.ManualShardingOption(
        ("data",), in_axis_resources=(None, P("model"))))
    with pytest.raises(ValueError, match=r"in_axis_resources for arg1\[0\]: spec .* names mesh "
                                         r"axis 'model', which is not one of the mesh axes "
                                         r"\('data',\)"):
        autoshard.parallelize(train_step, method=bad_axis)(state, batch)
    bad_dim = autoshard.ShardParallel(manual_sharding_option=autoshard.ManualShardingOption(
        ("data",), in_axis_resources=(None, P(None, "data"))))
    f = autoshard.parallelize(train_step, method=bad_dim)
    x = jnp.ones((16, 12))
    with pytest.raises(ValueError, match=r"splits dim 1 of size 12 into 8 parts"):
        f(make_state(MLP(), x), (x, jnp.ones((16, 8))))


def test_tracer_where_static_value_needed():
    f = autoshard.parallelize(lambda x, n: x * n, static_argnums=(1,), batch_argnums=(0,),
                              method=autoshard.DataParallel())
    with pytest.raises(TypeError, match="static argument .* got a tracer"):
        jax.jit(lambda n: f(jnp.ones(8), n))(3)
    with pytest.raises(TypeError, match="is a tracer: parallelized functions .* static_argnums"):
        jax.jit(lambda x: f(x, 2))(jnp.ones(8))


def test_init_required_for_non_local_cluster(monkeypatch):
    monkeypatch.setattr(_api, "_state", {"cluster": None})
    monkeypatch.setenv("AUTOSHARD_CLUSTER", "distributed")
    f, _ = dp_step()
    with pytest.raises(RuntimeError, match=r"autoshard.init\(cluster='distributed'\) was not "
                                           "called"):
        f(*mlp_state())
    monkeypatch.setenv("AUTOSHARD_CLUSTER", "local")
    f(*mlp_state())  # local initialises implicitly
    assert _api._state["cluster"] == "local"
    autoshard.init("local")  # idempotent
    with pytest.raises(ValueError, match=r"cluster \('slurm'\) must be one of"):
        autoshard.init("slurm")


def test_bad_method_and_options():
    with pytest.raises(TypeError, match="method .* must be a ParallelMethod"):
        autoshard.parallelize(train_step, method="dp")
    with pytest.raises(ValueError, match=r"num_micro_batches \(0\) must be a positive int"):
        autoshard.DataParallel(num_micro_batches=0)
    with pytest.raises(TypeError, match="devices .* must be None"):
        autoshard.parallelize(train_step, method=autoshard.DataParallel(devices="gpu"))(
            *mlp_state())


# Recompiles, the cache, abstract arguments, debug dumps -----------------------------------------
def test_changing_python_scalar_warns_naming_the_argument_and_cache_is_capped():
    calls = []

    @autoshard.parallelize(method=autoshard.DataParallel(), batch_argnums=(0,), max_executables=2)
    def scale(x, lr):
        calls.append(lr)
        return x * lr

    x = jnp.ones(16)
    with pytest.warns(RuntimeWarning, match=r"compiled 4 times .*static value of arg1 \(now 0.4\) changed.*jnp\.asarray"):
        for lr in (0.1, 0.2, 0.3, 0.4):
            np.testing.assert_allclose(scale(x, lr), x * lr, rtol=1e-6)
    assert len(scale._cache) == 2  # least recently used executables are dropped
    scale(x, 0.4)
    assert calls == [0.1, 0.2, 0.3, 0.4]  # a cached value does not retrace
    scale(x, jnp.asarray(0.5))
    scale(x, jnp.asarray(0.6))  # traced data: one executable for every value
    assert calls[-1] is not None and len(calls) == 5
    with pytest.raises(ValueError, match=r"max_executables \(0\) must be a positive int"):
        autoshard.parallelize(lambda x: x, max_executables=0)


def test_abstract_arguments_plan_and_compile_before_data_exists():
    f, calls = dp_step()
    state, batch = mlp_state()
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
                            if isinstance(a, jax.Array) else a, (state, batch))
    ex = f.get_executable(*abstract)
    assert len(calls) == 1
    placed_state, placed_batch = f.preshard_dynamic_args(*abstract)
    assert placed_batch[0].sharding == ex.get_input_placement_specs()[1][0]
    assert f.get_executable(state, batch) is ex and len(calls) == 1  # same signature
    with pytest.raises(TypeError, match="is a jax.ShapeDtypeStruct: an executable runs on "
                                        "arrays"):
        f(*abstract)
    new_state, loss = f(state, batch)
    assert np.isfinite(float(loss))


def test_dump_debug_info_writes_hlo_plan_and_timings(tmp_path):
    f, _ = dp_step()
    ex = f.get_executable(*mlp_state())
    names = ex.dump_debug_info(tmp_path / "dbg")
    assert {"before_partitioning.hlo", "after_partitioning.hlo", "plan.txt",
            "timings.json", "memory.json"} <= set(names)
    before = (tmp_path / "dbg" / "before_partitioning.hlo").read_text()
    after = (tmp_path / "dbg" / "after_partitioning.hlo").read_text()
    assert "f32[16,16]" in before and "f32[2,16]" in after  # the batch, whole then per device
    assert "all-reduce" in after and "all-reduce" not in before
    assert "DataParallel plan on mesh" in (tmp_path / "dbg" / "plan.txt").read_text()
    assert set(json.loads((tmp_path / "dbg" / "timings.json").read_text())) == set(ex.timings)


def test_executable_holds_no_user_arrays():
    f, _ = dp_step()
    state, batch = mlp_state()
    ex = f.get_executable(state, batch)
    refs = [weakref.ref(x) for x in jax.tree.leaves((state, batch)) if isinstance(x, jax.Array)]
    f(state, batch)
    del state, batch
    gc.collect()
    assert all(r() is None for r in refs), "the executable keeps user arrays alive"
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in ex._flat.dynamic_leaves)


def test_fast_path_serves_repeated_calls_without_flattening_paths(monkeypatch):
    f, _ = dp_step()
    state, batch = f.preshard_dynamic_args(*mlp_state())
    state, _ = f(state, batch)
    seen = []
    monkeypatch.setattr(_api, "flatten_args", lambda *a: seen.append(1) or _flatten(*a))
    for _ in range(3):
        state, _ = f(state, batch)
    assert seen == []  # the steady state never builds path strings
    f(state, (batch[0][:8], batch[1][:8]))  # a new signature takes the slow path once
    assert len(seen) == 1


# Smaller front-end checks ----------------------------------------------------------------------
def test_ZeRO_finds_parameters_by_structure_in_a_tuple_state():
    def step(state, x):
        params, opt = state
        g = autoshard.grad(lambda p: jnp.sum((x @ p["w"]) ** 2))(params)
        opt = {"m": 0.9 * opt["m"] + g["w"]}
        return ({"w": params["w"] - 0.1 * opt["m"]}, opt), jnp.sum(x)

    state = ({"w": jnp.ones((16, 8))}, {"m": jnp.zeros((16, 8))})
    f = autoshard.parallelize(step, method=autoshard.Zero2Parallel())
    ex = f.get_executable(state, jnp.ones((16, 16)))
    assert ex.program.param_invars == (True, False, False)
    specs = ex.get_input_placement_specs()[0]
    assert specs[0]["w"].spec == P() and specs[1]["m"].spec == P("data")  # opt state sharded
    ref = jax.jit(step)(state, jnp.ones((16, 16)))
    np.testing.assert_allclose(f(state, jnp.ones((16, 16)))[0][0]["w"], ref[0][0]["w"],
                               rtol=1e-6)
    with pytest.warns(RuntimeWarning, match="Zero3Parallel found no parameters .*autoshard.grad"):
        autoshard.parallelize(lambda s, x: (s * 2, x.sum()), method=autoshard.Zero3Parallel())(
            jnp.ones((8, 8)), jnp.ones((8, 2)))


def test_static_argnums_on_an_array_names_the_argument():
    f = autoshard.parallelize(lambda x, y: x + y, static_argnums=(1,), batch_argnums=(0,),
                              method=autoshard.DataParallel())
    with pytest.raises(TypeError, match=r"arg1 is an array of shape \(8,\), but static_argnums"
                                        r"=\(1,\) marks argument 1 static"):
        f(jnp.ones(8), jnp.ones(8))


def test_devices_checked_at_construction():
    with pytest.raises(TypeError, match=r"devices \('cpu'\) must be None"):
        autoshard.DataParallel(devices="cpu")
    d = jax.devices()
    dup = jax.sharding.Mesh(np.array([d[0], d[0], d[1], d[2]]), ("a",))
    with pytest.raises(ValueError, match=r"the Mesh \{'a': 4\} holds .* more than once"):
        autoshard.ShardParallel(devices=dup)


def test_one_argument_function_has_no_batch_by_default():
    f = autoshard.parallelize(lambda x: x * 2, method=autoshard.DataParallel())
    np.testing.assert_allclose(f(jnp.ones(3)), 2 * np.ones(3))
    assert not any(f.get_last_executable().program.batch_invars)


def test_init_distributed_without_settings_says_what_to_pass(monkeypatch):
    monkeypatch.setattr(_api, "_state", {"cluster": None})

    def fail(**kwargs):
        raise ValueError("coordinator_address should be defined.")
    monkeypatch.setattr(jax.distributed, "initialize", fail)
    with pytest.raises(RuntimeError, match=r"init\(cluster='distributed'\) could not start .*"
                                           r"coordinator_address='host:port', num_processes"):
        autoshard.init("distributed")
    assert _api._state["cluster"] is None


def test_the_garbage_collector_is_paused_while_a_step_compiles_and_restored_after():
    # The collector's passes over the jaxpr and the planner's graph freed nothing and took a
    # sixth of planning (_api.collector_paused); a user's own setting is left as it was.
    seen = []

    def step(state, batch):
        seen.append(gc.isenabled())
        return train_step(state, batch)
    state, batch = mlp_state()
    assert gc.isenabled()
    autoshard.parallelize(step).get_executable(state, batch)
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        seen.clear()
        autoshard.plan(step, state, batch, method=autoshard.ShardParallel())
        assert seen == [False] and not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(ZeroDivisionError):   # re-enabled after an error too
        autoshard.parallelize(lambda s, b: 1 / 0).get_executable(state, batch)
    assert gc.isenabled()
