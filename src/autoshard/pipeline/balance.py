"""How evenly the stages share a step's work: FLOPs per stage, reported and checked.

A stage's work is the FLOPs of its forward and backward tasks for one micro-batch
(``_prims.eqn_flops``; the apply tasks run once per step and are left out). A plan's
``explain()`` shows each stage's share and the imbalance (the largest stage over the mean: the
pipeline runs at the pace of its slowest stage). A stage with under ``1 / (4 * num_stages)``
of the work leaves its devices idle most of the step: planning warns, naming the stage, its
share and the fix.
"""

from __future__ import annotations

import warnings

from ..ir._prims import eqn_flops
from .layers import AutoLayerOption


def stage_flops(part) -> tuple[float, ...]:
    """Per stage, the FLOPs of its F and B tasks for one micro-batch."""
    return tuple(float(sum(eqn_flops(e) for t in (part.forward[s], part.backward[s])
                           for e in t.eqns)) for s in range(part.num_stages))


def imbalance(flops) -> float:
    """The largest stage's work over the mean (1.0: perfectly balanced)."""
    mean = sum(flops) / len(flops) if flops else 0.0
    return max(flops) / mean if mean > 0 else 1.0


def describe(flops) -> str:
    """One line for ``explain()``: each stage's work and share, and the imbalance."""
    total = sum(flops) or 1.0
    shares = ", ".join(f"stage {s} {f:.3g} ({f / total:.1%})" for s, f in enumerate(flops))
    return (f"stage work (F+B FLOPs per micro-batch): {shares}; imbalance max/mean "
            f"{imbalance(flops):.2f}")


def warn_idle_stages(flops, layer_option, stage_layer_ids) -> None:
    """Warn for every stage holding under ``1 / (4 * num_stages)`` of the work."""
    n, total = len(flops), sum(flops)
    if n < 2 or total <= 0:
        return
    floor = 1 / (4 * n)
    for s, f in enumerate(flops):
        if f / total >= floor:
            continue
        if isinstance(layer_option, AutoLayerOption):  # balanced already: one op dominates
            fix = ("use fewer stages (no cut of the forward balances them better: a few "
                   "operations hold most of the work), or give the stages sub-meshes of "
                   "different sizes with ManualStageOption(submesh_physical_shapes=...)")
        else:
            fix = ("move the autoshard.mark_pipeline_boundary() calls so that each stage "
                   f"holds a similar share, use layer_option=AutoLayerOption(layer_num={n}) "
                   "(layers balanced by FLOPs), or use fewer stages")
        warnings.warn(
            f"Pipeline stage {s} (layers {list(stage_layer_ids[s])}) holds {f / total:.1%} "
            f"of the step's work (F+B FLOPs per micro-batch), under 1/(4*{n}) = {floor:.1%}: "
            f"its devices idle most of the step. To balance the stages, {fix}.",
            UserWarning, stacklevel=3)


__all__ = ["describe", "imbalance", "stage_flops", "warn_idle_stages"]
