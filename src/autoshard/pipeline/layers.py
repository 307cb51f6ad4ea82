"""Layers: the forward cut at ``mark_pipeline_boundary`` calls, or clustered automatically.

``ManualLayerOption``: a layer is the span between two boundary markers. ``AutoLayerOption``:
a dynamic program over the forward equations in program order picks ``layer_num - 1`` cuts;
every layer's FLOPs stay within ``(1 + eps) * total / layer_num`` and at least
``total / (4 * layer_num)``, and the bytes of the values crossing the cuts are minimal (ties:
the most balanced). Where one equation holds more than that upper bound (a wide matmul), the
bound is raised to the least largest-layer FLOPs any cut reaches, so every layer keeps work;
where no cut keeps every layer above the lower bound, it is dropped. Either may recompute each
stage's forward in its backward (``remat_layer=True``, ``remat_mode="coarse_grained_remat"``),
the effect of ``jax.checkpoint`` around it: only the stage inputs are kept between F and B.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ..ir._compat import Var
from ..ir._markers import pipeline_p
from ..ir._prims import eqn_flops
from ..ir._walk import any_eqn, sub_jaxprs


@dataclass(frozen=True)
class ManualLayerOption:
    """Layers from ``autoshard.mark_pipeline_boundary()`` calls in the forward."""

    remat_layer: bool = False
    """Recompute each stage's forward during its backward instead of keeping activations."""

    def __post_init__(self):
        if not isinstance(self.remat_layer, bool):
            raise TypeError(f"ManualLayerOption.remat_layer ({self.remat_layer!r}) must be a bool.")

    @property
    def remat(self) -> bool:
        return self.remat_layer


@dataclass(frozen=True)
class AutoLayerOption:
    """Layers from clustering the traced forward: balanced FLOPs, few bytes across cuts."""

    layer_num: int
    """Number of layers to cut the forward into."""
    remat_mode: Literal["none", "coarse_grained_remat"] = "none"
    """``coarse_grained_remat``: recompute each stage's forward during its backward."""
    eps: float = 0.5
    """A layer may hold at most ``(1 + eps) / layer_num`` of the forward FLOPs."""

    def __post_init__(self):
        n = self.layer_num
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"AutoLayerOption.layer_num ({n!r}) must be a positive int.")
        if self.remat_mode not in ("none", "coarse_grained_remat"):
            raise ValueError(f"AutoLayerOption.remat_mode ({self.remat_mode!r}) must be 'none' "
                             "or 'coarse_grained_remat'.")
        if not isinstance(self.eps, int | float) or self.eps < 0:
            raise ValueError(f"AutoLayerOption.eps ({self.eps!r}) must be a number >= 0.")

    @property
    def remat(self) -> bool:
        return self.remat_mode == "coarse_grained_remat"


def check_no_nested_markers(jaxpr) -> None:
    """Boundary markers must be at the top level of the step, not inside a loop or cond."""
    def boundary(x):
        return x.primitive is pipeline_p and x.params["mark_type"] == "boundary"
    for e in jaxpr.eqns:
        if any(any_eqn(sub, boundary) for sub in sub_jaxprs(e)):
            raise ValueError(
                f"mark_pipeline_boundary() was called inside the body of {e.primitive.name} "
                "(e.g. lax.scan); a pipeline layer cannot start in the middle of a loop or "
                "branch. Move the marker out of the loop body (unroll the loop over layers), "
                "or use layer_option=AutoLayerOption(layer_num=...).")


def manual_layers(pre, fwd_end: int) -> tuple[dict, int]:
    """Forward equation index -> layer, from boundary markers; and the number of layers."""
    layer, count, out = 0, 0, {}
    for i in range(fwd_end):
        e = pre[i]
        if e.primitive is pipeline_p and e.params["mark_type"] == "boundary":
            if count:
                layer, count = layer + 1, 0
            continue
        out[i] = layer
        count += 1
    return out, layer + (1 if count or layer == 0 else 0)


def _nbytes(v) -> int:
    aval = v.aval
    return math.prod(getattr(aval, "shape", ())) * getattr(getattr(aval, "dtype", None),
                                                           "itemsize", 1)


def auto_layers(pre, fwd_end: int, layer_num: int, eps: float) -> tuple[dict, int]:
    """Cluster the forward into ``layer_num`` layers (see the module docstring)."""
    idx = [i for i in range(fwd_end) if not (pre[i].primitive is pipeline_p and
                                             pre[i].params["mark_type"] == "boundary")]
    n = len(idx)
    if n == 0:
        return {}, 1
    layer_num = min(layer_num, n)
    prefix = [0.0]
    for i in idx:
        prefix.append(prefix[-1] + eqn_flops(pre[i]))
    total = prefix[-1] or 1.0
    limit = max((1 + eps) * total / layer_num, least_max_layer(prefix, layer_num))
    cut_bytes = _cut_bytes(pre, idx)
    back = _cluster(prefix, layer_num, limit, total / (4 * layer_num), cut_bytes)
    if back is None:  # no cut keeps every layer above the floor: balance alone
        back = _cluster(prefix, layer_num, limit, 0.0, cut_bytes)
    assert back is not None, "the least largest layer is always reachable"
    out, j = {}, n
    for layer in range(layer_num, 0, -1):
        i = back[layer][j]
        for k in range(i, j):
            out[idx[k]] = layer - 1
        j = i
    return out, layer_num


def _cluster(prefix, layer_num: int, limit: float, floor: float, cut_bytes):
    """Back-pointers of the cheapest cut (bytes crossing, then the largest layer's FLOPs)
    into ``layer_num`` layers of FLOPs in ``[floor, limit]`` each; None if there is none."""
    n = len(prefix) - 1
    inf = (math.inf, math.inf)
    # best[l][j]: (bytes, max layer flops) for the first j equations in l layers.
    best = [[inf] * (n + 1) for _ in range(layer_num + 1)]
    back = [[0] * (n + 1) for _ in range(layer_num + 1)]
    best[0][0] = (0.0, 0.0)
    for layer in range(1, layer_num + 1):
        for j in range(1, n + 1):
            i = j - 1
            while i >= layer - 1:
                f = prefix[j] - prefix[i]
                if f > limit and i < j - 1:
                    break
                prev = best[layer - 1][i]
                if prev != inf and f >= floor:
                    cost = (prev[0] + (cut_bytes[i - 1] if i > 0 else 0), max(prev[1], f))
                    if cost < best[layer][j]:
                        best[layer][j], back[layer][j] = cost, i
                i -= 1
    return back if best[layer_num][n] != inf else None


def least_max_layer(prefix, layer_num: int) -> float:
    """The least FLOPs of the largest layer over every cut of the equations (FLOPs summed in
    ``prefix``) into ``layer_num`` contiguous layers: a bisection on the bound, each bound
    checked by filling layers greedily (fewer layers can always be split further)."""
    n = len(prefix) - 1
    lo = max(prefix[j + 1] - prefix[j] for j in range(n))
    hi = prefix[-1]

    def fits(bound) -> bool:
        count, i = 0, 0
        while i < n:
            j = i + 1
            while j < n and prefix[j + 1] - prefix[i] <= bound:
                j += 1
            count, i = count + 1, j
        return count <= layer_num
    if fits(lo):
        return lo
    for _ in range(100):
        if hi - lo <= 1e-9 * hi:
            break
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def _cut_bytes(pre, idx) -> list[int]:
    """Bytes of forward values produced at or before position p and read after it."""
    made = {}
    last = {}
    for p, i in enumerate(idx):
        for v in pre[i].outvars:
            made[v] = p
        for v in pre[i].invars:
            if isinstance(v, Var) and v in made:
                last[v] = max(last.get(v, -1), p)
    delta = [0] * (len(idx) + 1)
    for v, p in made.items():
        q = last.get(v)
        if q is not None and q > p:
            delta[p] += _nbytes(v)
            delta[q] -= _nbytes(v)
    out, run = [], 0
    for p in range(len(idx)):
        run += delta[p]
        out.append(run)
    return out


def layer_option_of(layer, default_layers: int):
    """A method's ``layer_option`` as an option: ``'manual'`` is ``ManualLayerOption()``, None
    ``AutoLayerOption(layer_num=default_layers)``; anything else but an option is an error."""
    if layer is None:
        return AutoLayerOption(layer_num=default_layers)
    if layer == "manual":
        return ManualLayerOption()
    if not isinstance(layer, ManualLayerOption | AutoLayerOption):
        raise TypeError(f"layer_option ({layer!r}) must be 'manual', ManualLayerOption() "
                        "or AutoLayerOption(layer_num=...).")
    return layer


__all__ = ["AutoLayerOption", "ManualLayerOption", "auto_layers", "check_no_nested_markers",
           "layer_option_of", "least_max_layer", "manual_layers"]
