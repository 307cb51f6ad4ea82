"""Aux values under micro-batching (issue 21 item 3): an accumulated step returns what the
step returns on the whole batch, for every method, or fails naming the value."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard

B = 32


def _params():
    return {"w1": jax.random.normal(jax.random.key(0), (16, 32)) * 0.3,
            "w2": jax.random.normal(jax.random.key(1), (32, 4)) * 0.3}


def _batch():
    return {"x": jax.random.normal(jax.random.key(2), (B, 16)), "label": jnp.arange(B) % 4}


def metrics_step(p, batch):
    """Repro B: a mean loss, an int32 count from jnp.sum, a Python int from a shape, a mean
    metric, a sum, and a batch-independent value."""
    def loss_fn(p):
        h = jnp.tanh(batch["x"] @ p["w1"])
        autoshard.mark_pipeline_boundary()
        logits = h @ p["w2"]
        loss = jnp.mean((logits - 1.0) ** 2)
        correct = jnp.sum(jnp.argmax(logits, -1) == batch["label"])
        return loss, {"correct": correct, "count": logits.shape[0], "loss": loss,
                      "abs_sum": jnp.sum(jnp.abs(logits)), "w_norm": jnp.sum(p["w1"] ** 2),
                      "reg_loss": loss + 1e-3 * jnp.sum(p["w2"] ** 2)}
    (loss, m), g = autoshard.value_and_grad(loss_fn, has_aux=True)(p)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), loss, m


METHODS = {
    "ShardParallel": lambda: autoshard.ShardParallel(num_micro_batches=4),
    "DataParallel": lambda: autoshard.DataParallel(num_micro_batches=4),
    "Zero3Parallel": lambda: autoshard.Zero3Parallel(num_micro_batches=4),
    "PipeshardParallel": lambda: autoshard.PipeshardParallel(
        num_micro_batches=4, layer_option="manual",
        stage_option=autoshard.UniformStageOption(num_stages=2)),
}


@pytest.mark.parametrize("name", list(METHODS))
def test_metrics_equal_whole_batch_step(name):
    p, batch = _params(), _batch()
    ref = jax.jit(metrics_step)
    f = autoshard.parallelize(metrics_step, method=METHODS[name]())
    p_ref, p_got = p, p
    for _ in range(3):
        p_ref, loss_ref, m_ref = ref(p_ref, batch)
        p_got, loss_got, m_got = f(p_got, batch)
        np.testing.assert_allclose(loss_got, loss_ref, rtol=1e-5)
        assert int(m_got["correct"]) == int(m_ref["correct"])
        assert int(m_got["count"]) == B
        assert jnp.asarray(m_got["correct"]).dtype == jnp.asarray(m_ref["correct"]).dtype
        for key in ("loss", "abs_sum", "w_norm", "reg_loss"):
            np.testing.assert_allclose(m_got[key], m_ref[key], rtol=1e-5, err_msg=key)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                     p_got, p_ref)


def test_nonlinear_aux_is_an_error_naming_it():
    def step(p, batch):
        def loss_fn(p):
            logits = jnp.tanh(batch["x"] @ p["w1"]) @ p["w2"]
            loss = jnp.mean((logits - 1.0) ** 2)
            return loss, {"perplexity": jnp.exp(loss)}
        (loss, m), g = autoshard.value_and_grad(loss_fn, has_aux=True)(p)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), loss, m
    f = autoshard.parallelize(step, method=autoshard.DataParallel(num_micro_batches=4))
    with pytest.raises(ValueError, match=r"(?s)Marked value 1 .*float32\[scalar\].*"
                       r"returned as out\[2\]\['perplexity'\].*test_combine.py.*aux_reduction"):
        f(_params(), _batch())


def test_explicit_aux_reduction_overrides_the_rule():
    def step(p, batch):
        def loss_fn(p):
            logits = jnp.tanh(batch["x"] @ p["w1"]) @ p["w2"]
            loss = jnp.mean((logits - 1.0) ** 2)
            return loss, {"perplexity": jnp.exp(loss)}
        (loss, m), g = autoshard.value_and_grad(loss_fn, has_aux=True,
                                                aux_reduction="mean")(p)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), loss, m
    f = autoshard.parallelize(step, method=autoshard.DataParallel(num_micro_batches=4))
    _, loss, m = f(_params(), _batch())
    # the declared rule: the mean of the micro-batches' exp(loss), not exp of the mean
    assert float(m["perplexity"]) >= float(jnp.exp(loss)) - 1e-6


def after_grad_step(params, batch):
    """flax's pattern: padding weights from the batch outside the loss, logits as aux, metrics
    from them and the labels after value_and_grad, and a per-row output (logits.T)."""
    w = (batch["x"][:, 0] > 0).astype(jnp.float32)
    def loss_fn(p):
        h = jnp.tanh(batch["x"] @ p["w1"])
        autoshard.mark_pipeline_boundary()
        logits = h @ p["w2"]
        return jnp.mean((logits - batch["y"]) ** 2), logits
    (loss, logits), g = autoshard.value_and_grad(loss_fn, has_aux=True)(params)
    hit = jnp.argmax(logits, -1) == jnp.argmax(batch["y"], -1)
    acc = jnp.sum(hit * w) / jnp.sum(w)
    return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), loss, acc, logits.T


@pytest.mark.parametrize("name", list(METHODS))
def test_metrics_after_the_gradient_from_aux_logits_equal_jit(name):
    """Issue 21 items 3 and 4: the update after the gradient runs on the whole batch, with the
    micro-batches' logits joined in row order and batch-only values computed again."""
    p = _params()
    batch = {"x": jax.random.normal(jax.random.key(2), (B, 16)),
             "y": jax.random.normal(jax.random.key(3), (B, 4))}
    f = autoshard.parallelize(after_grad_step, method=METHODS[name]())
    ref = jax.jit(after_grad_step)
    p_got = p_ref = p
    for _ in range(3):
        p_got, *got = f(p_got, batch)
        p_ref, *want = ref(p_ref, batch)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 p_got, p_ref)


def test_random_value_skipping_the_marker_is_an_error_naming_it():
    def step(p, batch, key):
        noisy = batch["x"] + 0.1 * jax.random.normal(key, batch["x"].shape)
        def loss_fn(p):
            return jnp.mean((jnp.tanh(noisy @ p["w1"]) @ p["w2"]) ** 2)
        loss, g = autoshard.value_and_grad(loss_fn)(p)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), loss, jnp.mean(noisy)
    f = autoshard.parallelize(step, method=autoshard.DataParallel(num_micro_batches=4))
    with pytest.raises(ValueError, match=r"(?s)float32\[32,16\].*test_combine.py.*draws "
                       r"random numbers.*has_aux=True"):
        f(_params(), _batch(), jax.random.key(0))


def test_random_value_of_no_batch_data_used_after_the_gradient_equals_jit():
    """A value drawn from a key alone (not from the batch) is drawn again for the update."""
    def step(p, batch, key):
        keep = jax.random.bernoulli(key, 0.5, (batch["x"].shape[0],))
        def loss_fn(p):
            return jnp.mean((jnp.tanh(batch["x"] @ p["w1"]) @ p["w2"]) ** 2)
        loss, g = autoshard.value_and_grad(loss_fn)(p)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), loss, jnp.mean(keep)
    f = autoshard.parallelize(step, method=autoshard.DataParallel(num_micro_batches=4))
    got = f(_params(), _batch(), jax.random.key(0))
    want = jax.jit(step)(_params(), _batch(), jax.random.key(0))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_batch_stats_rule_mean_of_micro_batch_statistics():
    """BatchNorm-style running statistics stored back into the state: running mean exact,
    running variance the mean of the micro-batches' variances (documented rule)."""
    def step(state, batch):
        def loss_fn(w):
            x = batch["x"]
            mean = jnp.mean(x, axis=0)
            var = jnp.mean(x * x, axis=0) - mean * mean
            y = (x - mean) / jnp.sqrt(var + 1e-5)
            new_stats = {"mean": 0.9 * state["stats"]["mean"] + 0.1 * mean,
                         "var": 0.9 * state["stats"]["var"] + 0.1 * var}
            return jnp.mean((y @ w) ** 2), new_stats
        (loss, stats), g = autoshard.value_and_grad(loss_fn, has_aux=True)(state["w"])
        return {"w": state["w"] - 0.1 * g, "stats": stats}, loss
    state = {"w": jnp.ones((16, 4)) * 0.1,
             "stats": {"mean": jnp.zeros(16), "var": jnp.ones(16)}}
    x = jax.random.normal(jax.random.key(3), (B, 16)) * 2.0 + 1.0
    f = autoshard.parallelize(step, method=autoshard.DataParallel(num_micro_batches=4))
    new, _ = f(state, {"x": x})
    micro = x.reshape(B // 4, 4, 16).transpose(1, 0, 2)  # micro-batch j: rows j, j+4, ...
    means = micro.mean(axis=1)
    variances = (micro ** 2).mean(axis=1) - means ** 2
    np.testing.assert_allclose(new["stats"]["mean"], 0.1 * x.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new["stats"]["var"], 0.9 + 0.1 * variances.mean(0),
                               rtol=1e-5)
