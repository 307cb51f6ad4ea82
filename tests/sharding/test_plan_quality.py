"""Plan quality: the planner finds Megatron, data parallel and hybrid plans where they pay."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import block, init_block, mlp, mse, sgd_step
from _util import assert_close, collectives, compile_plan, hlo_of, plan_fn, run_plan
from jax.sharding import PartitionSpec as P

from autoshard.sharding.cost import DEFAULT_ALPHA_S, DEFAULT_BETA_S_PER_BYTE

MLP_STEP = sgd_step(mse(mlp))


def _mlp_case(batch, hidden, seed=0):
    rng = np.random.default_rng(seed)
    params = (jnp.asarray(rng.normal(size=(hidden, 4 * hidden)).astype(np.float32) * 0.02),
              jnp.asarray(rng.normal(size=(4 * hidden, hidden)).astype(np.float32) * 0.02))
    x = jnp.asarray(rng.normal(size=(batch, hidden)).astype(np.float32))
    y = jnp.asarray(rng.normal(size=(batch, hidden)).astype(np.float32))
    return params, x, y


def _plan_mlp(batch, hidden, **opt):
    params, x, y = _mlp_case(batch, hidden)
    opt.setdefault("logical_mesh_shape", (8,))
    closed, plan = plan_fn(MLP_STEP, (params, x, y), batch=[0, 0, 1, 1],
                           aliases=[(0, 0), (1, 1)], **opt)
    return closed, plan, (params, x, y)


def all_reduce(n: int, num_bytes: float) -> float:
    """Alpha-beta cost of an all-reduce over n devices (Alpa's model): a + b * 2(n-1)/n * B."""
    return DEFAULT_ALPHA_S + DEFAULT_BETA_S_PER_BYTE * 2 * (n - 1) / n * num_bytes


def merged_all_reduce(n: int, num_bytes: float) -> float:
    """An all-reduce of a tail reduction (a weight gradient, the loss): XLA merges those into
    one collective, so the model charges each its bytes and the group one latency."""
    return all_reduce(n, num_bytes) - DEFAULT_ALPHA_S


def test_megatron_mlp_small_batch_large_hidden():
    batch, hidden = 8, 1024
    closed, plan, args = _plan_mlp(batch, hidden)
    w1, w2, x, y = plan.in_specs
    assert w1 == P(None, "x")  # first kernel split by columns
    assert w2 == P("x")        # second kernel split by rows
    assert plan.out_specs[:2] == (w1, w2)  # the updated parameters stay where they are
    found = collectives(hlo_of(closed, plan, args))
    sizes = sorted(size for kind, size in found)
    # One all-reduce of the block's output activation, none of the hidden activation between
    # the dots, and no gradient all-reduce.
    assert sizes == [batch * hidden * 4], found
    assert all(kind == "all-reduce" for kind, _ in found)


def test_data_parallel_mlp_large_batch_small_hidden():
    batch, hidden = 1024, 32
    closed, plan, args = _plan_mlp(batch, hidden)
    w1, w2, x, y = plan.in_specs
    assert (w1, w2) == (P(), P())
    assert x == P("x") and y == P("x")
    found = collectives(hlo_of(closed, plan, args))
    grad_bytes = 2 * hidden * 4 * hidden * 4
    # Only gradient all-reduces (XLA may combine them) and the scalar loss.
    assert {kind for kind, _ in found} == {"all-reduce"}
    assert sum(size for _, size in found) in (grad_bytes, grad_bytes + 4), found


def test_forced_data_parallel_objective_matches_alpha_beta_formula():
    batch, hidden = 64, 128
    closed, plan, args = _plan_mlp(batch, hidden, force_data_parallel=True,
                                   logical_mesh_shape=None)
    assert plan.mesh_shape == (8,)
    assert plan.in_specs == (P(), P(), P("x"), P("x"))
    param_bytes = hidden * 4 * hidden * 4
    # Two gradient all-reduces, and one of the scalar loss (reduce_sum over the split batch),
    # which XLA merges into one: their bytes and one latency.
    expected = (2 * merged_all_reduce(8, param_bytes) + merged_all_reduce(8, 4)
                + DEFAULT_ALPHA_S)
    o = plan.objective
    assert o.resharding_s == 0
    assert o.communication_s == pytest.approx(expected, rel=1e-9)
    assert o.total_s == pytest.approx(expected + o.compute_s)


def test_forced_model_parallel_objective_matches_alpha_beta_formula():
    # A batch of 4 cannot be split 8 ways and heavy ops are not recomputed on several devices,
    # so the dots must split model dims: Megatron, one all-reduce of the block output.
    batch, hidden = 4, 256
    closed, plan, args = _plan_mlp(batch, hidden)
    assert plan.in_specs[:2] == (P(None, "x"), P("x"))
    expected = all_reduce(8, batch * hidden * 4)
    o = plan.objective
    assert o.resharding_s == 0
    assert o.communication_s == pytest.approx(expected, rel=1e-9)
    out = run_plan(closed, plan, args)
    assert_close(out, jax.jit(MLP_STEP)(*args))


def _over(spec, axis) -> P:
    """``spec`` without ``axis``: a weight the default also shards over the batch axis
    (ZeRO: its optimizer state and update in shards, gathered at use) is the same tensor
    parallel layout."""
    entries = []
    for e in spec:
        names = (e,) if isinstance(e, str) else tuple(e or ())
        names = tuple(n for n in names if n != axis)
        entries.append(names[0] if len(names) == 1 else (names or None))
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def test_2d_mesh_mlp_is_hybrid():
    closed, plan, args = _plan_mlp(1024, 256, logical_mesh_shape=(2, 4))
    w1, w2, x, y = plan.in_specs
    batch_axis = y[0]
    assert batch_axis in ("x", "y") and y == P(batch_axis)
    model_axis = "y" if batch_axis == "x" else "x"
    assert _over(w1, batch_axis) == P(None, model_axis)
    assert _over(w2, batch_axis) == P(model_axis)
    assert_close(run_plan(closed, plan, args), jax.jit(MLP_STEP)(*args))


def test_2d_mesh_transformer_block_is_hybrid():
    rng = np.random.default_rng(0)
    params = init_block(rng, 256, 8)
    x = jnp.asarray(rng.normal(size=(32, 64, 256)).astype(np.float32))
    step = sgd_step(mse(block))
    leaves = len(jax.tree.leaves(params))
    closed, plan = plan_fn(step, (params, x, x), batch=[0] * leaves + [1, 1],
                           aliases=[(i, i) for i in range(leaves)], logical_mesh_shape=(2, 4),
                           memory_tradeoff=0.1)   # the least time (the default's FSDP: below)
    names = sorted(params)  # leaves are flattened in sorted key order
    # the batch on one axis ...
    batch_axis = plan.in_specs[leaves][0]
    assert batch_axis in ("x", "y") and plan.in_specs[leaves] == P(batch_axis)
    spec = {n: _over(s, batch_axis)
            for n, s in zip(names, plan.in_specs[:leaves], strict=True)}
    # ... heads (dim 1 of wq/wk/wv, dim 0 of wo) and the MLP Megatron-style on the other
    # (the weights may also be sharded over the batch axis: ZeRO, gathered at use)
    model = "x" if batch_axis == "y" else "y"
    assert spec["wk"] == spec["wv"] == spec["wq"] == P(None, model)
    assert spec["wo"] == P(model)
    assert spec["w1"] == P(None, model) and spec["w2"] == P(model)
    assert plan.objective.total_s < plan.objective.data_parallel_s


def test_memory_budget_shards_parameters():
    # Inference of a wide MLP: data parallel needs no communication at all, so the fastest
    # plan keeps the parameters replicated; a budget below their footprint forces them to be
    # split. (The default weighs memory: it splits them already, 8 MB less per device for
    # 128 KB sent, pareto.expert_choice.)
    batch, hidden = 64, 512
    params, x, _ = _mlp_case(batch, hidden)
    param_bytes = 2 * hidden * 4 * hidden * 4
    closed, free = plan_fn(mlp, (params, x), batch=[0, 0, 1], logical_mesh_shape=(8,),
                           memory_tradeoff=0.0)
    assert free.in_specs == (P(), P(), P("x"))
    assert free.objective.communication_s == 0
    closed, default = plan_fn(mlp, (params, x), batch=[0, 0, 1], logical_mesh_shape=(8,))
    assert default.in_specs[0] != P() and default.in_specs[1] != P()
    assert default.objective.peak_bytes_per_device < free.objective.peak_bytes_per_device
    budget = param_bytes // 2
    closed, plan = plan_fn(mlp, (params, x), batch=[0, 0, 1], logical_mesh_shape=(8,),
                           memory_budget_per_device=budget)
    assert plan.in_specs[0] != P() and plan.in_specs[1] != P()
    assert plan.objective.peak_bytes_per_device <= budget
    compiled = compile_plan(closed, plan).lower(*jax.tree.leaves((params, x))).compile()
    stats = compiled.memory_analysis()
    used = (stats.argument_size_in_bytes + stats.output_size_in_bytes
            + stats.temp_size_in_bytes - stats.alias_size_in_bytes)
    assert used <= budget, (used, budget)
    assert_close(compiled(*jax.tree.leaves((params, x))), jax.jit(mlp)(params, x))


def test_memory_budget_too_small_is_an_error():
    with pytest.raises(ValueError, match="memory_budget_per_device"):
        _plan_mlp(64, 128, memory_budget_per_device=1000)


def test_objective_is_what_the_ilp_minimised():
    closed, plan, _ = _plan_mlp(8, 1024)
    o = plan.objective
    assert o.total_s == pytest.approx(o.communication_s + o.resharding_s + o.compute_s)
    assert sum(c.cost_s for c in plan.collectives) == pytest.approx(
        o.communication_s + o.resharding_s)
    assert o.data_parallel_s > o.total_s


TWO_LEVEL_BETA = (DEFAULT_BETA_S_PER_BYTE, DEFAULT_BETA_S_PER_BYTE / 10)
"""Measured-looking per-axis constants with a cheap second axis (given explicitly)."""


def _gather(n: int, num_bytes: float, axis: int) -> float:
    """Alpha-beta all-gather over n devices of mesh axis ``axis``: a + b * (n-1)/n * B."""
    return DEFAULT_ALPHA_S + TWO_LEVEL_BETA[axis] * (n - 1) / n * num_bytes


def test_2d_resharding_cost_is_exact():
    from autoshard.sharding.cost import CostModel
    from autoshard.sharding.options import AutoShardingOption

    cost = CostModel.from_option((2, 4), AutoShardingOption(mesh_beta=TWO_LEVEL_BETA))
    shape, total = (64, 512), 64 * 512 * 4
    # Split by axis 1 only: each group of 4 devices holds the whole array (axis 0 replicates
    # it), so the all-gather moves total bytes, not total / 2.
    assert cost.reshard(((1,), ()), ((), ()), shape, 4) == pytest.approx(_gather(4, total, 1))
    # One dim split over both axes: gather the expensive axis 0 first while the array is
    # small (total / 4 per group of 2), then axis 1 on the whole array.
    both = ((0, 1), ())
    first0 = _gather(2, total / 4, 0) + _gather(4, total, 1)
    first1 = _gather(4, total / 2, 1) + _gather(2, total, 0)
    assert first0 < first1
    assert cost.reshard(both, ((), ()), shape, 4) == pytest.approx(first0)
    # Moving axis 1 to the other dim while axis 0 keeps dim 0: an all-to-all over the group
    # that holds half the array.
    a2a = DEFAULT_ALPHA_S + TWO_LEVEL_BETA[1] * 3 / 16 * (total / 2)
    assert cost.reshard(both, ((0,), (1,)), shape, 4) == pytest.approx(a2a)
    # Adding splits is a local slice.
    assert cost.reshard(((0,), ()), both, shape, 4) == 0.0


def test_2d_objective_is_what_the_ilp_minimised():
    params, x, y = _mlp_case(16, 256)
    closed, plan = plan_fn(MLP_STEP, (params, x, y), batch=[0, 0, 1, 1],
                           aliases=[(0, 0), (1, 1)], logical_mesh_shape=(2, 4))
    o = plan.objective
    assert dict(o.meshes_tried)[(2, 4)] == pytest.approx(o.total_s, rel=1e-6)
    assert sum(c.cost_s for c in plan.collectives) == pytest.approx(
        o.communication_s + o.resharding_s)


def test_conv_images_are_never_split_spatially():
    from jax import lax

    from autoshard.sharding import AutoShardingOption
    from autoshard.sharding.build import build_problem
    from autoshard.sharding.graph import build_graph

    def loss(w, x):
        y = lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return (jnp.tanh(y) ** 2).sum()

    args = (jnp.ones((3, 3, 8, 16)), jnp.ones((8, 16, 16, 8)))
    closed, plan = plan_fn(jax.grad(loss), args, batch=[False, True],
                           logical_mesh_shape=(2, 4))
    graph = build_graph(closed, ["w", "x"], ["dw"])
    prob = build_problem(graph, (2, 4), AutoShardingOption(), batch_invars=[False, True],
                         aliases=(), warned=set())
    images = 0
    for node in graph.nodes:
        for s in prob.strategies[node.id]:
            for vid, spec in zip(node.outputs, s.out_specs, strict=False):
                if graph.values[vid].shape in ((8, 16, 16, 8), (8, 16, 16, 16)):
                    images += 1
                    assert not spec[1] and not spec[2], (node.kind, spec)
    assert images
    assert_close(run_plan(closed, plan, args), jax.jit(jax.grad(loss))(*args))


def test_exact_2d_resharding_is_never_worse_than_per_axis_terms():
    rng = np.random.default_rng(0)
    params = init_block(rng, 128, 4)
    x = jnp.asarray(rng.normal(size=(16, 32, 128)).astype(np.float32))
    step = sgd_step(mse(block))
    leaves = len(jax.tree.leaves(params))

    def objective(columns):
        _, plan = plan_fn(step, (params, x, x), batch=[0] * leaves + [1, 1],
                          aliases=[(i, i) for i in range(leaves)], logical_mesh_shape=(2, 4),
                          exact_resharding_columns=columns)
        return plan.objective

    exact, per_axis = objective(10**9), objective(0)
    # Both report the exact cost of their plan; only the first minimised it.
    assert exact.total_s <= per_axis.total_s * (1 + 1e-6)
    assert exact.num_edge_columns > per_axis.num_edge_columns
    with pytest.raises(ValueError, match="exact_resharding_columns"):
        from autoshard.sharding import AutoShardingOption
        AutoShardingOption(exact_resharding_columns=-1)


def test_tied_layers_can_alternate_column_and_row_splits():
    """A stack of square layers: tying repeats must not remove the alternating Megatron plan."""
    layers, hidden, batch = 10, 1024, 8

    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.mean(x ** 2)

    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.normal(size=(hidden, hidden)) / 32, jnp.float32)
          for _ in range(layers)]
    x = jnp.asarray(rng.normal(size=(batch, hidden)), jnp.float32)
    step = sgd_step(loss)
    closed, plan = plan_fn(step, (ws, x), batch=[0] * layers + [1], logical_mesh_shape=(8,),
                           aliases=[(i, i) for i in range(layers)])
    specs = plan.in_specs[:layers]
    assert specs == tuple(P(None, "x") if i % 2 == 0 else P("x") for i in range(layers))
    found = collectives(hlo_of(closed, plan, (ws, x)))
    assert {kind for kind, _ in found} == {"all-reduce"} and len(found) <= layers, found
    assert any("tied" in n and not n.startswith("0 ") for n in plan.notes)  # still tied


def test_prefer_reduce_scatter_scatters_gradients_and_gathers_after_the_update():
    closed, plan, args = _plan_mlp(2048, 128, memory_tradeoff=0.0)
    assert {c.kind for c in plan.collectives} == {"all-reduce"}  # plain data parallel
    closed, plan, args = _plan_mlp(2048, 128, prefer_reduce_scatter=True)
    kinds = [(c.kind, c.where.split("[")[0]) for c in plan.collectives]
    scattered = [c for c in plan.collectives if c.kind == "reduce-scatter"]
    assert len(scattered) == 2 and all(c.num_bytes == 128 * 512 * 4 // 8 for c in scattered)
    assert not any(k == "all-reduce" and w == "dot_general" for k, w in kinds), kinds
    gathered = [c for c in plan.collectives if c.kind == "all-gather"]
    assert len(gathered) == 2  # each updated weight is gathered once, where it is used whole
    found = collectives(hlo_of(closed, plan, args))
    # The step reduce-scatters the two gradients in one collective (a shard of each); the two
    # updated weights are gathered after the update, in one buffer; the loss's scalar sum.
    assert sorted(found) == [("all-gather", 2 * 128 * 512 * 4), ("all-reduce", 4),
                             ("reduce-scatter", 2 * 128 * 512 * 4 // 8)]
    assert_close(run_plan(closed, plan, args), [jax.jit(MLP_STEP)(*args)])
