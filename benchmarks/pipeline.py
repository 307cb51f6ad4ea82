"""Pipeline benchmark: controller overhead per action and the simulated bubble.

XLA's CPU client runs multi-device executables one at a time, so CPU timings cannot show
stage overlap. On CPU this measures:

* **controller overhead**: a step of a tiny 4-stage MLP (8 micro-batches, 1F1B) whose compute
  is negligible, through the controller and as a direct replay of the dispatches it recorded
  (the same compiled executables and ``jax.device_put`` copies with the same arguments, from
  a plain loop), in interleaved rounds: (controller - replay) per action (F, B, apply, split,
  finalize, accumulator init) and transfer; also the whole step per action. Target: under
  0.3 ms per action.
* **bubble**: per-stage F and B times measured by running one step blocking per action (the
  stage execution trace), fed to the simulator for gpipe, 1f1b and zero_bubble; the same run
  drawn as a PNG timeline (``results/pipeline.png``).
* **stage plans**: every task is planned by the intra-operator planner on its sub-mesh, its
  inputs pinned to the layouts their producers give them; per schedule (1f1b,
  interleaved_1f1b with 2 virtual stages per sub-mesh) the planning/compile time, tasks
  planned, the transfers per step (reshards on a sub-mesh, device-to-device copies) and the
  audit: collective bytes per step the task plans predict against the compiled tasks, and
  compiled collectives no plan predicted.
* **optimizer and cut moves**: a 2-stage MLP with Adam after global-norm clipping: copies
  and reshards per step (Adam's moments stay on their parameter's sub-mesh), the values
  crossing between apply tasks; and the plan's estimate for the cut between sub-meshes of
  4 and 2 devices (gathered and copied whole) against 2 and 2 (shard for shard).
* **gradient reduction**: a 2-stage data-parallel MLP (4 devices per stage, 16 micro-batches):
  collective bytes per step in the backward tasks (gradients kept partial over the batch axis)
  and in the once-per-step reduce tasks, against ``k`` times that reduction (what reducing in
  every backward task costs; the runtime did that before commit fafbed5); the same on (2, 2)
  sub-meshes split over data and model axes (reduced in every backward before 71d3703).

Run: ``XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/pipeline.py``;
writes ``benchmarks/results/pipeline.{json,md,png}``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import autoshard  # noqa: E402
from autoshard.pipeline import ManualStageOption, PipeshardParallel, UniformStageOption  # noqa: E402
from autoshard.pipeline.schedules import get_schedule  # noqa: E402
from autoshard.pipeline.simulate import simulate  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def mlp(width: int, num_layers: int, batch: int):
    rng = np.random.default_rng(0)
    params = {f"w{i}": jnp.asarray(rng.normal(size=(width, width)).astype(np.float32) /
                                   np.sqrt(width)) for i in range(num_layers)}
    x = jnp.asarray(rng.normal(size=(batch, width)).astype(np.float32))

    def loss(p, x):
        h = x
        for i in range(num_layers):
            h = jnp.tanh(h @ p[f"w{i}"])
            if i < num_layers - 1:
                autoshard.mark_pipeline_boundary()
        return jnp.mean(h ** 2)

    def step(p, x):
        g = autoshard.grad(loss)(p, x)
        return jax.tree.map(lambda a, b: a - 0.01 * b, p, g)
    return step, params, x


class _Recorder:
    """Wraps a dispatching callable for one recorded step: logs (callable, args, outputs)."""

    def __init__(self, fn, log):
        self.fn, self.log = fn, log

    def __call__(self, *args):
        out = self.fn(*args)
        self.log.append((self.fn, args, out))
        return out


def record_dispatches(f, ex, args) -> tuple[list, list]:
    """One step of ``f`` with every executable the runtime dispatches (tasks, finalize, batch
    split, accumulator init, reshards) and every ``jax.device_put`` logged; returns the log
    and the step's output leaves."""
    assert not ex.sums, "the replay does not cover cross-stage sums"
    log: list = []
    tasks = ex._all_tasks()
    saved = ([t.compiled for t in tasks], ex.finalize, ex._split_fns, ex._zeros_fns,
             ex.move._reshard, jax.device_put)
    for t in tasks:
        t.compiled = _Recorder(t.compiled, log)
    ex.finalize = [(s, _Recorder(fn, log), p, sh) for s, fn, p, sh in ex.finalize]
    ex._split_fns = {v: _Recorder(fn, log) for v, fn in ex._split_fns.items()}
    ex._zeros_fns = {s: (acc, _Recorder(fn, log)) for s, (acc, fn) in ex._zeros_fns.items()}
    ex.move._reshard = {key: _Recorder(fn, log) for key, fn in ex.move._reshard.items()}
    jax.device_put = _Recorder(jax.device_put, log)
    try:
        out = jax.block_until_ready(f(*args))
    finally:
        for t, c in zip(tasks, saved[0], strict=True):
            t.compiled = c
        ex.finalize, ex._split_fns, ex._zeros_fns, ex.move._reshard = saved[1:5]
        jax.device_put = saved[5]
    return log, jax.tree.leaves(out)


def replay_program(log: list, in_leaves: list, out_leaves: list):
    """The log as straight-line code over a list of slots: the step inputs first, then
    constants (shardings, cached micro-batch indices) and each dispatch's outputs. Returns
    ``(ops, env, out_slots)``; an op is ``(callable, argument slots, first output slot,
    number of outputs or None for a single array)``."""
    slot = {id(x): i for i, x in enumerate(in_leaves)}
    env = list(in_leaves)
    ops = []
    for fn, args, out in log:
        refs = []
        for a in args:
            if id(a) not in slot:  # made outside the step: a constant
                assert not isinstance(a, jax.Array) or not a.is_deleted()
                slot[id(a)] = len(env)
                env.append(a)
            refs.append(slot[id(a)])
        many = isinstance(out, (list, tuple))
        outs = list(out) if many else [out]
        ops.append((fn, tuple(refs), len(env), len(outs) if many else None))
        for o in outs:
            slot[id(o)] = len(env)
            env.append(None)
    return ops, env, [slot[id(o)] for o in out_leaves]


def replay(ops, env0, out_slots, in_leaves):
    """Dispatch the recorded executables and copies in order, no controller logic."""
    env = list(env0)
    env[:len(in_leaves)] = in_leaves
    for fn, refs, dst, n in ops:
        out = fn(*[env[i] for i in refs])
        if n is None:
            env[dst] = out
        else:
            env[dst:dst + n] = out
    return [env[i] for i in out_slots]


def controller_overhead(num_stages=4, k=8, rounds=150) -> dict:
    """Step time through the controller against a direct replay of the same dispatches
    (same executables, arguments and shardings) in interleaved rounds; the difference per
    action and transfer is the controller's overhead."""
    step, params, x = mlp(8, num_stages, 8 * k)
    f = autoshard.parallelize(step, method=PipeshardParallel(
        num_micro_batches=k, layer_option="manual",
        stage_option=UniformStageOption(num_stages=num_stages), blocking=True))
    params, x = f.preshard_dynamic_args(params, x)
    params = f(params, x)
    ex = f.get_last_executable()
    ex.blocking = False
    params = jax.block_until_ready(f(params, x))
    log, out_leaves = record_dispatches(f, ex, (params, x))
    treedef = jax.tree.structure(params)
    ops, env0, out_slots = replay_program(log, jax.tree.leaves(params) + [x], out_leaves)
    log = None  # drop the recorded step's arrays
    params = jax.tree.unflatten(treedef, out_leaves)
    r_params = [jnp.copy(p) for p in out_leaves]  # the replay's own state
    r_params = [jax.device_put(p, q.sharding) for p, q in zip(r_params, out_leaves, strict=True)]
    for _ in range(3):  # warm up both
        params = jax.block_until_ready(f(params, x))
        r_params = jax.block_until_ready(replay(ops, env0, out_slots, r_params + [x]))
    ctrl, rep = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        params = jax.block_until_ready(f(params, x))
        t1 = time.perf_counter()
        r_params = jax.block_until_ready(replay(ops, env0, out_slots, r_params + [x]))
        t2 = time.perf_counter()
        ctrl.append((t1 - t0) * 1e3)
        rep.append((t2 - t1) * 1e3)
    same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), r_params,
                                                     strict=True))
    actions = (len(ex.order) + len(ex.apply) + len(ex.finalize) + 1 +
               num_stages)  # + batch split + accumulator init per stage
    transfers = 2 * (num_stages - 1) * k  # activations forward, cotangents backward
    diff = [c - r for c, r in zip(ctrl, rep, strict=True)]

    def quartiles(v):
        return [round(q, 3) for q in statistics.quantiles(v, n=4)]
    n = actions + transfers
    return {"num_stages": num_stages, "num_micro_batches": k, "rounds": rounds,
            "actions": actions, "transfers": transfers, "dispatches_replayed": len(ops),
            "replay_matches_controller": same,
            "step_ms": round(statistics.median(ctrl), 3), "step_ms_quartiles": quartiles(ctrl),
            "replay_ms": round(statistics.median(rep), 3), "replay_ms_quartiles": quartiles(rep),
            "overhead_ms_per_action": round(statistics.median(diff) / n, 4),
            "overhead_ms_per_action_quartiles": [
                round(q / n, 4) for q in statistics.quantiles(diff, n=4)],
            "ms_per_action": round(statistics.median(ctrl) / n, 4), "target_ms": 0.3}


def measured_bubble(num_stages=4, k=8, width=256) -> dict:
    step, params, x = mlp(width, num_stages, 16 * k)
    f = autoshard.parallelize(step, method=PipeshardParallel(
        num_micro_batches=k, layer_option="manual",
        stage_option=UniformStageOption(num_stages=num_stages), blocking=True))
    params = f(params, x)
    ex = f.get_last_executable()
    with tempfile.TemporaryDirectory() as d:
        ex.dump_stage_execution_trace(os.path.join(d, "trace.json"), params, x)
        ex.dump_stage_execution_trace(os.path.join(d, "trace.json"), params, x)
        ex.dump_stage_execution_trace(str(RESULTS / "pipeline.png"))
    costs: dict = {}
    for name, stage, _, dur in ex.trace:
        if name[0] in "FB":
            costs.setdefault((name[0], stage), []).append(dur * 1e3)
    cost = {key: statistics.median(v) for key, v in costs.items()}
    out = {"num_stages": num_stages, "num_micro_batches": k, "width": width,
           "stage_ms": {f"{kind}{s}": round(v, 4) for (kind, s), v in sorted(cost.items())}}
    for name in ("gpipe", "1f1b", "zero_bubble"):
        sched = get_schedule(name, num_stages=num_stages, num_micro_batches=k)
        c = dict(cost)
        if name == "zero_bubble":  # the split halves of each measured backward
            c.update({("Ba", s): cost[("B", s)] / 2 for s in range(num_stages)})
            c.update({("Bw", s): cost[("B", s)] / 2 for s in range(num_stages)})
        sim = simulate(sched, c)
        out[name] = {"makespan_ms": round(sim.makespan, 3),
                     "bubble_fraction": round(sim.bubble_fraction, 4)}
    return out


def stage_plans(k=8, width=64, repeats=5) -> dict:
    """Planning + compile time, planned tasks and transfers per step, per schedule."""
    out = {}
    for name, stages, virtual in (("1f1b", 4, 1), ("interleaved_1f1b", 8, 2)):
        step, params, x = mlp(width, stages, 16 * k)
        f = autoshard.parallelize(step, method=PipeshardParallel(
            num_micro_batches=k, layer_option="manual", pipeline_schedule=name,
            virtual_stages=max(virtual, 2), stage_option=UniformStageOption(num_stages=stages),
            blocking=True))
        params, x = f.preshard_dynamic_args(params, x)
        params = f(params, x)
        ex = f.get_last_executable()
        before = dict(ex.move.counts)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            params = jax.block_until_ready(f(params, x))
            times.append(time.perf_counter() - t0)
        moves = {key: (ex.move.counts[key] - before[key]) / repeats for key in before}
        audit = ex.audit()
        out[name] = {"audit_predicted_bytes": audit.predicted_bytes,
                     "audit_compiled_bytes": audit.compiled_bytes,
                     "audit_unpredicted": len(audit.unpredicted),
                     "audit_within_10pct": audit.within(0.10),
                     "transfer_bytes_per_step": audit.transfer_bytes,
                     "transfers_resharded": sum(t.resharded for t in audit.transfers),
"model_stages": stages, "sub_meshes": ex.schedule.num_ranks,
                     "compile_s": round(ex.timings["compile_s"], 2),
                     "tasks_planned": len(ex.task_plans),
                     "tasks": len(ex.get_task_hlo_texts()),
                     "step_ms": round(statistics.median(times) * 1e3, 2),
                     "reshards_per_step": moves["reshard"], "copies_per_step": moves["copy"]}
    return out


def optimizer_and_cut_moves(width=64, k=4, repeats=3) -> dict:
    """Copies per step of a 2-stage Adam+clipping step; the plan's cut estimates."""
    import optax


    step_sgd, params, x = mlp(width, 4, 16 * k)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))

    def loss(p, x):
        h = x
        for i in range(4):
            h = jnp.tanh(h @ p[f"w{i}"])
            if i < 3:
                autoshard.mark_pipeline_boundary()
        return jnp.mean(h ** 2)

    def step(p, opt, x):
        g = autoshard.grad(loss)(p, x)
        updates, opt = tx.update(g, opt, p)
        return optax.apply_updates(p, updates), opt

    f = autoshard.parallelize(step, batch_argnums=(2,), method=PipeshardParallel(
        devices=jax.devices()[:4], num_micro_batches=k, layer_option="manual", blocking=True,
        stage_option=UniformStageOption(num_stages=2)))
    state = (params, tx.init(params))
    state = f(*state, x)
    ex = f.get_last_executable()
    before = dict(ex.move.counts)
    for _ in range(repeats):
        state = jax.block_until_ready(f(*state, x))
    moves = {key: (ex.move.counts[key] - before[key]) / repeats for key in before}
    apply_moves = [t for t in ex.audit().transfers if t.src.startswith("apply")]
    out = {"adam_copies_per_step": moves["copy"], "adam_reshards_per_step": moves["reshard"],
           "apply_values_crossing": len(apply_moves),
           "apply_bytes_crossing": sum(t.num_bytes for t in apply_moves)}
    for name, shapes in (("4->2", [(4,), (2,)]), ("2->2", [(2,), (2,)])):
        n = sum(s[0] for s in shapes)
        g = autoshard.parallelize(step_sgd, method=PipeshardParallel(
            devices=jax.devices()[:n], num_micro_batches=k, layer_option="manual",
            blocking=True, stage_option=ManualStageOption(
                [[0, 1], [2, 3]], [(1, s[0]) for s in shapes], shapes, [{}, {}])))
        g(params, x)
        plan = g.get_last_executable().plan
        (cut,) = plan.crossings
        out[f"cut_{name}"] = {"bytes_per_micro_batch": cut.num_bytes,
                              "resharded": cut.resharded,
                              "est_us_per_micro_batch": round(cut.seconds * 1e6, 2),
                              "est_ms_per_step": round(plan.transfer_s * 1e3, 4)}
    return out


def grad_reduction(width=64, k=16, model_axis=False) -> dict:
    """Collective bytes per step of a 2-stage pipeline, by task kind: data parallel on 4
    devices per stage, or (``model_axis``) on (2, 2) sub-meshes planned with the batch over
    the first axis and no replicated weights (rows over data, weights over the model axis)."""
    step, params, x = mlp(width, 2, (4 if model_axis else 16) * k)
    if model_axis:
        opt = {"force_batch_dim_to_mesh_dim": 0, "allow_replicated_parameters": False}
        method = PipeshardParallel(
            num_micro_batches=k, layer_option="manual", blocking=True,
            stage_option=ManualStageOption([[0], [1]], [(1, 4), (1, 4)], [(2, 2), (2, 2)],
                                           [opt, opt]))
    else:
        method = PipeshardParallel(
            num_micro_batches=k, layer_option="manual", blocking=True,
            stage_option=UniformStageOption(num_stages=2),
            default_auto_sharding_option=autoshard.AutoShardingOption(force_data_parallel=True))
    f = autoshard.parallelize(step, method=method)
    f(params, x)
    audit = f.get_last_executable().audit()

    def total(prefix):
        return sum(t.runs * t.audit.compiled_bytes for t in audit.tasks
                   if t.name.startswith(prefix))
    reduce_bytes = total("reduce")
    return {"micro_batches": k, "backward_bytes_per_step": total("B"),
            "reduce_bytes_per_step": reduce_bytes, "compiled_bytes_per_step":
            audit.compiled_bytes, "per_micro_batch_reduction_bytes": k * reduce_bytes,
            "unpredicted": len(audit.unpredicted)}


def iqr(quartiles, digits):
    return f"{quartiles[0]:.{digits}f} to {quartiles[2]:.{digits}f}"


def main():
    RESULTS.mkdir(exist_ok=True)
    result = {"jax": jax.__version__, "platform": jax.devices()[0].platform,
              "devices": jax.device_count(), "cpus": os.cpu_count(),
              "load_average": round(os.getloadavg()[0], 1), "controller": controller_overhead(),
              "bubble": measured_bubble(), "stage_plans": stage_plans(),
              "moves": optimizer_and_cut_moves(), "grad_reduction": grad_reduction(),
              "grad_reduction_model_axis": grad_reduction(model_axis=True)}
    (RESULTS / "pipeline.json").write_text(json.dumps(result, indent=1))
    c, b = result["controller"], result["bubble"]
    lines = ["# Pipeline benchmark", "",
             f"jax {result['jax']}, {result['devices']} x {result['platform']} on "
             f"{result['cpus']} CPUs (load average {result['load_average']} at the start)", "",
             "## Controller overhead (tiny 4-stage MLP, 1F1B, CPU)", "",
             f"{c['actions']} dispatches and {c['transfers']} transfers per step "
             f"({c['dispatches_replayed']} recorded and replayed); medians over "
             f"{c['rounds']} interleaved rounds (first to third quartile):", "",
             "| step through the controller (ms) | direct replay of its dispatches (ms) | "
             "controller overhead per action (ms) | whole step per action (ms) |",
             "|---|---|---|---|",
             f"| {c['step_ms']:.2f} ({iqr(c['step_ms_quartiles'], 2)}) | {c['replay_ms']:.2f} "
             f"({iqr(c['replay_ms_quartiles'], 2)}) | **{c['overhead_ms_per_action']:.3f}** "
             f"({iqr(c['overhead_ms_per_action_quartiles'], 3)}) | "
             f"{c['ms_per_action']:.3f} |", "",
             f"Target: overhead under {c['target_ms']} ms per action. The replay calls the "
             "same compiled executables and `jax.device_put` copies with the same arguments "
             "from a plain loop (recorded from one step; its result equals the controller's: "
             f"{c['replay_matches_controller']}); the difference is the controller's own "
             "work (parallelize's call path, scheduling, value bookkeeping).", "",
             "## Bubble simulated from measured stage times", "",
             f"stage times (ms, blocking per action): {b['stage_ms']}", "",
             "| schedule | makespan (ms) | bubble |", "|---|---|---|"]
    for name in ("gpipe", "1f1b", "zero_bubble"):
        lines.append(f"| {name} | {b[name]['makespan_ms']} | {b[name]['bubble_fraction']:.1%} |")
    lines += ["", "Timeline of that run (blocking per action): `pipeline.png`.", "",
              "## Stage plans (MLP width 64, 8 micro-batches, blocking)", "",
              "| schedule | model stages | sub-meshes | tasks planned | compile (s) | "
              "step (ms) | reshards/step | d2d copies/step | collective B/step predicted | "
              "compiled | unpredicted | transfer B/step |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in result["stage_plans"].items():
        lines.append(f"| {name} | {r['model_stages']} | {r['sub_meshes']} | "
                     f"{r['tasks_planned']}/{r['tasks']} | {r['compile_s']} | {r['step_ms']} | "
                     f"{r['reshards_per_step']:g} | {r['copies_per_step']:g} | "
                     f"{r['audit_predicted_bytes']:,} | {r['audit_compiled_bytes']:,} | "
                     f"{r['audit_unpredicted']} | {r['transfer_bytes_per_step']:,} |")
    m = result["moves"]
    lines += ["", "## Optimizer and cut moves (MLP width 64, 4 micro-batches)", "",
              f"2 stages x 2 devices, Adam after global-norm clipping: "
              f"{m['adam_copies_per_step']:g} copies and {m['adam_reshards_per_step']:g} "
              f"reshards per step; {m['apply_values_crossing']} values "
              f"({m['apply_bytes_crossing']} B) cross between apply tasks (scalars: the "
              "clipping norm's partial sums and the step count's bias corrections).", "",
              "| cut | B per micro-batch | resharded | est. us per micro-batch (both ways) | "
              "est. ms per step |", "|---|---|---|---|---|"]
    for name in ("4->2", "2->2"):
        c = m[f"cut_{name}"]
        lines.append(f"| {name} devices | {c['bytes_per_micro_batch']:,} | {c['resharded']} | "
                     f"{c['est_us_per_micro_batch']} | {c['est_ms_per_step']} |")
    g = result["grad_reduction"]
    lines += ["", f"## Gradient reduction (2 data-parallel stages x 4 devices, MLP width 64, "
              f"{g['micro_batches']} micro-batches)", "",
              f"collective bytes per step: {g['backward_bytes_per_step']:,} B in the backward "
              f"tasks (gradients stay partial), {g['reduce_bytes_per_step']:,} B in the "
              f"once-per-step reduce tasks, {g['compiled_bytes_per_step']:,} B in all "
              f"({g['unpredicted']} unpredicted); reducing in every backward task instead: "
              f"{g['per_micro_batch_reduction_bytes']:,} B ({g['micro_batches']}x; measured "
              "524,288 B per step with the runtime before fafbed5)."]
    g = result["grad_reduction_model_axis"]
    lines += ["", f"Sub-meshes split over data and model axes (2 stages on (2, 2), MLP width 64, "
              f"{g['micro_batches']} micro-batches, planned with the batch over the first "
              "axis and no replicated weights): "
              f"{g['backward_bytes_per_step']:,} B in the backward tasks, "
              f"{g['reduce_bytes_per_step']:,} B in the reduce tasks, "
              f"{g['compiled_bytes_per_step']:,} B in all ({g['unpredicted']} unpredicted); "
              "measured with the runtime before 71d3703 (which reduced these stages' "
              "gradients in every backward task): 262,144 B in the backward tasks, 270,336 B "
              "in all."]
    (RESULTS / "pipeline.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
