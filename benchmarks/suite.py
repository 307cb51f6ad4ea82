"""Side-by-side benchmark suite: autoshard's plans against hand-written jax.jit plans.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/suite.py
    python benchmarks/suite.py --backend gpu --size large
    python benchmarks/suite.py --quick --out /tmp/results      # the smallest sizes

Writes suite.json, suite.md and PNG plots into --out (default benchmarks/results). A failing
(model, plan) pair is recorded with its error and the suite goes on. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("cpu", "gpu"), default="cpu",
                   help="cpu: 8 virtual devices unless XLA_FLAGS says otherwise; gpu: CUDA")
    p.add_argument("--size", choices=("quick", "default", "large"), default="default")
    p.add_argument("--quick", action="store_true", help="same as --size quick, fewer repeats")
    p.add_argument("--models", default="gpt,mlp,moe,wresnet", help="comma-separated")
    p.add_argument("--plans", default="all",
                   help="comma-separated plan names (e.g. manual:dp,autoshard:ShardParallel-1d)")
    p.add_argument("--num-devices", type=int, default=None, help="default: all (cpu: 8)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed steps per plan (compiled ahead of time: no compile in them)")
    p.add_argument("--repeats", type=int, default=8, help="most timed steps per plan")
    p.add_argument("--min-repeats", type=int, default=5,
                   help="fewest timed steps per plan; more rounds only while --step-budget lasts")
    p.add_argument("--step-budget", type=float, default=20.0,
                   help="seconds of timed round-robin stepping per model (after --min-repeats "
                        "rounds no new round starts once it is spent)")
    p.add_argument("--pair-timeout", type=float, default=300.0,
                   help="seconds for one (model, plan) pair before it is recorded as timed out")
    p.add_argument("--solver-time-limit", type=float, default=30.0,
                   help="ILP solver time limit (s) per autoshard plan (at most a third of "
                        "--pair-timeout)")
    p.add_argument("--sweep-layers", default=None,
                   help="GPT layer counts for the planning-time sweep (default by size)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--report-only", action="store_true",
                   help="recompute the ratios in --out/suite.json, rewrite suite.md and the "
                        "plots from it; run nothing")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.repeats, args.warmup = "quick", min(args.repeats, 3), 1
    args.min_repeats = max(1, min(args.min_repeats, args.repeats))
    return args


def configure_backend(backend: str) -> None:
    """Pick the JAX platform before JAX starts (the flag only affects the host platform)."""
    if backend == "gpu":
        os.environ["JAX_PLATFORMS"] = "cuda"
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if args.report_only:
        import json

        import suite_report
        with open(os.path.join(args.out, "suite.json")) as f:
            result = json.load(f)
        suite_report.derive(result["records"])
        with open(os.path.join(args.out, "suite.json"), "w") as f:
            json.dump(result, f, indent=1)
        suite_report.write_markdown(result, os.path.join(args.out, "suite.md"))
        suite_report.write_plots(result, args.out)
        return 0
    configure_backend(args.backend)
    from suite_runner import run_suite  # imports jax: after the backend is configured

    return run_suite(args)


if __name__ == "__main__":
    raise SystemExit(main())
