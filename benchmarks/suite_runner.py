"""Runs every (model, plan) pair, records its measures, and writes the results."""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import json
import os
import platform
import signal
import subprocess
import time
import traceback

import jax
import numpy as np

import autoshard
import suite_measure as measure
import suite_plans as plans
import suite_report as report
from suite_models import MODELS, SIZES, make_case

# The default GPT depth (2) is reused from the main records; benchmarks/solver.py
# sweeps planning time much deeper (2..48 layers).
SWEEP_LAYERS = {"quick": (1,), "default": (1, 2, 4), "large": (2, 4, 8)}


# Every record has these keys; a failed or skipped pair keeps them None.
NULL_FIELDS = ("step_time_s", "step_time_iqr_s", "step_time_ratio_to_best_manual",
               "planning_time_s", "compile_time_s", "lower_time_s", "plan_plus_compile_s",
               "collective_bytes", "total_collective_bytes", "collective_wire_bytes",
               "total_wire_bytes", "peak_bytes_per_device",
               "ilp_objective_s")


class PairTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float, error: type = PairTimeout, option: str = "--pair-timeout"):
    """Raise ``error`` in the main thread after ``seconds`` (checked between Python steps)."""
    def handler(signum, frame):
        raise error(f"timed out after {seconds:g} s ({option})")
    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def machine_info(devices) -> dict:
    def git(*cmd):
        try:
            return subprocess.run(["git", *cmd], capture_output=True, text=True, timeout=10,
                                  cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
    import flax
    import optax
    return {"platform": platform.platform(), "processor": platform.processor() or None,
            "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "jax": jax.__version__,
            "jaxlib": importlib.metadata.version("jaxlib"),
            "flax": flax.__version__, "optax": optax.__version__,
            "backend": devices[0].platform, "device_kind": devices[0].device_kind,
            "num_devices": len(devices), "git_commit": git("rev-parse", "HEAD"),
            "git_dirty": bool(git("status", "--porcelain", "--", "src", "benchmarks")),
            "xla_flags": os.environ.get("XLA_FLAGS", "")}


def plan_names(model: str, num_devices: int, wanted: set[str] | None) -> list[str]:
    """The plans run for ``model``: all of them, or those in ``wanted``."""
    manual = [p for p in plans.manual_plans(num_devices) if p != "manual:expert" or model == "moe"]
    auto = list(plans.autoshard_methods(num_devices, 1.0))
    names = ["single:jit", *manual, *auto]
    return names if wanted is None else [p for p in names if p in wanted]


def prepare_pair(case, plan: str, devices, args, solver_limit: float):
    """Plan, compile and inspect one pair: (record, Prepared or None when it failed)."""
    family = plan.split(":")[0]
    record = {"model": case.name, "plan": plan, "family": family, "mesh_shape": None,
              "status": "ok", "error": None, **dict.fromkeys(NULL_FIELDS)}
    t_start = time.perf_counter()
    prepared = None
    try:
        with time_limit(args.pair_timeout):
            if family == "single":
                prepared = plans.prepare_single(case, devices)
            elif family == "manual":
                manual = plans.manual_plans(len(devices))[plan]
                record["mesh_shape"] = list(manual.mesh_shape)
                prepared = plans.prepare_manual(case, manual, devices)
            else:
                make = plans.autoshard_methods(len(devices), solver_limit)[plan]
                if make is None:
                    record.update(status="skipped",
                                  error=f"{plan.split(':')[1]} does not exist in autoshard yet")
                    return record, None
                prepared = plans.prepare_autoshard(case, make, devices)
            record["mesh_shape"] = list(prepared.mesh_shape)
            record.update(planning_time_s=prepared.planning_time_s,
                          compile_time_s=prepared.compile_time_s,
                          lower_time_s=prepared.lower_time_s, **prepared.extra)
            setup = (prepared.planning_time_s or 0.0) + (prepared.lower_time_s or 0.0)
            record["plan_plus_compile_s"] = setup + prepared.compile_time_s
            num_bytes, counts, wire = measure.collective_bytes(prepared.compiled.as_text(),
                                                               len(devices))
            record.update(collective_bytes=num_bytes, collective_counts=counts,
                          total_collective_bytes=sum(num_bytes.values()),
                          collective_wire_bytes=wire, total_wire_bytes=sum(wire.values()))
            record.update(measure.memory_per_device(prepared.compiled))
    except PairTimeout as e:
        record.update(status="timeout", error=str(e))
        prepared = None
    except Exception as e:       # recorded, and the suite goes on
        lines = traceback.format_exception_only(type(e), e)
        record.update(status="error", error="".join(lines).strip()[-2000:])
        prepared = None
    record["prepare_wall_time_s"] = time.perf_counter() - t_start
    return record, prepared


def run_model(case, names: list[str], devices, args, solver_limit: float) -> list[dict]:
    """Prepare every plan of one model, then time them all round-robin."""
    records, steppers = {}, {}
    for plan in names:
        record, prepared = prepare_pair(case, plan, devices, args, solver_limit)
        records[plan] = record
        if prepared is not None:
            steppers[plan] = measure.Stepper(prepared.step, prepared.state, prepared.batch)
        if record["status"] != "ok":
            print(f"  {plan:<30} {_brief(record)}", flush=True)
        del prepared
    measure.time_interleaved(steppers, warmup=args.warmup, repeats=args.repeats,
                             budget_s=args.step_budget, min_rounds=args.min_repeats)
    for plan, stepper in steppers.items():
        record = records[plan]
        if stepper.error is not None:
            record.update(status="error", error=stepper.error)
        elif stepper.times:
            record.update(measure.summarize_times(stepper.times), step_times_s=stepper.times,
                          loss_first_step=stepper.losses[0], loss_last_step=stepper.losses[-1])
        print(f"  {plan:<30} {_brief(record)}", flush=True)
    steppers.clear()
    autoshard.clear_executable_cache()
    gc.collect()
    return [records[p] for p in names]


def planning_sweep(sizes: dict, layer_counts, devices, args, solver_limit, done) -> list[dict]:
    """Planning and compile time of ShardParallel on GPTs of growing depth (no steps run)."""
    rows = []
    n = len(devices)
    for layers in layer_counts:
        case = make_case("gpt", **{**sizes, "layers": layers})
        for plan in ("autoshard:ShardParallel-1d", "autoshard:ShardParallel-2d", "manual:dp"):
            reuse = [r for r in done if r["model"] == "gpt" and r["plan"] == plan
                     and sizes["layers"] == layers]
            if reuse:
                r = reuse[0]
            elif plan not in plans.autoshard_methods(n, solver_limit) and plan.startswith("auto"):
                continue
            else:
                r = sweep_one(case, plan, devices, args, solver_limit)
            rows.append({"layers": layers, "plan": plan, "status": r["status"],
                         "error": r["error"], "mesh_shape": r["mesh_shape"],
                         "planning_time_s": r.get("planning_time_s"),
                         "compile_time_s": r.get("compile_time_s"),
                         "plan_plus_compile_s": r.get("plan_plus_compile_s"),
                         "ilp_columns": r.get("ilp_columns"),
                         "ilp_objective_s": r.get("ilp_objective_s")})
            print(f"  sweep gpt layers={layers} {plan}: {_brief(r)}", flush=True)
    return rows


def sweep_one(case, plan, devices, args, solver_limit) -> dict:
    record = {"status": "ok", "error": None, "mesh_shape": None}
    try:
        with time_limit(args.pair_timeout):
            if plan.startswith("manual"):
                p = plans.prepare_manual(case, plans.manual_plans(len(devices))[plan], devices)
            else:
                make = plans.autoshard_methods(len(devices), solver_limit)[plan]
                p = plans.prepare_autoshard(case, make, devices)
        record.update(mesh_shape=list(p.mesh_shape), planning_time_s=p.planning_time_s,
                      compile_time_s=p.compile_time_s, **p.extra)
        record["plan_plus_compile_s"] = ((p.planning_time_s or 0) + (p.lower_time_s or 0)
                                         + p.compile_time_s)
        del p
    except PairTimeout as e:
        record.update(status="timeout", error=str(e))
    except Exception as e:
        record.update(status="error", error="".join(traceback.format_exception_only(e))[-2000:])
    autoshard.clear_executable_cache()
    gc.collect()
    return record


def _brief(r: dict) -> str:
    if r["status"] != "ok":
        return f"{r['status'].upper()}: {str(r['error']).splitlines()[-1][:160]}"
    parts = []
    if r.get("step_time_s") is not None:
        parts.append(f"step {r['step_time_s'] * 1e3:.1f} ms")
    if r.get("planning_time_s") is not None:
        parts.append(f"plan {r['planning_time_s']:.1f} s")
    parts.append(f"compile {r['compile_time_s']:.1f} s")
    if r.get("total_collective_bytes") is not None:
        parts.append(f"coll {r['total_collective_bytes'] / 1e6:.2f} MB "
                     f"(sent {r['total_wire_bytes'] / 1e6:.2f} MB)")
    return ", ".join(parts)


def run_suite(args) -> int:
    devices = jax.devices()
    if args.num_devices:
        devices = devices[:args.num_devices]
    os.makedirs(args.out, exist_ok=True)
    solver_limit = max(1.0, min(args.solver_time_limit, args.pair_timeout / 3))
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"--models: {m!r} is not one of {MODELS}")
    wanted = None if args.plans == "all" else {p.strip() for p in args.plans.split(",")}
    known = {p for m in MODELS for p in plan_names(m, len(devices), None)}
    known.add("autoshard:ShardParallel")
    if wanted is not None and wanted - known:
        raise SystemExit(f"--plans: {sorted(wanted - known)} unknown; choose from {sorted(known)}")
    result = {"suite": "autoshard side-by-side", "size": args.size,
              "settings": {"warmup": args.warmup, "repeats": args.repeats,
                           "min_repeats": args.min_repeats, "step_budget_s": args.step_budget,
                           "pair_timeout_s": args.pair_timeout,
                           "solver_time_limit_s": solver_limit},
              "machine": machine_info(devices), "models": {}, "records": [],
              "planning_sweep": []}
    t_suite = time.perf_counter()
    print(f"autoshard suite: {len(devices)} x {devices[0].platform}, size {args.size}", flush=True)
    for model in models:
        case = make_case(model, **SIZES[args.size][model])
        result["models"][model] = {"config": case.config, "num_params": case.num_params}
        print(f"{model}: {case.num_params:,} parameters {case.config}", flush=True)
        names = plan_names(model, len(devices), wanted)
        result["records"] += run_model(case, names, devices, args, solver_limit)
        report.derive(result["records"])
        write_json(result, args.out)
    if "gpt" in models and (wanted is None or "autoshard:ShardParallel-1d" in wanted):
        layers = SWEEP_LAYERS[args.size] if args.sweep_layers is None else tuple(
            int(x) for x in args.sweep_layers.split(",") if x)
        result["planning_sweep"] = planning_sweep(
            SIZES[args.size]["gpt"], layers, devices, args, solver_limit, result["records"])
    result["suite_wall_time_s"] = time.perf_counter() - t_suite
    write_json(result, args.out)
    report.write_markdown(result, os.path.join(args.out, "suite.md"))
    report.write_plots(result, args.out)
    print(f"wrote {args.out}/suite.json, suite.md and plots in "
          f"{result['suite_wall_time_s']:.0f} s", flush=True)
    return 0


def write_json(result: dict, out: str) -> None:
    path = os.path.join(out, "suite.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1, default=_jsonable)
    os.replace(path + ".tmp", path)


def _jsonable(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, tuple | set):
        return list(x)
    return str(x)
