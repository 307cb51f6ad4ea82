"""Alpha-beta cost model: collectives, resharding, compute and memory, all in seconds or bytes.

Every constant of the model lives here, and every pricing decision is written down below.

**Collectives.** A collective over mesh axis ``a`` moving ``b`` bytes costs
``alpha[a] + beta[a] * f(n) * b`` with ``n`` the axis size and ``f`` the volume factor of the
collective (as in Alpa): all-reduce ``2(n-1)/n``, all-gather and reduce-scatter ``(n-1)/n``,
all-to-all ``(n-1)/n^2``.

**Ring latency** (``ring_pass_latency``, ``Cluster.mesh_costs``). A ``Cluster``'s latencies
are per ring hop, and an axis's ``alpha`` is the latency of one ring pass over it: ``n - 1``
hops for ``n`` devices, ``hosts - 1`` of them between hosts and the rest inside hosts. This is
NCCL's own latency model (``ncclTopoTuneModel``: a ring makes ``n - 1`` steps per pass,
``nodes - 1`` of them over the network) with its Simple-protocol hop figures, the protocol
large messages use (A100-era releases: 3.4 us over NVLink, 9.6 us over the network). Before,
a collective paid one latency whatever its size, so a ring over 512 GPUs (511 hops a pass)
cost what a ring over 2 does. One pass is charged per collective of any kind. The ring is the
algorithm chosen because it is the only one NCCL has for all-gather and reduce-scatter, the
collectives of ZeRO's weight gathers and gradient scatters (every layer, every step, on
data-parallel meshes over every GPU). An all-reduce is charged one pass as well, not the
ring's two: inside a host (NCCL's tree is a chain there) that reads ``n - 1`` hops low (24 us
on 8 A100s); across hosts NCCL runs small all-reduces as a tree (``2 log2(hosts)`` network
hops, fewer than one pass) and large ones are bandwidth-bound, so one pass lies between the
two. (Two passes for an all-reduce would need a latency per collective kind, which the
merged-reduction terms of the ILP, paying each axis's ``alpha`` once, and Alpa's units, one
``alpha`` per collective of any kind, do not have.) NCCL's fixed base latency (8.4 us per
call) is not counted. Constants given as ``mesh_alpha`` are one collective's latency, as in
Alpa.

**One hierarchical rule for several axes** (``CostModel.collective_steps``). A collective over
several axes runs one phase per axis, the fastest link first on the whole array, each slower
axis on what the faster ones left: an all-reduce over (hosts, GPUs of a host) is a
reduce-scatter inside the host, an all-reduce across hosts on ``1/devices_per_host`` of the
bytes and an all-gather inside the host (the reduce-scatter and all-gather together cost the
inside axis's all-reduce volume); an all-gather gathers over the slow axis first, on the
small pieces; a reduce-scatter the other way round. Strategy collectives (an all-reduce after a
contracting split) and the all-gather chains of resharding (``reshard_steps``) are priced by
this one function. On links of one speed it telescopes to one ring over all the devices
(``2(N-1)/N`` for an all-reduce over ``N``), which is what XLA runs there; before, each axis
was charged the full bytes, so an all-reduce over two axes paid its whole size on the slow
one. Each phase pays its axis's latency once (as ``latency`` counts it; the three phases of an
all-reduce are issued as one NCCL call per axis). All-to-alls have no shrinking phase: each
axis moves the whole array.

**Where the axes lie.** The mesh is laid over the devices in order (row-major), and an axis
whose devices all sit in one host (process) costs the intra-host link; an axis that spans
hosts, or straddles them, costs the inter-host link. Devices of one host are one level: on a
single host every axis costs the same.

**Per-device inter-host bandwidth** (``crossing_beta``). The inter-host bandwidth is a figure
per device (a DGX A100 has one 200 Gb/s NIC per GPU, eight per node). When an axis spanning
hosts has ``k`` of its devices in each host (a data axis over all 8 GPUs of every node:
``k = 8``), NCCL spreads the ring over the ``k`` NICs of those devices (one channel per NIC),
so the ring's host-to-host hop runs at ``k`` times the per-device figure, capped by the
intra-host link the rest of the ring uses: ``beta = max(inter / k, intra)`` in s/byte. An axis
with one device per host (a data axis across nodes beside a tensor axis inside them) keeps
the per-device figure: each of the parallel rings has its own NIC. An axis straddling hosts
unevenly counts ``k = 1`` (its worst group has a lone device in some host). Before, every
crossing axis was one ring through one NIC. The two rules price the same devices differently
when they form one axis or two: an all-reduce of ``B`` bytes over 4 DGX A100 nodes as one
32-wide axis is one ring, ``1.94 B / 184 GB/s``; over a (4, 8) mesh's two axes it is the
phases, ``1.75 B / 230 GB/s + 1.5 B / 8 / 23 GB/s``, about 1.3x the ring (NCCL's flat ring over
all NICs beats the phased algorithm for large messages). The planner prices both meshes and
may choose either.

**Measured device figures** (``Cluster.a100_80gb``/``h100_80gb``). The presets held
datasheet figures where the fields are defined as measured ones (``autoshard.cluster``: a
link's bandwidth is what NCCL's ring reaches, ``nccl-tests``' bus bandwidth), and the model
rated Megatron-LM's Table 1 rows 1.30-1.50x faster than the paper measured (eq. 3 TFLOP/s
177/179/193/203 against 137/138/142/135). A back-of-envelope check of each term against
published measurements (the row-by-row accounting: ``benchmarks/results/cluster.md``) found
four figures high, now replaced by the measured ones:

* NVLink: ``nccl-tests`` ``all_reduce_perf`` on one 8x A100 SXM node reaches 232.5 GB/s bus
  bandwidth (NVIDIA/nccl-tests issue 175; about 200 GB/s on an HPE 8x A100 80GB, issue 149),
  and NCCL's maintainers put its protocol overhead at about 20% of the line rate (issue 212:
  450 GB/s NVLink 4 gives 370 GB/s): 230 GB/s for the A100's 300, 370 GB/s for the H100's 450.
* The NICs: an HDR 200 Gb/s NIC carries 24 GB/s in NCCL alone (NVIDIA/nccl issue 1048) and
  four of them 86-96 GB/s of bus bandwidth across nodes (nccl-tests issues 119, 175): 23 GB/s
  per GPU (25 on the datasheet). An NDR 400 Gb/s NIC reaches 48-49 GB/s (nccl-tests issue
  267): 48.
* Memory: an element-wise kernel over a large fp32 array streams 1.62 TB/s on an A100 80GB
  (mli/transformers-benchmarks: 0.202 TFLOP/s of ``a * 1.2``, 8 bytes per FLOP; an A800 80GB
  PCIe, the same die, 1.73 of its 1.94 TB/s, issue 4 there): 1.6 TB/s against the
  datasheet's 2.04. Memory-bound seconds rise by the same 1.25x.
* Matrix products: a bf16/fp16 8192^3 GEMM sustains 230 TFLOP/s on an A100 80GB over 3-second
  runs (mli/transformers-benchmarks, PyTorch 1.13, CUDA 11.7): 0.74 of the 312 peak, where the
  preset had 0.8. The best of a brute-force shape search reaches 271 (stas00/ml-engineering's
  MAMF table, 2025 software) and an 8192^3 GEMM at full boost clock 297 (NVIDIA/cutlass
  discussion 241); those are upper bounds, not what a training step's shapes sustain. The
  H100's 0.7 stays (its best-shape maximum measured is 794.5 TFLOP/s, 0.80).

Checked and left as they are, each worth under 1% of these rows' steps: NCCL's fixed base
latency (8.4 us per call in its tuning model; about 330 collectives a step in the 18.4B row:
3 ms of 7 s); the second ring pass of an all-reduce (latency only: the all-reduces' one pass
costs 0.04 s of the 18.4B row's step, so a second would add 0.04 s, 0.6%; it would need a
latency per collective kind, which the merged-reduction terms and Alpa's units do not have,
see "Ring latency"); the optimizer: Adam's update of each parameter is one fused pass (reads
the parameter, gradient and both moments, writes three of them: 28 bytes per fp32 element,
as apex's FusedAdam in Megatron-LM), 40 ms of the 18.4B paper plan's step (2.3e9 parameters
per GPU), 1 ms of the planner's (the moments split over 256 GPUs). Dropout (0.1 on attention
probabilities and hidden states in the paper's runs; Megatron-LM 2021 writes the attention
mask and reads it back, 15 bytes per attention probability: 0.36 s a step at 1.7B) is part
of the program, not of its pricing: the benchmark's GPT has none. After the change the rows
read 157/162/167/178 TFLOP/s (1.15/1.17/1.18/1.32x the paper's); what is left at 18.4B is
written up in ``benchmarks/results/cluster.md``.

**FLOPs reported** (``flops``). ``explain()`` shows the traced FLOPs (what the step runs) and,
beside them, the model FLOPs as Megatron-LM's eq. 3 counts a step (3 x the forward plus the
forward every remat recomputes), the count published TFLOP/s figures use. Neither enters the
objective.

**Compute.** A matrix product or convolution costs its FLOPs at the device's sustained rate
(``flop_cost``), or its bytes, whichever is slower (below, "Roofline"). A memory-bound op
costs the bytes it touches at the memory bandwidth (``byte_cost``); each rule prices an op
alone (an element-wise op: its output bytes).

**Roofline** (``fusion.Roofline``, applied with the fusion pass). A product costs
``max(FLOPs / (peak x efficiency), bytes / memory bandwidth)`` per device, the roofline
model (Williams, Waterman and Patterson, CACM 2009) that cuBLAS's and XLA's GEMMs reach:
the bytes are its operands as the strategy cuts them, read once, and its result, written
once (not when a fusion group takes the result as its epilogue: the group writes it). Before,
every product ran at the sustained FLOP rate with its memory traffic free, so products of low
arithmetic intensity (attention's ``batch x heads x seq x seq`` scores and their gradients:
about ``head dim`` FLOPs per byte against an A100's 125 at 80% of peak, or a small per-device
slice of a split product) were priced faster than the memory lets them run.

**Fusion** (``fusion.fuse_memory_bound``, applied to every problem). XLA fuses chains of
element-wise ops, the layout ops between them (broadcast, transpose, reshape, convert) and the
reductions they feed (softmax, layer norm) into one kernel that reads its external inputs and
writes its external outputs once; charging each op its output bytes charged a chain of ``N``
ops ``N`` times (the fp32 softmax passes alone were ~1.8 s of the 3.6B Table 1 step). So a
fusion group pays: each value it reads from outside once (at the first member reading it, cut
as that member's strategy needs it) and each value it produces that is read outside it once;
values passed between members cost nothing. Reading a value made from constants only (masks,
iotas) is free (XLA computes it in the kernel). Groups join fusible nodes at the same depth
(non-fusible nodes on the longest path from the inputs) in the same loop body, so a group never
spans a matrix product that one of its members feeds and another reads. Dots and convolutions
are unchanged, and two more decisions price what XLA fuses around them: a convert or layout op
whose result only products read is folded into their operand read (free: a cast of weights to
bf16 before a GEMM); a product's result read by one group member only, of a group without a
reduction, is that product's epilogue (bias, activation, residual add: the read is free; a
softmax cannot be a GEMM epilogue, so its group reads the scores). A group of only reshapes,
squeezes and expand_dims is a bitcast and costs nothing. Resharding between two members is
priced on its edge but does not split the group (a collective would end the kernel: the
model is optimistic there). Ops outside these sets (gathers, scatters, sorts, cumulative
sums, pooling) keep the rules' prices.

Replace the constants with measured ones through ``AutoShardingOption(mesh_alpha=...,
mesh_beta=...)``, or describe the hardware with ``autoshard.Cluster`` (its links price the
axes and its FLOP/s and memory bandwidth the compute term, through ``device_speed`` for the
duration of one plan).
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from .options import AutoShardingOption
from .spec import Spec, axis_place, dim_shards, shards, used_axes

DEFAULT_ALPHA_S = 5e-6
"""Latency of one collective over an axis inside one host (process), seconds."""
DEFAULT_BETA_S_PER_BYTE = 1e-10
"""Inverse bandwidth of an axis inside one host (10 GB/s), seconds per byte."""
INTER_HOST_ALPHA_S = 2e-5
"""Latency of one collective over an axis whose devices sit on several hosts, seconds."""
INTER_HOST_BETA_S_PER_BYTE = 1e-9
"""Inverse bandwidth of an axis that crosses hosts (1 GB/s, 10x slower), seconds per byte."""
FLOP_COST_S = 1e-14
"""Seconds per floating-point operation of a device (100 TFLOP/s): the compute term."""
BYTE_COST_S = 1e-12
"""Seconds per byte touched by a memory-bound op (1 TB/s): the compute term of cheap ops."""
FORBIDDEN_S = 1e3
"""Penalty of a resharding step the options forbid (large but finite, so the ILP stays feasible)."""

VOLUME = {
    "all-reduce": lambda n: 2.0 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / (n * n),
}


@dataclass(frozen=True)
class CostModel:
    """Per-axis alpha-beta constants of one logical mesh."""

    mesh_shape: tuple[int, ...]
    alpha: tuple[float, ...]
    beta: tuple[float, ...]
    allow_all_gather: bool = True
    allow_all_to_all: bool = True
    devices_per_host: int | None = None

    @classmethod
    def from_option(cls, mesh_shape: tuple[int, ...], option: AutoShardingOption,
                    devices_per_host: int | None = None) -> CostModel:
        """Costs of ``mesh_shape``: the option's constants, else those of where axes lie.

        ``devices_per_host``: devices of one host, consecutive in the mesh's device order
        (None: every device in one host).
        """
        rank = len(mesh_shape)
        crosses = tuple(axis_crosses_hosts(mesh_shape, a, devices_per_host) for a in range(rank))
        alpha = option.mesh_alpha or tuple(
            INTER_HOST_ALPHA_S if c else DEFAULT_ALPHA_S for c in crosses)
        beta = option.mesh_beta or tuple(
            crossing_beta(INTER_HOST_BETA_S_PER_BYTE, DEFAULT_BETA_S_PER_BYTE,
                          axis_devices_per_host(mesh_shape, a, devices_per_host))
            if c else DEFAULT_BETA_S_PER_BYTE for a, c in enumerate(crosses))
        for name, value in (("mesh_alpha", alpha), ("mesh_beta", beta)):
            if len(value) != rank:
                raise ValueError(
                    f"{name} ({value!r}) must have one entry per logical mesh axis "
                    f"(mesh shape {mesh_shape}). Give {rank} values or None for the defaults.")
        # Pure data parallel never reshards: batch-split or replicated values only, joined by
        # the all-reduces of reductions over the batch.
        dp = option.force_data_parallel
        # ZeRO-2 under pure data parallel (prefer_reduce_scatter): the updated parameters,
        # computed on the shards of reduce-scattered gradients, are all-gathered back.
        zero = dp and option.prefer_reduce_scatter
        return cls(tuple(mesh_shape), tuple(alpha), tuple(beta),
                   option.allow_all_gather and (not dp or zero),
                   option.allow_all_to_all and not dp, devices_per_host)

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh_shape)

    @property
    def forbidden_s(self) -> float:
        """``FORBIDDEN_S`` scaled with the constants: user-given alpha and beta in other units
        (Alpa's are 1 per collective and 1 per byte) keep a forbidden step as far above a
        real one as the defaults do."""
        scale = max(1.0, max(self.alpha, default=0.0) / DEFAULT_ALPHA_S,
                    max(self.beta, default=0.0) / DEFAULT_BETA_S_PER_BYTE)
        return FORBIDDEN_S * min(scale, 1e6)

    def collective_steps(self, kind: str, axes: tuple[int, ...], num_bytes: float
                         ) -> list[tuple[int, float, float]]:
        """The phases of one collective of ``kind`` over ``axes``: (axis, bytes, seconds).

        The module's hierarchical rule: fastest link first (lowest ``beta``, then lowest axis
        index), each phase on the whole array divided by the sizes of the phases before it.
        ``num_bytes`` is the array the whole group holds: an all-reduce's operand, an
        all-gather's result, a reduce-scatter's operand. For an all-gather the phases run in
        the reverse order (slow axis first, on the small pieces); the bytes and seconds of
        each are the same. An all-to-all moves the whole array over every axis.
        """
        live = [a for a in axes if self.mesh_shape[a] > 1]
        if kind == "all-to-all":
            return [(a, float(num_bytes), self.alpha[a] + self.beta[a] * VOLUME[kind](
                self.mesh_shape[a]) * num_bytes) for a in live]
        steps, size = [], float(num_bytes)
        for a in sorted(live, key=lambda a: (self.beta[a], a)):
            n = self.mesh_shape[a]
            steps.append((a, size, self.alpha[a] + self.beta[a] * VOLUME[kind](n) * size))
            size /= n
        return steps

    def collective(self, kind: str, axes: tuple[int, ...], num_bytes: float) -> float:
        """Cost of one collective of ``kind`` over ``axes`` (``collective_steps`` summed)."""
        return sum(step[2] for step in self.collective_steps(kind, axes, num_bytes))

    def latency(self, axes: tuple[int, ...]) -> float:
        """The alpha part of a collective over ``axes``."""
        return sum(self.alpha[a] for a in axes if self.mesh_shape[a] > 1)

    def axis_step(self, a: int, ds, dd, total_bytes: float, other_shards: int | None = None
                  ) -> tuple[str, float, float] | None:
        """The collective that moves mesh axis ``a`` from place ``ds`` to ``dd`` (None: unused).

        A place is ``spec.axis_place``: a dim and the axes more major than ``a`` on it.

        Keep (free), add a split (local slice, free), drop a split (all-gather), move a split to
        another dim (all-to-all, or all-gather then slice when all-to-all is off). The step
        moves the array held by one group of devices along ``a``: the array cut into
        ``other_shards`` pieces by the other mesh axes (None: by every other mesh axis). This
        makes the resharding cost a sum of per-axis terms, which keeps the ILP small; on a 1-D
        mesh it is exact (``sharding.reshard_memo`` bounds it on more axes).
        """
        if ds == dd or ds is None or self.mesh_shape[a] == 1:
            return None
        group_bytes = (total_bytes * self.mesh_shape[a] / math.prod(self.mesh_shape)
                       if other_shards is None else total_bytes / other_shards)
        if dd is None or not self.allow_all_to_all:
            cost = self.collective("all-gather", (a,), group_bytes)
            if not self.allow_all_gather:
                cost += self.forbidden_s
            return "all-gather", group_bytes, cost
        return "all-to-all", group_bytes, self.collective("all-to-all", (a,), group_bytes)

    def reshard_per_axis(self, src: Spec, dst: Spec, shape: tuple[int, ...], itemsize: int
                         ) -> float:
        """The sum of ``axis_step`` costs, each on the array the other axes splitting it in
        ``src`` leave: what the ILP's per-axis terms price."""
        total_bytes = math.prod(shape) * itemsize
        steps = (self.axis_step(a, axis_place(src, a), axis_place(dst, a), total_bytes,
                                other_shards=math.prod(self.mesh_shape[b]
                                                       for b in used_axes(src) if b != a))
                 for a in range(len(self.mesh_shape)))
        return sum(step[2] for step in steps if step is not None)

    def live_axes(self) -> tuple[int, ...]:
        return tuple(a for a, n in enumerate(self.mesh_shape) if n > 1)

    def reshard_steps(self, src: Spec, dst: Spec, shape: tuple[int, ...], itemsize: int
                      ) -> list[tuple[str, int, float, float]]:
        """Collectives that turn an array laid out as ``src`` into ``dst``: (kind, axis, bytes, s).

        The cheapest chain of per-axis steps, each priced on the array its device group really
        holds at that point: first the new splits (local slices, free, and they shrink what
        moves), then the splits that change dim (all-to-all, size per device unchanged), then
        the dropped splits (all-gathers, each growing the array) in the cheapest order. On a
        1-D mesh this is ``axis_step``; on more axes it also prices a dim split over two axes
        and an array the other axes do not split.
        """
        if src == dst:
            return []
        total_bytes = math.prod(shape) * itemsize
        adds, moves, drops = [], [], []
        for a in self.live_axes():
            ps, pd = axis_place(src, a), axis_place(dst, a)
            if ps == pd:
                continue
            if ps is None:
                adds.append(a)
            elif pd is None or not self.allow_all_to_all:
                drops.append((a, pd is None))
            else:
                moves.append(a)
        if len(moves) + len(drops) == 0:
            return []
        pieces = shards(src, self.mesh_shape) * math.prod(self.mesh_shape[a] for a in adds)
        steps = []
        for a in moves:
            group = total_bytes / pieces * self.mesh_shape[a]
            steps.append(("all-to-all", a, group, self.collective("all-to-all", (a,), group)))
        forbidden = 0.0 if self.allow_all_gather else self.forbidden_s
        # A split that changes dim without all-to-all: gathered, then sliced again at once.
        # Gathers only grow the array, so these go first, on the smallest pieces.
        for a, dropped in drops:
            if not dropped:
                group = total_bytes / pieces * self.mesh_shape[a]
                steps.append(("all-gather", a, group,
                              self.collective("all-gather", (a,), group) + forbidden))
        # The dropped splits: one all-gather over their axes, by the hierarchical rule (run
        # slow axis first, so its result is what the last, fastest phase produces).
        dropped = tuple(a for a, d in drops if d)
        result = total_bytes / pieces * math.prod(self.mesh_shape[a] for a in dropped)
        steps += [("all-gather", a, size, cost + forbidden) for a, size, cost in
                  reversed(self.collective_steps("all-gather", dropped, result))]
        return steps

    def reshard(self, src: Spec, dst: Spec, shape: tuple[int, ...], itemsize: int) -> float:
        """Cost in seconds of turning an array laid out as ``src`` into ``dst``."""
        if src == dst:
            return 0.0
        return sum(step[3] for step in self.reshard_steps(src, dst, shape, itemsize))


ALPA_CONSTANT = {"all-reduce": 0.01, "all-gather": 0.1, "reduce-scatter": 0.001,
                 "all-to-all": 0.001}
"""The constant Alpa adds to each collective's cost (its tie-breakers between collectives)."""


def alpa_collective_cost(kind: str, n: int, num_bytes: float, alpha: float, beta: float
                         ) -> float:
    """Cost of one collective in Alpa's units (its ``LogicalDeviceMesh`` formulas).

    ``num_bytes`` is the whole array the group holds (an all-reduce's operand, an all-gather's
    result, a reduce-scatter's operand, an all-to-all's array); ``n`` the devices of the axis.
    Alpa prices an all-to-all ``n/2`` times higher than its volume, and adds a small constant
    per kind (``ALPA_CONSTANT``).
    """
    if n <= 1:
        return alpha + ALPA_CONSTANT[kind]
    factor = VOLUME[kind](n) * (n / 2.0 if kind == "all-to-all" else 1.0)
    return alpha + beta * factor * num_bytes + ALPA_CONSTANT[kind]


def axis_devices_per_host(mesh_shape: tuple[int, ...], axis: int,
                          devices_per_host: int | None) -> int:
    """Devices of one group along ``axis`` (the other axes fixed) that share each host.

    ``mesh_shape[axis]`` on one host; 1 when the group has one device per host, or straddles
    hosts unevenly (some host holds a lone device of it).
    """
    n = mesh_shape[axis]
    if devices_per_host is None:
        return n
    stride = math.prod(mesh_shape[axis + 1:])
    if stride >= devices_per_host or devices_per_host % stride:
        return 1
    k = devices_per_host // stride
    return k if n % k == 0 else 1


def ring_pass_latency(num_devices: int, devices_per_host: int, intra_s: float,
                      inter_s: float) -> float:
    """Latency of one ring pass over an axis of ``num_devices``, ``devices_per_host`` of them in
    each host (``num_devices``: one host): ``n - 1`` hops, ``hosts - 1`` of them between hosts
    (NCCL's ring latency: ``(nsteps - nInterSteps) * intra + nInterSteps * inter`` per pass)."""
    hosts = max(1, num_devices // max(1, devices_per_host))
    return (num_devices - hosts) * intra_s + (hosts - 1) * inter_s


def crossing_beta(inter_beta: float, intra_beta: float, devices_per_host: int) -> float:
    """Inverse bandwidth of an axis crossing hosts with ``devices_per_host`` of its devices in
    each host: NCCL's ring runs over their NICs together, and no faster than the intra-host
    link (the module's "per-device inter-host bandwidth")."""
    return max(inter_beta / max(1, devices_per_host), intra_beta)


def axis_crosses_hosts(mesh_shape: tuple[int, ...], axis: int,
                       devices_per_host: int | None) -> bool:
    """Whether the devices along ``axis`` of a row-major mesh sit on more than one host."""
    if devices_per_host is None or mesh_shape[axis] == 1:
        return False
    stride = math.prod(mesh_shape[axis + 1:])
    span = stride * (mesh_shape[axis] - 1) + 1  # first to last device index along the axis
    return span > devices_per_host or devices_per_host % (stride * mesh_shape[axis]) != 0


def array_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    return math.prod(shape) * itemsize


def bytes_per_device(spec: Spec, shape: tuple[int, ...], itemsize: int,
                     mesh_shape: tuple[int, ...]) -> int:
    return array_bytes(shape, itemsize) // shards(spec, mesh_shape)


class ClusterCosts(Protocol):
    """What the planner reads of a cluster (``autoshard.Cluster``)."""

    name: str
    num_devices: int
    devices_per_host: int
    memory_bytes: int | None
    flop_s: float
    byte_s: float

    def mesh_costs(self, mesh_shape: Sequence[int]) -> tuple[tuple[float, ...],
                                                             tuple[float, ...]]: ...

    def describe(self) -> str: ...


_DEVICE_SPEED: contextvars.ContextVar[tuple[float, float]] = contextvars.ContextVar(
    "autoshard_device_speed", default=(FLOP_COST_S, BYTE_COST_S))
"""(seconds per FLOP, seconds per byte) of the device being planned for; set by ``device_speed``
around one ``plan_auto`` call (the rules price compute through ``flop_cost``/``byte_cost``)."""


@contextlib.contextmanager
def device_speed(flop_s: float, byte_s: float) -> Iterator[None]:
    """Price the compute term at ``flop_s`` s/FLOP and ``byte_s`` s/byte inside the block."""
    token = _DEVICE_SPEED.set((float(flop_s), float(byte_s)))
    try:
        yield
    finally:
        _DEVICE_SPEED.reset(token)


def flop_cost(flops: float, num_pieces: int) -> float:
    """Compute term of a flop-bound op whose work is cut into ``num_pieces`` per device."""
    return _DEVICE_SPEED.get()[0] * flops / max(1, num_pieces)


def byte_cost(num_bytes: float, num_pieces: int) -> float:
    """Compute term of a memory-bound op."""
    return _DEVICE_SPEED.get()[1] * num_bytes / max(1, num_pieces)


def dominated_meshes(shapes: list[tuple[int, ...]], costs: list[tuple[tuple[float, ...],
                     tuple[float, ...]]]) -> dict[int, int]:
    """Indices of mesh shapes another candidate beats on every axis (symmetry, links).

    Shape ``j`` is dominated by ``i`` when ``i`` holds the same axis sizes in another order
    and, matching axes of equal size, every axis of ``i`` has a latency and an inverse
    bandwidth no larger than ``j``'s (strictly smaller somewhere, or ``i`` comes first): any
    plan on ``j`` runs on ``i`` with its axes renamed at no higher cost, so ``j`` cannot win.
    On one host, ``(a, b)`` and ``(b, a)`` cost the same and only the first is kept. Returns
    {dominated index: index of the shape that dominates it}.
    """
    out: dict[int, int] = {}
    for j, sj in enumerate(shapes):
        for i, si in enumerate(shapes):
            if i == j or i in out or sorted(si) != sorted(sj):
                continue
            if _beats(si, costs[i], sj, costs[j], tie_wins=i < j):
                out[j] = i
                break
    return out


def _beats(si, ci, sj, cj, *, tie_wins: bool) -> bool:
    for perm in itertools.permutations(range(len(si))):  # axis perm[a] of i plays axis a of j
        if any(si[perm[a]] != sj[a] for a in range(len(sj))):
            continue
        pairs = [(ci[0][perm[a]], cj[0][a]) for a in range(len(sj)) if sj[a] > 1]
        pairs += [(ci[1][perm[a]], cj[1][a]) for a in range(len(sj)) if sj[a] > 1]
        if all(x <= y for x, y in pairs) and (tie_wins or any(x < y for x, y in pairs)):
            return True
    return False


__all__ = ["CostModel", "alpa_collective_cost", "array_bytes", "axis_crosses_hosts",
           "axis_devices_per_host", "bytes_per_device", "byte_cost", "crossing_beta",
           "ring_pass_latency",
           "device_speed", "dim_shards", "dominated_meshes", "flop_cost", "ClusterCosts"]
