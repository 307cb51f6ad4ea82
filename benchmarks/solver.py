"""Planner benchmark: planning time (trace + ILP) vs plain ``jax.jit`` compile time of a GPT.

GPT train step (causal attention, pre-LN, Adam) with hidden 1024 and 16 heads, unrolled over
2, 6, 12, 24 and 48 layers, planned for 8 devices. Everything runs on abstract shapes: no
parameter is allocated. For each depth:

* ``trace_s``: ``jax.make_jaxpr`` of the train step,
* ``plan_s``: ``plan_auto`` (graph, strategies, ILP over every candidate mesh, the
  data-parallel comparison),
* ``planned_compile_s``: XLA compile of the planned program (``apply_plan`` under ``jax.jit``
  with the plan's shardings, 8 devices),
* ``jit_compile_s``: XLA compile of the same train step with plain ``jax.jit`` (one device).

Run: ``XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/solver.py
[--layers 2 6 12] [--no-compile]``; writes ``benchmarks/results/solver.{json,md}``.
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
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402

from autoshard.sharding import AutoShardingOption, apply_plan, plan_auto  # noqa: E402

HIDDEN, HEADS, VOCAB, SEQ, BATCH, DEVICES = 1024, 16, 8192, 128, 16, 8
RESULTS = Path(__file__).parent / "results"


def layer_norm(x, scale):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale


def block(p, x):
    h = layer_norm(x, p["ln1"])
    q, k, v = (jnp.einsum("bsd,dhk->bshk", h, p[n]) for n in ("wq", "wk", "wv"))
    s = jnp.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(q.shape[-1])
    n = x.shape[1]
    s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -1e9)
    o = jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(s, axis=-1), v)
    x = x + jnp.einsum("bqhk,hkd->bqd", o, p["wo"])
    h = jax.nn.gelu(layer_norm(x, p["ln2"]) @ p["w1"])
    return x + h @ p["w2"]


def gpt_loss(params, tokens, targets):
    x = params["embed"][tokens]
    for p in params["layers"]:
        x = block(p, x)
    logits = layer_norm(x, params["ln_f"]) @ params["embed"].T
    logp = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


TX = optax.adam(1e-3)


def train_step(state, tokens, targets):
    params, opt = state
    loss, grads = jax.value_and_grad(gpt_loss)(params, tokens, targets)
    updates, opt = TX.update(grads, opt, params)
    return (optax.apply_updates(params, updates), opt), loss


def abstract_state(layers: int):
    f32 = jnp.float32
    hd = HIDDEN // HEADS

    def s(*shape):
        return jax.ShapeDtypeStruct(shape, f32)

    layer = {"ln1": s(HIDDEN), "ln2": s(HIDDEN), "wq": s(HIDDEN, HEADS, hd),
             "wk": s(HIDDEN, HEADS, hd), "wv": s(HIDDEN, HEADS, hd), "wo": s(HEADS, hd, HIDDEN),
             "w1": s(HIDDEN, 4 * HIDDEN), "w2": s(4 * HIDDEN, HIDDEN)}
    params = {"embed": s(VOCAB, HIDDEN), "layers": [dict(layer) for _ in range(layers)],
              "ln_f": s(HIDDEN)}
    opt = jax.eval_shape(TX.init, params)
    return params, opt


def run(layers: int, compile_: bool) -> dict:
    state = abstract_state(layers)
    tokens = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
    row = {"layers": layers}
    t0 = time.perf_counter()
    closed = jax.make_jaxpr(train_step)(state, tokens, tokens)
    row["trace_s"] = time.perf_counter() - t0
    row["num_equations"] = len(closed.jaxpr.eqns)
    leaves = len(jax.tree.leaves(state))
    n_out = len(closed.jaxpr.outvars)
    t0 = time.perf_counter()
    plan = plan_auto(closed, num_devices=DEVICES,
                     option=AutoShardingOption(show_progress=False),
                     in_paths=[f"state{i}" for i in range(leaves)] + ["tokens", "targets"],
                     out_paths=[f"out{i}" for i in range(n_out)],
                     batch_invars=[False] * leaves + [True, True],
                     aliases=[(i, i) for i in range(leaves)])
    row["plan_s"] = time.perf_counter() - t0
    row["planning_s"] = row["trace_s"] + row["plan_s"]
    row["mesh"] = list(plan.mesh_shape)
    row["objective_ms"] = plan.objective.total_s * 1e3
    row["data_parallel_ms"] = (plan.objective.data_parallel_s or float("nan")) * 1e3
    row["solver_status"] = plan.objective.solver_status
    if compile_:
        devices = np.array(jax.devices()[:DEVICES]).reshape(plan.mesh_shape)
        mesh = Mesh(devices, plan.axis_names, axis_types=(AxisType.Auto,) * devices.ndim)
        flat = jax.tree.leaves((state, tokens, tokens))
        fn = apply_plan(closed, plan, mesh)
        t0 = time.perf_counter()
        jax.jit(fn, in_shardings=tuple(NamedSharding(mesh, s) for s in plan.in_specs),
                out_shardings=[NamedSharding(mesh, s) for s in plan.out_specs]
                ).lower(*flat).compile()
        row["planned_compile_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        jax.jit(train_step).lower(state, tokens, tokens).compile()
        row["jit_compile_s"] = time.perf_counter() - t0
        row["ratio"] = (row["planning_s"] + row["planned_compile_s"]) / row["jit_compile_s"]
    return row


def write(rows: list[dict]):
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = {"jax": jax.__version__, "python": platform.python_version(),
            "cpus": os.cpu_count(), "hidden": HIDDEN, "heads": HEADS, "vocab": VOCAB,
            "seq": SEQ, "batch": BATCH, "devices": DEVICES, "optimizer": "adam"}
    (RESULTS / "solver.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = ["# Planner benchmark: GPT (hidden 1024, 16 heads, Adam) on 8 devices", "",
             f"jax {meta['jax']}, {meta['cpus']} CPUs (shared), XLA CPU with 8 virtual devices. "
             "Times in seconds. `planning` = trace + plan_auto; `ratio` = (planning + planned "
             "compile) / plain jit compile.", "",
             "| layers | eqns | trace | plan_auto | planning | planned compile | plain jit "
             "compile | ratio | mesh | objective ms | DP ms | status |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    for r in rows:
        def f(key, r=r):
            return f"{r[key]:.2f}" if key in r else "-"
        lines.append(f"| {r['layers']} | {r['num_equations']} | {f('trace_s')} | {f('plan_s')} "
                     f"| {f('planning_s')} | {f('planned_compile_s')} | {f('jit_compile_s')} "
                     f"| {f('ratio')} | {'x'.join(map(str, r['mesh']))} "
                     f"| {r['objective_ms']:.3f} | {r['data_parallel_ms']:.3f} "
                     f"| {r['solver_status']} |")
    lines += ["", "Targets:"]
    by = {r["layers"]: r for r in rows}
    if 24 in by:
        t = by[24]["planning_s"]
        lines.append(f"- 24-layer GPT planned in {t:.2f} s (target < 10 s): "
                     f"{'met' if t < 10 else 'NOT met'}.")
    ratios = [(r["layers"], r["ratio"]) for r in rows if "ratio" in r]
    if ratios:
        bad = [n for n, x in ratios if x > 2]
        lines.append("- plan + XLA compile <= 2x plain jit compile: "
                     + ("met for every depth." if not bad else
                        f"NOT met for {bad} layers (the SPMD-partitioned compile of a small "
                        "program costs about 2x its single-device compile before planning "
                        "is added); met for the others."))
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        per_layer = (last["plan_s"] - first["plan_s"]) / (last["layers"] - first["layers"])
        lines.append(f"- plan_auto grows by {per_layer:.3f} s per layer between "
                     f"{first['layers']} and {last['layers']} layers (the ILP keeps one size: "
                     "repeated layers share variables; graph and strategy work is linear).")
    lines += ["", "Timings come from a 2-core machine shared with other jobs; a run under load "
              "(load average 5-10) gave about 2x these planning times."]
    (RESULTS / "solver.md").write_text("\n".join(lines) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 6, 12, 24, 48])
    parser.add_argument("--no-compile", action="store_true", help="skip the XLA compiles")
    parser.add_argument("--rewrite", action="store_true",
                        help="only rewrite solver.md from results/solver.json")
    args = parser.parse_args(argv)
    if args.rewrite:
        write(json.loads((RESULTS / "solver.json").read_text())["rows"])
        return
    rows = []
    for layers in args.layers:
        rows.append(run(layers, not args.no_compile))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        write(rows)


if __name__ == "__main__":
    main()
