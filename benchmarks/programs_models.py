"""Four small training programs in the style of public Flax examples, written here.

Each is what a user brings to autoshard unchanged: a Flax model, an optax optimizer, a
``TrainState`` and a train step ``step(state, batch, rng) -> (state, metrics)`` whose gradient
comes from ``autoshard.value_and_grad(loss_fn, has_aux=True)``.

* ``lm``: a decoder-only Transformer language model (flax's lm1b example): token and learned
  position embeddings, pre-LN decoder blocks (causal self-attention without biases, as
  lm1b's, MLP), dropout, Adam.
  ``loss_fn`` returns the logits as aux; the metrics (summed loss, summed accuracy, the
  denominator) are computed AFTER the gradient from those logits and the batch.
  ``lm_marked`` is the same program with ``autoshard.mark_pipeline_boundary()`` between blocks.
* ``resnet``: a ResNet with BatchNorm (flax's imagenet example, on 8x8 images): conv stem,
  max pool, two residual blocks, average pool, classifier, SGD with Nesterov momentum, L2
  weight penalty. ``BatchNorm(use_running_average=False)`` updates ``batch_stats``, returned in
  aux with the logits and stored in the state; accuracy and loss after the gradient.
* ``lstm``: a bidirectional LSTM classifier (flax's SST-2 example): ``nn.scan`` over an
  ``OptimizedLSTMCell`` both ways (the backward pass on sequences reversed within their
  lengths), MLP attention over the valid positions, one binary logit. Aux holds integer metrics
  as SST-2's do: ``count = logits.shape[0]`` (a Python int) and ``correct`` (``jnp.sum``, int32).
* ``gpt``: a nanoGPT-style GPT: tied embeddings (``logits = h @ wte.T``), fused q/k/v
  projection, GELU MLP, no biases (nanoGPT's ``bias=False``), dropout, AdamW. Aux holds a
  mean-type float (token accuracy).

Attention has no key bias: its gradient is zero in exact arithmetic (a constant added to every
key of a query cancels in the softmax), so Adam would turn rounding noise in it into full-size
updates and the parameters of two correct runs would differ by the learning rate.

Data is synthetic and fixed by a seed. Tokens are drawn from 1..vocab-1 so the LM has no
padding: every micro-batch then has the same number of counted tokens and the mean of
micro-batch means is the batch mean (with padding it would not be, under any method).

``dropout`` is the dropout rate; 0 (the default of the benchmark) makes every dropout layer
deterministic, so an accumulated step can be compared with ``jax.jit`` exactly (micro-batches
fold their index into the random key and so draw other masks than one whole-batch step).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

import autoshard

SIZES = {
    "quick": {
        "lm": dict(batch=32, seq=8, vocab=32, dim=16, heads=2, mlp=32, layers=2),
        "resnet": dict(batch=32, image=8, channels=4, classes=4),
        "lstm": dict(batch=32, seq=6, vocab=32, dim=8, hidden=8),
        "gpt": dict(batch=32, seq=8, vocab=32, dim=16, heads=2, layers=2),
    },
    "default": {
        "lm": dict(batch=64, seq=32, vocab=128, dim=64, heads=4, mlp=256, layers=2),
        "resnet": dict(batch=64, image=8, channels=16, classes=10),
        "lstm": dict(batch=64, seq=16, vocab=128, dim=32, hidden=32),
        "gpt": dict(batch=64, seq=32, vocab=128, dim=64, heads=4, layers=2),
    },
    "large": {  # 4x default's rows: 8 rows per device in each of 4 micro-batches
        "lm": dict(batch=256, seq=32, vocab=128, dim=64, heads=4, mlp=256, layers=2),
        "resnet": dict(batch=256, image=8, channels=16, classes=10),
        "lstm": dict(batch=256, seq=16, vocab=128, dim=32, hidden=32),
        "gpt": dict(batch=256, seq=32, vocab=128, dim=64, heads=4, layers=2),
    },
    "xlarge": {  # compute-bound steps: 16-64 rows per device in each of 4 micro-batches
        "lm": dict(batch=512, seq=64, vocab=128, dim=64, heads=4, mlp=256, layers=2),
        "resnet": dict(batch=512, image=16, channels=16, classes=10),
        "lstm": dict(batch=2048, seq=16, vocab=128, dim=32, hidden=32),
        "gpt": dict(batch=512, seq=64, vocab=128, dim=64, heads=4, layers=2),
    },
}


class StatsState(TrainState):
    """A TrainState that also carries BatchNorm's running statistics (as flax's imagenet)."""

    batch_stats: Any = None


@dataclass(frozen=True, kw_only=True)
class Program:
    """A model, its initial state and batch, and its train step."""

    name: str
    """Short name used in the results."""
    description: str
    """One line for the report."""
    state: Any
    """Initial train state, leaves on the host (numpy): each run places its own copy."""
    batch: dict
    """One batch of host arrays (dim 0 is the batch)."""
    step: Callable
    """``step(state, batch, rng) -> (state, metrics)``."""
    has_markers: bool = False
    """Whether the step calls ``autoshard.mark_pipeline_boundary()`` (a manual layer split)."""
    micro_batch_reference: Callable[[int], Callable] | None = None
    """``k -> step`` of plain JAX applying the documented micro-batch rule, for programs whose
    accumulated step differs from the whole-batch step by design (BatchNorm); None: the
    whole-batch ``jax.jit`` step is the reference for every k."""
    rule: str = ""
    """The micro-batch rule that reference applies, for the report."""
    hand_loop: Callable[[int], Callable] | None = None
    """``k -> step`` of plain JAX looping over ``k`` micro-batches, what a user writes without
    autoshard (timed beside the cells); None: not timed for this program."""
    state_fields: tuple[str, ...] = field(default=("params",))
    """State fields compared with the reference."""


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def _create(model_params, tx, **extra):
    """A TrainState whose step counter is an int32 array, so every step has one signature."""
    cls = StatsState if extra else TrainState
    state = cls.create(apply_fn=None, params=model_params, tx=tx, **extra)
    return _host(state.replace(step=jnp.zeros((), jnp.int32)))


def _micro_batches(batch, k: int):
    """``batch`` as ``k`` micro-batches stacked on a new dim 0: micro-batch j is rows j, j+k,
    ... (each device's block of rows gives every micro-batch its share: no rows move)."""
    return jax.tree.map(
        lambda a: jnp.swapaxes(a.reshape((a.shape[0] // k, k) + a.shape[1:]), 0, 1), batch)


def _cross_entropy(logits, labels):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1)[..., 0]


# Transformer LM (lm1b-like) ---------------------------------------------------------------------
class DecoderBlock(nn.Module):
    heads: int
    mlp: int
    dropout: float

    @nn.compact
    def __call__(self, x, mask):
        deterministic = self.dropout == 0
        y = nn.LayerNorm()(x)
        y = nn.MultiHeadDotProductAttention(num_heads=self.heads, dropout_rate=self.dropout,
                                            deterministic=deterministic, use_bias=False)(
            y, mask=mask)
        x = x + nn.Dropout(self.dropout)(y, deterministic=deterministic)
        z = nn.LayerNorm()(x)
        z = nn.Dense(x.shape[-1])(nn.relu(nn.Dense(self.mlp)(z)))
        return x + nn.Dropout(self.dropout)(z, deterministic=deterministic)


class TransformerLM(nn.Module):
    vocab: int
    seq: int
    dim: int
    heads: int
    mlp: int
    layers: int
    dropout: float = 0.0
    markers: bool = False

    @nn.compact
    def __call__(self, tokens):
        inputs = jnp.pad(tokens, ((0, 0), (1, 0)))[:, :-1]      # shift right: predict token t
        h = nn.Embed(self.vocab, self.dim)(inputs)
        h = h + self.param("pos", nn.initializers.normal(0.02), (self.seq, self.dim))
        h = nn.Dropout(self.dropout)(h, deterministic=self.dropout == 0)
        mask = nn.make_causal_mask(tokens)
        for i in range(self.layers):
            if self.markers and i > 0:
                autoshard.mark_pipeline_boundary()
            h = DecoderBlock(self.heads, self.mlp, self.dropout)(h, mask)
        return nn.Dense(self.vocab)(nn.LayerNorm()(h))


def make_lm(size: dict, dropout: float, *, markers: bool = False, seed: int = 0) -> Program:
    model = TransformerLM(**size_without(size, "batch"), dropout=dropout, markers=markers)
    k_init, k_data = jax.random.split(jax.random.PRNGKey(seed))
    tokens = jax.random.randint(k_data, (size["batch"], size["seq"]), 1, size["vocab"])
    params = model.init({"params": k_init}, tokens[:1])["params"]
    state = _create(params, optax.sgd(0.1, momentum=0.9))  # Adam: see programs.py's report

    def step(state, batch, rng):
        tokens = batch["tokens"]
        weights = (tokens > 0).astype(jnp.float32)
        rng = jax.random.fold_in(rng, state.step)

        def loss_fn(params):
            logits = model.apply({"params": params}, tokens, rngs={"dropout": rng})
            loss = jnp.sum(_cross_entropy(logits, tokens) * weights)
            return loss / jnp.sum(weights), logits

        (loss, logits), grads = autoshard.value_and_grad(loss_fn, has_aux=True)(state.params)
        metrics = {"loss": loss,            # after the gradient, from the aux logits
                   "loss_sum": jnp.sum(_cross_entropy(logits, tokens) * weights),
                   "accuracy_sum": jnp.sum((jnp.argmax(logits, -1) == tokens) * weights),
                   "denominator": jnp.sum(weights)}
        return state.apply_gradients(grads=grads), metrics

    def hand_loop(k: int) -> Callable:
        """Plain JAX: micro-batch j is rows j, j+k, ...; each micro-batch's loss is its
        weighted sum over the whole batch's weights, so the gradients and the loss are sums
        over micro-batches, and so are the metrics."""
        def loop_step(state, batch, rng):
            rng = jax.random.fold_in(rng, state.step)
            total = jnp.sum((batch["tokens"] > 0).astype(jnp.float32))

            def one(mb):
                tokens = mb["tokens"]
                weights = (tokens > 0).astype(jnp.float32)

                def loss_fn(params):
                    logits = model.apply({"params": params}, tokens, rngs={"dropout": rng})
                    return jnp.sum(_cross_entropy(logits, tokens) * weights) / total, logits

                (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                    state.params)
                return loss, jnp.sum((jnp.argmax(logits, -1) == tokens) * weights), grads

            losses, correct, grads = jax.lax.map(one, _micro_batches(batch, k))
            loss = jnp.sum(losses)
            metrics = {"loss": loss, "loss_sum": loss * total,
                       "accuracy_sum": jnp.sum(correct), "denominator": total}
            return state.apply_gradients(grads=jax.tree.map(
                lambda g: jnp.sum(g, axis=0), grads)), metrics
        return loop_step

    name = "lm_marked" if markers else "lm"
    what = ("Transformer LM, pipeline markers between blocks" if markers
            else "Transformer LM (lm1b-like), metrics after the gradient")
    return Program(name=name, description=what, state=state,
                   batch={"tokens": np.asarray(tokens)}, step=step, has_markers=markers,
                   hand_loop=hand_loop)


# ResNet with BatchNorm (imagenet-like) ----------------------------------------------------------
class ResidualBlock(nn.Module):
    filters: int
    strides: int = 1

    @nn.compact
    def __call__(self, x):
        norm = functools.partial(nn.BatchNorm, use_running_average=False, momentum=0.9,
                                 epsilon=1e-5)
        s = (self.strides, self.strides)
        y = nn.relu(norm()(nn.Conv(self.filters, (3, 3), s, use_bias=False)(x)))
        y = norm(scale_init=nn.initializers.zeros)(
            nn.Conv(self.filters, (3, 3), use_bias=False)(y))
        if x.shape != y.shape:
            x = norm()(nn.Conv(self.filters, (1, 1), s, use_bias=False, name="proj")(x))
        return nn.relu(x + y)


class ResNet(nn.Module):
    channels: int
    classes: int

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(self.channels, (3, 3), use_bias=False, name="stem")(x)
        x = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9, epsilon=1e-5)(x))
        x = nn.max_pool(x, (3, 3), strides=(1, 1), padding="SAME")
        x = ResidualBlock(self.channels)(x)
        x = ResidualBlock(2 * self.channels, strides=2)(x)
        x = nn.avg_pool(x, x.shape[1:3])[:, 0, 0]
        return nn.Dense(self.classes)(x)


def make_resnet(size: dict, dropout: float, *, seed: int = 0) -> Program:
    del dropout  # the imagenet ResNet has none
    model = ResNet(size["channels"], size["classes"])
    k_init, k_x, k_y = jax.random.split(jax.random.PRNGKey(seed), 3)
    b, n = size["batch"], size["image"]
    images = jax.random.normal(k_x, (b, n, n, 3))
    labels = jax.random.randint(k_y, (b,), 0, size["classes"])
    variables = model.init(k_init, images[:2])
    state = _create(variables["params"], optax.sgd(0.05, momentum=0.9, nesterov=True),
                    batch_stats=variables["batch_stats"])

    def loss_fn_of(state, batch):
        def loss_fn(params):
            logits, updates = model.apply(
                {"params": params, "batch_stats": state.batch_stats}, batch["image"],
                mutable=["batch_stats"])
            penalty = sum(jnp.sum(w ** 2) for w in jax.tree.leaves(params) if w.ndim > 1)
            loss = jnp.mean(_cross_entropy(logits, batch["label"])) + 0.5e-4 * penalty
            return loss, (updates, logits)
        return loss_fn

    def finish(state, batch, loss, batch_stats, logits, grads):
        metrics = {"loss": loss,
                   "cross_entropy": jnp.mean(_cross_entropy(logits, batch["label"])),
                   "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"])}
        return state.apply_gradients(grads=grads, batch_stats=batch_stats), metrics

    def step(state, batch, rng):
        del rng
        (loss, (updates, logits)), grads = autoshard.value_and_grad(
            loss_fn_of(state, batch), has_aux=True)(state.params)
        return finish(state, batch, loss, updates["batch_stats"], logits, grads)

    def micro_batch_reference(k: int) -> Callable:
        """Plain JAX: micro-batch j is rows j, j+k, ...; loss and gradients are the mean over
        micro-batches, the new running statistics the mean of each micro-batch's update, the
        logits each row's own (from its micro-batch's forward)."""
        def ref_step(state, batch, rng):
            del rng
            micro = _micro_batches(batch, k)

            def one(mb):
                (loss, (updates, logits)), grads = jax.value_and_grad(
                    loss_fn_of(state, mb), has_aux=True)(state.params)
                return loss, updates["batch_stats"], logits, grads

            losses, stats, logits, grads = jax.lax.map(one, micro)
            mean = functools.partial(jnp.mean, axis=0)
            logits = jnp.swapaxes(logits, 0, 1).reshape((-1,) + logits.shape[2:])
            return finish(state, batch, mean(losses), jax.tree.map(mean, stats), logits,
                          jax.tree.map(mean, grads))
        return ref_step

    return Program(name="resnet", description="ResNet with BatchNorm (imagenet-like), 8x8 "
                   "images, batch_stats in aux and state", state=state,
                   batch={"image": np.asarray(images), "label": np.asarray(labels)}, step=step,
                   micro_batch_reference=micro_batch_reference, hand_loop=micro_batch_reference,
                   rule="rule: mean of micro-batch statistics (BatchNorm normalises each "
                        "micro-batch by its own statistics, so loss, metrics and parameters "
                        "follow the micro-batched reference too)",
                   state_fields=("params", "batch_stats"))


# Bidirectional LSTM classifier (sst2-like) ------------------------------------------------------
def _reverse_within(x, lengths):
    """Reverse each sequence's first ``lengths[b]`` steps (padding stays at the end)."""
    t = jnp.arange(x.shape[1])[None, :]
    idx = jnp.where(t < lengths[:, None], lengths[:, None] - 1 - t, t)
    return jnp.take_along_axis(x, idx[:, :, None], axis=1)


class ScannedLSTM(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x):
        lstm = nn.scan(nn.OptimizedLSTMCell, variable_broadcast="params",
                       split_rngs={"params": False}, in_axes=1, out_axes=1)
        zeros = jnp.zeros((x.shape[0], self.hidden), x.dtype)
        _, outputs = lstm(self.hidden, name="cell")((zeros, zeros), x)
        return outputs


class LSTMClassifier(nn.Module):
    vocab: int
    dim: int
    hidden: int
    dropout: float = 0.0

    @nn.compact
    def __call__(self, tokens, lengths):
        x = nn.Embed(self.vocab, self.dim)(tokens)
        x = nn.Dropout(self.dropout)(x, deterministic=self.dropout == 0)
        forward = ScannedLSTM(self.hidden, name="forward")(x)
        backward = _reverse_within(ScannedLSTM(self.hidden, name="backward")(
            _reverse_within(x, lengths)), lengths)
        h = jnp.concatenate([forward, backward], -1)
        valid = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
        scores = nn.Dense(1, use_bias=False)(nn.tanh(nn.Dense(self.hidden)(h)))[..., 0]
        weights = jax.nn.softmax(jnp.where(valid, scores, -1e9), axis=-1)
        pooled = jnp.einsum("bt,btd->bd", weights, h)
        pooled = nn.Dropout(self.dropout)(pooled, deterministic=self.dropout == 0)
        return nn.Dense(1)(nn.relu(nn.Dense(self.hidden)(pooled)))


def make_lstm(size: dict, dropout: float, *, seed: int = 0) -> Program:
    model = LSTMClassifier(size["vocab"], size["dim"], size["hidden"], dropout)
    k_init, k_t, k_l, k_y = jax.random.split(jax.random.PRNGKey(seed), 4)
    b, t = size["batch"], size["seq"]
    tokens = jax.random.randint(k_t, (b, t), 1, size["vocab"])
    lengths = jax.random.randint(k_l, (b,), t // 2, t + 1)
    tokens = jnp.where(jnp.arange(t)[None, :] < lengths[:, None], tokens, 0)
    labels = jax.random.randint(k_y, (b,), 0, 2)
    params = model.init({"params": k_init}, tokens[:2], lengths[:2])["params"]
    tx = optax.chain(optax.sgd(0.1, momentum=0.9), optax.add_decayed_weights(1e-4))
    state = _create(params, tx)

    def step(state, batch, rng):
        rng = jax.random.fold_in(rng, state.step)

        def loss_fn(params):
            logits = model.apply({"params": params}, batch["tokens"], batch["length"],
                                 rngs={"dropout": rng})
            labels = batch["label"][:, None].astype(jnp.float32)
            losses = optax.sigmoid_binary_cross_entropy(logits, labels)
            correct = jnp.sum((logits >= 0) == (labels > 0))
            return jnp.mean(losses), {"loss_sum": jnp.sum(losses), "correct": correct,
                                      "count": logits.shape[0]}

        (loss, aux), grads = autoshard.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss, **aux}

    def hand_loop(k: int) -> Callable:
        """Plain JAX: micro-batch j is rows j, j+k, ...; the loss and gradients are the mean
        over micro-batches, the sums and counts their sum (what the accumulated step returns)."""
        def loop_step(state, batch, rng):
            rng = jax.random.fold_in(rng, state.step)
            micro = _micro_batches(batch, k)

            def one(mb):
                def loss_fn(params):
                    logits = model.apply({"params": params}, mb["tokens"], mb["length"],
                                         rngs={"dropout": rng})
                    labels = mb["label"][:, None].astype(jnp.float32)
                    losses = optax.sigmoid_binary_cross_entropy(logits, labels)
                    return jnp.mean(losses), (jnp.sum(losses),
                                              jnp.sum((logits >= 0) == (labels > 0)))
                return jax.value_and_grad(loss_fn, has_aux=True)(state.params)

            (losses, (sums, correct)), grads = jax.lax.map(one, micro)
            metrics = {"loss": jnp.mean(losses), "loss_sum": jnp.sum(sums),
                       "correct": jnp.sum(correct), "count": b}
            return state.apply_gradients(grads=jax.tree.map(
                lambda g: jnp.mean(g, axis=0), grads)), metrics
        return loop_step

    return Program(name="lstm", description="bidirectional LSTM with nn.scan (sst2-like), "
                   "integer count and correct in aux", state=state,
                   batch={"tokens": np.asarray(tokens), "length": np.asarray(lengths),
                          "label": np.asarray(labels)}, step=step, hand_loop=hand_loop)


# nanoGPT-style GPT with tied embeddings ---------------------------------------------------------
class CausalSelfAttention(nn.Module):
    heads: int
    dropout: float

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        deterministic = self.dropout == 0
        q, k, v = jnp.split(nn.Dense(3 * d, use_bias=False, name="c_attn")(x), 3, axis=-1)
        q, k, v = (a.reshape(b, t, self.heads, d // self.heads) for a in (q, k, v))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // self.heads)
        att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -jnp.inf)
        att = nn.Dropout(self.dropout)(jax.nn.softmax(att, -1), deterministic=deterministic)
        y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d)
        return nn.Dropout(self.dropout)(nn.Dense(d, use_bias=False, name="c_proj")(y),
                                        deterministic=deterministic)


class GPTBlock(nn.Module):
    heads: int
    dropout: float

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        x = x + CausalSelfAttention(self.heads, self.dropout)(
            nn.LayerNorm(use_bias=False, name="ln_1")(x))
        h = nn.Dense(4 * d, use_bias=False, name="c_fc")(
            nn.LayerNorm(use_bias=False, name="ln_2")(x))
        h = nn.Dropout(self.dropout)(nn.Dense(d, use_bias=False, name="c_proj")(nn.gelu(h)),
                                     deterministic=self.dropout == 0)
        return x + h


class GPT(nn.Module):
    vocab: int
    seq: int
    dim: int
    heads: int
    layers: int
    dropout: float = 0.0

    @nn.compact
    def __call__(self, idx):
        wte = nn.Embed(self.vocab, self.dim, embedding_init=nn.initializers.normal(0.02),
                       name="wte")
        wpe = nn.Embed(self.seq, self.dim, embedding_init=nn.initializers.normal(0.02),
                       name="wpe")
        x = wte(idx) + wpe(jnp.arange(idx.shape[1])[None])
        x = nn.Dropout(self.dropout)(x, deterministic=self.dropout == 0)
        for _ in range(self.layers):
            x = GPTBlock(self.heads, self.dropout)(x)
        return wte.attend(nn.LayerNorm(use_bias=False, name="ln_f")(x))   # tied: h @ wte.T


def make_gpt(size: dict, dropout: float, *, seed: int = 0) -> Program:
    model = GPT(**size_without(size, "batch"), dropout=dropout)
    k_init, k_data = jax.random.split(jax.random.PRNGKey(seed))
    data = jax.random.randint(k_data, (size["batch"], size["seq"] + 1), 0, size["vocab"])
    params = model.init({"params": k_init}, data[:1, :-1])["params"]
    state = _create(params, optax.adamw(1e-2, b1=0.9, b2=0.95, weight_decay=0.1))

    def step(state, batch, rng):
        rng = jax.random.fold_in(rng, state.step)

        def loss_fn(params):
            logits = model.apply({"params": params}, batch["idx"], rngs={"dropout": rng})
            loss = jnp.mean(_cross_entropy(logits, batch["targets"]))
            return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["targets"])}

        (loss, aux), grads = autoshard.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss, **aux}

    def hand_loop(k: int) -> Callable:
        """Plain JAX: micro-batch j is rows j, j+k, ...; loss, accuracy and gradients are the
        mean over micro-batches."""
        def loop_step(state, batch, rng):
            rng = jax.random.fold_in(rng, state.step)

            def one(mb):
                def loss_fn(params):
                    logits = model.apply({"params": params}, mb["idx"], rngs={"dropout": rng})
                    return jnp.mean(_cross_entropy(logits, mb["targets"])), jnp.mean(
                        jnp.argmax(logits, -1) == mb["targets"])
                return jax.value_and_grad(loss_fn, has_aux=True)(state.params)

            (losses, accuracy), grads = jax.lax.map(one, _micro_batches(batch, k))
            return state.apply_gradients(grads=jax.tree.map(
                lambda g: jnp.mean(g, axis=0), grads)), {"loss": jnp.mean(losses),
                                                         "accuracy": jnp.mean(accuracy)}
        return loop_step

    return Program(name="gpt", description="nanoGPT-style GPT, tied embeddings, AdamW, "
                   "mean accuracy in aux", state=state,
                   batch={"idx": np.asarray(data[:, :-1]), "targets": np.asarray(data[:, 1:])},
                   step=step, hand_loop=hand_loop)


def size_without(size: dict, *keys: str) -> dict:
    return {k: v for k, v in size.items() if k not in keys}


PROGRAMS = ("lm", "lm_marked", "resnet", "lstm", "gpt")


def make_program(name: str, size: str = "default", dropout: float = 0.0) -> Program:
    """The program ``name`` (one of ``PROGRAMS``) at ``size`` ("quick" or "default")."""
    if name not in PROGRAMS:
        raise ValueError(f"program {name!r} is not one of {', '.join(PROGRAMS)}.")
    shapes = SIZES[size]["lm" if name == "lm_marked" else name]
    if name in ("lm", "lm_marked"):
        return make_lm(shapes, dropout, markers=name == "lm_marked")
    return {"resnet": make_resnet, "lstm": make_lstm, "gpt": make_gpt}[name](shapes, dropout)
