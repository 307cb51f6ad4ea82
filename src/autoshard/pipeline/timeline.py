"""A run's stage execution trace drawn as a PNG timeline (one row per sub-mesh).

Uses matplotlib's object API (``Figure`` + Agg canvas), so drawing changes no global
matplotlib state; matplotlib is imported only when a timeline is drawn (``pip install
autoshard[bench]``).
"""

from __future__ import annotations

COLORS = {"F": "#4c72b0", "B": "#55a868", "Ba": "#55a868", "Bw": "#dd8452", "apply": "#8c8c8c"}


def kind_of(name: str) -> str:
    """``F2.0`` -> ``F``; ``Bw1.3`` -> ``Bw``; ``apply0.1`` -> ``apply``."""
    for kind in ("apply", "Ba", "Bw", "F", "B"):
        if name.startswith(kind):
            return kind
    return "apply"


def draw_timeline(trace, path: str, *, row_of=None, title: str = "") -> str:
    """Write ``trace`` (``(name, stage, start_s, duration_s)`` rows) as a PNG to ``path``.

    ``row_of(stage)``: the row (sub-mesh) of a stage; None: one row per stage.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as err:
        raise ImportError("Drawing a pipeline timeline needs matplotlib: pip install "
                          "'autoshard[bench]' (or matplotlib).") from err
    if not trace:
        raise ValueError("The trace is empty: run a step with record=True first "
                         "(dump_stage_execution_trace(path, *args) does).")
    row_of = row_of or (lambda s: s)
    rows = sorted({row_of(stage) for _, stage, _, _ in trace})
    fig = Figure(figsize=(10, 0.6 * len(rows) + 1.4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, stage, start, dur in trace:
        kind = kind_of(name)
        y = rows.index(row_of(stage))
        ax.barh(y, dur * 1e3, left=start * 1e3, height=0.8, color=COLORS[kind],
                edgecolor="black", linewidth=0.4)
        if kind != "apply":
            ax.text((start + dur / 2) * 1e3, y, name.split(".")[-1], ha="center",
                    va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(rows)), [f"sub-mesh {r}" for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("time since the first action (ms)")
    ax.set_title(title or "pipeline stage execution (label: micro-batch)")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items() if k != "Ba"],
              loc="upper right", fontsize=7, ncols=4)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


__all__ = ["draw_timeline", "kind_of"]
