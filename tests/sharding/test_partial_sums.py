"""Sums of partial sums reduced once (``sharding/partial_sums.py``): a tied embedding.

A tied word embedding's gradient is the sum of the LM head's product and the lookup's
scatter-add, each a partial sum over the batch axis. The plan keeps both partial, adds them on
local shards and reduces once: one all-reduce (or reduce-scatter) of the embedding gradient
instead of two. Ports the assertions of Alpa's ``tests/shard_parallel/test_bert.py``
``test_bert_mlm_data_parallel`` and ``test_bert_mlm_data_parallel_reduce_scatter`` on a tiny
tied-embedding LM (the same pattern, small enough for the CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.training.train_state import TrainState
from jax.sharding import Mesh

import autoshard
from autoshard.sharding import hlo, partial_sums

VOCAB, HIDDEN, BATCH, SEQ = 128, 16, 8, 4
EMBED_BYTES = VOCAB * HIDDEN * 4


class TiedLM(nn.Module):
    """Embedding lookup, one dense layer, the LM head through the same embedding."""

    scale_head: bool = False
    """Read the head through ``0.5 * embedding`` (a sum the planner does not fold)."""

    @nn.compact
    def __call__(self, ids):
        emb = nn.Embed(VOCAB, HIDDEN)
        x = jnp.tanh(nn.Dense(HIDDEN)(emb(ids)))
        if self.scale_head:
            return x @ (0.5 * emb.embedding).T
        return emb.attend(x)


def lm(tx="adam", scale_head=False, with_loss=True):
    model = TiedLM(scale_head)
    ids = (jnp.arange(BATCH * SEQ).reshape(BATCH, SEQ) * 7) % VOCAB
    labels = (ids * 3 + 1) % VOCAB
    opt = optax.adam(1e-2) if tx == "adam" else optax.sgd(0.1)
    state = TrainState.create(apply_fn=model.apply,
                              params=model.init(jax.random.PRNGKey(0), ids), tx=opt)

    def step(state, batch):
        def loss_fn(p):
            logits = state.apply_fn(p, batch["ids"])
            onehot = jax.nn.one_hot(batch["labels"], VOCAB)
            return -jnp.mean(jnp.sum(onehot * jax.nn.log_softmax(logits), -1))
        if not with_loss:  # as Alpa's tests: jax.grad, the state only
            return state.apply_gradients(grads=jax.grad(loss_fn)(state.params))
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return step, state, {"ids": ids, "labels": labels}


def mesh(shape):
    return Mesh(np.array(jax.devices()[:4]).reshape(shape), ("x", "y"))


def option(**kw):
    return autoshard.AutoShardingOption(show_progress=False, memory_tradeoff=0.0, **kw)


def compile_step(step, state, batch, shape=(4, 1), **kw):
    f = autoshard.parallelize(step, method=autoshard.ShardParallel(
        devices=mesh(shape), auto_sharding_option=option(**kw)))
    return f, f.get_executable(state, batch)


def run(f, state, batch, num_steps=3):
    losses = []
    for _ in range(num_steps):
        state, loss = f(state, batch)
        losses.append(float(loss))
    return state, losses


def embedding_reductions(ex) -> int:
    """How many f32[128,16] buffers the compiled step's all-reduces and reduce-scatters move
    (the embedding gradient's terms)."""
    return sum(c.shape.count(f"f32[{VOCAB},{HIDDEN}]") * c.count
               for c in hlo.collectives(ex.get_hlo_text())
               if c.kind in ("all-reduce", "reduce-scatter"))


def reduced_bytes(ex) -> int:
    return sum(c.num_bytes * c.count for c in hlo.collectives(ex.get_hlo_text())
               if c.kind in ("all-reduce", "reduce-scatter"))


@pytest.fixture
def without_partial_sums(monkeypatch):
    """Today's plan without the feature: no sum is folded."""
    def disable():
        monkeypatch.setattr(partial_sums, "MAX_JOINT_STRATEGIES", 0)
    return disable


@pytest.mark.parametrize("tx", ["sgd", "adam"])
@pytest.mark.parametrize("shape,kw", [((4, 1), {}), ((1, 4), {}), ((2, 2), {}),
                                      ((4, 1), {"prefer_reduce_scatter": True})])
def test_tied_embedding_matches_single_device(tx, shape, kw):
    step, state, batch = lm(tx)
    f, ex = compile_step(step, state, batch, shape, **kw)
    assert len(ex.plan.partial_sums) == 1
    want, want_losses = run(jax.jit(step), state, batch)  # first: the planned step donates
    got, got_losses = run(f, state, batch)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_tied_embedding_gradient_is_reduced_once(without_partial_sums):
    """One f32[128,16] reduced instead of two: 8,192 fewer all-reduced bytes per step."""
    step, state, batch = lm()
    _, ex = compile_step(step, state, batch)
    assert embedding_reductions(ex) == 1
    (ps,) = ex.plan.partial_sums
    assert ps.axes == ("x",) and len(ps.sources) == 2
    assert "dot_general" in ps.where and "scatter-add" in ps.where
    assert "partial sums reduced once over x" in ex.plan.explain()
    reductions = [c for c in ex.plan.collectives if c.kind == "all-reduce"
                  and c.num_bytes == EMBED_BYTES]
    assert len(reductions) == 1  # the plan expects what the step compiles
    after = reduced_bytes(ex)
    without_partial_sums()
    _, old = compile_step(step, state, batch)
    assert old.plan.partial_sums == () and embedding_reductions(old) == 2
    assert reduced_bytes(old) - after == EMBED_BYTES
    assert ex.plan.objective.communication_s < old.plan.objective.communication_s


def test_unhandled_sum_keeps_its_plan(without_partial_sums):
    """A head that reads ``0.5 * embedding`` puts a product between the LM head's gradient and
    the sum: not a layout op, so the sum is not folded and the plan is today's."""
    step, state, batch = lm(scale_head=True)
    _, ex = compile_step(step, state, batch)
    assert ex.plan.partial_sums == ()
    assert embedding_reductions(ex) == 2
    without_partial_sums()
    _, old = compile_step(step, state, batch)
    assert ex.plan.intermediates == old.plan.intermediates
    assert ex.plan.collectives == old.plan.collectives
    assert ex.plan.objective.total_s == old.plan.objective.total_s


def test_plan_with_partial_sums_saves_and_loads(tmp_path):
    step, state, batch = lm()
    f, ex = compile_step(step, state, batch)
    ex.plan.save(tmp_path / "plan.json")
    loaded = autoshard.ShardingPlan.load(tmp_path / "plan.json")
    assert loaded.partial_sums == ex.plan.partial_sums
    g = autoshard.parallelize(step, method=autoshard.ShardParallel(devices=mesh((4, 1)),
                                                                   plan=loaded))
    copy = jax.tree.map(jnp.copy, state)  # each planned step donates the state it gets
    want, _ = run(f, state, batch, num_steps=1)
    got, _ = run(g, copy, batch, num_steps=1)
    assert g.get_executable(copy, batch).plan.partial_sums == ex.plan.partial_sums
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# Ports of Alpa's test_bert.py MLM data-parallel tests (their assert_data_parallel_cost), on the
# tiny tied LM at the tests' batch and length (32 x 32 tokens) and their mesh costs (alpha =
# beta = 1 on both axes).

def alpa_all_reduce_cost(num_bytes, n=4):
    """Alpa's ``LogicalDeviceMesh.all_reduce_cost``: alpha + beta 2(n-1)/n bytes + 0.01."""
    return 1.0 + 2 * (n - 1) / n * num_bytes + 0.01


PENALTY = 4
"""Alpa's replicated-input penalty on these meshes: round(all_reduce_cost(1, 0) +
all_reduce_cost(1, 1)) with one device on one axis."""


def alpa_data_parallel_objective(state, num_sharded: int = 0) -> float:
    """What Alpa's ``assert_data_parallel_cost`` expects: one all-reduce per parameter (the
    tied embedding once) and a penalty per replicated parameter and optimizer state leaf. In
    autoshard's Alpa units the step counter, an input too, adds one penalty, the scalar sum
    the step reduces (the loss's, 4 bytes) its all-reduce, and each of ``num_sharded`` leaves
    held in shards saves its penalty (all within the upstream test's 1% tolerance)."""
    params = jax.tree.leaves(state.params)
    num_opt = len(jax.tree.leaves(state.opt_state))
    return (sum(alpa_all_reduce_cost(p.size * 4) for p in params) + alpa_all_reduce_cost(4)
            + PENALTY * (len(params) + num_opt + 1 - num_sharded))


def alpa_lm(monkeypatch):
    monkeypatch.setitem(globals(), "BATCH", 32)
    monkeypatch.setitem(globals(), "SEQ", 32)
    return lm(with_loss=False)


ALPA_COSTS = {"mesh_alpha": (1.0, 1.0), "mesh_beta": (1.0, 1.0)}


@pytest.mark.parametrize("shape", [(4, 1), (1, 4)])
def test_bert_mlm_data_parallel(shape, monkeypatch, without_partial_sums):
    """Covers test_bert.py::test_bert_mlm_data_parallel: Alpa's objective (each parameter's
    gradient all-reduced once, the tied embedding included) and one all-reduce in the step.
    Without partial sums the embedding's two terms cost one all-reduce of it more."""
    step, state, batch = alpa_lm(monkeypatch)
    _, ex = compile_step(step, state, batch, shape, **ALPA_COSTS)
    axis = "x" if shape[0] == 4 else "y"
    assert [ps.axes for ps in ex.plan.partial_sums] == [(axis,)]
    assert ex.auto_sharding_objective == pytest.approx(alpa_data_parallel_objective(state),
                                                       rel=1e-9)
    compiled = hlo.collectives(ex.get_hlo_text())
    assert [c.kind for c in compiled] == ["all-reduce"]
    assert embedding_reductions(ex) == 1
    without_partial_sums()
    _, old = compile_step(step, state, batch, shape, **ALPA_COSTS)
    assert old.auto_sharding_objective - ex.auto_sharding_objective == pytest.approx(
        alpa_all_reduce_cost(EMBED_BYTES), rel=1e-9)
    assert embedding_reductions(old) == 2


@pytest.mark.parametrize("shape", [(4, 1), (1, 4)])
def test_bert_mlm_data_parallel_reduce_scatter(shape, monkeypatch):
    """Covers test_bert.py::test_bert_mlm_data_parallel_reduce_scatter: the same objective (a
    reduce-scatter priced as the all-reduce it replaces, the all-gather after the update
    free), the gradients reduced in one collective and the updated parameters gathered in one.
    The embedding's gradient is reduce-scattered once, after its two terms are added, in the
    step's one reduce-scatter of every gradient (a quarter of the parameters' bytes: the
    embedding's counted once), so its Adam moments are held in shards (the upstream test
    allows them whole)."""
    step, state, batch = alpa_lm(monkeypatch)
    _, ex = compile_step(step, state, batch, shape, prefer_reduce_scatter=True, **ALPA_COSTS)
    axis = "x" if shape[0] == 4 else "y"
    (ps,) = ex.plan.partial_sums
    # a quarter of the vocabulary or of the hidden dim: the two cost the same
    P = jax.sharding.PartitionSpec
    assert ps.total_spec in (P(axis), P(None, axis))
    # Six moments held in shards: the kernel's, the bias's (its sum reduce-scattered with the
    # other gradients) and the tied embedding's mu and nu.
    assert ex.auto_sharding_objective == pytest.approx(
        alpa_data_parallel_objective(state, num_sharded=6), rel=1e-9)
    scattered = [c for c in ex.plan.collectives if c.kind == "reduce-scatter"
                 and c.num_bytes == EMBED_BYTES // 4]
    assert len(scattered) == 1 and not [c for c in ex.plan.collectives if c.kind in (
        "all-reduce", "reduce-scatter") and c.num_bytes == EMBED_BYTES]
    found = hlo.collectives(ex.get_hlo_text())
    assert sorted(c.kind for c in found) == ["all-gather", "reduce-scatter"]
    params = sum(p.size * 4 for p in jax.tree.leaves(state.params))
    assert [c.num_bytes for c in found if c.kind == "reduce-scatter"] == [params // 4]
    moments = [leaf for leaf in ex.plan.inputs if "embedding" in leaf.path
               and ("mu" in leaf.path or "nu" in leaf.path)]
    assert len(moments) == 2 and all(
        leaf.bytes_per_device(ex.plan.mesh_sizes) == EMBED_BYTES // 4 for leaf in moments)


def test_sharded_embedding_is_reduced_once(without_partial_sums):
    """The embedding held split over y (its hidden dim, as the caller gives it), the batch over
    x: each term is a partial sum over x of a y-split gradient; their sum is reduced once over
    x, one 64 x 16 block per device (4,096 B) fewer than with one all-reduce per term."""
    from _util import collectives, compile_plan

    from autoshard.sharding import plan_auto

    vocab, hidden = 64, 32

    def loss(emb, w, ids, labels):
        logits = jnp.tanh(emb[ids] @ w) @ emb.T
        return -jnp.mean(jnp.sum(jax.nn.one_hot(labels, vocab) * jax.nn.log_softmax(logits), -1))

    def grads(emb, w, ids, labels):
        return jax.grad(loss, argnums=(0, 1))(emb, w, ids, labels)

    key = jax.random.PRNGKey(0)
    ids = (jnp.arange(64).reshape(16, 4) * 7) % vocab
    args = (jax.random.normal(key, (vocab, hidden)),
            0.1 * jax.random.normal(key, (hidden, hidden)), ids, (ids * 3) % vocab)
    closed = jax.make_jaxpr(grads)(*args)
    P = jax.sharding.PartitionSpec

    def plan():
        return plan_auto(closed, num_devices=4, option=option(), axis_names=("x", "y"),
                         in_paths=["emb", "w", "ids", "labels"], out_paths=["d_emb", "d_w"],
                         batch_invars=[False, False, True, True],
                         fixed_in_specs=[P(None, "y"), None, P("x"), P("x")])

    def reduced(compiled):
        return sum(b for kind, b in collectives(compiled.lower(*args).compile().as_text())
                   if kind == "all-reduce")

    new = plan()
    assert new.mesh_shape == (2, 2)
    (ps,) = new.partial_sums
    assert ps.axes == ("x",) and ps.total_spec == P(None, "y")
    f = compile_plan(closed, new)
    for got, want in zip(f(*args), jax.jit(grads)(*args), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    without_partial_sums()
    old = plan()
    assert old.partial_sums == ()
    assert reduced(compile_plan(closed, old)) - reduced(f) == vocab * hidden // 2 * 4


def test_gradient_accumulation_keeps_each_micro_batch_exact():
    """With micro-batches the backward pass runs in the micro-batch loop (its sums are taken
    on each device and reduced once after it): no sum is folded there, and the step stays
    equal to jax.jit's (the accumulation's own single reduction is unchanged)."""
    model = TiedLM()
    ids = (jnp.arange(BATCH * SEQ).reshape(BATCH, SEQ) * 7) % VOCAB
    state = TrainState.create(apply_fn=model.apply, params=model.init(jax.random.PRNGKey(0), ids),
                              tx=optax.sgd(0.1))

    def step(state, batch, grad=jax.grad):
        def loss_fn(p):
            logits = state.apply_fn(p, batch["ids"])
            return -jnp.mean(jnp.sum(jax.nn.one_hot(batch["labels"], VOCAB)
                                     * jax.nn.log_softmax(logits), -1))
        return state.apply_gradients(grads=grad(loss_fn)(state.params))

    batch = {"ids": ids, "labels": (ids * 3 + 1) % VOCAB}
    want = jax.jit(step)(state, batch)
    f = autoshard.parallelize(lambda s, b: step(s, b, autoshard.grad),
                              method=autoshard.ShardParallel(
                                  devices=mesh((4, 1)), num_micro_batches=2,
                                  auto_sharding_option=option()))
    assert f.get_executable(state, batch).plan.partial_sums == ()
    got = f(state, batch)
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
