"""How planning time grows with layers and GPUs (issue 24's "planning scale").

The GPT of ``cluster.py`` at GPT-3 175B's width (hidden 12288, 96 heads, seq 2048, batch
1536, Adam, every layer rematerialised) is planned by ``autoshard.plan`` with the default
``ShardParallel`` on described A100 clusters, nothing allocated:

* layers 24 / 48 / 96 on 1,024 GPUs, the layers as a ``lax.scan`` (the fast path) and as a
  Python loop (unrolled);
* 512 / 1,024 / 3,072 GPUs at 48 layers, both forms.

Each point runs in its own process, stopped after ``LIMIT_S``; its wall time is trace +
plan, with the load average of the (shared) machine beside it. The search itself is
reported too: how many meshes were solved and how many pruned.

Run: ``python benchmarks/planning_scale.py [--limit 600]``; writes
``benchmarks/results/planning_scale.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
HIDDEN, HEADS, BATCH = 12288, 96, 1536
LIMIT_S = 600
"""A point whose planning takes longer is stopped; the limit is recorded instead."""
POINTS = ([(layers, 1024) for layers in (24, 48, 96)]
          + [(48, gpus) for gpus in (512, 3072)])
"""(layers, GPUs) planned in both forms."""


def plan_point(layers: int, gpus: int, scan: bool) -> dict:
    """Plan one point in this process; what ``main`` records for it."""
    import autoshard
    import cluster
    from autoshard import AutoShardingOption, Cluster, ShardParallel

    t0 = time.perf_counter()
    step = cluster.make_step(scan)
    args = cluster.abstract_args(HIDDEN, HEADS, layers, BATCH, scan)
    method = ShardParallel(auto_sharding_option=AutoShardingOption(show_progress=False))
    plan = autoshard.plan(step, *args, cluster=Cluster.a100_80gb(gpus // 8), method=method,
                          batch_argnums=(1, 2))
    o = plan.objective
    return {"plan_s": time.perf_counter() - t0, "mesh": list(plan.mesh_shape),
            "step_s": o.total_s, "memory_gib": o.peak_bytes_per_device / 2**30,
            "meshes_solved": len(o.meshes_tried), "meshes_pruned": len(o.meshes_pruned)}


def in_subprocess(layers: int, gpus: int, scan: bool, limit: float) -> dict:
    row = {"layers": layers, "gpus": gpus, "form": "scan" if scan else "unrolled",
           "load_average": os.getloadavg()[0], "limit_s": limit}
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            "import planning_scale as s; "
            f"print(json.dumps(s.plan_point({layers}, {gpus}, {scan})))")
    t0 = time.perf_counter()
    c0 = _children_cpu_s()
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=limit)
    except subprocess.TimeoutExpired:  # the child is killed and waited for: its CPU counts
        return {**row, "plan_s": time.perf_counter() - t0, "cpu_s": _children_cpu_s() - c0,
                "load_average_end": os.getloadavg()[0], "stopped": True}
    row.update(cpu_s=_children_cpu_s() - c0, load_average_end=os.getloadavg()[0])
    if done.returncode:
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"
        return {**row, "plan_s": time.perf_counter() - t0, "error": last}
    return {**row, **json.loads(done.stdout.strip().splitlines()[-1])}


def _children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's finished children."""
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def markdown(rows: list[dict], limit: float) -> str:
    lines = [
        "# Planning time against layers and GPUs",
        "",
        f"`autoshard.plan`, default `ShardParallel`, GPT at GPT-3 175B's width (hidden {HIDDEN}, "
        f"{HEADS} heads, seq 2048, batch {BATCH}, Adam, remat), described A100 80GB clusters; "
        f"one process per point, stopped after {limit:.0f} s. Wall time is trace + plan on a "
        "2-core machine shared with other work (CPU s: the point's process; load: the "
        "1-minute load average at its start and end).",
        "",
        "| layers | GPUs | form | plan s | CPU s | mesh | est. step s | memory GiB | meshes "
        "solved / pruned | load |",
        "|---:|---:|---|---:|---:|---|---:|---:|---|---:|"]
    for r in rows:
        cpu = f"{r['cpu_s']:.0f}" if "cpu_s" in r else ""
        if r.get("limit_s", limit) != limit:  # a kept row of a run with another limit
            cpu += f" (limit {r['limit_s']:.0f} s)"
        load = f"{r['load_average']:.1f}" + (f"-{r['load_average_end']:.1f}"
                                             if "load_average_end" in r else "")
        if r.get("stopped"):
            rest = f"stopped at {r['plan_s']:.0f} | {cpu} | | | | |"
        elif "error" in r:
            found = re.search(r"smallest estimate found is ([\d,]+) B", r["error"])
            why = (f"no plan fits 80 GiB (least memory found {int(found[1].replace(',', '')) / 2**30:.0f}"
                   " GiB)" if found else f"error: {r['error'][:80]}")
            rest = f"{r['plan_s']:.1f} | {cpu} | {why} | | | |"
        else:
            rest = (f"{r['plan_s']:.1f} | {cpu} | {tuple(r['mesh'])} | {r['step_s']:.2f} | "
                    f"{r['memory_gib']:.1f} | {r['meshes_solved']} / {r['meshes_pruned']} |")
        lines.append(f"| {r['layers']} | {r['gpus']} | {r['form']} | {rest} {load} |")
    lines += ["", "A point with no plan under the GPUs' memory (one step of the whole batch, no "
              "micro-batches or pipeline) is timed to the error, which the planner raises after "
              "every mesh is tried.", "", *growth(rows)]
    return "\n".join(lines)


def growth(rows: list[dict]) -> list[str]:
    """Ratios of plan time (CPU seconds where recorded) from the smallest point of each
    series, per form; a stopped point's time is a lower bound (">")."""
    out = []
    for form in ("scan", "unrolled"):
        done = {(r["layers"], r["gpus"]): r.get("cpu_s", r["plan_s"]) for r in rows
                if r["form"] == form}
        stopped = {(r["layers"], r["gpus"]) for r in rows
                   if r["form"] == form and r.get("stopped")}
        by_layers = [(n, (n, 1024)) for n in (24, 48, 96) if (n, 1024) in done]
        by_gpus = [(g, (48, g)) for g in (512, 1024, 3072) if (48, g) in done]
        for label, series in (("layers", by_layers), ("GPUs", by_gpus)):
            if len(series) > 1 and series[0][1] not in stopped:
                base = done[series[0][1]]
                out.append(f"* {form}, time against {label} (CPU s): " + ", ".join(
                    f"{x}: {'>' if key in stopped else ''}{done[key]:.0f} s "
                    f"({done[key] / base:.2f}x)" for x, key in series))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=float, default=LIMIT_S, help="seconds per point")
    p.add_argument("--forms", default="scan,unrolled", help="comma-separated: scan, unrolled")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--skip", default="",
                   help="comma-separated form:layers:GPUs points not to plan (e.g. scan:24:1024)")
    p.add_argument("--keep", type=Path,
                   help="rows of an earlier run (its printed lines, one json row each) "
                        "recorded as they are (with the limit they ran under)")
    args = p.parse_args(argv)
    rows = ([json.loads(line) for line in args.keep.read_text().splitlines() if line.strip()]
            if args.keep else [])
    skip = set(filter(None, args.skip.split(",")))
    for form in args.forms.split(","):
        for layers, gpus in POINTS:
            if f"{form}:{layers}:{gpus}" in skip:
                continue
            row = in_subprocess(layers, gpus, form == "scan", args.limit)
            print(json.dumps(row), flush=True)
            rows.append(row)
    rows.sort(key=lambda r: (r["form"], r["gpus"] != 1024, r["gpus"], r["layers"]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "planning_scale.json").write_text(json.dumps(rows, indent=1) + "\n")
    (args.out / "planning_scale.md").write_text(markdown(rows, args.limit) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
