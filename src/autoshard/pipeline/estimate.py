"""What ``autoshard.plan`` returns for a pipeline: per-stage estimates and the step's."""

from __future__ import annotations

from dataclasses import dataclass

from ..cluster import GIB
from ..sharding.plan import ShardingPlan
from . import balance


@dataclass(frozen=True, kw_only=True)
class StageEstimate:
    """One stage's place, plans, times and memory."""

    stage: int
    """Model stage index."""
    layers: tuple[int, ...]
    """Layers the stage holds."""
    devices: tuple[int, int]
    """(first device, device count) of its sub-mesh in the cluster's device order."""
    physical_shape: tuple[int, int]
    """(hosts, devices per host) of its sub-mesh."""
    mesh_shape: tuple[int, ...]
    """Logical mesh shape its tasks are planned on."""
    task_s: dict
    """Task kind -> seconds of one run (``F``/``B``/``Ba``/``Bw``: per micro-batch; ``apply``:
    per step, all its apply tasks)."""
    send_s: dict
    """Task kind -> seconds of the copies of its outputs to other stages per run."""
    send_bytes: dict
    """Task kind -> bytes one device sends to other stages per run."""
    memory_bytes: int
    """Estimated peak bytes per device (largest task peak + residuals of micro-batches in
    flight)."""
    plans: tuple[tuple[str, ShardingPlan], ...]
    """(task name, its plan) in planning order."""
    reduce_bytes: int = 0
    """Bytes per device of the partial gradients its backward tasks keep over the batch axes,
    all-reduced once per step by its reduce task (before its apply tasks)."""
    reduce_s: float = 0.0
    """Seconds of that once-per-step reduction (included in ``task_s['apply']``)."""


@dataclass(frozen=True, kw_only=True)
class PipelineEstimate:
    """A pipeline plan for a described cluster: stages, sub-meshes, schedule and step time."""

    method: str
    """How it was made (``PipeshardParallel(...)`` with its options)."""
    cluster: str
    """``Cluster.describe()`` of the cluster priced."""
    schedule: str
    """Pipeline schedule replayed."""
    num_micro_batches: int
    """Micro-batches per step."""
    num_layers: int
    """Layers the forward was cut into."""
    stages: tuple[StageEstimate, ...]
    """Per model stage."""
    makespan_s: float
    """Replayed schedule of the F/B actions (copies included), seconds."""
    apply_s: float
    """The slowest stage's apply tasks after the last backward, seconds."""
    bubble_fraction: float
    """Idle share of all sub-mesh time during the replay."""
    flops: float
    """Matrix-product FLOPs of one step on all devices (every task, every micro-batch)."""
    num_devices: int
    """Devices of the cluster."""
    timeline: str = ""
    """The replayed schedule as text (``Simulation.render``)."""
    notes: tuple[str, ...] = ()
    """Remarks: choices made by the pricing, what it does not model."""
    stage_flops: tuple[float, ...] = ()
    """Per stage, the FLOPs of its forward and backward tasks for one micro-batch
    (``balance.stage_flops``)."""

    @property
    def stage_imbalance(self) -> float:
        """The slowest stage's F+B time per micro-batch over the mean (1.0: balanced)."""
        return balance.imbalance([sum(t for k, t in s.task_s.items() if k != "apply")
                                  for s in self.stages])

    @property
    def step_s(self) -> float:
        """Estimated seconds per training step."""
        return self.makespan_s + self.apply_s

    @property
    def peak_bytes_per_device(self) -> int:
        return max(s.memory_bytes for s in self.stages)

    @property
    def tflops_per_device(self) -> float:
        return self.flops / self.step_s / self.num_devices / 1e12

    def explain(self) -> str:
        lines = [f"{self.method} priced for {self.cluster}",
                 f"  {len(self.stages)} stages over {self.num_layers} layers, schedule "
                 f"{self.schedule}, {self.num_micro_batches} micro-batches",
                 f"  estimated step {self.step_s:.4g} s = schedule {self.makespan_s:.4g} s "
                 f"(bubble {self.bubble_fraction:.1%} of sub-mesh time) + apply "
                 f"{self.apply_s:.4g} s; {self.tflops_per_device:.3g} TFLOP/s per device; "
                 f"peak memory {self.peak_bytes_per_device / GIB:.3g} GiB per device"]
        for s in self.stages:
            first, n = s.devices
            times = ", ".join(f"{k} {v:.4g} s" + (f" + send {s.send_s[k]:.3g} s "
                                                  f"({s.send_bytes[k]:,} B/device)"
                                                  if s.send_bytes.get(k) else "")
                              for k, v in s.task_s.items())
            lines.append(f"  stage {s.stage}: layers {list(s.layers)} on devices "
                         f"{first}..{first + n - 1} ({s.physical_shape[0]} host(s) x "
                         f"{s.physical_shape[1]}), mesh {'x'.join(map(str, s.mesh_shape))}; "
                         f"{times}; memory {s.memory_bytes / GIB:.3g} GiB per device"
                         + (f"; gradients reduced once per step: {s.reduce_bytes:,} B/device "
                            f"in {s.reduce_s:.3g} s (in apply)" if s.reduce_bytes else ""))
            for name, plan in s.plans:
                o = plan.objective
                lines.append(f"    {name}: mesh {plan.mesh_shape}, {o.total_s:.4g} s (compute "
                             f"{o.compute_s:.4g} + communication "
                             f"{o.communication_s + o.resharding_s:.4g}), peak "
                             f"{(o.peak_bytes_per_device or 0) / GIB:.3g} GiB, "
                             f"{len(plan.collectives)} collectives")
        if self.stage_flops:
            lines.append(f"  {balance.describe(self.stage_flops)}; F+B time imbalance "
                         f"max/mean {self.stage_imbalance:.2f}")
        if self.timeline:
            lines += ["  schedule replayed (one micro-batch action per cell):"] + [
                "    " + row for row in self.timeline.splitlines()]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


__all__ = ["PipelineEstimate", "StageEstimate"]
