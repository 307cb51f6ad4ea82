"""mpi4jax 0.9.1's own test suite, unmodified, run against autoshard.mpi.notoken.

    python benchmarks/upstream_mpi4jax.py [--upstream DIR] [--np 1 2 3] [--reference SITE]

DIR holds mpi4jax's ``tests/``, ``examples/`` and ``pyproject.toml`` at tag v0.9.1 (default
/work/upstream/mpi4jax; fetch them from github.com/mpi4jax/mpi4jax, they are not part of this
repository). They are copied to a temporary directory and run as mpi4jax's CI runs them
(.github/workflows/mpi-tests.yml): ``pytest .`` and ``mpirun -np N pytest .``, here with
``--oversubscribe --allow-run-as-root`` for N = 2 and 3, each rank on one CPU device.

The one-line alias: a file ``mpi4jax.py`` on PYTHONPATH holding
``sys.modules["mpi4jax"] = autoshard.mpi.notoken`` (PYTHONPATH also reaches the tests'
subprocesses). This file doubles as a pytest plugin (``-p upstream_mpi4jax``) that records
every test's outcome on every rank.

Writes benchmarks/results/upstream_mpi4jax.md: per number of processes the counts, per test
its outcome, and the reason for every test that does not pass or does not apply. Tests that
import mpi4jax's private ``mpi4jax._src`` modules (version checks, its type-check decorator,
its ABI probe, its logging internals) do not apply to a re-implementation and are listed apart.

``--reference SITE``: also run the suite against mpi4jax itself, installed in the directory
SITE (``pip install --target SITE --no-deps --no-build-isolation mpi4jax==0.9.1.post2``, see
mk/mpi.mk's mpi4jax target for building its CPU extension), for a comparison column.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results" / "upstream_mpi4jax.md"
UPSTREAM_TAG = "v0.9.1"
ALIAS = 'import sys, autoshard.mpi.notoken; sys.modules["mpi4jax"] = autoshard.mpi.notoken\n'
MPIRUN = ["mpirun", "--oversubscribe", "--allow-run-as-root"]
TIMEOUT_S = 900  # the whole pytest run at one N (mpi4jax's CI allows 5 minutes)

# Tests that fail on purpose, with the reason (README, "Compatibility").
ACCEPTED = {
    "tests/collective_ops/test_sendrecv.py::test_sendrecv_jacfwd": (
        "expects jax.jacfwd through sendrecv to raise RuntimeError; autoshard.mpi differentiates "
        "sendrecv in forward mode too (the JVP sends the tangent along with the value), so "
        "jacfwd returns the forward-mode Jacobian of the program over all ranks, the adjoint of "
        "reverse mode (tests/mpi/test_notoken.py::test_sendrecv_grad_jacrev_and_jacfwd checks "
        "its values and the adjointness)"
    ),
}
# Tests that cannot pass at some N with any implementation, with the reason.
NOT_RUNNABLE = {
    ("tests/collective_ops/test_alltoall.py::test_alltoall_transpose", 3): (
        "reshapes a (256 // 3, 256) = (85, 256) array to [85, 3, 256 // 3] = [85, 3, 85]: 256 is "
        "not divisible by 3, so jnp.reshape raises TypeError before any MPI call, for mpi4jax "
        "itself as well"
    ),
    ("tests/test_examples.py::test_shallow_water_demo", 3): (
        "mpi4jax's example accepts 1, 2, 4, 6, 8 or 16 processes and raises RuntimeError('Got "
        "invalid number of MPI processes: 3') at import, for mpi4jax itself as well"
    ),
}


# Tests with a race of their own, rerun once alone when they fail (both runs are reported).
RACY = {
    "tests/collective_ops/test_barrier.py::test_barrier": (
        "rank 0 empties the shared output file when the test starts, without waiting for the "
        "others: a rank more than 0.2 s ahead of rank 0 (a loaded machine) has its first line "
        "erased, whatever the barrier does"
    ),
}


# --- pytest plugin: loaded in every rank's pytest with -p upstream_mpi4jax -------------------

_outcomes: dict[str, dict] = {}


def pytest_runtest_logreport(report):
    entry = _outcomes.setdefault(report.nodeid, {"outcome": "passed", "detail": ""})
    if report.skipped and report.when in ("setup", "call"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        entry.update(outcome="skipped", detail=reason.removeprefix("Skipped: "))
    elif report.failed:
        entry.update(outcome="failed" if report.when == "call" else "error",
                     detail=_last_error_line(report))


def _last_error_line(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    return " ".join(text.split())[:400]


def pytest_sessionfinish(session):
    out = os.environ.get("UPSTREAM_MPI4JAX_OUT")
    if out:
        from mpi4py import MPI

        path = pathlib.Path(out) / f"rank{MPI.COMM_WORLD.Get_rank()}.json"
        path.write_text(json.dumps(_outcomes, indent=1))


# --- runner ---------------------------------------------------------------------------------


def private_tests(tests_dir: pathlib.Path) -> dict[str, str]:
    """Test functions whose code imports mpi4jax._src: nodeid prefix -> what they import."""
    found = {}
    for path in sorted(tests_dir.rglob("test_*.py")):
        source = path.read_text()
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                segment = ast.get_source_segment(source, node)
                if "mpi4jax._src" in segment:
                    names = sorted({line.strip() for line in segment.splitlines()
                                    if "mpi4jax._src" in line and "import" in line})
                    rel = path.relative_to(tests_dir.parent).as_posix()
                    found[f"{rel}::{node.name}"] = "; ".join(f"`{n}`" for n in names)
    return found


def run_suite(upstream: pathlib.Path, num_procs: int, work: pathlib.Path,
              reference: pathlib.Path | None = None, only: str | None = None) -> dict[str, list]:
    """Runs the suite at ``num_procs`` processes; returns nodeid -> [outcome per rank].

    Through the alias to autoshard.mpi.notoken, or against mpi4jax installed in ``reference``;
    ``only``: one test's nodeid instead of the whole suite.
    """
    name = f"{'mpi4jax' if reference else 'autoshard'}_np{num_procs}"
    if only:
        name += "_rerun_" + only.rsplit("::", 1)[-1]
    suite = work / name
    for part in ("tests", "examples"):
        shutil.copytree(upstream / part, suite / part)
    shutil.copy(upstream / "pyproject.toml", suite / "pyproject.toml")
    alias_dir = work / "alias"
    alias_dir.mkdir(exist_ok=True)
    (alias_dir / "mpi4jax.py").write_text(ALIAS)
    out = work / f"{name}_out"
    out.mkdir()
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device per process, as in mpi4jax's CI
    env["PYTHONPATH"] = os.pathsep.join([str(reference or alias_dir), str(HERE)])
    env["UPSTREAM_MPI4JAX_OUT"] = str(out)
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
              "upstream_mpi4jax", "--timeout", "300", only or "."]
    command = pytest if num_procs == 1 else [*MPIRUN, "-np", str(num_procs), *pytest]
    proc = subprocess.run(command, cwd=suite, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    (work / f"{name}.log").write_text(proc.stdout + proc.stderr)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(num_procs)
             if (out / f"rank{r}.json").exists()]
    if len(ranks) != num_procs:
        raise RuntimeError(f"{name}: {len(ranks)} of {num_procs} ranks reported; log:\n"
                           f"{(proc.stdout + proc.stderr)[-4000:]}")
    nodeids = sorted(set().union(*ranks))
    return {n: [r.get(n, {"outcome": "missing", "detail": ""}) for r in ranks] for n in nodeids}


def private_reason(nodeid: str, private: dict[str, str]) -> str | None:
    base = nodeid.split("[")[0]
    return private.get(base)


def classify(per_rank: list[dict], nodeid: str, num_procs: int,
             accepted: dict[str, str]) -> tuple[str, str]:
    """One test at one N: (kind, reason). A test passes if no rank fails and one rank ran it."""
    outcomes = [r["outcome"] for r in per_rank]
    bad = [(i, r) for i, r in enumerate(per_rank) if r["outcome"] not in ("passed", "skipped")]
    if bad:
        detail = "; ".join(f"r{i} {r['outcome']}: {r['detail']}" for i, r in bad)
        if nodeid in accepted:
            return "accepted", accepted[nodeid]
        if (nodeid, num_procs) in NOT_RUNNABLE:
            return "not runnable", NOT_RUNNABLE[nodeid, num_procs]
        return "failed", detail
    if "passed" in outcomes:
        return "passed", ""
    return "skipped", per_rank[0]["detail"]


def cell(per_rank: list[dict]) -> str:
    outcomes = [r["outcome"] for r in per_rank]
    text = (outcomes[0] if len(set(outcomes)) == 1
            else ", ".join(f"r{i} {o}" for i, o in enumerate(outcomes)))
    return text + (" (rerun alone; failed at first)" if "rerun" in per_rank[0] else "")


def reruns(label: str, results: dict[int, dict]) -> list[str]:
    """The report's lines for the racy tests that were rerun."""
    return [f"- {label}, np {n}, `{nodeid}`: {cell(per_rank)}. First run: "
            f"{'; '.join(f'r{i} ' + r['rerun'] for i, r in enumerate(per_rank))}. {RACY[nodeid]}"
            for n, tests in results.items() for nodeid, per_rank in tests.items()
            if "rerun" in per_rank[0]]


KINDS = ("passed", "skipped", "accepted", "not runnable", "failed")


def count_rows(label: str, results: dict[int, dict], private: dict[str, str],
               accepted: dict[str, str], elapsed: dict[int, float]):
    """The counts table's rows for one implementation, and each test's (kind, reason) per N."""
    rows, kinds = [], {}
    for n, tests in results.items():
        kinds[n] = {nodeid: classify(per_rank, nodeid, n, accepted)
                    for nodeid, per_rank in tests.items()
                    if private_reason(nodeid, private) is None}
        c = {k: sum(1 for kind, _ in kinds[n].values() if kind == k) for k in KINDS}
        rows.append(
            f"| {label} | {n} | {len(tests)} | {len(kinds[n])} | {c['passed']} | {c['skipped']} "
            f"| {c['passed'] + c['skipped']} of {len(kinds[n])} | {c['accepted']} "
            f"| {c['not runnable']} | {c['failed']} | {elapsed[n]:.0f} |")
    return rows, kinds


def report(results: dict[int, dict], private: dict[str, str], elapsed: dict[int, float],
           reference: dict[int, dict] | None, reference_elapsed: dict[int, float]) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()
    import jax
    from mpi4py import MPI

    lines = [
        "# mpi4jax 0.9.1's test suite through `autoshard.mpi.notoken`",
        "",
        f"`python benchmarks/upstream_mpi4jax.py` at autoshard {commit}, "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC: mpi4jax's `tests/` and "
        f"`examples/` at tag {UPSTREAM_TAG}, unmodified, run as its CI runs them (`pytest .`, "
        f"`mpirun -np N pytest .`, one CPU device per process), with one alias on PYTHONPATH "
        f"(`mpi4jax.py`: `{ALIAS.strip()}`). jax {jax.__version__}, "
        f"{MPI.Get_library_version().splitlines()[0].split(',')[0].strip()}."
        + (" The reference rows run the same suite against mpi4jax 0.9.1.post2 itself (PyPI, "
           "CPU extension built here)." if reference else ""),
        "",
        "A test passes at N processes when it fails on no rank and runs on at least one (mpi4jax's",
        "own `skipif` conditions skip some tests on some ranks, e.g. sendrecv beyond rank 1);",
        "`skipped` means upstream skips it on every rank at that N (send/recv need 2 processes).",
        "Applicable: every test except those importing mpi4jax's private `mpi4jax._src`.",
        "",
        "| implementation | processes | collected | applicable | passed | skipped by upstream |"
        " passed or skipped | accepted difference | cannot pass at N | failed | seconds |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows, kinds = count_rows("autoshard.mpi.notoken", results, private, ACCEPTED, elapsed)
    lines += rows
    if reference:
        rows, ref_kinds = count_rows("mpi4jax 0.9.1.post2", reference, private, {},
                                     reference_elapsed)
        lines += rows
    lines += ["", "## Exceptions (autoshard.mpi.notoken)", ""]
    exceptions = [f"- np {n}, `{nodeid}`: {kind}. {reason}" for n in results
                  for nodeid, (kind, reason) in kinds[n].items()
                  if kind in ("accepted", "not runnable", "failed")]
    lines += exceptions or ["- none"]
    if reference:
        lines += ["", "## Exceptions (mpi4jax 0.9.1.post2 itself)", ""]
        exceptions = [f"- np {n}, `{nodeid}`: {kind}. {reason}" for n in reference
                      for nodeid, (kind, reason) in ref_kinds[n].items()
                      if kind in ("not runnable", "failed")]
        lines += exceptions or ["- none"]
    rerun_lines = reruns("autoshard.mpi.notoken", results)
    if reference:
        rerun_lines += reruns("mpi4jax 0.9.1.post2", reference)
    lines += ["", "## Reruns", "",
              "A test with a race of its own that fails is rerun once, alone, at the same N; the",
              "counts above use the rerun.", ""]
    lines += rerun_lines or ["- none"]
    lines += ["", "## Not applicable: tests of mpi4jax's private modules", ""]
    all_ids = sorted(set().union(*results.values()))
    for nodeid in all_ids:
        why = private_reason(nodeid, private)
        if why is not None:
            lines.append(f"- `{nodeid}`: {why}")
    columns = [(f"np {n}", results[n]) for n in results]
    if reference:
        columns += [(f"mpi4jax np {n}", reference[n]) for n in reference]
    lines += ["", "## Every test", "",
              "| test | " + " | ".join(name for name, _ in columns) + " |",
              "|---|" + "---|" * len(columns)]
    for nodeid in all_ids:
        row = [cell(tests[nodeid]) if nodeid in tests else "-" for _, tests in columns]
        if private_reason(nodeid, private) is not None:
            row = [f"n/a ({c})" for c in row]
        lines.append(f"| `{nodeid}` | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", type=pathlib.Path,
                        default=pathlib.Path("/work/upstream/mpi4jax"))
    parser.add_argument("--np", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--reference", type=pathlib.Path, default=None,
                        help="a directory holding mpi4jax 0.9.1 itself, for a comparison column")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    if not (args.upstream / "tests" / "conftest.py").exists():
        sys.exit(f"{args.upstream} does not hold mpi4jax's tests/ (tag {UPSTREAM_TAG}); fetch "
                 f"github.com/mpi4jax/mpi4jax and copy its tests/, examples/ and pyproject.toml "
                 f"there, or pass --upstream DIR.")
    if args.reference and not (args.reference / "mpi4jax" / "__init__.py").exists():
        sys.exit(f"--reference {args.reference} does not hold an installed mpi4jax package.")
    private = private_tests(args.upstream / "tests")
    work = pathlib.Path(tempfile.mkdtemp(prefix="upstream_mpi4jax_"))
    results, elapsed, reference, reference_elapsed = {}, {}, {}, {}
    try:
        for target, into, seconds in [(None, results, elapsed),
                                      (args.reference, reference, reference_elapsed)]:
            if into is reference and not args.reference:
                continue
            for n in args.np:
                start = time.monotonic()
                into[n] = run_suite(args.upstream, n, work, target)
                for nodeid, per_rank in into[n].items():
                    if nodeid in RACY and any(r["outcome"] == "failed" for r in per_rank):
                        again = run_suite(args.upstream, n, work, target, only=nodeid)[nodeid]
                        into[n][nodeid] = [
                            {**r, "rerun": f"{first['outcome']} at first ({first['detail']})"}
                            for r, first in zip(again, per_rank, strict=True)]
                seconds[n] = time.monotonic() - start
                print(f"{'mpi4jax' if target else 'autoshard'} np {n}: {len(into[n])} tests in "
                      f"{seconds[n]:.0f} s", flush=True)
    finally:
        if args.keep:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    RESULTS.write_text(report(results, private, elapsed, reference or None, reference_elapsed))
    print(RESULTS.read_text())


if __name__ == "__main__":
    main()
