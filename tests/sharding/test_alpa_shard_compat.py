"""Alpa's shard-parallel behaviour, ported from Alpa's ``tests/shard_parallel`` (written here).

Alpa's tests give a logical mesh with Alpa's cost parameters (``mesh_alpha``, ``mesh_beta``)
and compare ``auto_sharding_objective`` with sums of Alpa's collective formulas. With those
parameters given, autoshard reports its plan's objective in Alpa's units
(``sharding/alpa_units.py``), so the same plan gives the same number. Each test names the
upstream test it covers. Where autoshard's plan differs from the one Alpa asserts, the test
shows that ours moves fewer compiled bytes on the same mesh.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.training.train_state import TrainState
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import autoshard
from autoshard.sharding import hlo
from autoshard.sharding.cost import alpa_collective_cost

ALPHA_1 = (1.0, 1.0)
PENALTY = 4
"""Alpa's replicated penalty on a 4-device axis with alpha = beta = 1:
round(all_reduce_cost(1, 0) + all_reduce_cost(1, 1)) = round(2.51 + 1.01)."""


def all_reduce_cost(num_bytes, n, alpha=1.0, beta=1.0):
    """Alpa's ``LogicalDeviceMesh.all_reduce_cost`` written out: alpha + beta 2(n-1)/n b + 0.01."""
    return alpha + beta * 2 * (n - 1) / n * num_bytes + 0.01


def mesh(shape):
    return Mesh(np.array(jax.devices()[:4]).reshape(shape), ("x", "y"))


def option(alpha=ALPHA_1, beta=(1.0, 1.0), **kw):
    return autoshard.AutoShardingOption(mesh_alpha=alpha, mesh_beta=beta, memory_tradeoff=0.0,
                                        show_progress=False, **kw)


class MLP(nn.Module):
    num_layers: int
    hidden: int

    @nn.compact
    def __call__(self, x):
        for _ in range(self.num_layers - 1):
            x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(self.hidden)(x)


def mlp_step(num_layers, batch, hidden, tx=None, grad=jax.grad):
    model = MLP(num_layers, hidden)
    x = jnp.ones((batch, hidden))
    state = TrainState.create(apply_fn=model.apply, params=model.init(jax.random.PRNGKey(0), x),
                              tx=tx or optax.adam(1e-2))

    def step(state, batch):
        def loss(p):
            return jnp.mean((state.apply_fn(p, batch["x"]) - batch["y"]) ** 2)
        return state.apply_gradients(grads=grad(loss)(state.params))

    return step, state, {"x": x, "y": jnp.ones((batch, hidden))}


def mse_state_and_step(model, x, tx):
    """A flax ``model``'s TrainState (parameters initialised on ``x``, optimizer ``tx``) and
    its step: one update on the mean squared distance of ``model(batch["x"])`` from
    ``batch["y"]``."""
    state = TrainState.create(apply_fn=model.apply, tx=tx,
                              params=model.init(jax.random.PRNGKey(0), x))

    def step(state, batch):
        def loss(p):
            return jnp.mean((state.apply_fn(p, batch["x"]) - batch["y"]) ** 2)
        return state.apply_gradients(grads=jax.grad(loss)(state.params))

    return state, step


def compile_step(step, state, batch, devices, opt, **method):
    f = autoshard.parallelize(step, method=autoshard.ShardParallel(
        devices=devices, auto_sharding_option=opt, **method))
    return f, f.get_executable(state, batch)


def kinds(ex) -> list[str]:
    return [c.kind for c in hlo.collectives(ex.get_hlo_text())]


def test_alpa_collective_cost_is_alpas_formula():
    """Alpa's LogicalDeviceMesh cost formulas (used by every upstream expected objective)."""
    assert alpa_collective_cost("all-reduce", 4, 4096, 1.0, 1.0) == pytest.approx(6145.01)
    assert alpa_collective_cost("all-gather", 4, 4096, 1.0, 1.0) == pytest.approx(3073.1)
    assert alpa_collective_cost("reduce-scatter", 2, 100, 2.0, 0.1) == pytest.approx(7.001)
    # all-to-all: (n-1)/n^2 of the bytes, weighted n/2
    assert alpa_collective_cost("all-to-all", 4, 4096, 1.0, 1.0) == pytest.approx(1537.001)
    assert alpa_collective_cost("all-reduce", 1, 4096, 1.0, 1.0) == pytest.approx(1.01)


@pytest.mark.parametrize("shape,axis", [((4, 1), 0), ((1, 4), 1)])
def test_mlp_data_parallel_objective_in_alpa_units(shape, axis):
    """Covers test_mlp.py::test_n_layer_mlp_data_parallel: the gradients' all-reduces at
    Alpa's cost plus Alpa's penalty (``PENALTY``) per replicated parameter and optimizer leaf; one
    (combined) all-reduce in the compiled step; parameters replicated."""
    step, state, batch = mlp_step(6, 256, 32)
    _, ex = compile_step(step, state, batch, mesh(shape), option())
    params = jax.tree.leaves(state.params)
    n_opt = len(jax.tree.leaves(state.opt_state))
    expected = sum(all_reduce_cost(p.size * 4, 4) for p in params) + PENALTY * (len(params) + n_opt)
    # Within 0.2%: the loss's scalar all-reduce is the rest (the old objective, our seconds
    # with alpha and beta substituted, was 0.4% off: no constants, no penalties).
    assert ex.auto_sharding_objective == pytest.approx(expected, rel=2e-3)
    assert kinds(ex) == ["all-reduce"]
    assert all(leaf.spec == P() for leaf in ex.plan.inputs if "params" in leaf.path)
    # Without Alpa's parameters the objective stays our own estimate in seconds.
    _, default = compile_step(step, state, batch, mesh(shape), None)
    assert 0 < default.auto_sharding_objective < 1e-2


@pytest.mark.parametrize("shape,prefer", [((4, 1), False), ((1, 4), False), ((4, 1), True)])
def test_mlp_model_parallel_alternates_columns_and_rows(shape, prefer):
    """Covers test_mlp.py::test_n_layer_mlp_model_parallel (and, with prefer_reduce_scatter,
    test_n_layer_mlp_model_parallel_reduce_scatter / test_bert.py's model-parallel
    reduce-scatter case: activations keep their all-reduce): 5 activation all-reduces for 6
    layers (Megatron: kernels column, row, column, ...), objective 5 x all_reduce_cost."""
    step, state, batch = mlp_step(6, 32, 256)
    _, ex = compile_step(step, state, batch, mesh(shape),
                         option(prefer_reduce_scatter=prefer))
    assert ex.auto_sharding_objective == pytest.approx(5 * all_reduce_cost(32 * 256 * 4, 4),
                                                       rel=1e-2)
    assert kinds(ex) == ["all-reduce"] * 5
    axis = "x" if shape[0] == 4 else "y"
    specs = {leaf.path: leaf.spec for leaf in ex.plan.inputs}
    for k in range(6):
        spec = specs[f"arg0.params['params']['Dense_{k}']['kernel']"]
        assert spec == (P(None, axis) if k % 2 == 0 else P(axis)), (k, spec)
    # per-device kernels in the compiled step: [256, 64] and [64, 256]
    entry = re.search(r"ENTRY .*", ex.get_hlo_text()).group(0)
    assert entry.count("f32[256,64]") >= 3 and entry.count("f32[64,256]") >= 3


def test_force_batch_dim_to_mesh_dim():
    """Covers test_mlp.py::test_n_layer_mlp_force_batch_dim_mapping: on (4, 1) the batch on
    axis 0 makes the plan data parallel; on (1, 4) axis 0 has one device, the batch stays
    whole (a warning says so) and the plan is model parallel."""
    step, state, batch = mlp_step(6, 32, 256)
    _, dp = compile_step(step, state, batch, mesh((4, 1)), option(force_batch_dim_to_mesh_dim=0))
    params = jax.tree.leaves(state.params)
    n_opt = len(jax.tree.leaves(state.opt_state))
    expected = sum(all_reduce_cost(p.size * 4, 4) for p in params) + PENALTY * (len(params) + n_opt)
    assert dp.auto_sharding_objective == pytest.approx(expected, rel=1e-2)
    assert kinds(dp) == ["all-reduce"]
    with pytest.warns(UserWarning, match="names an axis of size 1"):
        _, mp = compile_step(step, state, batch, mesh((1, 4)),
                             option(force_batch_dim_to_mesh_dim=0))
    assert mp.auto_sharding_objective == pytest.approx(5 * all_reduce_cost(32 * 256 * 4, 4),
                                                       rel=1e-2)


class EncoderLayers(nn.Module):
    """BERT-like encoder layers: fused q/k/v, attention, output, 4x MLP, layer norms."""
    num_layers: int
    hidden: int
    heads: int

    @nn.compact
    def __call__(self, x):
        h, n = self.hidden, self.heads
        for _ in range(self.num_layers):
            q, k, v = jnp.split(nn.Dense(3 * h)(x), 3, -1)
            split = lambda a: a.reshape(a.shape[:2] + (n, h // n))  # noqa: E731
            att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / 4.0)
            o = jnp.einsum("bhqk,bkhd->bqhd", att, split(v)).reshape(x.shape)
            x = nn.LayerNorm()(x + nn.Dense(h)(o))
            x = nn.LayerNorm()(x + nn.Dense(h)(nn.gelu(nn.Dense(4 * h)(x))))
        return x


def test_force_batch_dim_holds_for_every_value():
    """Covers test_bert.py::test_bert_layer_force_batch_dim_mapping's model-parallel case:
    ``force_batch_dim_to_mesh_dim=0`` on (1, 4), where axis 0 has one device, keeps the batch
    dim of every value whole, not only of the batch inputs (Alpa filters the strategies of
    every instruction with a batch dim). Forced on the inputs alone, the plan sliced the rows
    right after them and ran data parallel. Alpa asserts its Megatron plan (7 activation
    all-reduces: 5,505,031 in its units at its sizes, batch 64, sequence 64, hidden 32); ours
    splits the sequence with all-to-alls instead, 3,298,519 there (the upstream test fails on
    that value), and 349,203 against Megatron's 344,071 at the sizes here. Checked: no
    per-device block of batch rows, and the step equals jax.jit's."""
    batch, seq, hidden = 16, 16, 32
    model = EncoderLayers(2, hidden, 4)
    x = jax.random.normal(jax.random.PRNGKey(1), (batch, seq, hidden))
    state = TrainState.create(apply_fn=model.apply, params=model.init(jax.random.PRNGKey(0), x),
                              tx=optax.sgd(0.1))   # Adam would make the key bias's zero
                                                   # gradient (rounding noise) a +-lr step

    def step(state, batch):
        def loss(p):
            return jnp.mean((state.apply_fn(p, batch["x"]) - batch["y"]) ** 2)
        return state.apply_gradients(grads=jax.grad(loss)(state.params))

    data = {"x": x, "y": jnp.ones_like(x)}
    with warnings.catch_warnings():   # "names an axis of size 1": warned once per process
        warnings.simplefilter("ignore")
        f, ex = compile_step(step, state, data, mesh((1, 4)),
                             option(force_batch_dim_to_mesh_dim=0))
    text = ex.get_hlo_text()
    assert f"[{batch // 4},{seq}," not in text   # no device holds a quarter of the rows
    assert f"[{batch},{seq}," in text or f"[{batch},{seq // 4}," in text  # rows whole
    want = jax.jit(step)(state, data)
    got = f(state, data)
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_force_data_parallel_prices_the_flattened_mesh():
    """Covers test_mlp.py::test_n_layer_mlp_force_data_parallel on (2, 2): Alpa flattens the
    mesh (latency the largest, inverse bandwidth the smallest of the axes) and so does the
    objective; the batch splits over all four devices."""
    step, state, batch = mlp_step(6, 32, 256)
    _, ex = compile_step(step, state, batch, mesh((2, 2)), option(force_data_parallel=True))
    params = jax.tree.leaves(state.params)
    n_opt = len(jax.tree.leaves(state.opt_state))
    penalty = round(all_reduce_cost(1, 4) + all_reduce_cost(0, 1))
    expected = sum(all_reduce_cost(p.size * 4, 4) for p in params) + penalty * (
        len(params) + n_opt)
    assert ex.auto_sharding_objective == pytest.approx(expected, rel=1e-2)
    assert kinds(ex) == ["all-reduce"]
    assert [leaf.spec for leaf in ex.plan.inputs if leaf.path.startswith("arg1")] == [
        P(("x", "y"))] * 2


def test_argmax_and_reshape_cost_nothing():
    """Covers test_basic.py::test_argmax and test_reshape_uneven_partition: with Alpa's
    default logical mesh (1, 4), alpha (1, 1), beta (1, 0.1) the objective is exactly 0 and
    the argmax input arrives split on its second dim (per device f32[144,36])."""
    opt = option(beta=(1.0, 0.1))
    f = autoshard.parallelize(lambda a: jnp.argmax(a, axis=0), method=autoshard.ShardParallel(
        devices=mesh((1, 4)), auto_sharding_option=opt))
    ex = f.get_executable(jnp.ones((144, 144)))
    assert ex.auto_sharding_objective == 0.0
    assert re.search(r"ENTRY [^\n]*f32\[144,36\]", ex.get_hlo_text())
    g = autoshard.parallelize(lambda a: a.reshape((8, 18)), method=autoshard.ShardParallel(
        devices=mesh((1, 4)), auto_sharding_option=opt))
    assert g.get_executable(jnp.ones(144)).auto_sharding_objective == 0.0


def _wire_bytes(ex, shape) -> float:
    return sum(c.wire_bytes * c.count for c in hlo.collectives(ex.get_hlo_text(), ("x", "y"),
                                                                shape))


def test_2d_mlp_plan_moves_fewer_bytes_than_alpas():
    """Covers the difference in test_mlp.py::test_n_layer_mlp_2d_mesh (and its
    reduce-scatter variant): Alpa asserts batch over x, Megatron over y and 6 all-reduces
    (objective 21,265 in its units). Ours is data parallel over both axes: on the same (2, 2)
    mesh it moves 38,016 compiled bytes per device against 94,784 for Alpa's plan. Alpa's units
    charge a collective over two axes its full bytes on each axis (28,023 for ours); priced
    hierarchically, as autoshard prices it (reduce-scatter over the fast y, all-reduce over x
    on half the bytes, all-gather over y), ours crosses the slow axis x with about 19,008 B
    against Alpa's 12,864 B plus 81,920 B over y, and costs less with beta (1, 0.1). With
    prefer_reduce_scatter (test_n_layer_mlp_2d_mesh_reduce_scatter) ours is ZeRO-2 over both
    axes: one reduce-scatter and one all-gather of every gradient, the all-reduce's 38,016 B."""
    step, state, batch = mlp_step(6, 256, 32)
    shape = (2, 2)
    _, ours = compile_step(step, state, batch, mesh(shape), option(beta=(1.0, 0.1)))

    def alpa_spec(path, _):
        key = jax.tree_util.keystr(path)
        layer = re.search(r"Dense_(\d)", key)
        if layer is None:
            return P()
        column = int(layer.group(1)) % 2 == 0
        if "kernel" in key:
            return P(None, "y") if column else P("y", None)
        return P("y") if column else P()

    specs = jax.tree_util.tree_map_with_path(alpa_spec, state)
    alpas = autoshard.parallelize(step, method=autoshard.ShardParallel(
        devices=mesh(shape), manual_sharding_option=autoshard.ManualShardingOption(
            ("x", "y"), in_axis_resources=(specs, {"x": P("x"), "y": P("x")}),
            out_axis_resources=specs))).get_executable(state, batch)
    assert kinds(alpas).count("all-reduce") == 6  # what Alpa's test counts for its plan
    assert _wire_bytes(ours, shape) < _wire_bytes(alpas, shape)
    _, zero2 = compile_step(step, state, batch, mesh(shape),
                            option(beta=(1.0, 0.1), prefer_reduce_scatter=True))
    assert sorted(kinds(zero2)) == ["all-gather", "reduce-scatter"]
    assert _wire_bytes(zero2, shape) == _wire_bytes(ours, shape) == 38_016
    beta = {("x",): 1.0, ("y",): 0.1}

    def priced(ex):  # wire bytes weighted by the axes' beta, a two-axis one hierarchically
        total = 0.0
        for c in hlo.collectives(ex.get_hlo_text(), ("x", "y"), shape):
            b = c.wire_bytes * c.count
            total += b / 2 + b / 2 * 0.1 if c.axes == ("x", "y") else b * beta[c.axes]
        return total
    assert priced(ours) < priced(alpas)


def test_gradient_accumulation_reduce_scatter():
    """Covers test_gradient_accumulation.py::test_gradient_accumulation_reduce_scatter: with
    prefer_reduce_scatter and 2 micro-batches on (1, 4), the kernels' and biases' gradients
    are reduced once after the loop, reduce-scattered (each device updates a quarter of each
    parameter and holds a quarter of its momentum), then the parameters are all-gathered, all
    in one buffer (``apply.gather_outputs_once``, as without micro-batches); nothing is
    communicated inside the micro-batch loop. On the CPU XLA lowers the reduce-scatter as an
    all-reduce whose result each device slices, so bytes and placements are checked, not
    opcodes. The step equals jax.jit's."""
    step, state, batch = mlp_step(2, 256, 16, tx=optax.sgd(1e-2, momentum=0.9),
                                  grad=autoshard.grad)
    opt = option(prefer_reduce_scatter=True, allow_all_to_all=False)
    f, ex = compile_step(step, state, batch, mesh((1, 4)), opt, num_micro_batches=2)
    predicted = {(c.kind, c.where.split("[")[0]) for c in ex.plan.collectives}
    assert ("reduce-scatter", "dot_general") in predicted
    momentum = [leaf for leaf in ex.plan.inputs if "trace" in leaf.path and "kernel" in leaf.path]
    assert len(momentum) == 2 and all(leaf.bytes_per_device(ex.plan.mesh_sizes) == 16 * 16
                                      for leaf in momentum)
    found = hlo.collectives(ex.get_hlo_text())
    assert not any(c.in_loop for c in found)
    gathers = [c for c in found if c.kind == "all-gather"]
    assert [c.num_bytes for c in gathers] == [2 * (16 * 16 + 16) * 4]
    assert [c.kind for c in found if c.kind != "all-gather"] == ["all-reduce"]
    # each device's kernel update reads a quarter of the reduced gradient (rows or columns:
    # the two cost the same, and HiGHS may return either)
    assert len(re.findall(r"f32\[(?:16,4|4,16)\]\{[01],[01]\} dynamic-slice",
                          ex.get_hlo_text())) >= 2
    expected = jax.jit(step)(state, batch)
    actual = f(state, batch)
    for a, b in zip(jax.tree.leaves(actual.params), jax.tree.leaves(expected.params),
                    strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_data_parallel_reduce_scatter_objective_is_the_all_reduce_plans():
    """Covers the objective of test_mlp.py::test_n_layer_mlp_data_parallel_reduce_scatter
    (Alpa's Zero2Parallel): Alpa's ILP prices each gradient's reduce-scatter as the all-reduce
    it replaces and the all-gather after the update as free, so the objective is the
    data-parallel one; the Adam moments of the kernels are sharded (a quarter per device)."""
    step, state, batch = mlp_step(6, 256, 32)
    _, ex = compile_step(step, state, batch, mesh((4, 1)), option(prefer_reduce_scatter=True))
    assert {c.kind for c in ex.plan.collectives} >= {"reduce-scatter", "all-gather"}
    params = jax.tree.leaves(state.params)
    n_opt = len(jax.tree.leaves(state.opt_state))
    expected = sum(all_reduce_cost(p.size * 4, 4) for p in params) + PENALTY * (len(params) + n_opt)
    assert ex.auto_sharding_objective == pytest.approx(expected, rel=1e-2)
    moments = [leaf for leaf in ex.plan.inputs if ("mu" in leaf.path or "nu" in leaf.path)
               and "kernel" in leaf.path]
    assert len(moments) == 12 and all(
        leaf.bytes_per_device(ex.plan.mesh_sizes) == 32 * 32 for leaf in moments)


class DepthwiseNet(nn.Module):
    channel: int

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(8 * self.channel, (3, 3), use_bias=False)(x)
        x = nn.Conv(8 * self.channel, (3, 3), feature_group_count=8 * self.channel,
                    use_bias=False)(x)
        x = nn.Conv(self.channel, (3, 3), use_bias=False)(x)
        return nn.relu(x)


@pytest.mark.parametrize("shape", [(4, 1), (1, 4)])
def test_depthwise_conv_model_parallel(shape):
    """Covers test_conv.py::test_n_layer_depthwise_conv_model_parallel: the channels split
    through the depthwise conv, whose kernel gradient (a conv with batch groups) keeps its
    groups whole per device; one all-reduce in the whole step; equal to jax.jit."""
    model = DepthwiseNet(channel=64)
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 8, 8, 64))
    state, step = mse_state_and_step(model, x, optax.sgd(0.1))

    batch = {"x": x, "y": jnp.ones((4, 8, 8, 64))}
    f, ex = compile_step(step, state, batch, mesh(shape), option())
    assert [c.kind for c in hlo.collectives(ex.get_hlo_text()) if c.num_bytes > 4] == [
        "all-reduce"]
    expected = jax.jit(step)(state, batch)
    actual = f(state, batch)
    for a, b in zip(jax.tree.leaves(actual.params), jax.tree.leaves(expected.params),
                    strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


class ConvNet(nn.Module):
    """Alpa's test_conv.py model: conv (stride 2), batch norm, relu, max pool, per layer."""
    num_layers: int
    channel: int

    @nn.compact
    def __call__(self, x, train=True):
        for _ in range(self.num_layers):
            x = nn.Conv(self.channel, (3, 3), strides=(2, 2), use_bias=False)(x)
            x = nn.BatchNorm(use_running_average=not train)(x)
            x = nn.max_pool(nn.relu(x), (2, 2), strides=(1, 1), padding="SAME")
        return x


class BatchNormState(TrainState):
    batch_stats: dict


def conv_step(num_layers, batch, image, channel):
    model = ConvNet(num_layers, channel)
    x = jax.random.normal(jax.random.PRNGKey(1), (batch, image, image, channel))
    variables = model.init(jax.random.PRNGKey(0), x)
    state = BatchNormState.create(apply_fn=model.apply, params=variables["params"],
                                  tx=optax.sgd(0.1, momentum=0.9),
                                  batch_stats=variables["batch_stats"])

    def step(state, batch):
        def loss(p):
            out, new = state.apply_fn({"params": p, "batch_stats": state.batch_stats},
                                      batch["x"], mutable=["batch_stats"])
            return jnp.mean((out - batch["y"]) ** 2), new
        grads, new = jax.grad(loss, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads, batch_stats=new["batch_stats"])

    out = image // 2 ** num_layers
    return step, state, {"x": x, "y": jnp.ones((batch, out, out, channel))}


def test_conv_model_parallel_plan_moves_fewer_bytes_than_alpas():
    """Covers the difference in test_conv.py::test_n_layer_conv_model_parallel: Alpa asserts
    the alternating (Megatron) plan, output channels then input channels, with 3 all-reduces
    and nothing else for 4 layers (2 in the forward pass, 1 in the backward). Ours splits the
    input channels of layers 2-4 (an all-reduce each in the forward pass, none in the
    backward) and all-gathers the channel-split gradients of the small last layers in the
    backward pass instead of all-reducing the 8x4x4x256 gradient of layer 3's input: on the
    same (4, 1) mesh it moves fewer compiled bytes per device, and the step equals jax.jit's."""
    step, state, batch = conv_step(4, 8, 16, 256)
    shape = (4, 1)
    f, ours = compile_step(step, state, batch, mesh(shape), option())

    def alpa_spec(path, leaf):
        key = jax.tree_util.keystr(path)
        layer = re.search(r"(Conv|BatchNorm)_(\d)", key)
        if layer is None or leaf.ndim == 0:
            return P()
        column = int(layer.group(2)) % 2 == 0
        if "kernel" in key:
            return P(None, None, None, "x") if column else P(None, None, "x", None)
        return P("x") if column else P()

    specs = jax.tree_util.tree_map_with_path(alpa_spec, state)
    alpas = autoshard.parallelize(step, method=autoshard.ShardParallel(
        devices=mesh(shape), manual_sharding_option=autoshard.ManualShardingOption(
            ("x", "y"), in_axis_resources=(specs, {"x": P(), "y": P()}),
            out_axis_resources=specs))).get_executable(state, batch)
    big = [c.kind for c in hlo.collectives(alpas.get_hlo_text()) if c.num_bytes > 4]
    assert big == ["all-reduce"] * 3  # what Alpa's test counts for its plan
    assert sorted(kinds(ours)) == ["all-gather"] * 4 + ["all-reduce"] * 3
    assert _wire_bytes(ours, shape) < _wire_bytes(alpas, shape)
    expected = jax.jit(step)(state, batch)
    actual = f(state, batch)
    for a, b in zip(jax.tree.leaves(actual.params), jax.tree.leaves(expected.params),
                    strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


class MoE(nn.Module):
    """A top-1 mixture-of-experts layer in Alpa's einsum layout (G groups of S tokens, E
    experts of capacity C): dispatch GSEC,GSM->EGCM, experts EGCM,EMH->EGCH, combine."""
    num_experts: int
    capacity: int
    hidden: int

    @nn.compact
    def __call__(self, x):
        g, s, m = x.shape
        e, c = self.num_experts, self.capacity
        init = nn.initializers.normal(0.02)
        wg = self.param("wg", init, (m, e))
        wi = self.param("wi", init, (e, m, self.hidden))
        wo = self.param("wo", init, (e, self.hidden, m))
        probs = jax.nn.softmax(jnp.einsum("GSM,ME->GSE", x, wg), axis=-1)
        expert = jax.nn.one_hot(jnp.argmax(probs, axis=-1), e)          # GSE
        position = (jnp.cumsum(expert, axis=1) - 1.0) * expert          # GSE
        dispatch = expert[..., None] * jax.nn.one_hot(position.astype(jnp.int32), c)  # GSEC
        combine = dispatch * jnp.sum(probs * expert, axis=-1)[..., None, None]
        inputs = jnp.einsum("GSEC,GSM->EGCM", dispatch, x)
        h = nn.relu(jnp.einsum("EGCM,EMH->EGCH", inputs, wi))
        outputs = jnp.einsum("EGCH,EHM->GECM", h, wo)
        return x + jnp.einsum("GSEC,GECM->GSM", combine, outputs)


@pytest.mark.parametrize("prefer", [False, True])
def test_moe_2d_plan_moves_fewer_bytes_than_alpas(prefer):
    """Covers the difference in test_moe.py::test_moe_layer_2d (and its reduce-scatter
    variant, ``prefer``): on (2, 2) Alpa asserts 2 all-reduces (the normal weights' and the
    expert weights' gradients, the experts split over one axis and reduced over the other)
    beside all-to-alls. Ours splits the experts over both axes (no expert-gradient reduction at
    all) and the tokens over y; that costs all-to-alls over y and activation all-reduces over
    x. The expert weights' gradient all-reduce of Alpa's plan alone moves more bytes per device
    than our whole compiled step; the step equals jax.jit's. With prefer_reduce_scatter and
    all-gathers off, the plan is the same: the gradients' all-reduces are not forced into
    reduce-scatters (``build._prefer_reduce_scatter``), since the all-gather of the updated
    parameter is off too."""
    num_experts, hidden = 16, 128
    model = MoE(num_experts, capacity=8, hidden=hidden)
    x = jax.random.normal(jax.random.PRNGKey(1), (32, 32, 32))
    state, step = mse_state_and_step(model, x, optax.adam(1e-2))

    batch = {"x": x, "y": jnp.ones_like(x)}
    shape = (2, 2)
    f, ours = compile_step(step, state, batch, mesh(shape),
                           option(allow_all_gather=False, prefer_reduce_scatter=prefer))
    specs = {leaf.path.split("'")[-2]: leaf.spec for leaf in ours.plan.inputs
             if "params" in leaf.path and "'mu'" not in leaf.path and "'nu'" not in leaf.path}
    assert specs["wi"] == specs["wo"] == P(("x", "y"))
    assert "all-to-all" in kinds(ours)
    # Alpa's plan: each expert weight split over one axis of 2 and all-reduced over the other
    expert_bytes = 2 * num_experts * 32 * hidden * 4
    alpa_expert_reduction = 2 * (2 - 1) / 2 * expert_bytes / 2
    assert _wire_bytes(ours, shape) < alpa_expert_reduction
    if prefer:  # the plan without prefer_reduce_scatter, byte for byte
        _, plain = compile_step(step, state, batch, mesh(shape), option(allow_all_gather=False))
        assert _wire_bytes(ours, shape) == _wire_bytes(plain, shape)
    expected = jax.jit(step)(state, batch)
    actual = f(state, batch)
    for a, b in zip(jax.tree.leaves(actual.params), jax.tree.leaves(expected.params),
                    strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


class MoELM(nn.Module):
    """Token embedding, one ``MoE`` layer over groups of ``group`` tokens, a vocabulary head."""
    vocab: int
    hidden: int
    num_experts: int
    group: int

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.hidden)(tokens)
        batch, length, m = x.shape
        x = x.reshape((batch * length // self.group, self.group, m))
        x = MoE(self.num_experts, capacity=2 * self.group // self.num_experts,
                hidden=4 * self.hidden)(x)
        return nn.Dense(self.vocab)(x.reshape((batch, length, m)))


def _moe_lm_step():
    """(step, state, batch) of ``MoELM`` (vocabulary 32, 16 experts) with Adam on 64 x 16
    tokens: Alpa's test_moe_lm sizes, one layer."""
    model = MoELM(vocab=32, hidden=64, num_experts=16, group=32)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (64, 16), 0, 32)
    state = TrainState.create(apply_fn=model.apply, tx=optax.adam(1e-2),
                              params=model.init(jax.random.PRNGKey(0), tokens))

    def step(state, batch):
        def loss(p):
            logits = state.apply_fn(p, batch["tokens"])
            return -jnp.mean(jnp.sum(jax.nn.one_hot(batch["labels"], 32)
                                     * jax.nn.log_softmax(logits), axis=-1))
        return state.apply_gradients(grads=jax.grad(loss)(state.params))

    return step, state, {"tokens": tokens, "labels": jnp.roll(tokens, 1, axis=1)}


def test_moe_lm_2d_dispatches_with_all_to_alls():
    """Covers test_moe.py::test_moe_lm_2d: on (2, 2) Alpa's plan keeps the tokens split over
    both axes, the experts too, and moves the dispatched and combined tokens with 4 all-to-alls
    over the flattened mesh (forward and backward), beside the gradients' all-reduces. Ours is
    that plan. The dispatched tokens are read by two einsums (the experts' forward product and
    the gradient of their weights): the planner prices their all-to-all once, at the layout op
    both read (``simplify._forks``); priced once per reader, that plan lost to one that
    all-gathers the token groups before both dispatch einsums (f32[32,32,64] twice)."""
    step, state, batch = _moe_lm_step()
    shape = (2, 2)
    f, ex = compile_step(step, state, batch, mesh(shape), option())
    found = hlo.collectives(ex.get_hlo_text(), ("x", "y"), shape)
    assert [c.kind for c in found].count("all-to-all") == 4
    assert {c.kind for c in found} == {"all-to-all", "all-reduce"}
    specs = {leaf.path.split("'")[-2]: leaf.spec for leaf in ex.plan.inputs
             if leaf.path.startswith("arg0.params")}
    assert specs["wi"] == specs["wo"] == P(("x", "y"))
    expected = jax.jit(step)(state, batch)
    actual = f(state, batch)
    for a, b in zip(jax.tree.leaves(actual.params), jax.tree.leaves(expected.params),
                    strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_moe_lm_2d_reduce_scatter_over_both_axes():
    """Covers test_moe.py::test_moe_lm_2d_reduce_scatter: test_moe_lm_2d's plan on (2, 2)
    (tokens and experts split over both axes, 4 all-to-alls) with prefer_reduce_scatter, where
    Alpa asserts reduce-scatters and nothing but all-reduces, all-gathers, reduce-scatters and
    all-to-alls. The batch is split over x and y, so every weight gradient is a sum over both
    axes: each is reduce-scattered over the 4 devices into one dim (the embedding's scatter-add,
    the gate's and the head's products, the head bias's sum), their Adam moments held in
    shards, the updated weights all-gathered. Before, the rules offered a reduce-scatter only
    for a sum over one axis: every gradient was all-reduced and no reduce-scatter compiled. The
    step equals jax.jit's."""
    step, state, batch = _moe_lm_step()
    shape = (2, 2)
    f, ex = compile_step(step, state, batch, mesh(shape), option(prefer_reduce_scatter=True))
    specs = {leaf.path: leaf.spec for leaf in ex.plan.inputs}
    params = {p: s for p, s in specs.items() if p.startswith("arg0.params")}
    moments = {p: s for p, s in specs.items() if ".mu[" in p or ".nu[" in p}
    experts = {p for p in params if "'wi'" in p or "'wo'" in p}
    assert all(params[p] == P(("x", "y")) for p in experts)
    assert all(s == P() for p, s in params.items() if p not in experts)
    assert len(moments) == 2 * len(params) and all(s != P() for s in moments.values())
    dense = [leaf for p, leaf in jax.tree_util.tree_leaves_with_path(state.params)
             if "'wi'" not in jax.tree_util.keystr(p) and "'wo'" not in jax.tree_util.keystr(p)]
    dense_bytes = sum(leaf.size * 4 for leaf in dense)
    scattered = [c for c in ex.plan.collectives if c.kind == "reduce-scatter"]
    assert len(scattered) == len(dense) and all(c.axes == ("x", "y") for c in scattered)
    assert sum(c.num_bytes * 4 for c in scattered) == dense_bytes
    assert all(c.num_bytes == 4 for c in ex.plan.collectives if c.kind == "all-reduce")
    # The step reduce-scatters the 4 gradients over the 4 devices in one collective (each
    # device keeping a quarter of them: partial_run.PartialSums.flush) and gathers the
    # updated weights in one all-gather.
    found = hlo.collectives(ex.get_hlo_text(), ("x", "y"), shape)
    assert sorted(c.kind for c in found) == (["all-gather"] + ["all-to-all"] * 4
                                             + ["reduce-scatter"])
    assert all(c.axes == ("x", "y") for c in found)
    by_kind = {c.kind: c.num_bytes for c in found}
    assert by_kind["reduce-scatter"] == dense_bytes // 4
    assert by_kind["all-gather"] == dense_bytes
    expected = jax.jit(step)(state, batch)
    actual = f(state, batch)
    for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


class ExpertMixer(nn.Module):
    """Alpa's ``test_mixed_2d`` model: two products, the features regrouped as E experts of
    M/E, two expert einsums (EBH: experts major), the features back, two products."""
    num_experts: int = 4
    features: int = 16

    @nn.compact
    def __call__(self, x):
        e, m = self.num_experts, self.features
        init = nn.initializers.normal(0.1)
        wi = self.param("wi", init, (e, m // e, 8 * m))
        wo = self.param("wo", init, (e, 8 * m, m // e))
        x = nn.Dense(m, use_bias=False)(nn.Dense(m, use_bias=False)(x))
        x = jnp.einsum("BEM,EMH->EBH", x.reshape((x.shape[0], e, m // e)), wi)
        x = jnp.einsum("EBH,EHM->BEM", x, wo).reshape((-1, m))
        return nn.Dense(m, use_bias=False)(nn.Dense(m, use_bias=False)(x))


def test_mixed_2d_dot_all_to_all():
    """Covers test_mixed_2d.py::test_dot_all_to_all: on (2, 2) with beta (1, 0.1) and
    all-gathers off, Alpa's plan (allow_mixed_mesh_shape) moves the activations between the
    batch-split products and the expert-split einsums with all-to-alls, and the step has
    all-to-alls and all-reduces only. Ours does too (over the cheap axis y). The regrouped
    features are read by the first einsum and by the gradient of its weights: priced once per
    reader, the all-to-all lost to keeping the experts whole (one all-reduce of every gradient,
    30,720 B per device); the step equals jax.jit's."""
    model = ExpertMixer()
    x = jax.random.normal(jax.random.PRNGKey(1), (256, 16))
    state, step = mse_state_and_step(model, x, optax.sgd(1e-2))

    batch = {"x": x, "y": jnp.ones_like(x)}
    f, ex = compile_step(step, state, batch, mesh((2, 2)),
                         option(beta=(1.0, 0.1), allow_all_gather=False))
    found = kinds(ex)
    assert "all-to-all" in found and set(found) == {"all-to-all", "all-reduce"}, found
    expected = jax.jit(step)(state, batch)
    actual = f(state, batch)
    for a, b in zip(jax.tree.leaves(actual.params), jax.tree.leaves(expected.params),
                    strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def _zero2_step(model, x, y):
    """(step, state, batch): MSE of ``model`` with Adam (eps 1e-3: a gradient entry near zero
    would turn summation-order noise into a +-lr step); ``step`` returns (state, loss)."""
    state = TrainState.create(apply_fn=model.apply, params=model.init(jax.random.PRNGKey(0), x),
                              tx=optax.adam(1e-2, eps=1e-3))

    def step(state, batch):
        def loss(p):
            return jnp.mean((state.apply_fn(p, batch["x"]) - batch["y"]) ** 2)
        value, grads = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=grads), value

    return step, state, {"x": x, "y": y}


def _assert_zero2(f, ex, step, state, batch):
    """Alpa's Zero2Parallel plan (``assert_data_parallel_cost`` with prefer_reduce_scatter):
    parameters whole between steps, every gradient reduce-scattered (the kernels' dots and the
    bias and LayerNorm sums) into one collective, every optimizer-state leaf but the step count
    in shards, the updated parameters all-gathered in one collective, nothing else; three
    steps' losses and the final state equal jax.jit's."""
    params = jax.tree.leaves(state.params)
    total = sum(p.size * 4 for p in params)
    specs = {leaf.path: leaf.spec for leaf in ex.plan.inputs}
    assert all(s == P() for path, s in specs.items() if path.startswith("arg0.params"))
    opt = {path: s for path, s in specs.items() if path.startswith("arg0.opt_state")
           and not path.endswith(".count")}
    assert len(opt) == 2 * len(params) and all(s != P() for s in opt.values()), opt
    scattered = sum(c.count for c in ex.plan.collectives if c.kind == "reduce-scatter")
    assert scattered == len(params)
    assert all(c.num_bytes == 4 for c in ex.plan.collectives if c.kind == "all-reduce")
    # One reduce-scatter of every gradient, each device keeping its part (a quarter of the
    # parameters' bytes); the loss's scalar all-reduce aside, nothing else is compiled.
    found = [c for c in hlo.collectives(ex.get_hlo_text()) if c.num_bytes > 4]
    assert sorted(c.kind for c in found) == ["all-gather", "reduce-scatter"], found
    assert {c.kind: c.num_bytes for c in found}["reduce-scatter"] == total // 4
    assert {c.kind: c.num_bytes for c in found}["all-gather"] == total
    want_state, got_state = state, state
    for _ in range(3):
        want_state, want_loss = jax.jit(step)(want_state, batch)
        got_state, got_loss = f(got_state, batch)
        np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", [(4, 1), (1, 4)])
def test_adafactor_gradients_are_reduce_scattered_in_one_collective(shape):
    """Covers test_moe.py::test_moe_lm_reduce_scatter and
    test_moe_lm_data_parallel_reduce_scatter (Adafactor under prefer_reduce_scatter: one
    reduce-scatter asserted), on a 4-layer MLP: every gradient, each a sum over the batch
    axis the plan reduce-scatters, is reduced in one reduce-scatter of all of them
    (``partial_run.PartialSums.flush``: one per step, the size of a quarter of the
    parameters); Adafactor's factored statistics (each squared kernel gradient's sums along
    its split dim and a few scalars: 544 B) are all-reduced after it, and the updated
    parameters come back in one all-gather. Before, each gradient's reduce-scatter was left
    to XLA's partitioner (an all-reduce of the whole gradient and a slice on the CPU), and
    XLA:CPU's all-reduce combiner merged each with the previous gradient's statistics: 12
    all-reduces of 16,900 B, no reduce-scatter. Three steps equal jax.jit's."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(256, 32)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(256, 32)), jnp.float32)
    state, step = mse_state_and_step(MLP(4, 32), x, optax.adafactor(
        1e-2, min_dim_size_to_factor=4))
    batch = {"x": x, "y": y}
    f, ex = compile_step(step, state, batch, mesh(shape), option(prefer_reduce_scatter=True))
    params = jax.tree.leaves(state.params)
    total = sum(p.size * 4 for p in params)
    assert len(ex.plan.reduce_scattered) == len(params)  # one term each, reduced together
    found = hlo.collectives(ex.get_hlo_text())
    assert [c.num_bytes for c in found if c.kind == "reduce-scatter"] == [total // 4]
    assert [c.num_bytes for c in found if c.kind == "all-gather"] == [total]
    assert sum(c.num_bytes for c in found if c.kind == "all-reduce") < total // 4
    assert {c.kind for c in found} == {"reduce-scatter", "all-reduce", "all-gather"}
    want, got = state, state
    for _ in range(3):
        want, got = jax.jit(step)(want, batch), f(got, batch)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", [(4, 1), (1, 4)])
def test_mlp_data_parallel_reduce_scatter_is_zero2(shape):
    """Covers test_mlp.py::test_n_layer_mlp_data_parallel_reduce_scatter (Alpa's
    Zero2Parallel: prefer_reduce_scatter): 6 layers, 12 gradients reduce-scattered, one
    reduce-scatter and one all-gather compiled (``_assert_zero2``). Before, the bias sums kept
    their all-reduce and a kernel was held in shards and gathered before the forward pass
    (ZeRO-3's layout: the same bytes), 2 all-gathers and 1 all-reduce."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(256, 32)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(256, 32)), jnp.float32)
    step, state, batch = _zero2_step(MLP(6, 32), x, y)
    f, ex = compile_step(step, state, batch, mesh(shape), option(prefer_reduce_scatter=True))
    _assert_zero2(f, ex, step, state, batch)
    params = jax.tree.leaves(state.params)
    n_opt = len(jax.tree.leaves(state.opt_state))
    expected = sum(all_reduce_cost(p.size * 4, 4) for p in params) + PENALTY * (len(params) + n_opt)
    assert ex.auto_sharding_objective == pytest.approx(expected, rel=1e-2)


def test_2d_mlp_reduce_scatter_is_zero2_over_both_axes():
    """Covers the difference in test_mlp.py::test_n_layer_mlp_2d_mesh_reduce_scatter: Alpa
    asserts its Megatron plan (5 all-reduces, 2 reduce-scatters); ours is data parallel over
    both axes of (2, 2), as without prefer_reduce_scatter (``test_2d_mlp_plan_moves_fewer_
    bytes_than_alpas``), and now ZeRO-2 over both: every gradient, a sum over x and y, is
    reduce-scattered over the 4 devices into one collective, the updated parameters gathered
    in one (``_assert_zero2``). Before, a sum over two axes was offered no reduce-scatter:
    the 12 gradients were all-reduced and the Adam moments kept whole."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(256, 32)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(256, 32)), jnp.float32)
    step, state, batch = _zero2_step(MLP(6, 32), x, y)
    f, ex = compile_step(step, state, batch, mesh((2, 2)),
                         option(beta=(1.0, 0.1), prefer_reduce_scatter=True))
    assert {c.axes for c in ex.plan.collectives if c.kind == "reduce-scatter"} == {("x", "y")}
    _assert_zero2(f, ex, step, state, batch)


def test_bert_layer_data_parallel_reduce_scatter_is_zero2():
    """Covers test_bert.py::test_bert_layer_data_parallel_reduce_scatter: 2 BERT-like layers
    on (4, 1), their kernels', biases' and LayerNorm parameters' gradients reduce-scattered
    into one collective and the updated parameters all-gathered in one (``_assert_zero2``)."""
    rng = np.random.default_rng(0)
    # Batch and sequence 32 (Alpa's: 64): at 16 x 8 the activations are small enough that
    # splitting the first q/k/v kernel (one all-to-all of its output) costs less.
    x = jnp.asarray(rng.normal(size=(32, 32, 32)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(32, 32, 32)), jnp.float32)
    step, state, batch = _zero2_step(EncoderLayers(2, 32, 4), x, y)
    f, ex = compile_step(step, state, batch, mesh((4, 1)), option(prefer_reduce_scatter=True))
    _assert_zero2(f, ex, step, state, batch)


class EmbedMLP(nn.Module):
    """A token and a position embedding (lookups: scatter-add gradients), then a Dense layer."""

    @nn.compact
    def __call__(self, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = nn.Embed(64, 32)(tokens) + nn.Embed(tokens.shape[1], 32)(positions)
        return nn.Dense(32)(jnp.tanh(x))


@pytest.mark.parametrize("shape", [(4, 1), (1, 4)])
def test_embedding_gradients_reduce_scatter_is_zero2(shape):
    """Covers the embeddings of test_bert.py::test_bert_mlm_data_parallel_reduce_scatter
    (Alpa's Zero2Parallel): the token and position embeddings' gradients (scatter-adds of
    the batch's rows) are reduce-scattered with the kernel's, their Adam moments held in
    shards (``_assert_zero2``). Before, the scatter-add rule offered no reduce-scatter: the
    embeddings' gradients kept their all-reduce and their 4 moments stayed whole."""
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 64, size=(32, 16)), jnp.int32)
    y = jnp.asarray(rng.normal(size=(32, 16, 32)), jnp.float32)
    step, state, batch = _zero2_step(EmbedMLP(), tokens, y)
    f, ex = compile_step(step, state, batch, mesh(shape), option(prefer_reduce_scatter=True))
    _assert_zero2(f, ex, step, state, batch)
