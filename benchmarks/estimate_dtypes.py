"""The memory estimate against the compiled program for a mixed-precision step.

    python benchmarks/estimate_dtypes.py [--devices N] [--out FILE.json]

A small flax transformer LM (4 blocks, dim 256, sequence 128, batch 8, vocabulary 1,024) with
AdamW, computed in bfloat16 or float32 (parameters float32), with or without dropout,
parallelized with the default ``ShardParallel``. Per variant: XLA's compiled memory per device
(arguments + outputs + temporaries - aliased), the planner's estimate
(``plan.objective.peak_bytes_per_device``), and where the platform reports it the device's
peak bytes in use after three steps. On a CPU run ``XLA_FLAGS`` sets the device count
(``--devices``); on an accelerator the devices at hand are used.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

VARIANTS = (("bf16", 0.1), ("bf16", 0.0), ("f32", 0.1), ("f32", 0.0))


def measure(dtype_name: str, dropout: float) -> dict:
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax
    from flax.training.train_state import TrainState

    import autoshard

    vocab, dim, heads, layers, seq, batch_size = 1024, 256, 4, 4, 128, 8
    dtype = jnp.bfloat16 if dtype_name == "bf16" else jnp.float32

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            h = nn.LayerNorm(dtype=dtype)(x)
            h = nn.SelfAttention(num_heads=heads, dtype=dtype, deterministic=not train,
                                 dropout_rate=dropout)(
                h, mask=nn.make_causal_mask(jnp.ones(x.shape[:2])))
            x = x + nn.Dropout(dropout, deterministic=not train)(h)
            h = nn.Dense(4 * dim, dtype=dtype)(nn.LayerNorm(dtype=dtype)(x))
            h = nn.Dense(dim, dtype=dtype)(nn.gelu(h))
            return x + nn.Dropout(dropout, deterministic=not train)(h)

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens, train=True):
            x = nn.Embed(vocab, dim, dtype=dtype)(tokens)
            for _ in range(layers):
                x = Block()(x, train)
            return nn.Dense(vocab, dtype=dtype)(nn.LayerNorm(dtype=dtype)(x))

    model = LM()
    tokens = jax.random.randint(jax.random.key(1), (batch_size, seq + 1), 0, vocab)
    batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
    params = model.init({"params": jax.random.key(0), "dropout": jax.random.key(2)}, batch["x"])
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3))

    def train_step(state, batch, key):
        def loss_fn(p):
            logits = state.apply_fn(p, batch["x"], rngs={"dropout": key})
            return optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), batch["y"]).mean()
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    step = autoshard.parallelize(train_step)
    ex = step.get_executable(state, batch, jax.random.key(3))
    ma = ex.compiled.memory_analysis()
    compiled = (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
                - ma.alias_size_in_bytes)
    estimate = ex.plan.objective.peak_bytes_per_device
    for i in range(3):
        state, loss = step(state, batch, jax.random.key(10 + i))
    float(loss)
    stats = jax.devices()[0].memory_stats() or {}
    return {"platform": jax.devices()[0].platform, "devices": len(jax.devices()),
            "dtype": dtype_name, "dropout": dropout, "compiled_memory": compiled,
            "argument_bytes": ma.argument_size_in_bytes, "temp_bytes": ma.temp_size_in_bytes,
            "estimate": estimate, "compiled_over_estimate": compiled / estimate,
            "device_peak_bytes": stats.get("peak_bytes_in_use"),
            "mesh_shape": list(ex.mesh.devices.shape)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8, help="virtual CPU devices (CPU only)")
    p.add_argument("--out", default=None, help="JSON file the rows are written to")
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.variant:   # a child: one variant, one process (one device peak each)
        dtype_name, dropout = args.variant.split(":")
        print("ROW " + json.dumps(measure(dtype_name, float(dropout))), flush=True)
        return 0
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + [
        f"--xla_force_host_platform_device_count={args.devices}"])
    rows = []
    for dtype_name, dropout in VARIANTS:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--variant",
                              f"{dtype_name}:{dropout}"], env=env, text=True,
                             capture_output=True, check=True).stdout
        row = json.loads(next(x for x in out.splitlines() if x.startswith("ROW "))[4:])
        rows.append(row)
        print(f"{row['platform']} x{row['devices']} {dtype_name} dropout {dropout}: compiled "
              f"{row['compiled_memory']:,} B, estimate {row['estimate']:,} B "
              f"({row['compiled_over_estimate']:.3f}), device peak {row['device_peak_bytes']}",
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
