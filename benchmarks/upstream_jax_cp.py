"""JAX 0.10.2's own custom_partitioning tests, run unmodified against ``autoshard.custom_partitioning``.

The upstream files are not part of this repository. Fetch them (tag ``jax-v0.10.2`` of
github.com/jax-ml/jax) into one folder, by default /work/upstream/jax/tests::

    tests/custom_partitioning_test.py   all 11 tests (the 2 marked skip_on_devices('cpu') run too)
    tests/shard_map_test.py             CustomPartitionerTest.test_custom_partitioning
    tests/cache_key_test.py             CacheKeyTest.test_custom_partitioning_ptr_removal

and run, with 8 virtual CPU devices::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python benchmarks/upstream_jax_cp.py

The alias is one thin module per import path the tests use (``jax.experimental.custom_partitioning``
and ``jax._src.custom_partitioning``): a copy of JAX's module whose ``custom_partitioning`` is
``autoshard.custom_partitioning``. It is put into ``sys.modules`` before the test files are
imported, so ``from jax.experimental.custom_partitioning import custom_partitioning`` in a test
gets ours; everything else the tests import (``SdyShardingRule``, ``BATCHING``, the test
utilities) is JAX's own. The "cpu-unskipped variants" are the two tests JAX skips on CPU
("Collectives don't seem to work on CPU"): ``jtu.skip_on_devices`` is made a no-op while
``custom_partitioning_test.py`` is imported, so they run here as written.

Each mode (``autoshard``, and ``jax`` for reference: the same tests against JAX's own class) runs
in a fresh subprocess. Writes benchmarks/results/upstream_jax_cp.md: pass/fail per test and the
reason for each failure, with JAX's own result beside it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import subprocess
import sys
import time
import traceback
import types
import unittest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_UPSTREAM = pathlib.Path("/work/upstream/jax/tests")
RESULTS = ROOT / "benchmarks" / "results" / "upstream_jax_cp.md"

# (file, class, test, accepted difference or None)
TESTS = [
    *(("custom_partitioning_test", "CustomPartitionerTest", name, None) for name in (
        "test_custom_partitioner",
        "test_custom_partitioner_propagate_user_sharding",
        "test_custom_partitioner_sharding_override",
        "test_custom_partitioner_invalid_sharding",
        "test_custom_partitioner_jit_annotated_function",
        "test_custom_partitioner_with_scan",
        "test_custom_partitioning_no_mesh_context",
        "test_custom_partitioner_pytree_inputs",
        "test_custom_partition_with_sharding_rule_callback",
        "test_custom_partition_shardy_migration",
        "test_custom_partitioner_reshape",
    )),
    ("shard_map_test", "CustomPartitionerTest", "test_custom_partitioning", None),
    ("cache_key_test", "CacheKeyTest", "test_custom_partitioning_ptr_removal", None),
]
ACCEPTED = {
    "test_custom_partition_shardy_migration": (
        "expects NotImplementedError for the legacy rule-less form (callbacks, no sharding_rule) "
        "under Shardy; autoshard keeps that form working by deriving a rule from "
        "infer_sharding_from_operands"),
}
CPU_SKIPPED = {"test_custom_partitioner", "test_custom_partition_with_sharding_rule_callback"}
HISTORY = (
    "Before issue 22's changes (commit f810934): 8 of 13. Failing then: the two static_argnums "
    "tests (a static parameter left to its default was refused), the invalid-sharding test (our "
    "message lacked \"Mismatch in result shapes.\"), shard_map's test ('i -> i' checked against "
    "the rank-2 local block) and the accepted difference.")


# -- one mode, in its own process -------------------------------------------------------------
def _install_alias() -> None:
    import autoshard

    for path in ("jax.experimental.custom_partitioning", "jax._src.custom_partitioning"):
        real = importlib.import_module(path)
        alias = types.ModuleType(path, real.__doc__)
        alias.__dict__.update({k: v for k, v in real.__dict__.items() if k != "__name__"})
        alias.custom_partitioning = autoshard.custom_partitioning
        sys.modules[path] = alias


def _import_tests(upstream: pathlib.Path) -> dict:
    from jax._src import test_util as jtu

    sys.path.insert(0, str(upstream))
    modules = {}
    for name in dict.fromkeys(t[0] for t in TESTS):
        skip = jtu.skip_on_devices
        if name == "custom_partitioning_test":
            jtu.skip_on_devices = lambda *_: (lambda f: f)
        try:
            modules[name] = importlib.import_module(name)
        finally:
            jtu.skip_on_devices = skip
    return modules


def _reason(err_text: str) -> str:
    """The last line of a traceback that says what went wrong (exception type and message)."""
    lines = [line for line in err_text.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        head = line.split(":")[0].strip()
        if head.endswith(("Error", "Exception", "Exit")) or head.startswith(("jax.", "jaxlib.")):
            return line.strip()
    return lines[-1].strip() if lines else "?"


def run_mode(mode: str, upstream: pathlib.Path) -> list[dict]:
    import jax
    from absl import flags

    flags.FLAGS(["upstream_jax_cp"], known_only=True)  # the tests' parse_flags_with_absl
    if mode == "autoshard":
        _install_alias()
    modules = _import_tests(upstream)
    out = []
    for file, cls, name, _ in TESTS:
        case = getattr(modules[file], cls)(name)
        result = unittest.TestResult()
        start = time.perf_counter()
        case.run(result)
        row = {"file": file, "test": f"{cls}.{name}", "name": name,
               "seconds": round(time.perf_counter() - start, 2)}
        if result.errors or result.failures:
            text = (result.errors + result.failures)[0][1]
            row.update(status="fail", reason=_reason(text), traceback=text[-3000:])
        elif result.skipped:
            row.update(status="skip", reason=result.skipped[0][1])
        else:
            row.update(status="pass")
        out.append(row)
    assert jax.device_count() == 8, jax.devices()
    return out


# -- driver -----------------------------------------------------------------------------------
def _run_subprocess(mode: str, upstream: pathlib.Path, timeout: int) -> list[dict]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                      env.get("PYTHONPATH", "")]))
    cmd = [sys.executable, __file__, "--mode", mode, "--upstream", str(upstream)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [{"test": f"{c}.{n}", "name": n, "status": "fail",
                 "reason": f"the {mode} run timed out after {timeout} s"} for _, c, n, _ in TESTS]
    marker = "UPSTREAM_JAX_CP_JSON:"
    for line in proc.stdout.splitlines():
        if line.startswith(marker):
            return json.loads(line[len(marker):])
    reason = _reason(proc.stderr) if proc.stderr else f"exit status {proc.returncode}"
    return [{"test": f"{c}.{n}", "name": n, "status": "fail",
             "reason": f"the {mode} run crashed: {reason}"} for _, c, n, _ in TESTS]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:400]


def write_report(ours: list[dict], theirs: list[dict], path: pathlib.Path) -> str:
    import jax

    passed = sum(r["status"] == "pass" for r in ours)
    accepted = [r for r in ours if r["status"] != "pass" and r["name"] in ACCEPTED]
    jax_passed = sum(r["status"] == "pass" for r in theirs)
    lines = [
        "# JAX 0.10.2's custom_partitioning tests against autoshard.custom_partitioning",
        "",
        f"Generated by `benchmarks/upstream_jax_cp.py` (jax {jax.__version__}, 8 virtual CPU "
        "devices, Shardy partitioner, the JAX default). The upstream test files run unmodified "
        "through an import alias (`jax.experimental.custom_partitioning.custom_partitioning` and "
        "`jax._src.custom_partitioning.custom_partitioning` are `autoshard.custom_partitioning`); "
        "the two tests JAX skips on CPU run here too. The `jax` column runs the same tests "
        "against JAX's own class.",
        "",
        f"**autoshard: {passed} of {len(ours)} pass** ({len(accepted)} accepted difference); "
        f"JAX's own class: {jax_passed} of {len(theirs)}.",
        "",
        HISTORY,
        "",
        "| test | autoshard | jax | reason (autoshard) |",
        "|---|---|---|---|",
    ]
    for r, j in zip(ours, theirs, strict=True):
        name = f"`{r['file'] if 'file' in r else ''}::{r['test']}`"
        if r["name"] in CPU_SKIPPED:
            name += " (skipped on CPU upstream)"
        why = r.get("reason", "")
        if r["status"] != "pass" and r["name"] in ACCEPTED:
            why = f"accepted difference: {ACCEPTED[r['name']]}. Raised: {why}"
        jax_cell = j["status"] + (f" ({_cell(j.get('reason', ''))})" if j["status"] != "pass"
                                  else "")
        lines.append(f"| {name} | {r['status']} | {jax_cell} | {_cell(why)} |")
    text = "\n".join(lines) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", type=pathlib.Path, default=DEFAULT_UPSTREAM,
                        help="folder holding the three upstream test files")
    parser.add_argument("--mode", choices=("autoshard", "jax"),
                        help="run one mode in this process and print its results as JSON")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per mode")
    args = parser.parse_args()
    missing = [f"{f}.py" for f in dict.fromkeys(t[0] for t in TESTS)
               if not (args.upstream / f"{f}.py").exists()]
    if missing:
        sys.exit(f"{args.upstream} lacks {missing}: fetch tests/ of jax-ml/jax at tag "
                 "jax-v0.10.2 into it (see this file's docstring).")
    if args.mode:
        try:
            rows = run_mode(args.mode, args.upstream)
        except Exception:  # noqa: BLE001 -- reported by the parent
            traceback.print_exc()
            sys.exit(1)
        print("UPSTREAM_JAX_CP_JSON:" + json.dumps(rows))
        return
    ours = _run_subprocess("autoshard", args.upstream, args.timeout)
    theirs = _run_subprocess("jax", args.upstream, args.timeout)
    print(write_report(ours, theirs, args.out))


if __name__ == "__main__":
    main()
