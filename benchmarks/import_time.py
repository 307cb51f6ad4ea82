"""How long ``import autoshard`` takes beyond ``import jax`` (issue 23: within 0.3 s).

    python benchmarks/import_time.py [--repeats 7]

Each repeat is a fresh interpreter: ``import jax`` is timed, then ``import autoshard``; the
difference is what autoshard adds. One more run with ``python -X importtime`` lists autoshard's
slowest modules and says which heavy libraries (scipy, flax, optax, ray, mpi4py) and which of
autoshard's own subpackages were loaded by the import. Writes ``results/import_time.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
PROBE = """
import sys, time
t0 = time.perf_counter(); import jax; t1 = time.perf_counter()
import autoshard; t2 = time.perf_counter()
heavy = [m for m in ("scipy", "flax", "optax", "ray", "mpi4py") if m in sys.modules]
ours = sorted({m.split(".")[1] for m in sys.modules if m.startswith("autoshard.")})
print(t1 - t0, t2 - t1, ",".join(heavy), ",".join(ours))
"""


def measure(repeats: int) -> dict:
    runs = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                             check=True).stdout.split()
        runs.append((float(out[0]), float(out[1])))
        heavy = out[2].split(",") if len(out) > 3 and out[2] else []
        ours = out[-1].split(",")
    trace = subprocess.run([sys.executable, "-X", "importtime", "-c", "import jax, autoshard"],
                           capture_output=True, text=True, check=True).stderr
    slowest = []
    for line in trace.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[2].strip().startswith("autoshard"):
            slowest.append((int(parts[0].split(":")[1]), parts[2].strip()))
    slowest.sort(reverse=True)
    return {"jax_s": statistics.median(r[0] for r in runs),
            "autoshard_extra_s": statistics.median(r[1] for r in runs),
            "runs": runs, "heavy_loaded": heavy, "subpackages_loaded": ours,
            "slowest_self_us": slowest[:10]}


def markdown(r: dict) -> str:
    target = 0.3
    verdict = "met" if r["autoshard_extra_s"] <= target else "**missed**"
    lines = ["# Import time", "",
             f"Median of {len(r['runs'])} fresh interpreters: `import jax` "
             f"{r['jax_s']:.2f} s, then `import autoshard` adds "
             f"**{r['autoshard_extra_s']:.3f} s** (target: within {target} s: {verdict}).", "",
             f"Heavy libraries loaded by `import autoshard`: "
             f"{', '.join(r['heavy_loaded']) or 'none'} (scipy loads with the first plan, "
             "mpi4py with `autoshard.mpi`).", "",
             f"autoshard modules and subpackages loaded: {', '.join(r['subpackages_loaded'])}.",
             "", "Slowest autoshard modules (`-X importtime`, self time):", "",
             "| module | self us |", "|---|---:|"]
    lines += [f"| `{m}` | {us:,} |" for us, m in r["slowest_self_us"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    r = measure(args.repeats)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "import_time.json").write_text(json.dumps(r, indent=1))
    (args.out / "import_time.md").write_text(markdown(r))
    print(markdown(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
