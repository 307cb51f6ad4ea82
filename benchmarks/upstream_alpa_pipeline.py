"""Alpa's ``tests/pipeline_parallel``, unmodified, against autoshard through an import alias.

Fetch Alpa's repository (github.com/alpa-projects/alpa) and copy ``tests/`` (with
``tests/__init__.py``), ``alpa/testing.py`` and ``alpa/model/{bert_model,model_util}.py`` to
a folder outside this repository (default ``/work/upstream/alpa``, or ``ALPA_UPSTREAM``). Then

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/upstream_alpa_pipeline.py

runs every test file in a fresh process (``benchmarks/alpa_alias_pipeline.py`` installs the
``alpa`` alias there; the tests import ``alpa`` exactly as upstream) on 8 virtual CPU devices,
and writes ``benchmarks/results/upstream_alpa_pipeline.md``: per upstream test pass, fail or
skip, and for every test not run here the reason. ``--only FILE`` runs one file.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import time
import traceback
import unittest
from pathlib import Path

from upstream_common import run_case, test_cases

HERE = Path(__file__).resolve().parent
UPSTREAM = os.environ.get("ALPA_UPSTREAM", "/work/upstream/alpa")
SUITE = "tests/pipeline_parallel"

_INTERNALS = ("Alpa's runtime internals (cross-mesh resharding task specs, NCCL/cupy collective "
              "groups on Ray workers, ShardingSpec objects): nothing here has that meaning")
NOT_RUNNABLE = {
    "test_cross_mesh_resharding.py": _INTERNALS,
    "test_stage_construction_util.py": (
        "Alpa's compiler internals (split_and_process_layers, "
        "slice_apply_grad_for_stage_construction, stage profiling on Ray meshes, "
        "GradFuncTransformContext)"),
    "test_pipeline_marker.py::PipelineMarkerTest::test_xla_graph": (
        "builds an XLA computation with Alpa's 'pipeline_marker' custom call through "
        "xla_client.XlaBuilder on the GPU backend; autoshard's marker lowers to nothing "
        "(no custom call) and there is no GPU here"),
    "test_layer_construction.py::LayerConstructionTest::test_8_layer_bert_layer_construction": (
        "upstream skips it without 8 GPUs"),
    "test_remat.py::PipelineRematTest::test_8_layer_bert_auto_layer_slicing_remat": (
        "upstream skips it without 8 GPUs"),
    "test_global_norm.py::GlobalNormTest::test_dynamic_scale": "upstream @unittest.skip",
    "test_global_norm.py::GlobalNormTest::test_global_norm_dynamic_scale": (
        "upstream @unittest.skip"),
    "test_global_norm.py::GlobalNormTest::test_global_norm": (
        "asserts the HLO text holds Alpa's 'CrossMeshAllReduce' custom call (Alpa's runtime "
        "instruction); autoshard sums across stages with an ordinary jitted all-reduce"),
    "test_global_norm.py::GlobalNormTest::test_glob_norm_and_all_le": (
        "asserts Alpa's 'CrossMeshAllReduce' custom call and its backend_config strings"),
    "test_mlp.py::PipelineMLPTest::test_2_layer_mlp_local_pipeline_parallel": (
        "LocalPipelineParallel: Alpa's single-device debugging runtime, no counterpart"),
    "test_bert.py::PipelineBERTTest::test_2_layer_bert_local_pipeline_parallel": (
        "LocalPipelineParallel: Alpa's single-device debugging runtime, no counterpart"),
}


_LAYOUT = ("asserts the parameter and root shapes of the compiled backward and apply tasks: "
           "Alpa's backward takes the accumulated gradients first, in their parameters' "
           "layouts, and all-reduces them in the last micro-batch; ours takes them last, as "
           "partial sums with a leading per-device-group dim (f32[1,12,14] for f32[12,14]) "
           "reduced once per step by the stage's reduce task, and its planner may lay a "
           "gradient out unlike its parameter (tests/pipeline/test_manual_sharding.py checks "
           "such steps against jax.jit)")
KNOWN_FAILURES = {
    "test_manual_sharding.py::PipeshardManualShardingTest::test_set_input_output": _LAYOUT,
    "test_manual_sharding.py::PipeshardManualShardingTest::test_set_intermediate": _LAYOUT,
}


def _reason(test_id: str) -> str | None:
    file = test_id.split("::")[0]
    return NOT_RUNNABLE.get(test_id) or NOT_RUNNABLE.get(file)


# child: one file ---------------------------------------------------------------------------
def _listed(name: str) -> list[str]:
    """The test ids of a file, read from its source (for files not imported here)."""
    tree = ast.parse((Path(UPSTREAM) / SUITE / name).read_text())
    return [f"{name}::{c.name}::{f.name}" for c in tree.body if isinstance(c, ast.ClassDef)
            for f in c.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test")]


def run_file(name: str) -> list[dict]:
    if name in NOT_RUNNABLE:
        return [{"id": t, "status": "not run", "detail": NOT_RUNNABLE[name]}
                for t in _listed(name)]
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, UPSTREAM)
    os.chdir(UPSTREAM)
    import alpa_alias_pipeline

    alpa_alias_pipeline.install(UPSTREAM)
    mod_name = f"tests.pipeline_parallel.{name[:-3]}"
    results = []
    try:
        module = __import__(mod_name, fromlist=["*"])
    except Exception as e:  # noqa: BLE001 (reported per file)
        return [{"id": f"{name}::<import>", "status": "fail",
                 "detail": f"{type(e).__name__}: {e}"}]
    suite = unittest.TestLoader().loadTestsFromModule(module)
    for test in test_cases(suite):
        cls, method = type(test).__name__, test._testMethodName
        if type(test).__module__ != mod_name:
            continue  # classes a file imports run under their own file
        tid = f"{name}::{cls}::{method}"
        reason = _reason(tid)
        if reason is not None:
            results.append({"id": tid, "status": "not run", "detail": reason})
            continue
        status, detail, dt = run_case(test)
        if status in ("fail", "error"):
            print(detail, file=sys.stderr)
            status, detail = "fail", detail.strip().splitlines()[-1][:300]
        results.append({"id": tid, "status": status, "detail": detail, "seconds": round(dt, 1)})
        print(f"{tid}: {status} {detail} ({dt:.1f} s)", file=sys.stderr, flush=True)
    return results


# parent --------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", help="one test file name, e.g. test_schedules.py")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--before", help="a results JSON of an earlier run (e.g. at the commit "
                    "before issue 22) to show beside this one")
    ap.add_argument("--before-label", default="the --before run",
                    help="what the earlier run was, for the report")
    args = ap.parse_args()
    if args.child:
        try:
            out = run_file(args.child)
        except Exception:  # noqa: BLE001
            out = [{"id": f"{args.child}::<run>", "status": "fail",
                    "detail": traceback.format_exc().strip().splitlines()[-1]}]
        print("RESULTS " + json.dumps(out))
        return
    files = sorted(p.name for p in (Path(UPSTREAM) / SUITE).glob("test_*.py"))
    if args.only:
        files = [args.only]
    env = dict(os.environ)
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "src"), env.get("PYTHONPATH", "")])
    results = []
    for f in files:
        t0 = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, __file__, "--child", f], env=env,
                               capture_output=True, text=True, timeout=args.timeout)
            line = next((x for x in p.stdout.splitlines() if x.startswith("RESULTS ")), None)
            got = json.loads(line[8:]) if line else [
                {"id": f"{f}::<process>", "status": "fail",
                 "detail": (p.stderr.strip().splitlines() or ["no output"])[-1][:300]}]
        except subprocess.TimeoutExpired:
            got = [{"id": f"{f}::<process>", "status": "fail",
                    "detail": f"timed out after {args.timeout} s"}]
        for r in got:
            print(f"{r['id']}: {r['status']} {r.get('detail', '')}", flush=True)
        print(f"  ({f}: {time.perf_counter() - t0:.0f} s)", flush=True)
        results.extend(got)
    if not args.only:
        before = json.loads(Path(args.before).read_text()) if args.before else None
        write_report(results, before, args.before_label)


def write_report(results: list[dict], before: list[dict] | None = None,
                 before_label: str = "the --before run"):
    runnable = [r for r in results if r["status"] != "not run"]
    passed = [r for r in runnable if r["status"] == "pass"]
    failed = [r for r in runnable if r["status"] == "fail"]
    skipped = [r for r in runnable if r["status"] == "skip"]
    (HERE / "results" / "upstream_alpa_pipeline.json").write_text(
        json.dumps(results, indent=1) + "\n")
    was = {r["id"]: r["status"] for r in before or []}
    lines = [
        "# Alpa `tests/pipeline_parallel` through the `alpa` alias",
        "",
        "Alpa's pipeline tests (github.com/alpa-projects/alpa, `tests/pipeline_parallel`), "
        "unmodified, run with `import alpa` resolving to autoshard "
        "(`benchmarks/alpa_alias_pipeline.py`) on 8 virtual CPU devices, one process per file "
        "(`benchmarks/upstream_alpa_pipeline.py`).",
        "",
        f"**{len(passed)} of {len(runnable)} runnable tests pass** ({len(failed)} fail, "
        f"{len(skipped)} skipped); {len(results) - len(runnable)} tests are not runnable here "
        "(reasons below).",
        "",
    ]
    if before is not None:
        passed_before = sum(1 for r in runnable if was.get(r["id"]) == "pass")
        lines += [f"Before ({before_label}): {passed_before} of these {len(runnable)} passed.",
                  ""]
    lines += ["| upstream test | result | " + ("before | " if before is not None else "")
              + "detail |", "|---|---|" + ("---|" if before is not None else "") + "---|"]
    for r in results:
        detail = r.get("detail", "")
        if r["status"] == "fail" and r["id"] in KNOWN_FAILURES:
            detail += f" ({KNOWN_FAILURES[r['id']]})"
        detail = detail.replace("|", "\\|").replace("\n", " ")
        secs = f" ({r['seconds']} s)" if "seconds" in r else ""
        old = f" {was.get(r['id'], 'fail')} |" if before is not None else ""
        lines.append(f"| `{r['id']}` | {r['status']}{secs} |{old} {detail} |")
    out = HERE / "results" / "upstream_alpa_pipeline.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}: {len(passed)} of {len(runnable)} runnable pass")


if __name__ == "__main__":
    main()
