"""ShardParallel(num_micro_batches=k) runs the plan it costed inside the micro-batch loop
(issue 21 item 1): each device computes its own B/(k*n) rows, the loop holds the collectives
the plan predicts, and the audit agrees with the prediction."""

import jax
import jax.numpy as jnp
import numpy as np
from tests.hlo import dot_shapes, loop_computations

import autoshard
from autoshard.sharding.hlo import collectives

B, L, V, D, K = 32, 8, 128, 32, 4


def _step(p, tokens):
    def loss_fn(p):
        h = p["emb"][tokens]
        h = h + jax.nn.gelu(h @ p["w1"]) @ p["w2"]
        logits = h @ p["out"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], -1))
    loss, g = autoshard.value_and_grad(loss_fn)(p)
    return jax.tree.map(lambda a, b: a - 1e-2 * b, p, g), loss


def _inputs():
    k = jax.random.split(jax.random.key(0), 5)
    p = {"emb": jax.random.normal(k[0], (V, D)) * .05, "w1": jax.random.normal(k[1], (D, 4 * D)) * .05,
         "w2": jax.random.normal(k[2], (4 * D, D)) * .05, "out": jax.random.normal(k[3], (D, V)) * .05}
    return p, jax.random.randint(k[4], (B, L), 0, V)


def test_loop_runs_each_device_on_its_rows_and_matches_jit():
    p, tokens = _inputs()
    f = autoshard.parallelize(_step, method=autoshard.ShardParallel(num_micro_batches=K))
    ref = jax.jit(_step)
    p_got, p_ref = p, p
    for _ in range(3):
        p_got, loss = f(p_got, tokens)
        p_ref, loss_ref = ref(p_ref, tokens)
        np.testing.assert_allclose(loss, loss_ref, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), p_got, p_ref)

    ex = f.get_last_executable()
    n = len(jax.devices())
    text = ex.get_hlo_text()
    loops = loop_computations(text)
    assert loops, "the accumulated step has no loop"
    weights = {f"f32[{a},{b}]" for a, b in [(V, D), (D, V), (D, 4 * D), (4 * D, D)]}
    rows = [s for s in dot_shapes(text, loops) if s not in weights]
    assert rows, dot_shapes(text, loops)
    # every activation dot in the loop: this device's B/(k*n) sequences of L tokens
    assert {int(s.split("[")[1].split(",")[0]) for s in rows} == {B // (K * n) * L}, rows
    # the plan is data parallel: no collective runs inside the loop, and none is predicted
    # to run k times; the gradients are reduced once, as predicted
    in_loop = [c for c in collectives(text) if c.in_loop]
    assert in_loop == []
    assert all(c.count < K for c in ex.plan.collectives), ex.plan.collectives
    audit = ex.audit()
    assert 0.9 <= audit.bytes_ratio() <= 1.1, str(audit)
    assert audit.memory_ratio() <= 1.1, str(audit)


def test_loop_follows_a_plan_that_does_not_split_the_rows():
    """Micro-batches of 2 rows on 8 devices: the plan splits the model instead; the loop runs
    it (before, every device computed the whole micro-batch, 0 collectives compiled against
    the plan's prediction)."""
    p, tokens = _inputs()
    tokens = tokens[:8]
    f = autoshard.parallelize(_step, method=autoshard.ShardParallel(num_micro_batches=K))
    p_got, loss = f(p, tokens)
    p_ref, loss_ref = jax.jit(_step)(p, tokens)
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), p_got, p_ref)
    ex = f.get_last_executable()
    spec = ex.plan.in_specs[-1]
    assert not (len(spec) and spec[0]), ex.plan.explain()  # the rows are not split
    text = ex.get_hlo_text()
    assert any(c.in_loop for c in collectives(text)), "the loop ignores the plan"
    audit = ex.audit()
    assert not audit.divergences(), str(audit)


def test_tied_embedding_gradients_are_predicted_as_one_reduction():
    """Issue 21 repro A (tied embeddings): the two partial gradients of the embedding add up
    on each device before their one reduction, and the prediction counts it once."""
    def step(p, tokens):
        def loss_fn(p):
            h = p["emb"][tokens]
            h = h + jax.nn.gelu(h @ p["w1"]) @ p["w2"]
            logits = h @ p["emb"].T
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None],
                                                 -1))
        loss, g = autoshard.value_and_grad(loss_fn)(p)
        return jax.tree.map(lambda a, b: a - 1e-2 * b, p, g), loss
    p, tokens = _inputs()
    del p["out"]
    f = autoshard.parallelize(step, method=autoshard.ShardParallel(num_micro_batches=K))
    p_got, loss = f(p, tokens)
    p_ref, loss_ref = jax.jit(step)(p, tokens)
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), p_got, p_ref)
    audit = f.get_last_executable().audit()
    assert 0.9 <= audit.bytes_ratio() <= 1.1, str(audit)



def test_the_whole_loop_variant_skips_meshes_the_deferred_bounds_rule_out(monkeypatch):
    """When the deferred plan does not split the rows over every axis, the loop's other
    variants are planned (methods/_auto.plan_program). The whole-loop variant's costs are
    the deferred one's or more on every mesh, so a mesh whose deferred bound reaches the best
    found is not searched again; the plan is the one found searching every mesh."""
    from autoshard.methods import _auto
    from autoshard.sharding import planner

    p, tokens = _inputs()
    args = (jax.eval_shape(lambda: p), jax.ShapeDtypeStruct(tokens.shape, tokens.dtype))
    cluster = autoshard.Cluster.a100_80gb(num_hosts=1, devices_per_host=8)
    method = autoshard.ShardParallel(num_micro_batches=K, auto_sharding_option=(
        autoshard.AutoShardingOption(show_progress=False, memory_tradeoff=0.0)))
    real_runs, real_plan = _auto._loop_runs, planner.plan_auto
    monkeypatch.setattr("autoshard.sharding.solver.CUTOFF_MIN_COLUMNS", 0)  # LP bounds here too
    calls, made, keep = [], [], [True]

    def spy(closed, **kw):
        calls.append(kw)
        made.append(real_plan(closed, **(kw if keep[0] else {**kw, "skip_meshes": None})))
        return made[-1]
    # the deferred plan (the first made) is read as one the loop cannot run per device
    monkeypatch.setattr(_auto, "_loop_runs", lambda plan, program: None if plan is made[0]
                        else real_runs(plan, program))
    monkeypatch.setattr("autoshard.sharding.plan_auto", spy)
    got = autoshard.plan(_step, *args, cluster=cluster, method=method, batch_argnums=(1,))
    assert len(calls) == 3, calls   # deferred, rows split on (8,), whole loop
    skips = calls[2]["skip_meshes"]
    assert skips and all("with the reductions deferred" in why for why in skips.values())
    assert set(skips) <= set(calls[0]["mesh_bounds"])
    keep[0], calls[:], made[:] = False, [], []
    full = autoshard.plan(_step, *args, cluster=cluster, method=method, batch_argnums=(1,))
    assert got.mesh_shape == full.mesh_shape and got.in_specs == full.in_specs
    assert got.objective.total_s == full.objective.total_s
