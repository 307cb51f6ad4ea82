"""Four model families for the families benchmark (Flax linen, synthetic data, AdamW steps).

- ``llama``: a LLaMA-style decoder: RMSNorm, rotary position embeddings (RoPE), SwiGLU
  feed-forward, grouped-query attention (``kv_heads`` key/value heads shared by groups of
  query heads), untied LM head, next-token loss.
- ``vit``: a Vision Transformer: patch embedding, class token, learned positions, pre-LN
  blocks (multi-head attention, GELU MLP), classifier on the class token.
- ``t5``: a T5-style encoder-decoder: RMSNorm, a clipped relative position bias per stack,
  encoder self-attention, decoder causal self-attention and cross-attention to the encoder,
  ReLU feed-forward, untied LM head.
- ``unet``: a convolutional U-Net: residual blocks (GroupNorm, SiLU, 3x3 convs), strided-conv
  downsampling, nearest upsampling with skip concatenation, a denoising (MSE) loss.

``layers`` is the depth knob of every family (decoder layers; ViT blocks; encoder and decoder
layers each; residual blocks per U-Net level). Layers are Python loops (unrolled in the
jaxpr), as most user code writes them.

Activations are marked with ``constrain(x, name)``: the identity outside
``activation_rules(mesh, rules)``; inside, it pins the named activation with
``with_sharding_constraint``, as an expert annotates a model for FSDP and tensor parallelism.
Names: ``embed`` (residual stream, batch first), ``heads`` (per-head values, heads on dim 2),
``mlp`` (the wide hidden layer), ``conv`` (channels of a conv block), ``logits``.
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

_RULES: list = []  # stack of (mesh, rules) set by activation_rules


@contextlib.contextmanager
def activation_rules(mesh, rules: dict[str, dict[int, str]]):
    """While tracing inside this block, ``constrain`` pins the activations named in ``rules``.

    A rule maps a tensor dim (negative counts from the end) to a mesh axis, e.g.
    ``{0: "data", -1: "model"}``; a dim whose size the axis does not divide stays whole.
    """
    _RULES.append((mesh, rules))
    try:
        yield
    finally:
        _RULES.pop()


def constrain(x, name: str):
    if not _RULES:
        return x
    mesh, rules = _RULES[-1]
    rule = rules.get(name)
    if rule is None:
        return x
    entries = [None] * x.ndim
    for dim, axis in rule.items():
        if x.shape[dim] % mesh.shape[axis] == 0 and mesh.shape[axis] > 1:
            entries[dim % x.ndim] = axis
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*entries)))


# Building blocks -------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    eps: float = 1e-6

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps) * scale


def rope(x):
    """Rotary position embedding of (batch, seq, heads, head_dim) by position in seq."""
    seq, half = x.shape[1], x.shape[-1] // 2
    freq = 1.0 / (10000.0 ** (np.arange(half, dtype=np.float32) / half))
    angle = np.arange(seq, dtype=np.float32)[:, None] * freq[None]
    sin, cos = np.sin(angle)[None, :, None], np.cos(angle)[None, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class Attention(nn.Module):
    """Multi-head attention with ``kv_heads`` key/value heads (grouped-query when fewer)."""

    dim: int
    heads: int
    kv_heads: int
    causal: bool = False
    rotary: bool = False
    use_bias: bool = False

    @nn.compact
    def __call__(self, x, context=None, bias=None):
        hd = self.dim // self.heads
        src = x if context is None else context
        dense = dict(use_bias=self.use_bias)
        q = nn.DenseGeneral((self.heads, hd), name="q", **dense)(x)
        k = nn.DenseGeneral((self.kv_heads, hd), name="k", **dense)(src)
        v = nn.DenseGeneral((self.kv_heads, hd), name="v", **dense)(src)
        if self.rotary:
            q, k = rope(q), rope(k)
        q, k, v = constrain(q, "heads"), constrain(k, "heads"), constrain(v, "heads")
        b, sq, _, _ = q.shape
        group = self.heads // self.kv_heads
        q = q.reshape(b, sq, self.kv_heads, group, hd)
        scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k) / np.float32(np.sqrt(hd))
        if bias is not None:      # (heads, q, k)
            scores = scores + bias.reshape(self.kv_heads, group, *bias.shape[1:])[None]
        if self.causal:
            mask = np.tril(np.ones((sq, src.shape[1]), bool))
            scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
        ctx = jnp.einsum("bkgqs,bskd->bqkgd", jax.nn.softmax(scores, axis=-1), v)
        ctx = constrain(ctx.reshape(b, sq, self.heads, hd), "heads")
        out = nn.DenseGeneral(self.dim, axis=(-2, -1), name="o", **dense)(ctx)
        return constrain(out, "embed")


class SwiGLU(nn.Module):
    dim: int
    hidden: int

    @nn.compact
    def __call__(self, x):
        gate = nn.Dense(self.hidden, use_bias=False, name="gate")(x)
        up = nn.Dense(self.hidden, use_bias=False, name="up")(x)
        h = constrain(nn.silu(gate) * up, "mlp")
        return constrain(nn.Dense(self.dim, use_bias=False, name="down")(h), "embed")


class MLP(nn.Module):
    dim: int
    hidden: int
    activation: str = "gelu"
    use_bias: bool = True

    @nn.compact
    def __call__(self, x):
        act = {"gelu": nn.gelu, "relu": nn.relu}[self.activation]
        h = constrain(act(nn.Dense(self.hidden, use_bias=self.use_bias, name="wi")(x)), "mlp")
        return constrain(nn.Dense(self.dim, use_bias=self.use_bias, name="wo")(h), "embed")


# LLaMA-style decoder ---------------------------------------------------------------------------
class DecoderLayer(nn.Module):
    dim: int
    heads: int
    kv_heads: int
    hidden: int

    @nn.compact
    def __call__(self, x):
        x = x + Attention(self.dim, self.heads, self.kv_heads, causal=True, rotary=True,
                          name="attn")(RMSNorm(name="attn_norm")(x))
        return x + SwiGLU(self.dim, self.hidden, name="mlp")(RMSNorm(name="mlp_norm")(x))


class Llama(nn.Module):
    vocab: int
    dim: int
    heads: int
    kv_heads: int
    hidden: int
    layers: int

    @nn.compact
    def __call__(self, tokens):
        x = constrain(nn.Embed(self.vocab, self.dim, name="embed")(tokens), "embed")
        for i in range(self.layers):
            x = DecoderLayer(self.dim, self.heads, self.kv_heads, self.hidden,
                             name=f"layer_{i}")(x)
        x = RMSNorm(name="final_norm")(x)
        return constrain(nn.Dense(self.vocab, use_bias=False, name="lm_head")(x), "logits")


# ViT -------------------------------------------------------------------------------------------
class ViTBlock(nn.Module):
    dim: int
    heads: int
    hidden: int

    @nn.compact
    def __call__(self, x):
        x = x + Attention(self.dim, self.heads, self.heads, use_bias=True, name="attn")(
            nn.LayerNorm(name="ln1")(x))
        return x + MLP(self.dim, self.hidden, name="mlp")(nn.LayerNorm(name="ln2")(x))


class ViT(nn.Module):
    patch: int
    dim: int
    heads: int
    hidden: int
    layers: int
    classes: int

    @nn.compact
    def __call__(self, images):
        b, h, w, c = images.shape
        p = self.patch
        patches = images.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
        x = nn.Dense(self.dim, name="patch_embed")(patches.reshape(b, -1, p * p * c))
        cls = self.param("cls", nn.initializers.zeros, (1, 1, self.dim))
        x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, self.dim)), x], axis=1)
        pos = self.param("pos", nn.initializers.normal(0.02), (1, x.shape[1], self.dim))
        x = constrain(x + pos, "embed")
        for i in range(self.layers):
            x = ViTBlock(self.dim, self.heads, self.hidden, name=f"block_{i}")(x)
        x = nn.LayerNorm(name="final_ln")(x[:, 0])
        return nn.Dense(self.classes, name="head")(x)


# T5-style encoder-decoder ----------------------------------------------------------------------
class RelativeBias(nn.Module):
    """(heads, q, k) bias from a learned table over clipped relative distances."""

    heads: int
    max_distance: int
    causal: bool

    @nn.compact
    def __call__(self, q_len, k_len):
        table = self.param("table", nn.initializers.normal(0.02),
                           (2 * self.max_distance + 1, self.heads))
        rel = np.arange(k_len)[None] - np.arange(q_len)[:, None]
        if self.causal:
            rel = np.minimum(rel, 0)
        idx = np.clip(rel, -self.max_distance, self.max_distance) + self.max_distance
        return jnp.transpose(table[idx], (2, 0, 1))


class EncoderLayer(nn.Module):
    dim: int
    heads: int
    hidden: int

    @nn.compact
    def __call__(self, x, bias):
        x = x + Attention(self.dim, self.heads, self.heads, name="self_attn")(
            RMSNorm(name="ln1")(x), bias=bias)
        return x + MLP(self.dim, self.hidden, activation="relu", use_bias=False,
                       name="mlp")(RMSNorm(name="ln2")(x))


class T5DecoderLayer(nn.Module):
    dim: int
    heads: int
    hidden: int

    @nn.compact
    def __call__(self, y, enc, bias):
        y = y + Attention(self.dim, self.heads, self.heads, causal=True, name="self_attn")(
            RMSNorm(name="ln1")(y), bias=bias)
        y = y + Attention(self.dim, self.heads, self.heads, name="cross_attn")(
            RMSNorm(name="ln2")(y), context=enc)
        return y + MLP(self.dim, self.hidden, activation="relu", use_bias=False,
                       name="mlp")(RMSNorm(name="ln3")(y))


class T5(nn.Module):
    vocab: int
    dim: int
    heads: int
    hidden: int
    layers: int
    max_distance: int = 32

    @nn.compact
    def __call__(self, src, tgt):
        embed = nn.Embed(self.vocab, self.dim, name="embed")   # shared by both stacks
        x = constrain(embed(src), "embed")
        bias = RelativeBias(self.heads, self.max_distance, False, name="enc_bias")(
            src.shape[1], src.shape[1])
        for i in range(self.layers):
            x = EncoderLayer(self.dim, self.heads, self.hidden, name=f"enc_{i}")(x, bias)
        enc = RMSNorm(name="enc_norm")(x)
        y = constrain(embed(tgt), "embed")
        bias = RelativeBias(self.heads, self.max_distance, True, name="dec_bias")(
            tgt.shape[1], tgt.shape[1])
        for i in range(self.layers):
            y = T5DecoderLayer(self.dim, self.heads, self.hidden, name=f"dec_{i}")(y, enc, bias)
        y = RMSNorm(name="dec_norm")(y)
        return constrain(nn.Dense(self.vocab, use_bias=False, name="lm_head")(y), "logits")


# U-Net -----------------------------------------------------------------------------------------
class ResBlock(nn.Module):
    channels: int
    groups: int

    @nn.compact
    def __call__(self, x):
        h = nn.Conv(self.channels, (3, 3), name="conv1")(
            nn.silu(nn.GroupNorm(self.groups, name="norm1")(x)))
        h = constrain(h, "conv")
        h = nn.Conv(self.channels, (3, 3), name="conv2")(
            nn.silu(nn.GroupNorm(self.groups, name="norm2")(h)))
        if x.shape[-1] != self.channels:
            x = nn.Conv(self.channels, (1, 1), name="skip")(x)
        return constrain(x + h, "embed")


class UNet(nn.Module):
    channels: tuple[int, ...]
    layers: int
    groups: int
    out_channels: int

    @nn.compact
    def __call__(self, x):
        h = nn.Conv(self.channels[0], (3, 3), name="stem")(x)
        skips = []
        for level, ch in enumerate(self.channels):
            for i in range(self.layers):
                h = ResBlock(ch, self.groups, name=f"down_{level}_{i}")(h)
            skips.append(h)
            if level < len(self.channels) - 1:
                h = nn.Conv(ch, (3, 3), strides=(2, 2), name=f"downsample_{level}")(h)
        for i in range(self.layers):
            h = ResBlock(self.channels[-1], self.groups, name=f"mid_{i}")(h)
        for level in reversed(range(len(self.channels))):
            ch = self.channels[level]
            if level < len(self.channels) - 1:
                h = jnp.repeat(jnp.repeat(h, 2, axis=1), 2, axis=2)
                h = nn.Conv(ch, (3, 3), name=f"upsample_{level}")(h)
            h = jnp.concatenate([h, skips[level]], axis=-1)
            for i in range(self.layers):
                h = ResBlock(ch, self.groups, name=f"up_{level}_{i}")(h)
        h = nn.silu(nn.GroupNorm(self.groups, name="out_norm")(h))
        return nn.Conv(self.out_channels, (3, 3), name="out")(h)


# Cases -----------------------------------------------------------------------------------------
SIZES = {
    # tiny: the test; default: `make bench-families` on 2 shared CPU cores.
    "tiny": dict(
        llama=dict(vocab=128, dim=32, heads=4, kv_heads=2, hidden=64, layers=1, seq=16,
                   batch=8),
        vit=dict(image=8, patch=4, dim=32, heads=4, hidden=64, layers=1, classes=16, batch=8),
        t5=dict(vocab=128, dim=32, heads=4, hidden=64, layers=1, src_len=16, tgt_len=8,
                batch=8),
        unet=dict(image=8, in_channels=4, channels=(16, 32), layers=1, groups=4, batch=8)),
    "default": dict(
        llama=dict(vocab=4096, dim=256, heads=8, kv_heads=4, hidden=704, layers=4, seq=64,
                   batch=16),
        vit=dict(image=32, patch=4, dim=256, heads=8, hidden=1024, layers=4, classes=128,
                 batch=16),
        t5=dict(vocab=4096, dim=256, heads=8, hidden=1024, layers=2, src_len=64, tgt_len=32,
                batch=16),
        unet=dict(image=32, in_channels=8, channels=(32, 64, 128), layers=1, groups=8,
                  batch=16)),
}
MODELS = ("llama", "vit", "t5", "unet")


@dataclass(frozen=True, kw_only=True)
class Case:
    """One model at one size: its module, a deterministic batch and its AdamW train step."""

    name: str
    """Model family: llama, vit, t5 or unet."""
    module: nn.Module
    """The Flax module."""
    batch: dict
    """Synthetic batch: NumPy arrays, batch on dim 0."""
    config: dict
    """The sizes it was built with."""
    _state: dict = field(default_factory=dict, repr=False, compare=False)

    def inputs(self, batch) -> tuple:
        return tuple(batch[k] for k in INPUTS[self.name])

    def init_state(self) -> TrainState:
        """The initial train state (AdamW), on the host: every plan places its own copy."""
        if "state" not in self._state:
            self._state["state"] = jax.device_get(self._new_state())
        return self._state["state"]

    def state_shapes(self) -> TrainState:
        """The train state's shapes and dtypes (``jax.ShapeDtypeStruct`` leaves), nothing
        computed. (``jax.eval_shape(init_state)`` gave the same, but ``jax.device_get`` on
        its tracers formats the whole init jaxpr for an AttributeError it then catches:
        65 s for the 32-layer decoder.)"""
        return jax.eval_shape(self._new_state)

    def _new_state(self) -> TrainState:
        small = jax.tree.map(lambda x: x[:1], self.batch)
        params = jax.jit(self.module.init)(jax.random.key(0), *self.inputs(small))
        if "tx" not in self._state:   # one optimizer per case: states of one case share
            # their pytree metadata, so shardings built from one apply to the other
            self._state["tx"] = optax.adamw(1e-3, weight_decay=0.01)
        return TrainState.create(apply_fn=self.module.apply, params=params,
                                 tx=self._state["tx"])

    def loss(self, params, batch):
        out = self.module.apply(params, *self.inputs(batch))
        if self.name == "unet":
            return jnp.mean((out - batch["target"]) ** 2)
        return optax.softmax_cross_entropy_with_integer_labels(out, batch["labels"]).mean()

    def step(self, state: TrainState, batch):
        """One AdamW step: (new state, loss)."""
        loss, grads = jax.value_and_grad(self.loss)(state.params, batch)
        return state.apply_gradients(grads=grads), loss

    @property
    def num_params(self) -> int:
        return int(sum(math.prod(x.shape) for x in jax.tree.leaves(self.init_state().params)))


INPUTS = {"llama": ("tokens",), "vit": ("images",), "t5": ("src", "tgt"), "unet": ("noisy",)}


def make_case(name: str, size: str = "default", **overrides) -> Case:
    """The model ``name`` at ``SIZES[size]`` (``overrides`` replace sizes, e.g. ``layers=8``)."""
    if name not in MODELS:
        raise ValueError(f"model ({name!r}) must be one of {MODELS}.")
    s = dict(SIZES[size][name], **overrides)
    config = dict(s)
    rng = np.random.default_rng(0)
    n = s.pop("batch")
    if name == "llama":
        seq = s.pop("seq")
        tokens = rng.integers(0, s["vocab"], size=(n, seq + 1)).astype(np.int32)
        batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
        module = Llama(**s)
    elif name == "vit":
        image = s.pop("image")
        batch = {"images": rng.normal(size=(n, image, image, 3)).astype(np.float32),
                 "labels": rng.integers(0, s["classes"], size=(n,)).astype(np.int32)}
        module = ViT(**s)
    elif name == "t5":
        src_len, tgt_len = s.pop("src_len"), s.pop("tgt_len")
        src = rng.integers(0, s["vocab"], size=(n, src_len)).astype(np.int32)
        tgt = rng.integers(0, s["vocab"], size=(n, tgt_len + 1)).astype(np.int32)
        batch = {"src": src, "tgt": tgt[:, :-1], "labels": tgt[:, 1:]}
        module = T5(**s)
    else:
        image, c = s.pop("image"), s.pop("in_channels")
        clean = rng.normal(size=(n, image, image, c)).astype(np.float32)
        noise = rng.normal(size=clean.shape).astype(np.float32)
        batch = {"noisy": clean + noise, "target": noise}
        module = UNet(out_channels=c, **s)
    return Case(name=name, module=module, batch=batch, config=config)
