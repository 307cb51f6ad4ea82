"""Data parallelism with micro-batches never gathers the batch: every op of a per-device step
runs on each device's own rows (``_local.LocalEval``), checked against ``jax.jit``."""

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import autoshard
import hlo
from autoshard.sharding.hlo import computations as hlo_computations
from models import assert_trees_close

N = 8  # devices (conftest)


def sgd_step(grad_fn, loss_fn, lr=0.1):
    def step(params, batch):
        loss, grads = grad_fn(loss_fn)(params, batch)
        return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss
    return step


def run_against_jit(loss_fn, params, batch, k, steps=3, rtol=1e-5):
    """``steps`` SGD steps under DataParallel(num_micro_batches=k) equal jax.jit's full batch
    (a mean loss: the mean of the micro-batch means), with no warning; returns the function."""
    f = autoshard.parallelize(sgd_step(autoshard.value_and_grad, loss_fn),
                              method=autoshard.DataParallel(num_micro_batches=k))
    ref = jax.jit(sgd_step(jax.value_and_grad, loss_fn))
    p, q = params, params
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(steps):
            p, loss = f(p, batch)
            q, ref_loss = ref(q, batch)
            np.testing.assert_allclose(loss, ref_loss, rtol=rtol)
    assert_trees_close(p, q, rtol=rtol, atol=1e-6)
    return f


def compiled_collectives(f):
    return hlo.collectives(f.get_last_executable().get_hlo_text())


def assert_rows_stay_local(f, in_loop=()):
    """No all-gather anywhere, and nothing but ``in_loop`` communicated inside the loop."""
    found = compiled_collectives(f)
    assert [c for c in found if c.kind == "all-gather"] == []
    assert [(c.kind, c.shape) for c in found if c.in_loop] == list(in_loop)


def loop_conv_labels(text):
    """``dim_labels`` of every convolution run inside the micro-batch loop."""
    comps = hlo_computations(text)
    return [m.group(1) for name in hlo.loop_computations(text)
            for m in re.finditer(r" convolution\(.*?dim_labels=([\w>-]+)", comps.get(name, ""))]


def normal(seed, shape, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale, jnp.float32)


# Convolutions ---------------------------------------------------------------------------------
class Convs(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3), padding="SAME")(x))
        x = nn.relu(nn.Conv(8, (3, 3), strides=2, feature_group_count=2)(x))   # grouped
        x = nn.relu(nn.Conv(8, (3, 3), padding="SAME", feature_group_count=8)(x))  # depthwise
        x = nn.relu(nn.ConvTranspose(4, (2, 2), strides=(2, 2))(x))   # lhs-dilated
        x = nn.Conv(4, (1, 3), kernel_dilation=(1, 2))(x)   # rhs-dilated
        return nn.Dense(3)(x.mean((1, 2)))


@pytest.mark.parametrize("k", [2, 4])
def test_convolutions_run_on_each_devices_rows(k):
    model, x = Convs(), normal(0, (N * k * 2, 10, 10, 3))
    y = normal(1, (x.shape[0], 3))
    params = model.init(jax.random.key(0), x)

    def loss_fn(p, batch):
        return jnp.mean((model.apply(p, batch[0]) - batch[1]) ** 2)
    f = run_against_jit(loss_fn, params, (x, y), k)
    assert_rows_stay_local(f)
    # the first convolution of a micro-batch has B / (k * n) rows per device
    text = f.get_last_executable().get_hlo_text()
    assert "f32[2,10,10,8]" in text and f"f32[{x.shape[0] // k},10,10,8]" not in text


# Pooling --------------------------------------------------------------------------------------
def test_pooling_and_its_transposes_run_on_each_devices_rows():
    x, y = normal(2, (N * 4, 8, 8, 4)), normal(3, (N * 4, 4))
    params = {"w": normal(4, (4, 4), 0.5)}

    def loss_fn(p, batch):
        h = jnp.tanh(batch[0] @ p["w"])
        a = nn.max_pool(h, (2, 2), strides=(2, 2))                       # select_and_scatter_add
        b = nn.avg_pool(h, (3, 3), strides=(1, 1), padding="SAME")        # pad + window sum
        c = nn.pooling.pool(h, jnp.inf, lax.min, (2, 2), (2, 2), "VALID")   # window min
        d = jax.jvp(lambda t: nn.max_pool(t, (2, 2), strides=(2, 2)), (h,), (h * h,))[1]
        # the general reduce_window (two operands at once), on a value without gradient
        s, m = lax.reduce_window((lax.stop_gradient(h),) * 2, (0.0, -jnp.inf),
                                 lambda u, v: (u[0] + v[0], jnp.maximum(u[1], v[1])),
                                 (1, 2, 2, 1), (1, 1, 1, 1), "VALID")
        out = a.mean((1, 2)) + b.mean((1, 2)) + c.mean((1, 2)) + d.mean((1, 2)) + (
            s * m).mean((1, 2))
        return jnp.mean((out - batch[1]) ** 2)
    f = run_against_jit(loss_fn, params, (x, y), k=4)
    assert_rows_stay_local(f)


# BatchNorm: a ResNet-like block ---------------------------------------------------------------
class ResBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Conv(8, (3, 3), padding="SAME", use_bias=False)(x)
        h = nn.relu(nn.BatchNorm(use_running_average=False)(h))
        h = nn.Conv(8, (3, 3), padding="SAME", use_bias=False)(h)
        h = nn.BatchNorm(use_running_average=False)(h)
        h = nn.relu(h + nn.Conv(8, (1, 1))(x))
        h = nn.avg_pool(h, (2, 2), strides=(2, 2))
        return nn.Dense(4)(h.mean((1, 2)))


def resnet_loss(model):
    def loss_fn(params, batch_stats, x, y):
        logits, updates = model.apply({"params": params, "batch_stats": batch_stats}, x,
                                      mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, updates["batch_stats"]
    return loss_fn


def test_resnet_block_with_batch_norm_runs_on_each_devices_rows():
    k, batch = 4, N * 4 * 2
    model = ResBlock()
    x, y = normal(5, (batch, 8, 8, 3)), jnp.arange(batch) % 4
    variables = model.init(jax.random.key(0), x)
    loss_fn = resnet_loss(model)

    def step(params, batch_stats, batch):
        (loss, stats), g = autoshard.value_and_grad(loss_fn, has_aux=True)(
            params, batch_stats, *batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), stats, loss

    @jax.jit
    def reference(params, batch_stats, x, y):
        """k micro-batches (rows j, j + k, ...), each normalised by its own statistics."""
        losses, grads = [], []
        for j in range(k):
            (loss, _), g = jax.value_and_grad(loss_fn, has_aux=True)(
                params, batch_stats, x[j::k], y[j::k])
            losses.append(loss)
            grads.append(g)
        g = jax.tree.map(lambda *gs: sum(gs) / k, *grads)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), sum(losses) / k

    f = autoshard.parallelize(step, batch_argnums=(2,),
                              method=autoshard.DataParallel(num_micro_batches=k))
    p, stats = variables["params"], variables["batch_stats"]
    q = p
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            p, stats, loss = f(p, stats, (x, y))
            q, ref_loss = reference(q, variables["batch_stats"], x, y)
            np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_trees_close(p, q, rtol=1e-5, atol=1e-6)
    found = compiled_collectives(f)
    assert [c for c in found if c.kind == "all-gather"] == []
    # Inside the loop only the statistics of the whole micro-batch (per channel) travel:
    # one device's rows of an activation would be 2 x 8 x 8 x 8 floats.
    inside = [c for c in found if c.in_loop]
    assert inside and all(c.num_bytes <= 8 * 4 * 4 for c in inside), [c.shape for c in inside]
    # Every convolution left in the loop (forward, kernel and input gradients) is in the
    # canonical order: XLA:CPU runs others (a kernel gradient's) in a while body through a
    # naive loop, which made a ResNet step 12x slower than without micro-batches.
    labels = loop_conv_labels(f.get_last_executable().get_hlo_text())
    assert len(labels) >= 5 and set(labels) == {"b01f_01io->b01f"}, labels


# A tied embedding (scatter-add of its gradient) -----------------------------------------------
def test_tied_embedding_gradient_is_a_partial_scatter_add():
    vocab, dim, length = 32, 16, 6
    tokens = jnp.asarray(np.random.default_rng(6).integers(0, vocab, (N * 4, length)),
                         jnp.int32)
    params = {"emb": normal(7, (vocab, dim), 0.1), "w": normal(8, (dim, dim), 0.1)}

    def loss_fn(p, tokens):
        h = p["emb"][tokens]
        h = h + jnp.tanh(h @ p["w"])
        logp = jax.nn.log_softmax(h @ p["emb"].T)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[..., None], -1))
    f = run_against_jit(loss_fn, params, tokens, k=2)
    assert_rows_stay_local(f)


# Ops within a row: cumulative, sort, top-k, argmax, row-wise gathers and slices -------------
def test_ops_within_a_row_run_on_each_devices_rows():
    x, y = normal(9, (N * 4, 6)), normal(10, (N * 4, 3))
    params = {"w": normal(11, (6, 8), 0.5)}

    def loss_fn(p, batch):
        z = batch[0] @ p["w"]
        finite = jnp.all(jnp.isfinite(z), axis=0)          # reduce_and over the rows
        z = jnp.where(finite, z, 0.0)
        parts = [
            jnp.cumsum(z, 1), jnp.cumprod(jnp.tanh(z), 1), lax.cummax(z, 1),
            lax.cumlogsumexp(z, 1), jnp.sort(z, 1),
            jnp.take_along_axis(z, jnp.argsort(z, 1), 1),
            jnp.take_along_axis(z, jnp.argmax(z, 1)[:, None], 1),
            jnp.take_along_axis(z, jnp.ones((z.shape[0], 2), jnp.int32), 1),  # whole indices
            lax.top_k(z, 3)[0], z[:, jnp.array([5, 1, 1])], jnp.max(z, 1, keepdims=True),
            lax.dynamic_slice_in_dim(z, 2, 4, axis=1),
            lax.dynamic_update_slice_in_dim(z, z[:, :2] * 2, 3, axis=1),
            jnp.split(z, [3], axis=1)[1], z.at[:, 0].set(1.0), z.at[:, jnp.array([1, 1])].add(z[:, :2]),
            jnp.prod(1 + 0.1 * jnp.tanh(z), 1, keepdims=True),
        ]
        out = sum(q.mean(1, keepdims=True) for q in parts)
        return jnp.mean((out - batch[1]) ** 2)
    f = run_against_jit(loss_fn, params, (x, y), k=4)
    # the one value all devices combine in the loop: jnp.all over the rows, per column
    assert_rows_stay_local(f, in_loop=[("all-reduce", "s32[8]{0}")])


def test_an_op_along_the_rows_still_gathers_and_says_so():
    """Sorting along the rows needs every row: the one case that gathers (and warns)."""
    x = normal(12, (N * 2, 4))

    def loss_fn(w, x):
        return jnp.mean(jnp.sort(x @ w, axis=0)[-1] ** 2)
    f = autoshard.parallelize(sgd_step(autoshard.value_and_grad, loss_fn),
                              method=autoshard.DataParallel(num_micro_batches=2))
    with pytest.warns(RuntimeWarning, match="for sort"):
        f(jnp.ones((4, 2)), x)


# Loops ----------------------------------------------------------------------------------------
class ScanLSTM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(20, 8)(tokens)
        cell = nn.scan(nn.OptimizedLSTMCell, variable_broadcast="params",
                       split_rngs={"params": False}, in_axes=1, out_axes=1)(16)
        carry = cell.initialize_carry(jax.random.key(0), x[:, 0].shape)  # zeros of all rows
        _, ys = cell(carry, x)
        return nn.Dense(2)(ys.mean(1))


def test_an_lstm_scanned_over_time_runs_on_each_devices_rows():
    model = ScanLSTM()
    tokens = jnp.asarray(np.random.default_rng(13).integers(0, 20, (N * 4, 5)), jnp.int32)
    labels = jnp.arange(N * 4) % 2
    params = model.init(jax.random.key(0), tokens)

    def loss_fn(p, batch):
        logits = model.apply(p, batch[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()
    f = run_against_jit(loss_fn, params, (tokens, labels), k=2)
    assert_rows_stay_local(f)


def test_scans_whiles_and_conds_run_on_each_devices_rows():
    x, y = normal(14, (N * 4, 5, 3)), normal(15, (N * 4, 3))
    params = {"w": normal(16, (3, 3), 0.5), "u": normal(17, (3, 3), 0.5)}

    def loss_fn(p, batch):
        def over_time(carry, xt):   # carry: the rows' state, and a sum over the rows
            h, total = carry
            h = jnp.tanh(xt @ p["w"] + h @ p["u"])
            return (h, total + h.sum(0)), h * 2
        h0 = (jnp.zeros((batch[0].shape[0], 3)), jnp.zeros(3))
        (h, total), hs = lax.scan(over_time, h0, jnp.swapaxes(batch[0], 0, 1))
        per_row = lax.map(lambda r: jnp.sort(r @ p["w"], axis=0)[-1], batch[0])  # over rows
        twice = lax.fori_loop(0, 2, lambda i, c: jnp.tanh(c @ p["u"]) + c, h)  # a scan
        steps = lax.while_loop(lambda c: c[1] < 3, lambda c: (jnp.tanh(c[0]) + 1, c[1] + 1),
                               (lax.stop_gradient(h), 0))[0]   # rows in, rows out
        chosen = lax.cond(p["w"].sum() > 0, lambda h: h * 2, jnp.tanh, h)
        out = h + hs.mean(0) + per_row + twice + steps * h + chosen
        # (a sum over the rows enters linearly: micro-batches change nothing)
        return jnp.mean((out - batch[1]) ** 2) + 0.1 * jnp.sum(total) / batch[0].shape[0]
    f = run_against_jit(loss_fn, params, (x, y), k=2)
    assert_rows_stay_local(f)


# Sums of one group go together ---------------------------------------------------------------
class TwoNorms(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.BatchNorm(use_running_average=False)(nn.Dense(8)(x)))
        h = nn.BatchNorm(use_running_average=False)(nn.Dense(8)(h))
        return nn.Dense(4)(h)


@pytest.mark.parametrize("bundle", [True, False])
def test_batch_norm_statistics_take_one_reduction_each_way(monkeypatch, bundle):
    """The mean and the mean of squares of a BatchNorm are summed over the devices in one
    all-reduce (and the backward's pair in one): 4 reductions per micro-batch for two norms,
    not 6 (XLA combines only the backward's pairs by itself). Same numbers as jax.jit's micro-batch loop either way."""
    monkeypatch.setattr(autoshard.ir._local.LocalEval, "bundle_sums", bundle)
    k, batch = 2, N * 2 * 2
    model = TwoNorms()
    x, y = normal(7, (batch, 6)), jnp.arange(batch) % 4
    variables = model.init(jax.random.key(0), x)
    loss_fn = resnet_loss(model)

    def step(params, batch_stats, batch):
        (loss, _), g = autoshard.value_and_grad(loss_fn, has_aux=True, aux_reduction="mean")(
            params, batch_stats, *batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), loss

    @jax.jit
    def reference(params, batch_stats, x, y):
        (loss, _), g = jax.vmap(jax.value_and_grad(loss_fn, has_aux=True),
                                in_axes=(None, None, 0, 0))(
            params, batch_stats, x.reshape(-1, k, 6).swapaxes(0, 1),
            y.reshape(-1, k).swapaxes(0, 1))
        g = jax.tree.map(lambda g: g.mean(0), g)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), loss.mean()

    f = autoshard.parallelize(step, batch_argnums=(2,),
                              method=autoshard.DataParallel(num_micro_batches=k))
    p = q = variables["params"]
    for _ in range(3):
        p, loss = f(p, variables["batch_stats"], (x, y))
        q, ref_loss = reference(q, variables["batch_stats"], x, y)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_trees_close(p, q, rtol=1e-5, atol=1e-6)
    inside = [c for c in compiled_collectives(f) if c.in_loop]
    assert all(c.kind == "all-reduce" for c in inside)
    assert len(inside) == (4 if bundle else 6), [c.shape for c in inside]
