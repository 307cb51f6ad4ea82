"""Benchmark models (Flax, synthetic data): GPT, MLP, GShard-style MoE, Wide-ResNet blocks.

Every model marks its activations with ``constrain(x, name)``. Outside a hand-written plan this
is the identity; inside ``activation_specs(mesh, rules)`` it pins the named activation with
``with_sharding_constraint``, the way an expert annotates a model for tensor parallelism.
Names: ``embed`` (the residual stream), ``heads`` (per-head q/k/v/context), ``mlp`` (the wide
hidden layer of a feed-forward block), ``conv`` (the hidden channels of a residual conv block),
``logits``, ``dispatched`` and ``expert`` (tokens dispatched to experts, (expert, batch,
capacity, dim), before and after they move to their experts' devices).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

_ACTIVE: list = []  # stack of (mesh, rules) set by activation_specs


@contextlib.contextmanager
def activation_specs(mesh, rules: dict[str, dict[int, str | tuple | None]]):
    """While tracing inside this block, ``constrain`` pins activations named in ``rules``.

    A rule maps a tensor dim (negative counts from the end) to a mesh axis, e.g. ``{0: "data",
    -1: "model"}``; dims a rule does not name, or whose size the axis does not divide, stay whole.
    """
    _ACTIVE.append((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.pop()


def constrain(x, name: str):
    if not _ACTIVE:
        return x
    mesh, rules = _ACTIVE[-1]
    rule = rules.get(name)
    if rule is None:
        return x
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
    entries = [None] * x.ndim
    for dim, axis in rule.items():
        if axis is None:
            continue
        axes = (axis,) if isinstance(axis, str) else tuple(axis)
        if x.shape[dim] % math.prod(sizes[a] for a in axes) == 0:
            entries[dim % x.ndim] = axis
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*entries)))


# Building blocks -------------------------------------------------------------------------------
class Attention(nn.Module):
    dim: int
    heads: int
    causal: bool = True

    @nn.compact
    def __call__(self, x):
        head_dim = self.dim // self.heads
        qkv = nn.DenseGeneral((3, self.heads, head_dim), name="qkv")(x)  # fused, as Megatron
        q, k, v = (constrain(qkv[:, :, i], "heads") for i in range(3))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head_dim).astype(np.float32)
        if self.causal:
            seq = x.shape[1]
            mask = jnp.tril(jnp.ones((seq, seq), bool))
            scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
        context = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        context = constrain(context, "heads")
        out = nn.DenseGeneral(self.dim, axis=(-2, -1), name="out")(context)
        return constrain(out, "embed")


class FeedForward(nn.Module):
    dim: int
    hidden: int

    @nn.compact
    def __call__(self, x):
        h = constrain(nn.gelu(nn.Dense(self.hidden, name="fc1")(x)), "mlp")
        return constrain(nn.Dense(self.dim, name="fc2")(h), "embed")


class MoEFeedForward(nn.Module):
    """GShard MoE layer: top-2 gating, expert capacity, dispatch/combine einsums.

    Each sequence is a group; tokens over capacity are dropped (their residual passes through).
    No auxiliary load-balancing loss (the benchmark measures the step, not the training curve).
    """

    dim: int
    hidden: int
    num_experts: int
    capacity_factor: float = 2.0

    @nn.compact
    def __call__(self, x):
        batch, seq, _ = x.shape
        e = self.num_experts
        capacity = max(1, math.ceil(2 * seq * self.capacity_factor / e))
        probs = jax.nn.softmax(nn.Dense(e, use_bias=False, name="gate")(x), axis=-1)
        mask1 = jax.nn.one_hot(jnp.argmax(probs, -1), e)
        mask2 = jax.nn.one_hot(jnp.argmax(probs * (1 - mask1), -1), e)
        pos1 = jnp.cumsum(mask1, axis=1) - 1
        pos2 = jnp.cumsum(mask2, axis=1) - 1 + jnp.sum(mask1, axis=1, keepdims=True)
        mask1 = mask1 * (pos1 < capacity)
        mask2 = mask2 * (pos2 < capacity)
        gate1 = jnp.sum(probs * mask1, -1, keepdims=True)
        gate2 = jnp.sum(probs * mask2, -1, keepdims=True)
        norm = jnp.maximum(gate1 + gate2, 1e-9)
        slot1 = jax.nn.one_hot(jnp.sum(pos1 * mask1, -1).astype(jnp.int32), capacity)
        slot2 = jax.nn.one_hot(jnp.sum(pos2 * mask2, -1).astype(jnp.int32), capacity)
        combine = ((gate1 / norm)[..., None] * mask1[..., None] * slot1[:, :, None, :]
                   + (gate2 / norm)[..., None] * mask2[..., None] * slot2[:, :, None, :])
        dispatch = (combine > 0).astype(x.dtype)                        # (batch, seq, e, cap)
        init = nn.initializers.lecun_normal(batch_axis=(0,))
        wi = self.param("wi", init, (e, self.dim, self.hidden))
        wo = self.param("wo", init, (e, self.hidden, self.dim))
        # Dispatch where the tokens are ("dispatched"), then move them to their experts.
        expert_in = constrain(jnp.einsum("bsec,bsd->ebcd", dispatch, x), "dispatched")
        expert_in = constrain(expert_in, "expert")
        h = nn.gelu(jnp.einsum("ebcd,edh->ebch", expert_in, wi))
        expert_out = constrain(jnp.einsum("ebch,ehd->ebcd", h, wo), "expert")
        expert_out = constrain(expert_out, "dispatched")
        del batch
        return constrain(jnp.einsum("bsec,ebcd->bsd", combine, expert_out), "embed")


class TransformerLayer(nn.Module):
    dim: int
    heads: int
    num_experts: int = 0  # > 0: the feed-forward is a MoE layer

    @nn.compact
    def __call__(self, x):
        x = x + Attention(self.dim, self.heads, name="attn")(nn.LayerNorm(name="ln1")(x))
        h = nn.LayerNorm(name="ln2")(x)
        if self.num_experts:
            h = MoEFeedForward(self.dim, 4 * self.dim, self.num_experts, name="moe")(h)
        else:
            h = FeedForward(self.dim, 4 * self.dim, name="ffn")(h)
        return constrain(x + h, "embed")


# Models ----------------------------------------------------------------------------------------
class GPT(nn.Module):
    """Alpa's GPT benchmark model scaled down; ``moe_every > 0`` makes it GShard's MoE stack."""

    vocab: int
    dim: int
    heads: int
    layers: int
    seq: int
    num_experts: int = 0
    moe_every: int = 0  # every moe_every-th layer (1-based) gets a MoE feed-forward

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.dim, name="embed")(tokens)
        x = x + self.param("pos_embed", nn.initializers.normal(0.02), (self.seq, self.dim))
        x = constrain(x, "embed")
        for i in range(self.layers):
            moe = self.moe_every and (i + 1) % self.moe_every == 0
            x = TransformerLayer(self.dim, self.heads, self.num_experts if moe else 0,
                                 name=f"layer_{i}")(x)
        logits = nn.Dense(self.vocab, name="head")(nn.LayerNorm(name="ln_f")(x))
        return constrain(logits, "logits")


class MLP(nn.Module):
    """Residual feed-forward blocks (Megatron's MLP) between an input and an output layer."""

    dim: int
    layers: int
    classes: int

    @nn.compact
    def __call__(self, x):
        x = constrain(nn.Dense(self.dim, name="stem")(x), "embed")
        for i in range(self.layers):
            h = nn.LayerNorm(name=f"ln_{i}")(x)
            x = constrain(x + FeedForward(self.dim, 4 * self.dim, name=f"block_{i}")(h), "embed")
        return nn.Dense(self.classes, name="head")(x)


class WideResNetBlock(nn.Module):
    channels: int

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Conv(self.channels, (3, 3), name="conv1")(x))
        h = nn.Conv(self.channels, (3, 3), name="conv2")(constrain(h, "conv"))
        # LayerNorm over channels stands in for BatchNorm: no mutable statistics in the state.
        return constrain(nn.LayerNorm(name="norm")(nn.relu(x + h)), "embed")


class WideResNet(nn.Module):
    """A stack of Wide-ResNet basic blocks at one resolution (width = channels)."""

    channels: int
    blocks: int
    classes: int

    @nn.compact
    def __call__(self, images):
        x = constrain(nn.Conv(self.channels, (3, 3), name="stem")(images), "embed")
        for i in range(self.blocks):
            x = WideResNetBlock(self.channels, name=f"block_{i}")(x)
        return nn.Dense(self.classes, name="head")(x.mean(axis=(1, 2)))


# Cases -----------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ModelCase:
    """A model at one size with its synthetic batch and the sizes that describe it."""

    name: str
    """Model family: gpt, mlp, moe or wresnet."""
    module: nn.Module
    """The Flax module."""
    inputs: np.ndarray
    """Synthetic inputs (tokens or features)."""
    labels: np.ndarray
    """Integer labels (next tokens or classes)."""
    config: dict = field(default_factory=dict)
    """Sizes, for the report."""
    _states: dict = field(default_factory=dict, repr=False, compare=False)
    """init_state's host copies, by learning rate (built once, shared by every plan)."""

    def init_state(self, learning_rate: float = 1e-3) -> TrainState:
        """The initial train state (Adam), every array on the host (NumPy).

        Initialised once per case with one jitted ``init`` (not op by op) and kept: each plan
        places its own device copy, so donating that copy leaves this one intact.
        """
        if learning_rate not in self._states:
            params = jax.jit(self.module.init)(jax.random.key(0), self.inputs[:1])
            state = TrainState.create(apply_fn=self.module.apply, params=params,
                                      tx=optax.adam(learning_rate))
            self._states[learning_rate] = jax.device_get(state)
        return self._states[learning_rate]

    @property
    def num_params(self) -> int:
        shapes = jax.eval_shape(self.module.init, jax.random.key(0), self.inputs[:1])
        return int(sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)))


SIZES = {
    # quick: the end-to-end test; default: `make bench` on 2 CPU cores; large: accelerators.
    "quick": dict(gpt=dict(vocab=64, dim=32, heads=8, layers=1, seq=16, batch=8),
                  mlp=dict(dim=32, layers=1, classes=8, features=16, batch=16),
                  moe=dict(vocab=64, dim=32, heads=8, layers=2, seq=16, batch=8,
                           num_experts=8, moe_every=2),
                  wresnet=dict(channels=16, blocks=1, classes=8, image=8, batch=8)),
    "default": dict(gpt=dict(vocab=1024, dim=256, heads=8, layers=2, seq=64, batch=16),
                    mlp=dict(dim=512, layers=2, classes=16, features=256, batch=64),
                    moe=dict(vocab=1024, dim=128, heads=8, layers=2, seq=64, batch=16,
                             num_experts=8, moe_every=2),
                    wresnet=dict(channels=64, blocks=2, classes=16, image=16, batch=16)),
    "large": dict(gpt=dict(vocab=8192, dim=1024, heads=16, layers=8, seq=256, batch=32),
                  mlp=dict(dim=2048, layers=4, classes=128, features=1024, batch=256),
                  moe=dict(vocab=8192, dim=768, heads=16, layers=4, seq=256, batch=32,
                           num_experts=16, moe_every=2),
                  wresnet=dict(channels=320, blocks=4, classes=128, image=32, batch=64)),
}
MODELS = ("gpt", "mlp", "moe", "wresnet")


def make_case(name: str, **sizes) -> ModelCase:
    """The model ``name`` with ``sizes`` (see ``SIZES``) and a deterministic synthetic batch."""
    rng = np.random.default_rng(0)
    s = dict(sizes)
    batch = s.pop("batch")
    if name in ("gpt", "moe"):
        module = GPT(**s)
        start = rng.integers(0, s["vocab"], size=(batch, 1))
        tokens = (start + np.arange(s["seq"] + 1)) % s["vocab"]     # counting sequences
        inputs, labels = tokens[:, :-1].astype(np.int32), tokens[:, 1:].astype(np.int32)
    elif name == "mlp":
        features = s.pop("features")
        module = MLP(**s)
        inputs = rng.normal(size=(batch, features)).astype(np.float32)
        labels = rng.integers(0, s["classes"], size=(batch,)).astype(np.int32)
    elif name == "wresnet":
        image = s.pop("image")
        module = WideResNet(**s)
        inputs = rng.normal(size=(batch, image, image, 3)).astype(np.float32)
        labels = rng.integers(0, s["classes"], size=(batch,)).astype(np.int32)
    else:
        raise ValueError(f"model ({name!r}) must be one of {MODELS}.")
    return ModelCase(name=name, module=module, inputs=inputs, labels=labels,
                     config=dict(sizes))


def loss_fn(apply_fn, params, batch):
    """Mean cross-entropy of integer labels (per token for the language models)."""
    inputs, labels = batch
    logits = apply_fn(params, inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
