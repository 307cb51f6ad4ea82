"""Front-end benchmark: calling a parallelized step against the same plan through ``jax.jit``.

Two measurements, each with autoshard and the baseline interleaved in one run:

* **step**: a DataParallel Adam step on a TrainState with about 600 leaves (200 parameter
  arrays): per-step time of ``autoshard.parallelize(step)`` against ``jax.jit`` of the same
  step with the executable's own input/output shardings and donation (the same plan, dispatched
  by jax). Target: at most 1.03x.
* **no-op**: per-call overhead in microseconds of a step that returns its state (no
  collective), for a state of 1 leaf and of 600 leaves: ``autoshard`` minus ``jax.jit``.

Every call is waited for: jaxlib 0.10's CPU client can deadlock when many executables with
collectives are queued on 8 virtual devices of a 2-core machine (plain ``jax.jit`` too).

Also reported: gradient accumulation on the benchmark GPT (``suite_models``, default size with
a batch of 64), compiled
temporary memory per device for k = 1, 2, 4, 8 micro-batches with DataParallel and the
default ShardParallel, and the loss after several steps against k = 1.

Run: ``XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/dispatch.py
[--repeats 30]``; writes ``benchmarks/results/dispatch.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training.train_state import TrainState  # noqa: E402

import autoshard  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
RESULTS = Path(__file__).parent / "results"
NUM_PARAMS, WIDTH, BATCH = 200, 32, 64


def wide_state(num_params: int = NUM_PARAMS) -> TrainState:
    """A TrainState of ``num_params`` small matrices: with Adam, 3 * num_params + 2 leaves."""
    rng = np.random.default_rng(0)
    params = {f"w{i:03d}": jnp.asarray(rng.normal(size=(WIDTH, WIDTH)) / WIDTH, jnp.float32)
              for i in range(num_params)}
    return TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))


def train_step(state, x):
    def loss_fn(params):
        return sum(jnp.mean(jnp.tanh(x @ w) ** 2) for w in params.values())
    loss, grads = autoshard.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def noop_step(state, x):
    return state, x.shape[0]


def _copy(tree):
    return jax.tree.map(lambda a: jnp.array(a, copy=True), tree)


def interleaved(fns: dict, args: dict, repeats: int, inner: int) -> dict[str, list[float]]:
    """Per-call seconds of each fn; rounds alternate the order so drift hits both alike."""
    times = {name: [] for name in fns}
    for r in range(repeats):
        order = list(fns) if r % 2 == 0 else list(reversed(fns))
        for name in order:
            state, x = args[name]
            t = time.perf_counter()
            for _ in range(inner):
                state, out = fns[name](state, x)
                # Wait for each step: jaxlib 0.10's CPU client can deadlock (rendezvous abort)
                # when many executables with collectives are queued on 8 virtual devices.
                jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t) / inner)
            args[name] = (state, x)
    return times


def same_plan_jit(fn, executable):
    """``jax.jit`` of ``fn`` with the executable's placements and donation (the same plan)."""
    specs_in = executable.get_input_placement_specs()
    donate = tuple(i for i, d in enumerate((True, False)) if d)
    return jax.jit(fn, in_shardings=specs_in, out_shardings=executable.get_output_placement_specs(),
                   donate_argnums=donate)


def measure_step(repeats: int) -> dict:
    par = autoshard.parallelize(train_step, method=autoshard.DataParallel())
    state, x = wide_state(), jnp.ones((BATCH, WIDTH))
    ex = par.get_executable(state, x)
    jitted = same_plan_jit(train_step, ex)
    args = {"autoshard": par.preshard_dynamic_args(_copy(state), x),
            "jax.jit": par.preshard_dynamic_args(_copy(state), x)}
    fns = {"autoshard": par, "jax.jit": jitted}
    interleaved(fns, args, 2, 2)  # warm-up (jit compiles here)
    times = interleaved(fns, args, repeats, 5)
    med = {k: float(np.median(v)) for k, v in times.items()}
    (a_state, _), (j_state, _) = args["autoshard"], args["jax.jit"]
    same = all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(
        jax.tree.leaves(a_state.params), jax.tree.leaves(j_state.params), strict=True))
    return {"leaves": len(jax.tree.leaves(state)), "median_s": med,
            "ratio": med["autoshard"] / med["jax.jit"], "same_params": bool(same),
            "target_ratio": 1.03}


def measure_noop(repeats: int) -> list[dict]:
    rows = []
    for num_params in (0, NUM_PARAMS):
        state = wide_state(num_params) if num_params else {"w": jnp.ones((WIDTH, WIDTH))}
        x = jnp.ones((BATCH, WIDTH))
        par = autoshard.parallelize(noop_step, method=autoshard.DataParallel(),
                                    donate_argnums=(), batch_argnums=())
        ex = par.get_executable(state, x)
        jitted = jax.jit(noop_step, in_shardings=ex.get_input_placement_specs(),
                         out_shardings=ex.get_output_placement_specs())
        placed = par.preshard_dynamic_args(state, x)
        args = {"autoshard": placed, "jax.jit": placed}
        fns = {"autoshard": par, "jax.jit": jitted}
        interleaved(fns, args, 2, 5)
        times = interleaved(fns, args, repeats, 50)
        med = {k: float(np.median(v)) for k, v in times.items()}
        rows.append({"leaves": len(jax.tree.leaves(state)) + 1, "median_us": {
            k: v * 1e6 for k, v in med.items()},
            "overhead_us": (med["autoshard"] - med["jax.jit"]) * 1e6})
    return rows


def measure_accumulation(steps: int) -> list[dict]:
    from suite_models import SIZES, make_case  # the suite's GPT
    from suite_plans import autoshard_step as step

    case = make_case("gpt", **dict(SIZES["default"]["gpt"], batch=64))
    state, batch = case.init_state(), (case.inputs, case.labels)
    rows, ref_loss = [], {}
    for method_name, make in (("DataParallel", autoshard.DataParallel),
                              ("ShardParallel", lambda num_micro_batches: autoshard.ShardParallel(
                                  num_micro_batches=num_micro_batches,
                                  auto_sharding_option=autoshard.AutoShardingOption(
                                      show_progress=False)))):
        for k in (1, 2, 4, 8):
            f = autoshard.parallelize(step, method=make(num_micro_batches=k))
            ex = f.get_executable(state, batch)
            mem = ex.compiled.memory_analysis()
            s = jax.tree.map(lambda a: jnp.array(a, copy=True), state)
            losses = []
            for _ in range(steps):
                s, loss = f(s, batch)
                losses.append(float(loss))
            ref_loss.setdefault(method_name, losses[-1])
            rows.append({"method": method_name, "k": k, "temp_bytes": int(mem.temp_size_in_bytes),
                         "total_allocation": ex.get_total_allocation_size(),
                         "loss_last": losses[-1],
                         "loss_rel_diff_vs_k1": abs(losses[-1] - ref_loss[method_name]) / abs(
                             ref_loss[method_name])})
    return rows


def write(results: dict, out: Path):
    out.mkdir(parents=True, exist_ok=True)
    (out / "dispatch.json").write_text(json.dumps(results, indent=1))
    s, lines = results["step"], []
    lines += ["# Front-end dispatch", "",
              f"{results['devices']} devices, jax {results['jax']}, {results['machine']}", "",
              f"## Train step, {s['leaves']}-leaf TrainState (DataParallel, Adam)", "",
              "| | median step |", "|---|---:|"]
    lines += [f"| {k} | {v * 1e3:.3f} ms |" for k, v in s["median_s"].items()]
    lines += ["", f"ratio autoshard / jax.jit (same plan): **{s['ratio']:.3f}x** "
              f"(target <= {s['target_ratio']}x: {'met' if s['ratio'] <= 1.03 else 'missed'}); "
              f"parameters equal after the run: {s['same_params']}", "",
              "## No-op step: per-call overhead", "",
              "| leaves | autoshard | jax.jit | overhead |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['leaves']} | {r['median_us']['autoshard']:.1f} us | "
              f"{r['median_us']['jax.jit']:.1f} us | {r['overhead_us']:.1f} us |"
              for r in results["noop"]]
    lines += ["", "## Gradient accumulation on the suite's GPT", "",
              "| method | k | temp bytes / device | total allocation | loss after steps | "
              "rel. diff to k=1 |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['method']} | {r['k']} | {r['temp_bytes']:,} | {r['total_allocation']:,} | "
              f"{r['loss_last']:.5f} | {r['loss_rel_diff_vs_k1']:.1e} |"
              for r in results["accumulation"]]
    (out / "dispatch.md").write_text("\n".join(lines) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--accumulation-steps", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    results = {"devices": jax.device_count(), "jax": jax.__version__,
               "machine": f"{platform.machine()}, {os.cpu_count()} cores",
               "step": measure_step(args.repeats), "noop": measure_noop(args.repeats),
               "accumulation": measure_accumulation(args.accumulation_steps)}
    write(results, args.out)
    print((args.out / "dispatch.md").read_text())


if __name__ == "__main__":
    main()
