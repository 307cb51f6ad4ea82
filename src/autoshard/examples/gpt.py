"""Train a small GPT on synthetic data with ``autoshard.parallelize`` on every local device.

    python -m autoshard.examples.gpt [--method shard|data|zero2|zero3] [--steps 40]

On a CPU-only machine run it with 8 virtual devices:
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m autoshard.examples.gpt
"""

from __future__ import annotations

import argparse
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

import autoshard


class CausalBlock(nn.Module):
    dim: int
    heads: int

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], dtype=jnp.int32))
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
        h = nn.LayerNorm()(x)
        h = nn.Dense(4 * self.dim)(h)
        return x + nn.Dense(self.dim)(nn.gelu(h))


class GPT(nn.Module):
    vocab: int = 128
    dim: int = 128
    heads: int = 4
    layers: int = 2
    max_len: int = 64

    @nn.compact
    def __call__(self, tokens):
        pos = jnp.arange(tokens.shape[1])
        x = nn.Embed(self.vocab, self.dim)(tokens) + nn.Embed(self.max_len, self.dim)(pos)
        for _ in range(self.layers):
            x = CausalBlock(self.dim, self.heads)(x)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def synthetic_batch(rng: np.random.Generator, batch: int, seq: int, vocab: int):
    """Sequences that count upwards with a random start and stride: learnable, never seen."""
    start = rng.integers(0, vocab, size=(batch, 1))
    stride = rng.integers(1, 4, size=(batch, 1))
    tokens = (start + stride * np.arange(seq + 1)) % vocab
    return jnp.asarray(tokens[:, :-1], jnp.int32), jnp.asarray(tokens[:, 1:], jnp.int32)


def train_step(state: TrainState, batch):
    inputs, targets = batch

    def loss_fn(params):
        logits = state.apply_fn(params, inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    loss, grads = autoshard.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


METHODS = {
    "shard": lambda k: autoshard.ShardParallel(num_micro_batches=k),
    "data": lambda k: autoshard.DataParallel(num_micro_batches=k),
    "zero2": lambda k: autoshard.Zero2Parallel(num_micro_batches=k),
    "zero3": lambda k: autoshard.Zero3Parallel(num_micro_batches=k),
}


def summarize(plan: autoshard.ShardingPlan) -> str:
    """The plan without optimizer-state and output rows (they repeat the parameter rows)."""
    keep = []
    for line in plan.explain().splitlines():
        if ".opt_state" in line or line.strip().startswith("out["):
            continue
        if line.strip() == "outputs:":
            line = "  outputs: the new state keeps its input specs; the loss is replicated"
        elif line.strip().startswith("leaf ") and keep and keep[-1].startswith("  outputs:"):
            continue
        keep.append(line)
    return "\n".join(keep)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", choices=sorted(METHODS), default="shard")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=None)
    args = p.parse_args(argv)

    print(f"jax {jax.__version__}: {jax.device_count()} {jax.devices()[0].platform} devices")
    model = GPT(layers=args.layers)
    rng = np.random.default_rng(0)
    inputs, _ = synthetic_batch(rng, args.batch, args.seq, model.vocab)
    params = model.init(jax.random.key(0), inputs)
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(3e-3))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"GPT: {args.layers} layers, dim {model.dim}, {n_params:,} parameters")

    step = autoshard.parallelize(train_step, method=METHODS[args.method](args.micro_batches))
    batch = synthetic_batch(rng, args.batch, args.seq, model.vocab)
    t0 = time.perf_counter()
    executable = step.get_executable(state, batch)
    print(f"planned and compiled in {time.perf_counter() - t0:.1f} s\n")
    print(summarize(executable.plan), "\n")
    state, batch = step.preshard_dynamic_args(state, batch)

    times, first_loss = [], None
    for i in range(args.steps):
        batch = step.preshard_dynamic_args(state, synthetic_batch(
            rng, args.batch, args.seq, model.vocab))[1]
        t = time.perf_counter()
        state, loss = step(state, batch)
        loss = float(loss)
        times.append(time.perf_counter() - t)
        first_loss = loss if first_loss is None else first_loss
        if i % 5 == 0 or i == args.steps - 1:
            print(f"step {i:3d}  loss {loss:.4f}  step time {times[-1] * 1e3:7.1f} ms")
    median = np.median(times[1:]) if len(times) > 1 else times[0]
    print(f"\nloss {first_loss:.3f} -> {loss:.3f}; median step time {median * 1e3:.1f} ms")
    if not loss < first_loss:
        raise SystemExit("loss did not go down")


if __name__ == "__main__":
    main()
