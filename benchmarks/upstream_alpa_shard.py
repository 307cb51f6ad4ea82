"""Run Alpa's ``tests/shard_parallel`` unmodified against autoshard, through a thin import alias.

Usage (8 virtual CPU devices; Alpa's tests use 4 of them)::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        .venv/bin/python benchmarks/upstream_alpa_shard.py [--upstream DIR] [-k SUBSTRING]

``DIR`` (default ``/work/upstream/alpa_shard``) holds a copy of Alpa's repository files:
``tests/shard_parallel/*.py``, ``alpa/testing.py``, ``alpa/test_install.py`` and
``alpa/model/{model_util,bert_model,moe}.py`` (kept outside this repository). The alias
(``benchmarks/alpa_alias_shard.py``) maps ``import alpa`` to autoshard. Every test runs in
this process, one at a time; the result of each (pass, fail, error, skip, or not runnable here
with the reason) goes to ``benchmarks/results/upstream_alpa_shard.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
import unittest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "upstream_alpa_shard.md")
FILES = ("test_basic", "test_bert", "test_conv", "test_gradient_accumulation", "test_manual",
         "test_mixed_2d", "test_mlp", "test_moe", "test_numerical_correctness")
NOT_RUNNABLE = {
    "test_gradient_accumulation.GradAccumulationTest.test_gradient_accumulation_multi_host":
        "needs a Ray cluster (init(cluster='ray'), get_global_cluster()); the same step on "
        "local devices is test_gradient_accumulation_single_host",
}


def run(upstream: str, select: str | None) -> list[tuple[str, str, str, float]]:
    sys.path.insert(0, upstream)
    sys.path.insert(0, HERE)
    for pkg in ("tests", os.path.join("tests", "shard_parallel")):
        init = os.path.join(upstream, pkg, "__init__.py")
        if not os.path.exists(init):
            open(init, "w").close()
    import alpa_alias_shard

    alpa_alias_shard.install(upstream)
    loader = unittest.defaultTestLoader
    rows = []
    for name in FILES:
        module = __import__(f"tests.shard_parallel.{name}", fromlist=["*"])
        suite = loader.loadTestsFromModule(module)
        for test in _flatten(suite):
            tid = f"{name}.{type(test).__name__}.{test._testMethodName}"
            if select and select not in tid:
                continue
            if tid in NOT_RUNNABLE:
                rows.append((tid, "not runnable", NOT_RUNNABLE[tid], 0.0))
                continue
            result = unittest.TestResult()
            t0 = time.perf_counter()
            test.run(result)
            dt = time.perf_counter() - t0
            if result.skipped:
                status, why = "skip", result.skipped[0][1]
            elif result.failures or result.errors:
                status = "fail" if result.failures else "error"
                why = _reason((result.failures or result.errors)[0][1])
            else:
                status, why = "pass", ""
            rows.append((tid, status, why, dt))
            print(f"{status:5s} {dt:6.1f}s {tid} {why[:200]}", flush=True)
    return rows


def _flatten(suite):
    for t in suite:
        if isinstance(t, unittest.TestSuite):
            yield from _flatten(t)
        else:
            yield t


def _reason(tb: str) -> str:
    lines = [ln for ln in tb.strip().splitlines() if ln.strip()]
    last = lines[-1].strip()
    where = next((ln.strip() for ln in reversed(lines) if ln.strip().startswith("File")
                  and "shard_parallel" in ln), "")
    return f"{last} ({where.split(', in ')[-1]}, {where.split('line ')[-1].split(',')[0]})" \
        if where else last


def write(rows, path: str) -> None:
    runnable = [r for r in rows if r[1] not in ("not runnable", "skip")]
    passed = [r for r in runnable if r[1] == "pass"]
    lines = [
        "# Alpa's tests/shard_parallel through the autoshard alias",
        "",
        "Alpa's own test files, unmodified, run by `benchmarks/upstream_alpa_shard.py` with "
        "`import alpa` resolved by `benchmarks/alpa_alias_shard.py` (8 virtual CPU devices; "
        "the tests use 4).",
        "",
        f"**{len(passed)} of {len(runnable)} runnable tests pass** "
        f"({len(rows)} tests: {sum(r[1] == 'skip' for r in rows)} skipped by Alpa itself, "
        f"{sum(r[1] == 'not runnable' for r in rows)} not runnable here).",
        "",
        "| test | result | reason | s |",
        "|---|---|---|---|",
    ]
    for tid, status, why, dt in rows:
        why = why.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| `{tid}` | {status} | {why} | {dt:.1f} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--upstream", default="/work/upstream/alpa_shard")
    ap.add_argument("-k", default=None, help="run only tests whose id contains this")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args()
    try:
        rows = run(args.upstream, args.k)
    except Exception:
        traceback.print_exc()
        raise
    runnable = [r for r in rows if r[1] not in ("not runnable", "skip")]
    print(f"{sum(r[1] == 'pass' for r in runnable)} of {len(runnable)} runnable pass")
    if args.k is None or args.out != RESULTS:
        write(rows, args.out)


if __name__ == "__main__":
    main()
