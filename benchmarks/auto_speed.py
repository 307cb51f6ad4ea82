"""How long ``AutoParallel()``'s first call takes on a small model (issue 26 item 8's planning
time, the user's view).

The model is what a new user writes: a flax.linen decoder-only LM of 4 pre-LN blocks (vocab
256, width 64, 4 heads, seq 32), dropout 0.1, ``optax.adamw``, bf16 compute on fp32 params,
batch 16, ``autoshard.value_and_grad``; the train step is run by
``autoshard.parallelize(step, method=AutoParallel())`` on the 8 virtual CPU devices with
every option at its default. Measured: the first call's wall seconds (trace, choice,
compile, run) and CPU seconds, the seconds of the choice alone (``auto.choose``), the number
of ``plan_auto`` calls (every module's binding of it wrapped by a counter), the choice
(``explain()``'s candidate lines), and the losses of 3 steps (the same before and after a
change: same choice, same plans).

Run: ``XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/auto_speed.py
[--label after] [--json results/auto_speed.json]``; appends a row to
``benchmarks/results/auto_speed.json`` and rewrites ``auto_speed.md`` from it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

import autoshard
from autoshard.pipeline import auto as auto_module

RESULTS = Path(__file__).parent / "results"
NOTES = """
## What changed (before -> after)

Where the first call's time went before (profiled on the same model, `autoshard.plan` on
`Cluster.from_devices`): the whole-mesh `ShardParallel` plan about 12 CPU s, half of it the
least-memory re-solve and its trade-off table (`memory_tradeoff` 0.1); the stage search's
spans 40 (span, sub-mesh) pairs x (F, B, apply) = most of the 186 `plan_auto` calls; the
3 pipelines priced in full about 36 calls. After (`pipeline/auto.py`):

* the stage search plans each layer once per sub-mesh (`layer_profile_mode="individual"`,
  AutoParallel's default now; a span's time is the sum of its layers' as Alpa composes them,
  and the `num_priced` layouts are then priced as whole stages, as before); identical layers
  are planned once (the task cache keys on the task's jaxpr);
* no span is planned on a sub-mesh that no pipeline of 2 or more stages can use (here the
  whole 8-device mesh), nor (composition mode) the span of every layer;
* a span's apply (optimizer) tasks are planned only where their memory can decide the DP's
  memory test: their peak is at most every value replicated and live at once, twice; where
  that fits the limit (here: the CPU devices have no limit), the test passes either way;
* the whole-mesh candidate is planned with `memory_tradeoff` 0 unless the option sets it
  (candidates are compared by step time within the memory, as the pipeline task plans are).

Same choice (ShardParallel on the whole mesh, 2x4), the same plan and the same losses; the
2-stage candidate's layout differs (layers 0-1 | 2-3 instead of 0-2 | 3, priced 1.69 ms
instead of 1.00 ms; the chosen plan is 0.127 ms either way). The machine was shared by
several agents (load 5-16 on 2 CPUs): wall seconds vary 3-5x with the load, CPU seconds are
the comparable figure.
"""
SIZE = dict(vocab=256, dim=64, heads=4, seq=32, batch=16, layers=4)


class Block(nn.Module):
    heads: int
    dropout: float

    @nn.compact
    def __call__(self, x, train: bool):
        d = x.shape[-1]
        y = nn.LayerNorm(dtype=jnp.bfloat16)(x)
        y = nn.SelfAttention(num_heads=self.heads, dtype=jnp.bfloat16, dropout_rate=self.dropout,
                             deterministic=not train)(y, mask=nn.make_causal_mask(x[..., 0]))
        x = x + nn.Dropout(self.dropout, deterministic=not train)(y)
        y = nn.LayerNorm(dtype=jnp.bfloat16)(x)
        y = nn.Dense(4 * d, dtype=jnp.bfloat16)(y)
        y = nn.Dense(d, dtype=jnp.bfloat16)(nn.gelu(y))
        return x + nn.Dropout(self.dropout, deterministic=not train)(y)


class LM(nn.Module):
    vocab: int
    dim: int
    heads: int
    seq: int
    layers: int
    dropout: float = 0.1

    @nn.compact
    def __call__(self, tokens, train: bool = True):
        h = nn.Embed(self.vocab, self.dim, dtype=jnp.bfloat16)(tokens)
        h = h + self.param("pos", nn.initializers.normal(0.02), (self.seq, self.dim))
        h = nn.Dropout(self.dropout, deterministic=not train)(h)
        for _ in range(self.layers):
            h = Block(self.heads, self.dropout)(h, train)
        return nn.Dense(self.vocab, dtype=jnp.bfloat16)(nn.LayerNorm(dtype=jnp.bfloat16)(h))


def make(seed: int = 0):
    """(step, state, batch, rng) of the 4-block LM."""
    model = LM(**{k: v for k, v in SIZE.items() if k != "batch"})
    k_init, k_data, k_drop = jax.random.split(jax.random.PRNGKey(seed), 3)
    tokens = jax.random.randint(k_data, (SIZE["batch"], SIZE["seq"] + 1), 0, SIZE["vocab"])
    params = model.init({"params": k_init}, tokens[:1, :-1], train=False)["params"]
    state = TrainState.create(apply_fn=model.apply, params=params,
                              tx=optax.adamw(1e-3, weight_decay=0.01))

    def step(state, batch, rng):
        rng = jax.random.fold_in(rng, state.step)

        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["inputs"],
                                    rngs={"dropout": rng})
            loss = optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), batch["targets"])
            return loss.mean()

        loss, grads = autoshard.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    batch = {"inputs": np.asarray(tokens[:, :-1]), "targets": np.asarray(tokens[:, 1:])}
    return step, state, batch, k_drop


class PlanAutoCounter:
    """Counts ``plan_auto`` calls: every loaded module's binding of it is wrapped."""

    def __init__(self):
        from autoshard.sharding import planner
        self.original, self.calls, self.patched = planner.plan_auto, 0, []

        def counted(*args, **kwargs):
            self.calls += 1
            return self.original(*args, **kwargs)
        self.counted = counted

    def __enter__(self):
        for mod in list(sys.modules.values()):
            if getattr(mod, "plan_auto", None) is self.original:
                self.patched.append(mod)
                mod.plan_auto = self.counted
        return self

    def __exit__(self, *exc):
        for mod in self.patched:
            mod.plan_auto = self.original


def measure() -> dict:
    step, state, batch, rng = make()
    timed = {"choose_s": 0.0}
    choose = auto_module.choose

    def timed_choose(*args, **kwargs):
        t, c = time.perf_counter(), time.process_time()
        est = choose(*args, **kwargs)
        timed["choose_s"] += time.perf_counter() - t
        timed["choose_cpu_s"] = timed.get("choose_cpu_s", 0.0) + time.process_time() - c
        timed["explain"] = est.explain()
        return est
    auto_module.choose = timed_choose
    try:
        run = autoshard.parallelize(step, method=autoshard.AutoParallel())
        with PlanAutoCounter() as counter:
            t0, c0 = time.perf_counter(), time.process_time()
            state, loss = run(state, batch, rng)
            loss = float(loss)
            first_s, first_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    finally:
        auto_module.choose = choose
    losses = [loss]
    for _ in range(2):
        state, loss = run(state, batch, rng)
        losses.append(float(loss))
    lines = timed["explain"].splitlines()
    end = next(i for i, x in enumerate(lines) if x.strip().startswith("chosen:"))
    candidates = [x.strip() for x in lines[1:end]]
    return {"first_call_s": first_s, "first_call_cpu_s": first_cpu_s,
            "planning_s": timed["choose_s"], "planning_cpu_s": timed["choose_cpu_s"],
            "plan_auto_calls": counter.calls,
            "chosen": next(c for c in candidates if c.startswith("*")),
            "candidates": candidates, "losses": losses,
            "load_average": os.getloadavg()[0]}


def write_md(rows: list[dict]) -> None:
    lines = [
        "# AutoParallel's first call on a small model", "",
        "`autoshard.parallelize(step, method=AutoParallel())` (every option at its default) on "
        "8 virtual CPU devices of a shared 2-CPU machine: a flax.linen LM of 4 pre-LN blocks "
        f"({', '.join(f'{k} {v}' for k, v in SIZE.items())}), dropout 0.1, optax.adamw, bf16 "
        "compute. first call: wall (CPU) seconds of the first call (trace, choice, compile, "
        "run); planning: seconds of `auto.choose`; plan_auto: planner calls during the first "
        "call. Written by `benchmarks/auto_speed.py`.", "",
        "| run | commit | first call s (CPU s) | planning s (CPU s) | plan_auto calls | load | chosen | "
        "losses (3 steps) |",
        "|---|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['commit']} | {r['first_call_s']:.1f} "
            f"({r['first_call_cpu_s']:.1f}) | {r['planning_s']:.1f}"
            + (f" ({r['planning_cpu_s']:.1f})" if "planning_cpu_s" in r else "")
            + f" | {r['plan_auto_calls']} | "
            f"{r['load_average']:.1f} | {r['chosen'].lstrip('* ')} | "
            f"{', '.join(f'{x:.6f}' for x in r['losses'])} |")
    for r in rows:
        lines += ["", f"## {r['label']}: candidates", ""] + [f"- {c}" for c in r["candidates"]]
    lines += ["", NOTES.strip()]
    (RESULTS / "auto_speed.md").write_text("\n".join(lines) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="after")
    parser.add_argument("--json", type=Path, default=RESULTS / "auto_speed.json")
    parser.add_argument("--rewrite", action="store_true", help="only rewrite the markdown")
    args = parser.parse_args()
    rows = json.loads(args.json.read_text())["rows"] if args.json.exists() else []
    if not args.rewrite:
        row = measure()
        row["label"] = args.label
        row["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                       capture_output=True, text=True).stdout.strip()
        print(json.dumps(row, indent=1))
        rows = [r for r in rows if r["label"] != args.label] + [row]
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows}, indent=1))
    write_md(rows)


if __name__ == "__main__":
    main()
