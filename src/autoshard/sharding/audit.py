"""Audit: the plan's predicted collectives and memory against what XLA compiled.

Bytes are compared per (kind, mesh axes) as bytes one device receives per step: the sum of
``count * num_bytes`` of the plan's ``Collective`` records against the result sizes of the
compiled collectives times their loop trip counts. An all-to-all is priced on its group's whole
array (``n`` shards); its compiled result on one device is one shard, so the prediction counts
``num_bytes / n``. XLA's CPU runtime has no 16-bit float reductions: it promotes a bf16/f16
all-reduce to float32, so there the prediction counts twice the bytes. On the CPU, XLA lowers a reduce-scatter to
an all-reduce of the whole array and a local slice, so there a predicted reduce-scatter is
counted as that all-reduce.

A compiled program *diverges* from its plan when its collective bytes fall outside
``BYTES_RATIO_RANGE`` times the predicted ones or its memory exceeds ``MEMORY_RATIO_MAX`` times
the estimate, by more than a few bytes (``DIVERGENCE_MIN_BYTES``, ``DIVERGENCE_MIN_MEMORY``):
then the plan's costs do not describe what runs (e.g. XLA left a planned split undone and
every device computes the whole array). A plan made under ``memory_budget_per_device``
whose compiled memory exceeds ``BUDGET_RATIO_MAX`` times the budget diverges too
(``Audit.budget_miss()``: by how much, and the budget that would fit). ``Audit.divergences()``
names each one,
``explain()`` reports them, and ``AUTOSHARD_AUDIT=1`` warns at the first call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import hlo
from .plan import ShardingPlan, spec_axes

BYTES_RATIO_RANGE = (0.5, 1.1)
"""Compiled over predicted collective bytes per step outside this range is a divergence."""
DIVERGENCE_MIN_BYTES = 4096
"""Collective bytes per step by which compiled and predicted must differ to diverge: below
this (a 4-byte loss reduction XLA folded away) a collective's latency, not its bytes, decides
its cost on any link."""
MEMORY_RATIO_MAX = 1.25
"""Compiled memory per device above this multiple of the estimate is a divergence."""
DIVERGENCE_MIN_MEMORY = 16384
"""Bytes per device by which compiled memory must exceed the estimate to diverge: XLA's
fixed buffers (tuples, scalars, alignment) outweigh the arrays of programs that small."""
BUDGET_RATIO_MAX = 1.02
"""Compiled memory per device above this multiple of ``memory_budget_per_device`` misses the
budget (a divergence: the plan's estimate fitted it)."""
DIVERGENCE_HINT = ("the compiled program is not the one the planner costed: compare "
                   "ex.plan.explain() with ex.get_hlo_text() (ex.dump_debug_info(dir) writes "
                   "both) and report it with the step that produced it")
"""What to do about a divergence (the planner's estimate, not the user's program, is wrong)."""


def allocation_bytes(memory_analysis) -> int:
    """Bytes per device of a compiled program (``compiled.memory_analysis()``): arguments +
    outputs + temporaries - aliased (a donated argument and its output share a buffer)."""
    m = memory_analysis
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
               - m.alias_size_in_bytes)


@dataclass(frozen=True, kw_only=True)
class AuditRow:
    """Predicted against compiled bytes of one (kind, mesh axes) pair."""

    kind: str
    """Collective kind."""
    axes: tuple[str, ...] | None
    """Mesh axes (None: groups that match no set of mesh axes)."""
    predicted_bytes: int
    """Bytes per device per step the plan expects."""
    compiled_bytes: int
    """Bytes per device per step in the compiled program."""
    compiled_count: int
    """Compiled executions per step."""


@dataclass(frozen=True, kw_only=True)
class Audit:
    """What was costed against what runs."""

    rows: tuple[AuditRow, ...]
    """One row per (kind, axes) seen in the prediction or the compiled program."""
    unpredicted: tuple[hlo.CompiledCollective, ...]
    """Compiled collectives of a (kind, axes) the plan did not predict at all."""
    predicted_memory: int | None
    """The planner's peak bytes per device (None for fixed-plan methods)."""
    compiled_memory: int
    """XLA's allocation per device: arguments + outputs + temporaries - aliased."""
    has_prediction: bool
    """False for methods that predict nothing (DataParallel, ZeRO, manual specs)."""
    memory_budget: int | None = None
    """The plan's ``memory_budget_per_device`` (None: planned without one)."""

    @property
    def predicted_bytes(self) -> int:
        return sum(r.predicted_bytes for r in self.rows)

    @property
    def compiled_bytes(self) -> int:
        return sum(r.compiled_bytes for r in self.rows)

    def bytes_ratio(self) -> float:
        """Compiled over predicted collective bytes (1.0 when both are zero)."""
        p, c = self.predicted_bytes, self.compiled_bytes
        return 1.0 if p == c == 0 else (math.inf if p == 0 else c / p)

    def memory_ratio(self) -> float | None:
        if not self.predicted_memory:
            return None
        return self.compiled_memory / self.predicted_memory

    def budget_miss(self) -> str | None:
        """How far the compiled program goes over the plan's memory budget, and what would
        fit; None when it has no budget or keeps within ``BUDGET_RATIO_MAX`` of it."""
        budget, compiled = self.memory_budget, self.compiled_memory
        if budget is None or compiled <= BUDGET_RATIO_MAX * budget:
            return None
        refit = int(budget * budget / compiled)
        return (f"compiled memory per device is {compiled / budget:.3f}x "
                f"memory_budget_per_device ({compiled:,} B against {budget:,} B, "
                f"{compiled - budget:,} B over; the estimate was "
                f"{self.predicted_memory or 0:,} B): plan with a budget of about {refit:,} B "
                f"to fit {budget:,} B, or raise it to {compiled:,} B")

    def within(self, tolerance: float = 0.10) -> bool:
        """Compiled bytes at most ``1 + tolerance`` times the predicted ones, memory likewise.

        Fewer compiled bytes than predicted pass down to ``BYTES_RATIO_RANGE[0]`` of them: XLA
        found a cheaper collective (it gathers a small operand instead of reducing a large
        result, or reshards a value once for several consumers the plan prices one by one).
        Fewer still, down to none, is a divergence: the planned split did not happen.
        """
        mem = self.memory_ratio()
        return (self.bytes_ratio() <= 1 + tolerance and self._bytes_divergence() is None
                and (mem is None or mem <= 1 + tolerance))

    def divergences(self) -> tuple[str, ...]:
        """Where the compiled program departs from the plan, one sentence each (empty: none).

        Only a method that predicts (``has_prediction``) can diverge.
        """
        if not self.has_prediction:
            return ()
        found = [] if (b := self._bytes_divergence()) is None else [b]
        mem = self.memory_ratio()
        if mem is not None and mem > MEMORY_RATIO_MAX and (
                self.compiled_memory - self.predicted_memory >= DIVERGENCE_MIN_MEMORY):
            found.append(f"compiled memory per device is {mem:.2f}x the estimate "
                         f"({self.compiled_memory:,} B against {self.predicted_memory:,} B; at "
                         f"most {MEMORY_RATIO_MAX}x expected)")
        if (miss := self.budget_miss()) is not None:
            found.append(miss)
        return tuple(found)

    def _bytes_divergence(self) -> str | None:
        low, high = BYTES_RATIO_RANGE
        p, c, ratio = self.predicted_bytes, self.compiled_bytes, self.bytes_ratio()
        if low <= ratio <= high or abs(c - p) < DIVERGENCE_MIN_BYTES:
            return None
        if c == 0:
            return (f"the plan predicts {p:,} B of collectives per step, the compiled program "
                    "has none (compiled/predicted 0.00): XLA did not split the computation "
                    "as planned")
        if p == 0:
            return f"the compiled program runs {c:,} B of collectives per step, the plan predicts none"
        return (f"compiled collectives are {ratio:.2f}x the predicted bytes ({c:,} B against "
                f"{p:,} B per step; {low}x-{high}x expected)")

    def unpredicted_full_gathers(self, full_bytes: set[int]) -> list[hlo.CompiledCollective]:
        """Unpredicted all-gathers whose result is a whole array of one of ``full_bytes``."""
        return [c for c in self.unpredicted if c.kind == "all-gather" and c.num_bytes in full_bytes]

    def explain(self) -> str:
        lines = ["audit: predicted against compiled collectives (bytes one device receives per "
                 "step)"]
        if not self.has_prediction:
            lines.append("  (this method makes no prediction: compiled collectives only)")
        lines.append(f"    {'kind':<16}{'axes':<12}{'predicted':>14}{'compiled':>14}{'runs':>7}")
        for r in self.rows:
            axes = "?" if r.axes is None else ("+".join(r.axes) or "-")
            lines.append(f"    {r.kind:<16}{axes:<12}{r.predicted_bytes:>14,}"
                         f"{r.compiled_bytes:>14,}{r.compiled_count:>7}")
        lines.append(f"    {'total':<28}{self.predicted_bytes:>14,}{self.compiled_bytes:>14,}"
                     + (f"   ratio {self.bytes_ratio():.2f}" if self.has_prediction else ""))
        for c in self.unpredicted:
            where = "in a loop" if c.in_loop else "once"
            lines.append(f"  unpredicted: {c.kind} {c.shape} over "
                         f"{'?' if c.axes is None else '+'.join(c.axes)} x{c.count} ({where})")
        mem = f"  memory per device: compiled {self.compiled_memory:,} B"
        if self.predicted_memory:
            mem += (f", estimated {self.predicted_memory:,} B (ratio "
                    f"{self.memory_ratio():.2f})")
        if self.memory_budget is not None:
            mem += (f", budget {self.memory_budget:,} B (compiled "
                    f"{self.compiled_memory / self.memory_budget:.3f}x)")
        lines.append(mem)
        lines.extend(verdict_lines(self.divergences(), self.has_prediction))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()


def verdict_lines(divergences: tuple[str, ...], has_prediction: bool) -> list[str]:
    """The closing lines of an audit's explain(): each divergence, or that there is none."""
    if divergences:
        return ([f"  DIVERGENCE: {d}" for d in divergences]
                + [f"  ({DIVERGENCE_HINT})"])
    if not has_prediction:
        return []
    low, high = BYTES_RATIO_RANGE
    return [f"  no divergence: collective bytes within {low}x-{high}x of the prediction (or "
            f"{DIVERGENCE_MIN_BYTES:,} B of it), memory at most {MEMORY_RATIO_MAX}x the estimate "
            f"(or {DIVERGENCE_MIN_MEMORY:,} B over it)"]


def audit(plan: ShardingPlan, hlo_text: str, compiled_memory: int, *,
          platform: str = "cpu") -> Audit:
    sizes = plan.mesh_sizes
    predicted: dict[tuple, int] = {}
    # Reduce-scatters the step makes itself (the gradients reduced together) stay
    # reduce-scatters on the CPU; XLA's partitioner makes the others all-reduces and slices.
    explicit = {src.where for ps in plan.partial_sums + plan.reduce_scattered
                if any(set(spec_axes(e)) & set(ps.axes) for e in ps.total_spec)
                for src in ps.sources}
    for c in plan.collectives:
        kind, num_bytes = c.kind, c.num_bytes
        group = math.prod(sizes[a] for a in c.axes)
        if kind == "reduce-scatter" and platform == "cpu" and c.where not in explicit:
            kind, num_bytes = "all-reduce", num_bytes * group
        elif kind == "all-to-all":   # priced on the group's array; a device ends with 1/n of it
            num_bytes = num_bytes / group
        if (platform == "cpu" and kind == "all-reduce"
                and c.dtype in ("bfloat16", "float16")):
            num_bytes *= 2   # the CPU runtime reduces in float32 (XLA promotes the all-reduce)
        key = (kind, tuple(a for a in c.axes if sizes[a] > 1))
        predicted[key] = predicted.get(key, 0) + int(round(c.count * num_bytes))
    compiled_list = hlo.collectives(hlo_text, plan.axis_names, plan.mesh_shape)
    compiled: dict[tuple, list] = {}
    for c in compiled_list:
        compiled.setdefault((c.kind, c.axes), []).append(c)
    rows = []
    for key in sorted(set(predicted) | set(compiled), key=lambda k: (k[0], str(k[1]))):
        found = compiled.get(key, [])
        rows.append(AuditRow(kind=key[0], axes=key[1], predicted_bytes=predicted.get(key, 0),
                             compiled_bytes=sum(c.num_bytes * c.count for c in found),
                             compiled_count=sum(c.count for c in found)))
    # XLA may run a predicted pair of per-axis steps (x, then y) as one step over x+y, or the
    # reverse: a compiled collective is predicted when every axis it spans has a predicted
    # collective of its kind.
    covered: dict[str, set] = {}
    for kind, axes in predicted:
        covered.setdefault(kind, set()).update(axes)
    unpredicted = tuple(c for c in compiled_list if c.axes is None
                        or not set(c.axes) <= covered.get(c.kind, set()))
    has_prediction = plan.objective is not None
    return Audit(rows=tuple(rows), unpredicted=unpredicted if has_prediction else (),
                 predicted_memory=(plan.objective.peak_bytes_per_device
                                   if has_prediction else None),
                 compiled_memory=int(compiled_memory), has_prediction=has_prediction,
                 memory_budget=(plan.objective.memory_budget_per_device
                                if has_prediction else None))
