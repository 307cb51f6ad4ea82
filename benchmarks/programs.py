"""Real training programs under every method, against ``jax.jit`` (issue 21's row set).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/programs.py
    python benchmarks/programs.py --quick                  # tiny shapes, fewer steps and cells
    python benchmarks/programs.py --programs lstm --cells DataParallel:4,ShardParallel:4
    python benchmarks/programs.py --report-only            # programs.md from programs.json

Four Flax programs in the style of public examples (``programs_models.py``: a Transformer LM
with metrics after the gradient, a ResNet with BatchNorm, a bidirectional LSTM with ``nn.scan``
and integer counts, a nanoGPT-style GPT with tied embeddings; plus the LM with pipeline
markers) run under every method with k = 1 and k = 4 micro-batches, and under the default
``autoshard.parallelize(step)``. Per cell: whether it runs (an exception is recorded with its
type and first line; the run goes on), the largest relative difference to ``jax.jit`` of the
loss (every step), each metric and the parameters after the steps, the step time (median) and
its ratio to ``jax.jit``'s and to the method's k = 1 step, and compiled against predicted
collective bytes from ``audit()``.

Writes ``programs.json`` and ``programs.md`` into ``--out`` (default ``benchmarks/results``);
``programs_<size>.json`` and ``.md`` for ``--size large`` or ``xlarge``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

import autoshard  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import programs_models as models  # noqa: E402
from suite_runner import time_limit  # noqa: E402

RESULTS = Path(__file__).parent / "results"
TOLERANCE = 1e-4          # largest relative difference that counts as equal (float32)
NOISE_FLOOR = 1e-3        # a state leaf's scale is at least this fraction of its field's largest
MAX_K_RATIO = 1.5         # a micro-batched step at most this much slower than its k=1 step
METHODS = ("ShardParallel", "ShardParallel@measured", "DataParallel", "Zero2Parallel",
           "Zero3Parallel", "PipeshardParallel", "AutoParallel", "default")
"""``ShardParallel@measured``: ``ShardParallel(cluster=Cluster.measure())``, the plan priced
for what these CPU devices deliver (measured once per run) instead of the accelerator-like
description ``Cluster.from_devices`` gives CPUs."""
ALL_CELLS = tuple(f"{m}:{k}" for m in METHODS if m != "default" for k in (1, 4)) + (
    "AutoParallel:1+4", "default")
QUICK_CELLS = ("ShardParallel:1", "ShardParallel:4", "DataParallel:4", "Zero3Parallel:4",
               "PipeshardParallel:1", "PipeshardParallel:4", "default")
QUICK_MARKED_CELLS = ("PipeshardParallel:1", "PipeshardParallel:4")


class CellTimeout(BaseException):
    """A cell over its time (a BaseException, so the cell's own ``except Exception`` lets it by)."""




def make_method(cell: str, program: models.Program):
    """The ParallelMethod of ``cell`` ("Method:k" or "default": None, parallelize's own;
    "AutoParallel:1+4": num_micro_batches 1, micro_batch_counts (4,): the count searched)."""
    if cell == "default":
        return None
    name, counts = cell.split(":")
    k, *more = (int(x) for x in counts.split("+"))
    if name == "PipeshardParallel":
        layers = "manual" if program.has_markers else autoshard.AutoLayerOption(layer_num=2)
        return autoshard.PipeshardParallel(
            num_micro_batches=k, layer_option=layers,
            stage_option=autoshard.UniformStageOption(num_stages=2))
    if name == "AutoParallel":  # one mesh or a pipeline, as it prices them on these devices
        layers = "manual" if program.has_markers else autoshard.AutoLayerOption(layer_num=2)
        return autoshard.AutoParallel(num_micro_batches=k, layer_option=layers,
                                      micro_batch_counts=tuple(more) or None)
    if name.endswith("@measured"):
        return autoshard.ShardParallel(num_micro_batches=None if k == 1 else k,
                                       cluster=measured_cluster())
    method = getattr(autoshard, name)
    return method() if k == 1 else method(num_micro_batches=k)


_MEASURED: dict = {}


def measured_cluster() -> autoshard.Cluster:
    """``Cluster.measure()`` of the devices, once per run (its figures go into the JSON)."""
    if "cluster" not in _MEASURED:
        _MEASURED["cluster"] = autoshard.Cluster.measure()
    return _MEASURED["cluster"]


def cell_k(cell: str) -> int:
    return 1 if cell == "default" else int(cell.split(":")[1].split("+")[0])


# Numbers ---------------------------------------------------------------------------------------
def rel_diff(a, b, floor: float = 0.0) -> float:
    """max |a - b| / max(max |b|, floor) (0 when equal; inf when the shapes differ or the
    scale is 0)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return math.inf
    err = float(np.max(np.abs(a - b))) if a.size else 0.0
    if err == 0.0:
        return 0.0
    scale = max(float(np.max(np.abs(b))), floor)
    return err / scale if scale > 0 else math.inf


def leaves(tree) -> dict:
    """Leaves by path ("block_0/Dense_0/kernel")."""
    return {jax.tree_util.keystr(p, simple=True, separator="/"): x
            for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def tree_diff(got, want, floor: float = 0.0) -> dict[str, float]:
    """Relative difference per leaf path of two pytrees; a missing or extra leaf is inf."""
    got_leaves, want_leaves = leaves(got), leaves(want)
    return {path: (rel_diff(got_leaves[path], want_leaves[path], floor)
                   if path in got_leaves and path in want_leaves else math.inf)
            for path in sorted(set(got_leaves) | set(want_leaves))}


def shape_notes(got, want) -> list[str]:
    """Leaves whose shape or dtype differ from the reference's (e.g. a count of a micro-batch)."""
    notes, want_leaves = [], leaves(want)
    for path, x in leaves(got).items():
        x = np.asarray(x)
        if path in want_leaves:
            w = np.asarray(want_leaves[path])
            if x.shape != w.shape or x.dtype != w.dtype:
                notes.append(f"{path}: {x.dtype}{list(x.shape)} (jax.jit: {w.dtype}"
                             f"{list(w.shape)})")
    return notes


def worst(diffs: dict[str, float]) -> tuple[str | None, float | None]:
    if not diffs:
        return None, None
    path = max(diffs, key=lambda p: diffs[p])
    return path, diffs[path]


# Running ---------------------------------------------------------------------------------------
def fresh(tree):
    """A copy of the host state for one run (runs donate what they are given)."""
    return jax.tree.map(np.array, tree)


def fields(state, names) -> dict:
    return jax.device_get({n: getattr(state, n) for n in names})


def run_steps(fn, program: models.Program, rng, args, progress: dict | None = None):
    """Run ``fn`` for ``args.steps`` steps from the initial state; returns a trace dict.

    ``progress["step"]`` holds the step being run (1 is the first call, which compiles)."""
    state, batch = fresh(program.state), program.batch
    metrics, t0 = [], time.perf_counter()
    first_call_s = None
    states = [fresh(state)]   # on the host: each step's input, and the last step's output
    for i in range(args.steps):
        if progress is not None:
            progress["step"] = i + 1
        state, m = fn(state, batch, rng)
        metrics.append(jax.device_get(m))
        states.append(fresh(jax.device_get(state)))
        if i == 0:
            first_call_s = time.perf_counter() - t0
    return state, {"metrics": metrics, "fields": fields(state, program.state_fields),
                   "first_call_s": first_call_s, "states": states}


def time_steps(fn, state, batch, rng, args) -> tuple[object, list[float]]:
    """``args.warmup`` untimed, then ``args.repeats`` timed steps, each waited for."""
    for _ in range(args.warmup):
        state, m = fn(state, batch, rng)
        jax.block_until_ready((state, m))
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        state, m = fn(state, batch, rng)
        jax.block_until_ready((state, m))
        times.append(time.perf_counter() - t)
    return state, times


def reference(program: models.Program, rng, args) -> dict:
    """``jax.jit`` on one device: the whole-batch trace and step time, and the micro-batch
    rule's trace (k = 4) where the program defines one."""
    ref = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fn = jax.jit(program.step)
        ref["fns"] = {"whole": fn}
        state, ref["whole"] = run_steps(fn, program, rng, args)
        _, times = time_steps(fn, state, program.batch, rng, args)
        ref["step_time_s"] = statistics.median(times)
        ref["step_times_s"] = times
        if program.micro_batch_reference is not None:
            ref["fns"]["rule"] = jax.jit(program.micro_batch_reference(4))
            _, ref["rule"] = run_steps(ref["fns"]["rule"], program, rng, args)
        if program.hand_loop is not None:
            ref["by_hand"] = by_hand(program, rng, args)
    return ref


def by_hand(program: models.Program, rng, args) -> dict:
    """What a user writes without autoshard: ``jax.jit`` with the batch rows split over every
    device and the state replicated, at k = 1 (the step) and k = 4 (the program's loop over
    micro-batches, ``hand_loop``). Median step times."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("rows",))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows"))
    times = {}
    for k, step in ((1, program.step), (4, program.hand_loop(4))):
        state = jax.device_put(fresh(program.state), whole)
        batch = jax.device_put(program.batch, rows)
        _, t = time_steps(jax.jit(step), state, batch, jax.device_put(rng, whole), args)
        times[k] = statistics.median(t)
    return {"k1_s": times[1], "k4_s": times[4]}


def audit_record(executable) -> dict:
    a = executable.audit()
    pipeline = hasattr(a, "tasks")
    rec = {"kind": "pipeline" if pipeline else "sharding",
           "has_prediction": bool(a.has_prediction),
           "predicted_bytes": int(a.predicted_bytes), "compiled_bytes": int(a.compiled_bytes),
           "bytes_ratio": float(a.bytes_ratio()) if a.has_prediction else None,
           "within": bool(a.within()), "num_unpredicted": len(a.unpredicted)}
    if pipeline:
        rec["transfer_bytes"] = int(a.transfer_bytes)
        rec["stage_memory"] = {str(s): list(v) for s, v in a.stage_memory().items()}
    else:
        rec["compiled_memory"] = int(a.compiled_memory)
        rec["predicted_memory"] = a.predicted_memory
        ratio = a.memory_ratio()
        rec["memory_ratio"] = None if ratio is None else float(ratio)
    ratio = rec["bytes_ratio"]
    rec["bytes_divergent"] = bool(a.has_prediction and ratio is not None
                                  and (ratio < 0.5 or ratio > 1.1))
    return rec


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:400] if text else ""


def run_cell(program: models.Program, cell: str, ref: dict, rng, args) -> dict:
    k = cell_k(cell)
    rule = k > 1 and program.micro_batch_reference is not None
    record = {"program": program.name, "cell": cell,
              "method": cell.split(":")[0] if cell != "default" else "default", "k": k,
              "status": "ok", "error_type": None, "error": None, "failed_at": None,
              "reference": "jax.jit, micro-batch rule" if rule else "jax.jit",
              "warnings": []}
    stage = "parallelize"
    t_start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with time_limit(args.cell_timeout, CellTimeout, "--cell-timeout"):
                method = make_method(cell, program)
                f = (autoshard.parallelize(program.step) if method is None
                     else autoshard.parallelize(program.step, method=method))
                stage, progress = "steps", {}
                state, trace = run_steps(f, program, rng, args, progress)
                record["first_call_s"] = trace["first_call_s"]
                stage = "audit"
                try:
                    record["audit"] = audit_record(f.get_last_executable())
                except Exception as e:  # the audit failing must not hide the numbers
                    record["audit"] = {"error": f"{type(e).__name__}: {first_line(e)}"}
                stage = "compare"
                record.update(compare(program, trace, ref, k, args, rng))
                stage = "timing"
                try:
                    placed = f.preshard_dynamic_args(state, program.batch, rng)
                    batch, key = placed[1], placed[2]
                except Exception as e:
                    record["preshard_error"] = f"{type(e).__name__}: {first_line(e)}"
                    batch, key = program.batch, rng
                _, times = time_steps(f, state, batch, key, args)
                record["step_time_s"] = statistics.median(times)
                record["step_times_s"] = times
                record["step_time_ratio_to_jit"] = record["step_time_s"] / ref["step_time_s"]
        except (Exception, CellTimeout) as e:
            if stage == "steps":
                stage = f"step {progress['step']}"
            record.update(status="timeout" if isinstance(e, CellTimeout) else "error",
                          error_type=type(e).__name__, error=first_line(e), failed_at=stage)
    seen = []
    for w in caught:
        line = f"{w.category.__name__}: {first_line(w.message)}"
        if line not in seen:
            seen.append(line)
    record["warnings"] = seen
    record["wall_s"] = time.perf_counter() - t_start
    autoshard.clear_executable_cache()
    gc.collect()
    return record


def compare(program: models.Program, trace: dict, ref: dict, k: int, args, rng) -> dict:
    """Relative differences of the loss (every step), each metric and the state fields."""
    if k > 1 and args.dropout > 0:
        return {"compared": False,
                "not_compared_why": "dropout masks differ per micro-batch (key folded with the "
                                    "micro-batch index)"}
    want = ref["rule"] if k > 1 and "rule" in ref else ref["whole"]
    got_m, want_m = trace["metrics"], want["metrics"]
    loss = [rel_diff(g["loss"], w["loss"]) for g, w in zip(got_m, want_m, strict=True)]
    metric_diffs: dict[str, float] = {}
    for g, w in zip(got_m, want_m, strict=True):
        others = ({n: v for n, v in g.items() if n != "loss"},
                  {n: v for n, v in w.items() if n != "loss"})
        for path, d in tree_diff(*others).items():
            metric_diffs[path] = max(metric_diffs.get(path, 0.0), d)
    out = {"compared": True, "loss_rel_diff_per_step": loss, "loss_rel_diff": max(loss),
           "metric_rel_diff": metric_diffs, "metric_notes": shape_notes(got_m[-1], want_m[-1])}
    got_last, want_last = leaves(got_m[-1]), leaves(want_m[-1])
    for path, d in metric_diffs.items():   # scalars that differ, as values (e.g. a count 8 vs 32)
        if d >= TOLERANCE and np.size(got_last.get(path)) == 1 == np.size(want_last.get(path)):
            g, w = np.asarray(got_last[path]).item(), np.asarray(want_last[path]).item()
            out["metric_notes"].append(f"{path} at the last step: {g} (reference {w})")
    for name in program.state_fields:
        diffs = field_diff(trace["fields"][name], want["fields"][name])
        path, value = worst(diffs)
        out[f"{name}_rel_diff"] = value
        out[f"{name}_worst_leaf"] = path
    if want is not ref["whole"]:    # how far the rule is from the whole-batch step, for scale
        out["loss_rel_diff_to_whole_batch"] = max(
            rel_diff(g["loss"], w["loss"]) for g, w in zip(
                got_m, ref["whole"]["metrics"], strict=True))
    values = [out["loss_rel_diff"], *metric_diffs.values(),
              *(out[f"{n}_rel_diff"] for n in program.state_fields)]
    out["matches"] = all(v is not None and v < TOLERANCE for v in values)
    out.update(replay(program, trace, ref["fns"]["rule" if want is not ref["whole"] else "whole"],
                      rng))
    return out


def replay(program: models.Program, trace: dict, fn, rng) -> dict:
    """The reference's step run from each of the cell's own states, against the cell's step.

    Five chained float32 steps can end apart by more than any one step's rounding: where a
    step's result is sensitive to its input's last bits (a max-pool or ReLU near a tie, a
    gradient entry near zero under Adam, or a kernel that rounds poorly on some inputs), two
    trajectories that start from states one rounding apart part ways. Replaying the reference
    from the cell's states separates that from a cell that computes another step: the worst
    relative difference, over steps, of every metric and state field.

    Where a step still differs by ``TOLERANCE`` or more, the step is also run in float64 from
    the same state (``float64_step``): a leaf whose cell value is within twice the float32
    reference's own distance from the float64 value is as exact as the reference is (Adam's
    first update, ``lr * g / (|g| + eps)``, is that sensitive where ``|g|`` is near ``eps``)."""
    worst_path, worst_value, ratio, notes = None, 0.0, None, []
    for i, metrics in enumerate(trace["metrics"]):
        state_in = trace["states"][i]
        state, want_m = fn(fresh(state_in), program.batch, rng)
        got = {"metrics": metrics, **{n: getattr(trace["states"][i + 1], n)
                                      for n in program.state_fields}}
        want = {"metrics": jax.device_get(want_m),
                **fields(state, program.state_fields)}
        diffs = step_diffs(program, got, want)
        path, value = worst(diffs)
        if value is None:
            continue
        over = [p for p, d in diffs.items() if d >= TOLERANCE]
        if over:
            try:
                exact = float64_step(program, fn, state_in, rng)
            except Exception as e:   # a program that cannot run in float64: strict criterion
                notes.append(f"step {i + 1}: no float64 step ({type(e).__name__}: "
                             f"{first_line(e)[:120]})")
                exact = None
            if exact is not None:
                cell_err, ref_err = step_diffs(program, got, exact), step_diffs(program, want,
                                                                                  exact)
                for p in over:
                    r = cell_err[p] / ref_err[p] if ref_err[p] > 0 else math.inf
                    ratio = r if ratio is None else max(ratio, r)
                    if cell_err[p] <= max(2.0 * ref_err[p], TOLERANCE):
                        diffs[p] = 0.0   # as exact as the reference's own step
                path, value = worst(diffs)
        if value >= worst_value:
            worst_path, worst_value = f"step {i + 1}: {path}", value
    return {"replay_rel_diff": worst_value, "replay_worst": worst_path,
            "replay_float64_ratio": ratio, "replay_notes": notes,
            "matches_stepwise": worst_value < TOLERANCE}


def step_diffs(program: models.Program, got: dict, want: dict) -> dict[str, float]:
    """Relative difference per leaf of one step's metrics and state fields (a state leaf's
    scale at least ``NOISE_FLOOR`` of its field's largest value, as ``compare`` measures)."""
    diffs = {f"metrics/{p}": d for p, d in tree_diff(got["metrics"], want["metrics"]).items()}
    for name in program.state_fields:
        diffs.update({f"{name}/{p}": d for p, d in field_diff(got[name], want[name]).items()})
    return diffs


def field_diff(got, want) -> dict[str, float]:
    """``tree_diff`` of one state field. A leaf that is rounding noise in the reference (a
    bias right before a BatchNorm: its gradient is zero up to rounding, its values ~1e-6) is
    measured against ``NOISE_FLOOR`` of the field's largest value, not against its own."""
    field_scale = max((float(np.max(np.abs(np.asarray(x)))) for x in leaves(want).values()
                       if np.size(x)), default=0.0)
    return tree_diff(got, want, floor=NOISE_FLOOR * field_scale)


def float64_step(program: models.Program, fn, state, rng) -> dict:
    """``fn``'s step from ``state`` with every float input in float64 (``jax.enable_x64``)."""
    def wide(x):
        x = np.asarray(x)
        return x.astype(np.float64) if np.issubdtype(x.dtype, np.floating) else x
    with jax.enable_x64(True):
        out, m = jax.jit(fn.__wrapped__ if hasattr(fn, "__wrapped__") else fn)(
            jax.tree.map(wide, state), jax.tree.map(wide, program.batch), rng)
        return {"metrics": jax.device_get(m), **fields(out, program.state_fields)}


def derive(records: list[dict]) -> None:
    """Ratio of each micro-batched cell's step time to the same method's k = 1 cell."""
    by_key = {(r["program"], r["cell"]): r for r in records}
    for r in records:
        if r["k"] > 1 and r.get("step_time_s"):
            base = by_key.get((r["program"], f"{r['method']}:1"))
            if base and base.get("step_time_s"):
                r["step_time_ratio_to_k1"] = r["step_time_s"] / base["step_time_s"]


# Report ----------------------------------------------------------------------------------------
def _num(x, fmt="{:.1e}"):
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return fmt.format(x)


def _mark(ok):
    return "" if ok else " **!**"


def markdown(result: dict) -> str:
    s, m = result["settings"], result["machine"]
    lines = ["# Real training programs under every method", "",
             f"{m['num_devices']} x {m['backend']} devices, {m['cpu_count']} CPU cores, jax "
             f"{m['jax']}, flax {m['flax']}, optax {m['optax']}, commit `{m['git_commit']}`"
             f"{' (dirty)' if m['git_dirty'] else ''}, size `{s['size']}`, {s['steps']} steps "
             f"compared, step time the median of {s['repeats']} timed steps after "
             f"{s['warmup']} warm-up, dropout rate {s['dropout']}, wall time "
             f"{result['wall_s']:.0f} s.", "",
             "Reference: the same step under plain `jax.jit` on one device, from the same "
             "initial state, batch and PRNG key. Differences are max |a - b| / max |b| per "
             "leaf: the loss over every step, each metric leaf (worst over steps), the "
             "parameters (and BatchNorm statistics) after the last step, where a state "
             f"leaf's max |b| is taken as at least {NOISE_FLOOR:g} of the largest value of its "
             "field (a bias right before a BatchNorm has a zero gradient up to rounding: "
             "its values are noise of ~1e-6, and the large ResNet's differed by 8e-9 "
             "absolute, 1.6e-3 of their own scale). On virtual CPU "
             "devices step times measure plan overhead, not accelerator speed; on shared "
             "cores they are noisy (every timed step is in the JSON). Adam turns the "
             "rounding of a sum over devices into a whole update where a gradient is near "
             "zero (an update of lr * sign): with Adam the Transformer LM's parameters "
             "differed from jax.jit's by 4.7e-4 (lr 1e-2) under every method, k=1 and plain "
             "data parallel included, and by 1.0e-2 on a bias (lr 1e-3, DataParallel k=4); "
             "with SGD the same cells differ by 1e-7. The LM trains with SGD here; the GPT "
             "keeps AdamW.", ""]
    if s["dropout"] == 0:
        lines += ["Dropout is deterministic (rate 0), so accumulated steps can be compared "
                  "exactly: micro-batches fold their index into the random key and would draw "
                  "other masks than one whole-batch step.", ""]
    if any(p["name"] == "resnet" for p in result["programs"]):
        lines += ["Max pooling sends each window's gradient to its largest input; where two "
                  "inputs agree to rounding, a plan that sums in another order can pick the "
                  "other one. That is a valid gradient, but a whole gradient entry moves, not a "
                  "rounding error: at size `large`, `ShardParallel:4`'s accelerator plan "
                  "(channels split) moved 8.9e-5 of the stem kernel's gradient between two "
                  "pixels of one image whose activations agree to 8e-8 in float64 (one channel, "
                  "one step of five; every other gradient within 2e-8 of a float64 "
                  "reference), and the parameters then differ by up to 1.7e-3 of a leaf's "
                  "scale after 5 steps.", ""]
    lines += ["Each step replayed: the reference's step run from each of the cell's own "
              "states, against the cell's step from that state (worst relative difference "
              "over steps, metrics and state). Five chained float32 steps can end further "
              "apart than any one step's rounding where a step is sensitive to its input's "
              "last bits. Found on the Transformer LM (every data-parallel k=1 cell ended "
              "3.2e-4 of a leaf's scale from `jax.jit`, on one entry of "
              "`DecoderBlock_0/Dense_1/bias`): after 4 steps the two states differ by 1e-9, "
              "and from the data-parallel state `jax.jit`'s own float32 gradient of that "
              "entry is -0.0026227739 where float64 gives -0.0025959522 from either state "
              "(and XLA:CPU with fusion disabled -0.0025959525, with fast math -0.0025959518): "
              "the fused float32 gradient kernel of XLA:CPU rounds poorly on that input, "
              "for `jax.jit` and autoshard alike. Such a cell computes the reference's step; "
              "a cell that computes another step shows in this column. Where a replayed step "
              "still differs by the tolerance, it is run once more in float64 from the same "
              "state, and a leaf counts as equal when the cell's value is within twice the "
              "float32 reference's own distance from the float64 one (AdamW's first update, "
              "`lr * g / (|g| + eps)`, turns a gradient entry near `eps` into any value "
              "between 0 and `lr`: the GPT's cells differ from `jax.jit` there by up to 1.4e-4 "
              "of a kernel's scale after one step). The JSON has each cell's "
              "`replay_float64_ratio`, the largest (cell's distance / reference's distance) "
              "over those leaves.", ""]
    rules = {p["name"]: p["rule"] for p in result["programs"] if p["rule"]}
    for name, rule in rules.items():
        lines += [f"`{name}` with k > 1 is compared with a plain-JAX reference of the "
                  f"micro-batch rule, {rule}; its distance to the whole-batch step is in "
                  "the JSON (`loss_rel_diff_to_whole_batch`).", ""]
    if result.get("measured_cluster"):
        c = autoshard.Cluster.from_dict(result["measured_cluster"])
        lines += ["`ShardParallel@measured` cells plan with `ShardParallel(cluster=Cluster."
                  "measure())`: priced for what these devices delivered when measured ("
                  f"{c.peak_flops / 1e9:.1f} GFLOP/s and {c.memory_bandwidth / 1e9:.1f} GB/s "
                  f"of memory per device, all-reduces at {c.intra_host_bandwidth / 1e9:.2f} "
                  f"GB/s and {c.intra_host_latency_s * 1e6:.0f} us per ring hop), where "
                  "`ShardParallel` cells get `Cluster.from_devices`' accelerator-like "
                  "description (100 TFLOP/s, 10 GB/s, 5 us per hop): the plan an "
                  "accelerator would get, run on CPU devices.", ""]
    lines += [*targets(result), ""]
    for p in result["programs"]:
        rows = [r for r in result["records"] if r["program"] == p["name"]]
        fields = p["state_fields"]
        if "reference_error" in p:
            lines += [f"## {p['name']}: {p['description']}", "",
                      f"**The `jax.jit` reference failed** ({_escape(p['reference_error'])}); "
                      "no cell was run.", ""]
            continue
        hand = p.get("by_hand")
        hand_line = [] if not hand else [
            f"Written by hand without autoshard (`jax.jit`, batch rows split over the "
            f"devices): k=1 step {hand['k1_s'] * 1e3:.1f} ms, its k=4 loop over micro-batches "
            f"{hand['k4_s'] * 1e3:.1f} ms ({hand['k4_s'] / hand['k1_s']:.2f}x its k=1 step).",
            ""]
        lines += [f"## {p['name']}: {p['description']}", "",
                  f"`jax.jit` step: {p['jit_step_time_s'] * 1e3:.1f} ms.", "", *hand_line,
                  "| cell | status | loss | metrics (worst leaf) | "
                  + " | ".join(fields) + " | each step replayed | step ms | x jit | x k=1 "
                  "| bytes compiled / predicted |",
                  "|---|---|---:|---|" + "---:|" * len(fields) + "---:|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(row(r, fields))
        lines.append("")
    failures = [r for r in result["records"] if r["status"] != "ok"]
    if failures:
        lines += ["## Failures", "", "| program | cell | at | error |", "|---|---|---|---|"]
        lines += [f"| {r['program']} | {r['cell']} | {r['failed_at']} | `{r['error_type']}`: "
                  f"{_escape(r['error'])} |" for r in failures]
        lines.append("")
    notes = [r for r in result["records"] if r["warnings"] or r.get("metric_notes")]
    if notes:
        lines += ["## Warnings and differing outputs", ""]
        for r in notes:
            for text in r.get("metric_notes", []):
                lines.append(f"- {r['program']} / {r['cell']}: output {_escape(text)}")
            for text in r["warnings"]:
                lines.append(f"- {r['program']} / {r['cell']}: {_escape(text[:300])}")
        lines.append("")
    return "\n".join(lines)


def row(r: dict, fields) -> str:
    audit = r.get("audit") or {}
    if "error" in audit:
        bytes_cell = f"audit failed: {_escape(audit['error'][:80])}"
    elif audit:
        ratio = audit["bytes_ratio"]
        bytes_cell = (f"{audit['compiled_bytes']:,} / "
                      + (f"{audit['predicted_bytes']:,} ({ratio:.2f}x)"
                         + _mark(not audit["bytes_divergent"]) if ratio is not None
                         else "(no prediction)"))
    else:
        bytes_cell = "-"
    if r["status"] != "ok" and not r.get("compared"):
        return (f"| {r['cell']} | **{r['status']}** at {r['failed_at']}: `{r['error_type']}` | "
                + " | ".join(["-"] * (3 + len(fields))) + " | - | - | - | " + bytes_cell + " |")
    if r.get("compared"):
        path, value = worst(r["metric_rel_diff"])
        metric = "-" if path is None else f"{_num(value)} ({path})"
        metric += _mark(value is None or value < TOLERANCE)
        loss = _num(r["loss_rel_diff"]) + _mark(r["loss_rel_diff"] < TOLERANCE)
        state = []
        for n in fields:
            v = r[f"{n}_rel_diff"]
            text = _num(v) + _mark(v is not None and v < TOLERANCE)
            if n == "batch_stats" and r["reference"] != "jax.jit":
                text += " (rule: mean of micro-batch statistics)"
            state.append(text)
        replayed = r.get("replay_rel_diff")
        state.append("-" if replayed is None else
                      _num(replayed) + _mark(replayed < TOLERANCE))
    else:
        loss, metric, state = ("n/c", r.get("not_compared_why", "-"),
                               ["n/c"] * (len(fields) + 1))
    ratio_k1 = r.get("step_time_ratio_to_k1")
    status = "ok" if r["status"] == "ok" else f"**{r['status']}** at {r['failed_at']}"
    return (f"| {r['cell']} | {status} | {loss} | {metric} | " + " | ".join(state)
            + f" | {_num(r.get('step_time_s') and r['step_time_s'] * 1e3, '{:.1f}')} | "
            f"{_num(r.get('step_time_ratio_to_jit'), '{:.2f}')} | "
            f"{_num(ratio_k1, '{:.2f}')}{_mark(ratio_k1 is None or ratio_k1 <= MAX_K_RATIO)} | "
            f"{bytes_cell} |")


def targets(result: dict) -> list[str]:
    records = result["records"]
    ran = [r for r in records if r["status"] == "ok"]
    compared = [r for r in records if r.get("compared")]
    equal = [r for r in compared if r["matches"]]
    timed = [r for r in records if r.get("step_time_ratio_to_k1") is not None]
    fast = [r for r in timed if r["step_time_ratio_to_k1"] <= MAX_K_RATIO]
    stepwise = [r for r in compared if r.get("matches_stepwise")]

    def verdict(a, b):
        return "met" if len(a) == len(b) else "**missed**"

    def names(rs):
        return ", ".join(f"{r['program']}/{r['cell']}" for r in rs) or "-"
    hand = {p["name"]: p["by_hand"]["k4_s"] / p["by_hand"]["k1_s"]
            for p in result["programs"] if p.get("by_hand")}
    over = [r for r in timed if r["step_time_ratio_to_k1"] > MAX_K_RATIO]
    floor = [r for r in over if r["program"] in hand
             and r["step_time_ratio_to_k1"] <= hand[r["program"]]]
    return ["## Targets (issue 21)", "",
            "| target | cells | |", "|---|---|---|",
            f"| every cell runs | {len(ran)} of {len(records)} | "
            f"{verdict(ran, records)} |",
            f"| every loss, metric and parameter within {TOLERANCE:g} of the reference "
            f"(`jax.jit`, or the documented micro-batch rule) | {len(equal)} of "
            f"{len(compared)} compared | {verdict(equal, compared)} |",
            f"| every step within {TOLERANCE:g} of the reference's step from the same state "
            f"(the reference replayed from the cell's own states) | {len(stepwise)} of "
            f"{len(compared)} compared | {verdict(stepwise, compared)} |",
            f"| micro-batched step at most {MAX_K_RATIO}x its k=1 step | {len(fast)} of "
            f"{len(timed)} timed pairs | {verdict(fast, timed)} |", "",
            f"Cells that failed: {names([r for r in records if r['status'] != 'ok'])}.", "",
            f"Cells that differ: {names([r for r in compared if not r['matches']])}.", "",
            "Of those, every step equal to the reference's step from the same state (the "
            "trajectories part on inputs where a float32 step is sensitive to its input's "
            "last bits, see above): "
            f"{names([r for r in compared if not r['matches'] and r.get('matches_stepwise')])}"
            ".", "",
            f"Cells over the step-time ratio: {names(over)}.", "",
            "Of those, at or under the ratio of the same program's k=4 loop written by hand "
            "(`jax.jit`, rows split over the devices, timed in this run: "
            + (", ".join(f"{n} {x:.2f}x" for n, x in hand.items()) or "none")
            + f"): {names(floor)}.", "",
            "**!** marks a value that misses its target (or a compiled/predicted byte ratio "
            "outside 0.5-1.1x)."]


def _escape(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def machine_info() -> dict:
    def git(*cmd):
        try:
            return subprocess.run(["git", *cmd], capture_output=True, text=True, timeout=10,
                                  cwd=Path(__file__).parent).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
    import flax
    import optax
    devices = jax.devices()
    return {"platform": platform.platform(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "jax": jax.__version__,
            "jaxlib": importlib.metadata.version("jaxlib"), "flax": flax.__version__,
            "optax": optax.__version__, "backend": devices[0].platform,
            "num_devices": len(devices), "git_commit": git("rev-parse", "--short=10", "HEAD"),
            "git_dirty": bool(git("status", "--porcelain", "--", "src", "benchmarks")),
            "xla_flags": os.environ.get("XLA_FLAGS", "")}


def _finite(x):
    """JSON without Infinity/NaN: non-finite floats become strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def _from_json(x):
    """Undo ``_finite``: "inf", "-inf" and "nan" strings become floats again."""
    if isinstance(x, str) and x in ("inf", "-inf", "nan"):
        return float(x)
    if isinstance(x, dict):
        return {k: _from_json(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_from_json(v) for v in x]
    return x


# Driver ----------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes, 3 steps, 3 timed steps, a subset of cells")
    p.add_argument("--programs", default=",".join(models.PROGRAMS),
                   help=f"comma-separated, from {', '.join(models.PROGRAMS)}")
    p.add_argument("--cells", default=None,
                   help=f"comma-separated, from {', '.join(ALL_CELLS)} (default: all; "
                        "--quick: a subset)")
    p.add_argument("--size", choices=sorted(models.SIZES), default=None,
                   help="model and batch sizes (default: 'default', or 'quick' with --quick); "
                        "'large' has 4x the rows per device of 'default', to separate XLA:CPU's "
                        "per-op cost from the micro-batch loop's; 'xlarge' is compute-bound "
                        "(8-32x default's rows, longer sequences, larger images)")
    p.add_argument("--steps", type=int, default=None, help="steps compared (default 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps before timing")
    p.add_argument("--repeats", type=int, default=None, help="timed steps (median)")
    p.add_argument("--dropout", type=float, default=0.0,
                   help="dropout rate (default 0: deterministic, so k=4 compares exactly)")
    p.add_argument("--cell-timeout", type=float, default=600.0, help="seconds per cell")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--report-only", action="store_true",
                   help="rewrite --out/programs.md from --out/programs.json (programs_<size>.* "
                        "with --size large or xlarge); run nothing")
    args = p.parse_args(argv)
    if args.size is None:
        args.size = "quick" if args.quick else "default"
    defaults = (3, 1, 3) if args.quick else (5, 2, 7)
    for name, value in zip(("steps", "warmup", "repeats"), defaults, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.programs = [p for p in args.programs.split(",") if p]
    for name in args.programs:
        if name not in models.PROGRAMS:
            p.error(f"--programs: {name!r} is not one of {', '.join(models.PROGRAMS)}")
    if args.cells is not None:
        args.cells = [c for c in args.cells.split(",") if c]
        for c in args.cells:
            if c not in ALL_CELLS:
                p.error(f"--cells: {c!r} is not one of {', '.join(ALL_CELLS)}")
    return args


def results_stem(size: str) -> str:
    """The results' file name without its suffix: ``programs`` for the default and quick
    sizes, ``programs_<size>`` for the others (a large run does not overwrite the default's)."""
    return "programs" if size in ("default", "quick") else f"programs_{size}"


def cells_for(program: str, args) -> list[str]:
    if args.cells is not None:
        return args.cells
    if args.quick:
        return list(QUICK_MARKED_CELLS if program == "lm_marked" else QUICK_CELLS)
    return list(ALL_CELLS)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report_only:
        stem = results_stem(args.size)
        result = _from_json(json.loads((args.out / f"{stem}.json").read_text()))
        (args.out / f"{stem}.md").write_text(markdown(result) + "\n")
        return 0
    t0 = time.perf_counter()
    rng = np.asarray(jax.random.PRNGKey(42))
    result = {"machine": machine_info(),
              "settings": {"size": args.size, "steps": args.steps, "warmup": args.warmup,
                           "repeats": args.repeats, "dropout": args.dropout,
                           "tolerance": TOLERANCE, "max_k_ratio": MAX_K_RATIO,
                           "sizes": {n: models.SIZES[args.size][n.replace("_marked", "")]
                                     for n in args.programs}},
              "programs": [], "records": []}
    for name in args.programs:
        program = models.make_program(name, args.size, args.dropout)
        print(f"[{time.perf_counter() - t0:6.0f} s] {name}: jax.jit reference", flush=True)
        try:
            ref = reference(program, rng, args)
        except Exception as e:   # no reference: nothing to compare this program's cells with
            result["programs"].append({
                "name": name, "description": program.description, "rule": program.rule,
                "state_fields": list(program.state_fields),
                "reference_error": f"{type(e).__name__}: {first_line(e)}"})
            print(f"    jax.jit reference failed: {type(e).__name__}: {first_line(e)}")
            continue
        result["programs"].append({
            "name": name, "description": program.description, "rule": program.rule,
            "state_fields": list(program.state_fields), "jit_step_time_s": ref["step_time_s"],
            "jit_step_times_s": ref["step_times_s"], "by_hand": ref.get("by_hand"),
            "jit_losses": [float(m["loss"]) for m in ref["whole"]["metrics"]]})
        for cell in cells_for(name, args):
            print(f"[{time.perf_counter() - t0:6.0f} s] {name}: {cell}", flush=True)
            record = run_cell(program, cell, ref, rng, args)
            status = record["status"] if record["status"] == "ok" else (
                f"{record['status']} at {record['failed_at']}: {record['error_type']}: "
                f"{record['error'][:160]}")
            print(f"    {status}", flush=True)
            result["records"].append(record)
    derive(result["records"])
    if "cluster" in _MEASURED:
        result["measured_cluster"] = _MEASURED["cluster"].to_dict()
    result["wall_s"] = time.perf_counter() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    stem = results_stem(args.size)
    (args.out / f"{stem}.json").write_text(json.dumps(_finite(result), indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(result) + "\n")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
