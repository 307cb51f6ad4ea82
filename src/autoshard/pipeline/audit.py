"""Audit of a pipeline: each task's predicted collectives and memory against what XLA compiled.

Every task (``F``, ``B``, ``Ba``/``Bw``, ``apply``) is one compiled program with its own plan,
audited by ``sharding.audit.audit``. A step runs each ``F``/``B`` task once per micro-batch and
each apply task once, so step totals weight a task's bytes by its runs. Memory is per stage:
the largest predicted and the largest compiled allocation of its tasks (activations a schedule
keeps in flight between tasks are in neither number). A task that fell back to data
parallelism has no prediction: its compiled collectives are listed, not judged. A planned
task diverges from its plan as a whole step does (``sharding.audit.Audit.divergences``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..sharding import hlo
from ..sharding.audit import Audit, AuditRow, audit, verdict_lines


@dataclass(frozen=True, kw_only=True)
class TaskAudit:
    """One task's audit and how often it runs per step."""

    name: str
    """Task name (``F0``, ``B1``, ``apply0.0``, ...)."""
    stage: int
    """Stage (sub-mesh) that runs it."""
    runs: int
    """Executions per step (micro-batches for F/B tasks, 1 for apply)."""
    audit: Audit
    """Predicted against compiled collectives and memory of one execution."""


@dataclass(frozen=True, kw_only=True)
class Transfer:
    """A value one task sends to a task on another sub-mesh."""

    value: str
    """The value (its jaxpr variable and shape)."""
    src: str
    """Producing task, or ``input`` for a step input (from where its first reader takes it)."""
    dst: str
    """Consuming task."""
    num_bytes: int
    """Bytes of the whole array (each destination device receives its shard)."""
    runs: int
    """Copies per step (once per micro-batch for per-micro-batch values)."""
    resharded: bool
    """True when the consumer's layout holds other shards than the producer's, so the value
    is resharded on the source devices before the copy (a cost no task plan prices)."""


@dataclass(frozen=True, kw_only=True)
class PipelineAudit:
    """What the per-task plans predicted against what runs, per task and per step."""

    tasks: tuple[TaskAudit, ...]
    """Tasks: forward, backward in reverse, apply, then the reduce tasks and cross-stage sums."""
    transfers: tuple[Transfer, ...] = ()
    """Values crossing between sub-meshes, with their copies per step."""

    @property
    def transfer_bytes(self) -> int:
        """Bytes of the arrays copied between sub-meshes per step."""
        return sum(t.runs * t.num_bytes for t in self.transfers)

    @property
    def predicted_bytes(self) -> int:
        """Collective bytes one device receives per step, as the plans predict."""
        return sum(t.runs * t.audit.predicted_bytes for t in self.tasks)

    @property
    def compiled_bytes(self) -> int:
        """Collective bytes one device receives per step in the compiled tasks."""
        return sum(t.runs * t.audit.compiled_bytes for t in self.tasks)

    @property
    def unpredicted(self) -> tuple[tuple[str, hlo.CompiledCollective], ...]:
        """(task name, collective) for compiled collectives of a kind and axes its plan lacks."""
        return tuple((t.name, c) for t in self.tasks for c in t.audit.unpredicted)

    @property
    def has_prediction(self) -> bool:
        """Whether every task was planned (none fell back to data parallelism)."""
        return all(t.audit.has_prediction for t in self.tasks)

    def stage_memory(self) -> dict[int, tuple[int | None, int]]:
        """Stage -> (largest predicted peak bytes per device, largest compiled allocation)."""
        out: dict[int, tuple[int | None, int]] = {}
        for t in self.tasks:
            pred, comp = out.get(t.stage, (None, 0))
            p = t.audit.predicted_memory
            out[t.stage] = (pred if p is None else max(pred or 0, p),
                            max(comp, t.audit.compiled_memory))
        return out

    def bytes_ratio(self) -> float:
        """Compiled over predicted collective bytes per step (1.0 when both are zero)."""
        p, c = self.predicted_bytes, self.compiled_bytes
        return 1.0 if p == c == 0 else (float("inf") if p == 0 else c / p)

    def within(self, tolerance: float = 0.10) -> bool:
        """Every planned task within ``tolerance`` (``Audit.within``) and nothing unpredicted."""
        return not self.unpredicted and all(
            t.audit.within(tolerance) for t in self.tasks if t.audit.has_prediction)

    def divergences(self) -> tuple[str, ...]:
        """Each planned task's divergences from its plan, prefixed with the task's name."""
        return tuple(f"task {t.name}: {d}" for t in self.tasks for d in t.audit.divergences())

    def explain(self) -> str:
        lines = ["pipeline audit: predicted against compiled collectives per task (bytes one "
                 "device receives per execution) and memory per device",
                 f"    {'task':<10}{'stage':>6}{'runs':>6}{'predicted':>12}{'compiled':>12}"
                 f"{'mem est':>12}{'mem XLA':>12}  unpredicted"]
        for t in self.tasks:
            a = t.audit
            pred = f"{a.predicted_bytes:,}" if a.has_prediction else "(no plan)"
            mem = f"{a.predicted_memory:,}" if a.predicted_memory else "-"
            lines.append(f"    {t.name:<10}{t.stage:>6}{t.runs:>6}{pred:>12}"
                         f"{a.compiled_bytes:>12,}{mem:>12}{a.compiled_memory:>12,}  "
                         f"{len(a.unpredicted)}")
        lines.append(f"  per step: predicted {self.predicted_bytes:,} B, compiled "
                     f"{self.compiled_bytes:,} B (ratio {self.bytes_ratio():.2f})")
        for s, (pred, comp) in sorted(self.stage_memory().items()):
            est = f"estimated {pred:,} B, " if pred else ""
            lines.append(f"  stage {s} memory per device: {est}compiled {comp:,} B (largest "
                         "task; activations in flight between tasks not included)")
        if self.transfers:
            copies = sum(t.runs for t in self.transfers)
            resharded = [t for t in self.transfers if t.resharded]
            lines.append(f"  transfers between sub-meshes per step: {copies} copies of "
                         f"{self.transfer_bytes:,} B in all; {len(resharded)} of "
                         f"{len(self.transfers)} values resharded before their copy")
            for t in resharded:
                lines.append(f"    resharded: {t.value} {t.src} -> {t.dst} x{t.runs}")
        for name, c in self.unpredicted:
            axes = "?" if c.axes is None else "+".join(c.axes)
            lines.append(f"  unpredicted in {name}: {c.kind} {c.shape} over {axes} x{c.count}")
        lines.extend(verdict_lines(self.divergences(),
                                   any(t.audit.has_prediction for t in self.tasks)))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()


def task_audit(task, runs: int) -> TaskAudit:
    """The audit of a ``CompiledTask`` (compiled collectives only when it has no plan)."""
    m = task.compiled.memory_analysis()
    memory = int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                 - m.alias_size_in_bytes)
    text = task.compiled.as_text()
    platform = task.mesh.devices.flat[0].platform
    if task.plan is not None:
        result = audit(task.plan, text, memory, platform=platform)
    else:  # no plan; a task run per device or a reduce task predicts its collectives itself
        mesh = task.mesh
        predicted = getattr(task, "predicted", None)
        found: dict = {}
        for c in hlo.collectives(text, tuple(mesh.axis_names), tuple(mesh.devices.shape)):
            found.setdefault((c.kind, c.axes), []).append(c)
        rows = tuple(AuditRow(kind=kind, axes=axes,
                              predicted_bytes=(predicted or {}).get((kind, axes), 0),
                              compiled_bytes=sum(c.num_bytes * c.count
                                                 for c in found.get((kind, axes), [])),
                              compiled_count=sum(c.count for c in found.get((kind, axes), [])))
                     for kind, axes in sorted(set(found) | set(predicted or {}), key=str))
        unpredicted = () if predicted is None else tuple(
            c for key, cs in found.items() if key not in predicted for c in cs)
        result = Audit(rows=rows, unpredicted=unpredicted, predicted_memory=None,
                       compiled_memory=memory, has_prediction=predicted is not None)
    return TaskAudit(name=task.task.name, stage=task.stage, runs=runs, audit=result)


__all__ = ["PipelineAudit", "TaskAudit", "Transfer", "task_audit"]
