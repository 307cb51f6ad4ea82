"""Cluster: the hardware a plan is costed for (hosts, devices, links, FLOP/s, memory).

A plan can be made for a cluster you do not have: ``autoshard.plan(step, *shapes,
cluster=Cluster.a100_80gb(num_hosts=32))`` prices every mesh axis on the links it really
uses and the compute on the device's FLOP/s, with no device of that cluster at hand.

Devices are numbered host by host (``devices_per_host`` consecutive devices share a host) and
a logical mesh is laid over them row-major, as ``jax.make_mesh`` and ``Mesh(np.array(
jax.devices()).reshape(shape))`` do on a GPU cluster. An axis whose devices all sit in one
host costs the intra-host link; an axis that crosses hosts, or straddles them (a 16-wide axis
over 8-device hosts), the inter-host link: its slowest hop (``sharding.cost.axis_crosses_hosts``).

Measured numbers replace the presets field by field::

    measured = dataclasses.replace(Cluster.a100_80gb(4), inter_host_bandwidth=21e9,
                                   flops_efficiency=0.7)

Bandwidths are per device and per direction, in bytes per second (what a ring all-reduce's
bus bandwidth measures, e.g. ``nccl-tests``' ``busbw``); latencies are seconds per ring hop
(a collective over an axis pays one ring pass: ``sharding.cost``, "Ring latency").
The inter-host figure is per device: a host's network bandwidth is ``inter_host_bandwidth *
devices_per_host`` (a DGX A100: 8 NICs, one per GPU). An axis crossing hosts with
``k`` of its devices in each host rings through their ``k`` NICs together (NCCL puts one
channel on each), at ``k * inter_host_bandwidth``, at most the intra-host link
(``sharding.cost.crossing_beta``); a host with fewer NICs than devices is described by its
network bandwidth divided by its devices.

The presets hold what the hardware is measured to deliver, not its datasheet: NCCL's bus
bandwidth, a streaming kernel's memory bandwidth, a sustained large GEMM's FLOP/s (the sources
and the decision: ``sharding.cost``, "Measured device figures").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .sharding import cost

GIB = 2**30


_PRESETS = {
    "A100 80GB": dict(peak_flops=312e12, flops_efficiency=0.74, memory_bytes=80 * GIB,
                      memory_bandwidth=1.6e12, intra_host_bandwidth=230e9,
                      inter_host_bandwidth=23e9),
    "H100 80GB": dict(peak_flops=989e12, flops_efficiency=0.7, memory_bytes=80 * GIB,
                      memory_bandwidth=3.35e12, intra_host_bandwidth=370e9,
                      inter_host_bandwidth=48e9),
}
"""Figures of the presets (see ``Cluster.a100_80gb``/``h100_80gb``): peak FLOP/s and memory
from the datasheets; the A100's GEMM efficiency, memory bandwidth and links and the H100's
links as measured (``sharding.cost``, "Measured device figures"); the H100's memory bandwidth
and GEMM efficiency are its datasheet figure and an estimate."""


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Hosts of identical devices joined by two levels of links."""

    num_hosts: int
    """Hosts (machines, nodes)."""
    devices_per_host: int
    """Devices of one host (consecutive in device order)."""
    peak_flops: float
    """Peak FLOP/s of one device in the dtype the model computes in (bf16 dense for GPUs)."""
    flops_efficiency: float = 1.0
    """Fraction of ``peak_flops`` that large matrix products sustain (the compute term's speed)."""
    memory_bytes: int | None = None
    """Memory of one device in bytes: the planner's budget per device (None: unbounded)."""
    memory_bandwidth: float = 1 / cost.BYTE_COST_S
    """Bytes/s one device reads and writes its memory at (prices memory-bound operations)."""
    intra_host_bandwidth: float = 1 / cost.DEFAULT_BETA_S_PER_BYTE
    """Bytes/s per device and direction between devices of one host (NVLink, ...)."""
    intra_host_latency_s: float = cost.DEFAULT_ALPHA_S
    """Seconds of latency of one ring step (hop) between devices of a host: a collective over
    ``n`` devices of one host pays ``n - 1`` of them per ring pass (``sharding.cost``,
    "Ring latency")."""
    inter_host_bandwidth: float = 1 / cost.INTER_HOST_BETA_S_PER_BYTE
    """Bytes/s per device and direction between hosts (a host's network links / its devices):
    an axis with ``k`` devices in each host crosses hosts at ``k`` times this."""
    inter_host_latency_s: float = cost.INTER_HOST_ALPHA_S
    """Seconds of latency of one ring step (hop) between hosts: a ring over ``h`` hosts makes
    ``h - 1`` of them per pass (its other hops are inside hosts)."""
    name: str = "custom"
    """What the numbers describe, shown by ``explain()``."""

    def __post_init__(self):
        for field in ("num_hosts", "devices_per_host"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Cluster.{field} ({value!r}) must be a positive int.")
        for field in ("peak_flops", "memory_bandwidth", "intra_host_bandwidth",
                      "inter_host_bandwidth"):
            value = getattr(self, field)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(
                    f"Cluster.{field} ({value!r}) must be a positive finite number (per second, "
                    "per device). Give the measured or datasheet figure.")
        for field in ("intra_host_latency_s", "inter_host_latency_s"):
            value = getattr(self, field)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"Cluster.{field} ({value!r}) must be non-negative seconds.")
        if not 0 < self.flops_efficiency <= 1:
            raise ValueError(
                f"Cluster.flops_efficiency ({self.flops_efficiency!r}) must be in (0, 1]: the "
                "fraction of peak_flops that large matrix products reach.")
        if self.memory_bytes is not None and (
                not isinstance(self.memory_bytes, int) or self.memory_bytes <= 0):
            raise ValueError(
                f"Cluster.memory_bytes ({self.memory_bytes!r}) must be a positive int (bytes "
                "per device) or None for no budget.")

    # Presets ---------------------------------------------------------------------------------
    @classmethod
    def a100_80gb(cls, num_hosts: int = 1, *, devices_per_host: int = 8) -> Cluster:
        """DGX A100 80GB nodes: NVLink 3 inside a node, 8x200 Gb/s HDR InfiniBand between.

        Measured, not datasheet figures (sources: ``sharding.cost``, "Measured device
        figures"): large bf16 GEMMs sustain 230 TFLOP/s (0.74 of the 312 peak), memory-bound
        kernels stream 1.6 TB/s (datasheet 2.04), NCCL's ring reaches a bus bandwidth of
        230 GB/s over NVLink (line rate 300 GB/s per direction) and 23 GB/s through each
        GPU's 200 Gb/s NIC (184 GB/s per node: a data axis over all 8 GPUs of each node
        crosses nodes at 184 GB/s, one over one GPU per node at 23 GB/s).
        """
        return cls._preset("A100 80GB", num_hosts, devices_per_host)

    @classmethod
    def h100_80gb(cls, num_hosts: int = 1, *, devices_per_host: int = 8) -> Cluster:
        """DGX H100 nodes: NVLink 4 inside a node, 8x400 Gb/s NDR InfiniBand between.

        989 TFLOP/s bf16 dense, 3.35 TB/s HBM3 (datasheet), NCCL's ring at 370 GB/s over
        NVLink (line rate 450 GB/s per direction) and 48 GB/s through each GPU's 400 Gb/s
        NIC (384 GB/s per node), as measured (``sharding.cost``, "Measured device
        figures"); large bf16 GEMMs sustain about 70% of peak (an estimate below the
        794.5 TFLOP/s best-shape maximum measured).
        """
        return cls._preset("H100 80GB", num_hosts, devices_per_host)

    @classmethod
    def _preset(cls, name: str, num_hosts: int, devices_per_host: int) -> Cluster:
        # Per ring hop: NCCL's tuning model for its Simple protocol (the one large messages
        # use) on A100-era releases, ring over NVLink 3.4 us, over the network 9.6 us.
        return cls(num_hosts=num_hosts, devices_per_host=devices_per_host,
                   intra_host_latency_s=3.4e-6, inter_host_latency_s=9.6e-6,
                   name=f"{name}, {num_hosts} x {devices_per_host}", **_PRESETS[name])

    @classmethod
    def from_devices(cls, devices: Sequence[Any]) -> Cluster:
        """The cluster of ``devices`` (e.g. ``jax.devices()``): hosts from their processes.

        A100/H100 GPUs get their preset's figures; other devices (CPUs) the cost model's
        defaults (``sharding.cost``), so planning for the devices at hand is unchanged.
        Memory is the device's ``bytes_limit`` where JAX reports one.
        """
        devices = list(devices)
        if not devices:
            raise ValueError("Cluster.from_devices needs at least one device, e.g. jax.devices().")
        per_host: dict[int, int] = {}
        for d in devices:
            per_host[d.process_index] = per_host.get(d.process_index, 0) + 1
        counts = sorted(set(per_host.values()))
        if len(counts) != 1:
            raise ValueError(
                f"Cluster.from_devices: the devices sit unevenly on their hosts ({per_host} "
                "devices per process). Give the same number of devices from every host.")
        kind = str(getattr(devices[0], "device_kind", "")).upper()
        num_hosts, dph = len(per_host), counts[0]
        preset = (cls.h100_80gb(num_hosts, devices_per_host=dph) if "H100" in kind
                  or "H200" in kind else cls.a100_80gb(num_hosts, devices_per_host=dph)
                  if "A100" in kind else cls(num_hosts=num_hosts, devices_per_host=dph,
                                              peak_flops=1 / cost.FLOP_COST_S))
        memory = _bytes_limit(devices[0])
        return dataclasses.replace(
            preset, memory_bytes=memory if memory is not None else preset.memory_bytes,
            name=f"{getattr(devices[0], 'device_kind', 'device')}, {num_hosts} x {dph}")

    @classmethod
    def measure(cls, devices: Sequence[Any] | None = None, *, repeats: int = 5) -> Cluster:
        """The cluster of ``devices`` (default ``jax.devices()``) with its figures measured.

        ``from_devices`` gives GPUs their preset and other devices (CPUs) the cost model's
        defaults, an accelerator-like description: plans made on CPU devices are then the
        plans an accelerator would get. This runs short micro-benchmarks on the devices
        instead (``autoshard._measure``: a matrix product, a streamed array, a chain of small
        all-reduces and one large one over the devices of a host and, with several hosts,
        over one device per host) and describes what they deliver, so plans are priced for
        running on them: on XLA:CPU, whose collectives cost hundreds of microseconds and
        whose products run at tens of GFLOP/s, it prices compute and latency as they are.
        It takes a few seconds on CPU devices; every process must call it (it runs
        collectives). Plan with it through ``autoshard.plan(..., cluster=Cluster.measure())``
        and run the plan with ``ShardParallel(plan=...)``.
        """
        import jax

        from . import _measure

        if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
            raise ValueError(f"Cluster.measure: repeats ({repeats!r}) must be a positive int "
                             "(timed calls per micro-benchmark; the median is used).")
        devices = sorted(jax.devices() if devices is None else devices,
                         key=lambda d: d.process_index)
        base = cls.from_devices(devices)
        found = _measure.measure(devices, base.num_hosts, base.devices_per_host, repeats)
        figures = dict(peak_flops=found.flops, flops_efficiency=1.0,
                       memory_bandwidth=found.memory_bandwidth)
        for link in ("intra_host", "inter_host"):
            if getattr(found, f"{link}_bandwidth") is not None:
                figures[f"{link}_bandwidth"] = getattr(found, f"{link}_bandwidth")
                figures[f"{link}_latency_s"] = getattr(found, f"{link}_latency_s")
        return dataclasses.replace(base, name=f"{base.name}, measured", **figures)

    # What the planner reads ------------------------------------------------------------------
    @property
    def num_devices(self) -> int:
        return self.num_hosts * self.devices_per_host

    @property
    def flop_s(self) -> float:
        """Seconds per floating-point operation of a matrix product on one device."""
        return 1.0 / (self.peak_flops * self.flops_efficiency)

    @property
    def byte_s(self) -> float:
        """Seconds per byte of a memory-bound operation on one device."""
        return 1.0 / self.memory_bandwidth

    def axis_crosses_hosts(self, mesh_shape: Sequence[int]) -> tuple[bool, ...]:
        """Per axis of a row-major mesh over these devices: whether it leaves one host."""
        self.check_mesh(mesh_shape)
        dph = self.devices_per_host if self.num_hosts > 1 else None
        return tuple(cost.axis_crosses_hosts(tuple(mesh_shape), a, dph)
                     for a in range(len(mesh_shape)))

    @property
    def host_network_bandwidth(self) -> float:
        """Bytes/s per direction out of one host (all its NICs): the per-device figure times
        the devices of a host."""
        return self.inter_host_bandwidth * self.devices_per_host

    def mesh_costs(self, mesh_shape: Sequence[int]) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(alpha, beta) per axis: latency in s of one ring pass over it and inverse bandwidth
        in s/byte of its link.

        A ring pass over an axis of ``n`` devices makes ``n - 1`` hops, ``hosts - 1`` of them
        between hosts (``sharding.cost.ring_pass_latency``); an axis crossing hosts is priced on
        the NICs of the devices it has in each host (``sharding.cost.crossing_beta``).
        """
        crosses = self.axis_crosses_hosts(mesh_shape)
        shape = tuple(mesh_shape)
        dph = self.devices_per_host if self.num_hosts > 1 else None
        alpha = tuple(cost.ring_pass_latency(
            shape[a], cost.axis_devices_per_host(shape, a, dph) if c else shape[a],
            self.intra_host_latency_s, self.inter_host_latency_s) for a, c in enumerate(crosses))
        beta = tuple(cost.crossing_beta(1.0 / self.inter_host_bandwidth,
                                        1.0 / self.intra_host_bandwidth,
                                        cost.axis_devices_per_host(shape, a, dph))
                     if c else 1.0 / self.intra_host_bandwidth for a, c in enumerate(crosses))
        return alpha, beta

    def check_mesh(self, mesh_shape: Sequence[int]) -> None:
        if math.prod(mesh_shape) != self.num_devices:
            raise ValueError(
                f"The mesh shape {tuple(mesh_shape)} holds {math.prod(mesh_shape)} devices but "
                f"the cluster ({self.name}) has {self.num_devices} ({self.num_hosts} hosts x "
                f"{self.devices_per_host}). Choose a mesh whose product is {self.num_devices}, "
                "or describe the cluster you run on (Cluster(num_hosts=..., "
                "devices_per_host=...)).")

    def describe(self) -> str:
        return (f"{self.name}: {self.num_devices} devices ({self.num_hosts} hosts x "
                f"{self.devices_per_host}), {self.peak_flops / 1e12:g} TFLOP/s peak x "
                f"{self.flops_efficiency:g}, "
                + (f"{self.memory_bytes / GIB:g} GiB" if self.memory_bytes else "unbounded memory")
                + f", links {self.intra_host_bandwidth / 1e9:g} GB/s in a host, "
                f"{self.inter_host_bandwidth / 1e9:g} GB/s between hosts per device "
                f"({self.host_network_bandwidth / 1e9:g} GB/s per host)")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Cluster:
        return cls(**data)


def _bytes_limit(device) -> int | None:
    try:
        stats = device.memory_stats()
    except Exception:  # backends without memory statistics (CPU) raise or return None
        return None
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit else None


__all__ = ["Cluster"]
