"""suite.md tables and PNG plots from the suite's result dictionary."""

from __future__ import annotations

import os

import numpy as np

SHORT = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS", "all-to-all": "A2A",
         "collective-permute": "CP"}


def _ms(x):
    return "-" if x is None else f"{x * 1e3:.1f}"


def _s(x):
    return "-" if x is None else f"{x:.2f}"


def _mb(x):
    return "-" if x is None else f"{x / 2**20:.2f}"


def _ratio(x):
    return "-" if x is None else f"{x:.2f}x"


def derive(records: list[dict]) -> None:
    """Ratios to the best hand-written plan of the same model (and of the same mesh).

    "Best" is the fastest; on a mesh, the hand-written plan moving the fewest bytes is also
    named, since on shared CPU cores the fastest can be a matter of noise.
    """
    for model in {r["model"] for r in records}:
        rows = [r for r in records if r["model"] == model and r["status"] == "ok"]
        manual = [r for r in rows if r["family"] == "manual"]
        single = next((r for r in rows if r["family"] == "single"), None)
        best = min(manual, key=lambda r: r["step_time_s"], default=None)
        for r in rows:
            r["best_manual_plan"] = best and best["plan"]
            r["step_time_ratio_to_best_manual"] = (
                r["step_time_s"] / best["step_time_s"] if best else None)
            same = [m for m in manual if m["mesh_shape"] == r["mesh_shape"]]
            best_same = min(same, key=lambda m: m["step_time_s"], default=None)
            r["best_manual_same_mesh"] = best_same and best_same["plan"]
            if best_same:
                r["step_time_ratio_to_best_manual_same_mesh"] = (
                    r["step_time_s"] / best_same["step_time_s"])
                r["collective_bytes_ratio_to_best_manual_same_mesh"] = _div(
                    r["total_wire_bytes"], best_same["total_wire_bytes"])
                r["plan_plus_compile_ratio_to_manual_jit"] = (
                    r["plan_plus_compile_s"] / best_same["plan_plus_compile_s"])
                fewest = min(same, key=lambda m: m["total_wire_bytes"])
                r["fewest_bytes_manual_same_mesh"] = fewest["plan"]
                r["collective_bytes_ratio_to_fewest_manual_same_mesh"] = _div(
                    r["total_wire_bytes"], fewest["total_wire_bytes"])
                r["result_bytes_ratio_to_fewest_manual_same_mesh"] = _div(
                    r["total_collective_bytes"], fewest["total_collective_bytes"])
            if single is not None and r.get("loss_first_step") is not None:
                ref = single["loss_first_step"]
                r["loss_matches_single"] = bool(
                    abs(r["loss_first_step"] - ref) <= 1e-3 * abs(ref) + 1e-4)


def _div(a, b):
    return a / b if b else None


def headline(result: dict) -> list[str]:
    """One line per (model, ShardParallel mesh): time and bytes against the best manual plan."""
    lines = []
    for model in result["models"]:
        rows = [r for r in result["records"] if r["model"] == model and r["status"] == "ok"]
        best = next((r for r in rows if r["plan"] == (rows[0].get("best_manual_plan") if rows
                                                       else None)), None)
        if best is None:
            lines.append(f"- **{model}**: no hand-written plan finished.")
            continue
        lines.append(f"- **{model}**: best hand-written plan `{best['plan']}` "
                     f"{_ms(best['step_time_s'])} ms/step, "
                     f"{_mb(best['total_wire_bytes'])} MiB sent per device "
                     f"({_mb(best['total_collective_bytes'])} MiB of collective results).")
        for r in result["records"]:
            if r["model"] != model or not r["plan"].startswith("autoshard:ShardParallel"):
                continue
            if r["status"] != "ok":
                lines.append(f"  - `{r['plan']}`: {r['status']} ({_first_line(r['error'])})")
                continue
            same = r.get("best_manual_same_mesh")
            text = (f"  - `{r['plan']}` mesh {r['mesh_shape']}: "
                    f"{_ratio(r['step_time_ratio_to_best_manual'])} the best manual step time; ")
            if same:
                text += (f"against `{same}` on the same mesh "
                         f"{_ratio(r.get('step_time_ratio_to_best_manual_same_mesh'))} time, "
                         f"{_ratio(r.get('collective_bytes_ratio_to_best_manual_same_mesh'))} "
                         f"bytes sent ("
                         f"{_ratio(r.get('collective_bytes_ratio_to_fewest_manual_same_mesh'))} "
                         f"of `{r.get('fewest_bytes_manual_same_mesh')}`, the fewest), "
                         f"plan + compile "
                         f"{_ratio(r.get('plan_plus_compile_ratio_to_manual_jit'))} of its "
                         "jax.jit compile; ")
            lines.append(text + f"planning {_s(r.get('planning_time_s'))} s.")
    return lines


def targets(result: dict) -> list[str]:
    """The issue's targets, each checked against this run (reported, never asserted)."""
    def mark(ok):
        return "-" if ok is None else ("met" if ok else "**missed**")
    out = ["| target | model / plan | value | |", "|---|---|---|---|"]
    for r in result["records"]:
        if not r["plan"].startswith("autoshard:ShardParallel") or r["status"] != "ok":
            continue
        where = f"{r['model']} / {r['plan']} vs `{r.get('best_manual_same_mesh')}`"
        b = r.get("collective_bytes_ratio_to_fewest_manual_same_mesh")
        fewest = r.get("fewest_bytes_manual_same_mesh")
        t = r.get("step_time_ratio_to_best_manual_same_mesh")
        c = r.get("plan_plus_compile_ratio_to_manual_jit")
        out.append(f"| bytes sent <= fewest of any manual plan, same mesh "
                   f"| {r['model']} / {r['plan']} vs `{fewest}` | {_ratio3(b)} "
                   f"| {mark(None if b is None else b <= 1.0)} |")
        out.append(f"| step time <= 1.05x best manual, same mesh | {where} | {_ratio(t)} "
                   f"| {mark(None if t is None else t <= 1.05)} |")
        out.append(f"| plan + compile <= 2x jax.jit compile | {where} | {_ratio(c)} "
                   f"| {mark(None if c is None else c <= 2.0)} |")
    out += _default_plan_targets(result, mark)
    sweep = [r for r in result.get("planning_sweep", [])
             if r["plan"].startswith("autoshard") and r["status"] == "ok"]
    if sweep:
        deepest = max(r["layers"] for r in sweep)
        for r in sweep:
            if r["layers"] == deepest:
                out.append(f"| planning < 10 s, largest GPT | gpt {deepest} layers / {r['plan']} "
                           f"| {_s(r['planning_time_s'])} s "
                           f"| {mark(r['planning_time_s'] < 10.0)} |")
    wall = result.get("suite_wall_time_s")
    if wall is not None:
        out.append(f"| suite part of `make bench` < 10 min | all | {wall / 60:.1f} min "
                   f"| {mark(wall < 600)} |")
    return out


def _default_plan_targets(result: dict, mark) -> list[str]:
    """What a user gets by default (ShardParallel(), the planner's own mesh) against the
    hand-written plan with the fewest collective bytes on the same devices, any mesh."""
    out = []
    for r in result["records"]:
        if r["plan"] != "autoshard:ShardParallel" or r["status"] != "ok":
            continue
        manual = [m for m in result["records"] if m["model"] == r["model"]
                  and m["family"] == "manual" and m["status"] == "ok"]
        if not manual:
            continue
        fewest = min(manual, key=lambda m: m["total_wire_bytes"])
        b = _div(r["total_wire_bytes"], fewest["total_wire_bytes"])
        rb = _div(r["total_collective_bytes"], fewest["total_collective_bytes"])
        m = _div(r["peak_bytes_per_device"], fewest["peak_bytes_per_device"])
        mesh = "x".join(map(str, r["mesh_shape"] or ()))
        where = f"{r['model']} / default plan (mesh {mesh}) vs `{fewest['plan']}`"
        out.append(f"| default plan: bytes sent <= fewest manual plan | {where} "
                   f"| {_ratio3(b)} (results {_ratio3(rb)}) "
                   f"| {mark(None if b is None else b <= 1.0)} |")
        out.append(f"| default plan: memory <= 1.05x that plan's | {where} | {_ratio3(m)} "
                   f"| {mark(None if m is None else m <= 1.05)} |")
        audit = r.get("audit_bytes_ratio")
        out.append(f"| default plan: compiled bytes within 10% of predicted | {r['model']} | "
                   f"{_ratio3(audit)} | "
                   f"{mark(None if audit is None else 0.90 <= audit <= 1.10)} |")
    return out


def _ratio3(x):
    return "-" if x is None else f"{x:.3f}x"


def _first_line(text) -> str:
    return str(text).strip().splitlines()[-1][:200] if text else ""


def _steps(result: dict) -> str:
    """Timed steps per plan as run (between --min-repeats and --repeats, by the step budget)."""
    counts = {r["num_timed_steps"] for r in result["records"] if r.get("num_timed_steps")}
    if not counts:
        return str(result["settings"]["repeats"])
    lo, hi = min(counts), max(counts)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def write_markdown(result: dict, path: str) -> None:
    m = result["machine"]
    out = ["# autoshard side-by-side suite", "",
           f"{m['num_devices']} x {m['backend']} devices ({m['device_kind']}), "
           f"{m['cpu_count']} CPU cores, jax {m['jax']}, flax {m['flax']}, commit "
           f"`{(m['git_commit'] or '?')[:10]}`{' (dirty)' if m['git_dirty'] else ''}, size "
           f"`{result['size']}`, {_steps(result)} timed steps after "
           f"{result['settings']['warmup']} warm-up, suite wall time "
           f"{result.get('suite_wall_time_s', 0):.0f} s.", ""]
    if m["backend"] == "cpu":
        out += ["On virtual CPU devices all 'devices' share the same cores: step times measure "
                "plan overhead and communication structure, not accelerator speed. Collective "
                "bytes are per device and per step, from the compiled HLO: 'results' are the "
                "collectives' result shapes, 'sent' is what each device puts on the links under "
                "ring algorithms over its group size (an all-reduce sends 2(n-1)/n of the array, "
                "an all-gather (n-1)/n of its result), the measure that compares plans whose "
                "groups differ in size. Comparisons with hand-written plans use bytes sent. On "
                "the CPU XLA lowers reduce-scatter to all-reduce + dynamic-slice, so it shows as "
                "AR.", ""]
    out += ["## Headline", "", *headline(result), "", "## Targets (issue 5)", "",
            "Reported, not asserted. A step-time ratio means little where the plans' IQRs "
            "(tables below) are as wide as the difference.", "", *targets(result), ""]
    for model, info in result["models"].items():
        out += [f"## {model}", "", f"{info['num_params']:,} parameters, {info['config']}", "",
                "| plan | mesh | step ms (median) | IQR ms | ratio to best manual | plan s | "
                "compile s | collective MiB (AR/AG/RS/A2A/CP) | sent MiB | predicted MiB | "
                "peak MiB/device "
                "| memory / estimate | ILP obj ms | loss = single |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in result["records"]:
            if r["model"] != model:
                continue
            mesh = "x".join(map(str, r["mesh_shape"])) if r["mesh_shape"] else "-"
            if r["status"] != "ok":
                out.append(f"| {r['plan']} | {mesh} | **{r['status']}**: "
                           f"{_first_line(r['error']).replace('|', '/')} | | | | | | | | | | | |")
                continue
            coll = r["collective_bytes"]
            by_kind = "/".join(_mb(coll[k]) if coll[k] else "0" for k in SHORT)
            ok = {True: "yes", False: "**no**", None: "-"}[r.get("loss_matches_single")]
            out.append(
                f"| {r['plan']} | {mesh} | {_ms(r['step_time_s'])} | {_ms(r['step_time_iqr_s'])} "
                f"| {_ratio(r.get('step_time_ratio_to_best_manual'))} "
                f"| {_s(r.get('planning_time_s'))} | {_s(r['compile_time_s'])} "
                f"| {_mb(r['total_collective_bytes'])} ({by_kind}) "
                f"| {_mb(r['total_wire_bytes'])} "
                f"| {_mb(r['predicted_collective_bytes']) if 'predicted_collective_bytes' in r else '-'} "
                f"| {_mb(r['peak_bytes_per_device'])} | {_ratio(r.get('audit_memory_ratio'))} "
                f"| {_ms(r.get('ilp_objective_s'))} | {ok} |")
        out.append("")
    if result.get("planning_sweep"):
        out += ["## Planning time vs GPT depth", "",
                "| layers | plan | mesh | status | planning s | XLA compile s | plan + compile s "
                "| ILP columns |", "|---|---|---|---|---|---|---|---|"]
        for r in result["planning_sweep"]:
            mesh = "x".join(map(str, r["mesh_shape"])) if r["mesh_shape"] else "-"
            out.append(f"| {r['layers']} | {r['plan']} | {mesh} | {r['status']} "
                       f"| {_s(r['planning_time_s'])} | {_s(r['compile_time_s'])} "
                       f"| {_s(r['plan_plus_compile_s'])} | {r['ilp_columns'] or '-'} |")
        out.append("")
    errors = [r for r in result["records"] + result.get("planning_sweep", [])
              if r["status"] not in ("ok",)]
    if errors:
        out += ["## Failures and skips", ""]
        for r in errors:
            where = r.get("model") or f"gpt, {r.get('layers')} layers"
            out.append(f"- {where} / `{r['plan']}`: {r['status']}: "
                       f"{_first_line(r['error'])}")
        out.append("")
    with open(path, "w") as f:
        f.write("\n".join(out))


def write_plots(result: dict, out_dir: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(result["models"])
    plans = []
    for r in result["records"]:
        if r["plan"] not in plans and r["status"] == "ok":
            plans.append(r["plan"])

    def grouped(key, scale, ylabel, title, fname, hline=None, log=False):
        fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(models) + 4), 4.8))
        width = 0.8 / max(1, len(plans))
        for j, plan in enumerate(plans):
            values = []
            for model in models:
                r = next((r for r in result["records"] if r["model"] == model
                          and r["plan"] == plan and r["status"] == "ok"), None)
                v = r.get(key) if r else None
                values.append(np.nan if v is None else v * scale)
            ax.bar(np.arange(len(models)) + (j - (len(plans) - 1) / 2) * width, values, width,
                   label=plan, color=plt.cm.tab20(j % 20))
        if log:
            ax.set_yscale("log")
        if hline is not None:
            ax.axhline(hline, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(np.arange(len(models)), models)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, fname), dpi=110)
        plt.close(fig)

    grouped("step_time_ratio_to_best_manual", 1.0, "step time / best hand-written plan",
            "Step-time ratio per model (log scale; lower is better; 1 = best manual)",
            "suite_step_ratio.png", hline=1.0, log=True)
    grouped("peak_bytes_per_device", 1 / 2**20, "MiB per device",
            "Memory per device (compiled memory analysis)", "suite_memory.png")

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    sweep = [r for r in result.get("planning_sweep", []) if r["status"] == "ok"]
    for plan, key, style in (("autoshard:ShardParallel-1d", "planning_time_s", "o-"),
                             ("autoshard:ShardParallel-2d", "planning_time_s", "s-"),
                             ("manual:dp", "compile_time_s", "k^--")):
        rows = sorted((r for r in sweep if r["plan"] == plan), key=lambda r: r["layers"])
        if rows:
            label = f"{plan} planning" if key == "planning_time_s" else "jax.jit compile (DP)"
            ax.plot([r["layers"] for r in rows], [r[key] for r in rows], style, label=label)
    if not sweep:
        ax.text(0.5, 0.5, "no planning sweep in this run", ha="center", transform=ax.transAxes)
    ax.set_xticks(sorted({r["layers"] for r in sweep}))
    ax.set_xlabel("GPT layers")
    ax.set_ylabel("seconds")
    ax.set_title("Planning time vs layers")
    if sweep:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "suite_planning_vs_layers.png"), dpi=110)
    plt.close(fig)
