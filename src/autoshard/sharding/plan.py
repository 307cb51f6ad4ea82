"""ShardingPlan: the device-free result of planning, printable, comparable, saved and applied."""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
from jax.sharding import PartitionSpec

from .pareto import TradeOffRow, table_lines


def spec_axes(entry) -> tuple[str, ...]:
    """Mesh axes named by one PartitionSpec entry (None, a name, or a tuple of names)."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def num_shards(spec: PartitionSpec, mesh_sizes: dict[str, int]) -> int:
    """How many pieces a spec cuts an array into (product of the sizes of the axes it names)."""
    return math.prod(mesh_sizes[a] for entry in spec for a in spec_axes(entry))


def format_spec(spec: PartitionSpec) -> str:
    parts = []
    for entry in spec:
        axes = spec_axes(entry)
        parts.append("-" if not axes else "+".join(axes))
    return "(" + ", ".join(parts) + ")" if parts else "(replicated)"


@dataclass(frozen=True, kw_only=True)
class LeafPlan:
    """Where one input or output leaf lives."""

    path: str
    """Readable pytree path, e.g. ``arg0.params['Dense_0']['kernel']``."""
    shape: tuple[int, ...]
    """Global shape."""
    dtype: str
    """dtype name."""
    spec: PartitionSpec
    """How the leaf is split over the mesh axes."""
    note: str = ""
    """Why the spec is what it is when that is not obvious (e.g. not divisible, kept replicated)."""

    def bytes_per_device(self, mesh_sizes: dict[str, int]) -> int:
        try:
            itemsize = np.dtype(self.dtype).itemsize
        except TypeError:  # a PRNG key array: two uint32 words per key
            itemsize = 8
        total = math.prod(self.shape) * itemsize
        return total // max(1, num_shards(self.spec, mesh_sizes))


@dataclass(frozen=True, kw_only=True)
class Collective:
    """One communication the plan expects XLA to insert."""

    kind: str
    """all-reduce, all-gather, reduce-scatter, all-to-all."""
    axes: tuple[str, ...]
    """Mesh axes it runs over."""
    num_bytes: int
    """Bytes of its result on one device, per occurrence (for a reduce-scatter, the shard)."""
    cost_s: float
    """Alpha-beta cost in seconds of all ``count`` occurrences together."""
    where: str = ""
    """The operation that causes it."""
    count: float = 1
    """How many times it runs per step (e.g. once per iteration of a scan over layers)."""
    dtype: str = ""
    """Element type of the array it moves ("" when unknown)."""


@dataclass(frozen=True, kw_only=True)
class PartialSource:
    """One term of a ``PartialSum``: an equation run on each device's shards, its result a
    partial sum over the sum's axes."""

    site: str
    """Path of the equation (``autoshard.ir._walk.eqn_site``), e.g. ``"12/3"``."""
    operand_specs: tuple[PartitionSpec, ...]
    """Spec each operand is read in (the shards the equation runs on)."""
    spec: PartitionSpec
    """Spec of the partial result on the axes the sum is not partial over."""
    where: str = ""
    """The operation (as ``Collective.where`` names it)."""


@dataclass(frozen=True, kw_only=True)
class PartialSum:
    """A sum of terms that are each a partial sum over ``axes``, reduced once after the sum.

    Without it every term is reduced on its own (a tied embedding's gradient: the LM head's
    product and the lookup's scatter-add, one all-reduce each). The terms and the layout ops
    between them and the sum run on local shards (``sharding.partial_sums``), their per-device
    partial results stacked along a new leading dim split over ``axes``; the sum is reduced by
    one ``psum`` (each device keeping its slice where the sum's spec splits over ``axes``).
    """

    axes: tuple[str, ...]
    """Mesh axes the terms are partial over."""
    sources: tuple[PartialSource, ...]
    """The equations whose results are the partial terms."""
    chain: tuple[tuple[str, PartitionSpec], ...] = ()
    """(equation path, spec of its partial result on the other axes) of the layout ops between
    a term and the sum (transposes, reshapes)."""
    total: str
    """Path of the add equation whose result is reduced."""
    total_spec: PartitionSpec
    """The planned spec of the reduced sum."""
    where: str = ""
    """The operations, for ``explain()``."""


class _Deferred:
    """A frozen dataclass whose ``DEFERRED`` fields may hold a function (``later``) until they
    are first read: read, saved (``_encode`` writes the public property) or pickled."""

    DEFERRED: ClassVar[tuple[str, ...]] = ()

    def _resolved(self, name: str):
        value = getattr(self, name)
        if callable(value):
            value = value()
            object.__setattr__(self, name, value)   # what the function held is freed
        return value

    def __getstate__(self) -> dict:
        return {**self.__dict__, **{name: self._resolved(name) for name in self.DEFERRED}}


def later(fn: Callable, *args) -> Callable[[], object]:
    """``fn(*args)``, called when a deferred field that holds it is first read, in the context
    this is called in (the device speed ``cost.device_speed`` sets)."""
    return functools.partial(contextvars.copy_context().run, fn, *args)


@dataclass(frozen=True, kw_only=True)
class Objective(_Deferred):
    """The ILP objective, split by term (seconds)."""

    communication_s: float = 0.0
    """Collectives implied by the chosen strategies."""
    resharding_s: float = 0.0
    """Conversions between a producer's spec and a consumer's spec."""
    compute_s: float = 0.0
    """Compute term that prefers splitting work."""
    _data_parallel_s: float | None | Callable[[], float | None] = field(default=None,
                                                                          compare=False)
    """``data_parallel_s``, or the function that finds it until it is first read."""
    peak_bytes_per_device: int | None = None
    """Estimated peak memory per device."""
    memory_budget_per_device: int | None = None
    """The budget the plan was made under (``AutoShardingOption.memory_budget_per_device``
    or the cluster's memory); ``Audit`` checks the compiled program against it."""
    solver_status: str = "optimal"
    """'optimal', 'node limit: best incumbent (gap g)' (a deterministic stop) or 'time limit:
    best incumbent (gap g)' (a wall-clock stop, warned about)."""
    num_columns: int = 0
    """ILP columns (strategy choices plus edge variables) of the chosen mesh's problem."""
    num_rows: int = 0
    """ILP constraint rows of the chosen mesh's problem."""
    num_edge_columns: int = 0
    """Of ``num_columns``, the continuous edge variables that price resharding."""
    meshes_tried: tuple[tuple[tuple[int, ...], float], ...] = ()
    """(logical mesh shape, objective in seconds) of every mesh the planner solved, in order."""
    meshes_pruned: tuple[tuple[tuple[int, ...], str], ...] = ()
    """(logical mesh shape, why) of every candidate mesh the planner did not solve."""
    flops: float = 0.0
    """Floating-point operations of one step on all devices (matrix products, convolutions),
    as traced: what the step runs, JAX's recomputation included."""
    model_flops: float = 0.0
    """The same step counted as Megatron-LM's eq. 3 counts (``sharding.flops``): 3 x the
    forward + the forward of every rematerialised region; published TFLOP/s use this."""
    alpa_units: float | None = None
    """The objective in Alpa's units (``sharding.alpa_units``: Alpa's collective formulas and
    replicated-input penalties, no compute term), set when the option gives ``mesh_alpha``
    and ``mesh_beta``; ``Executable.auto_sharding_objective`` then reports it."""
    _trade_off: tuple[TradeOffRow, ...] | Callable[[], tuple[TradeOffRow, ...]] = field(
        default=(), repr=False, compare=False)
    """``trade_off``'s rows, or the function that finds them (one more solve of the chosen
    mesh's ILP) until they are first read."""

    DEFERRED: ClassVar[tuple[str, ...]] = ("_data_parallel_s", "_trade_off")

    @property
    def total_s(self) -> float:
        return self.communication_s + self.resharding_s + self.compute_s

    @property
    def data_parallel_s(self) -> float | None:
        """The same objective for pure data parallel on the same mesh, for comparison (a
        second, easier ILP, solved when first read: ``explain()``, ``save()``, pickling)."""
        return self._resolved("_data_parallel_s")

    @property
    def trade_off(self) -> tuple[TradeOffRow, ...]:
        """Bytes, memory and time of the chosen plan and of the least-memory and least-bytes
        plans found on its mesh (``sharding.pareto``; empty under ``memory_tradeoff=0``).

        Searched when first read (``explain()``, ``save()``, pickling), not while planning:
        the least-memory plan costs one more solve of the ILP, as long as the first."""
        return self._resolved("_trade_off")


@dataclass(frozen=True, kw_only=True)
class PlanFingerprint(_Deferred):
    """What a plan was made for: checked before a saved plan runs (``ShardParallel(plan=)``)."""

    DEFERRED: ClassVar[tuple[str, ...]] = ("_program",)

    _program: str | Callable[[], str] = field(compare=False)
    """``program``, or the function that computes it until it is first read."""
    num_equations: int
    """Equations of the traced program (to describe a mismatch)."""
    num_devices: int
    """Devices the plan is for."""
    devices_per_host: int | None = None
    """Devices of one host in the cluster planned for (None: one host)."""
    num_micro_batches: int = 1
    """Micro-batches the program was traced with."""

    @property
    def program(self) -> str:
        """Digest of the traced program (jaxpr, abstract inputs and outputs, roles): computed
        when first read (``save()``, a saved plan's check), from the jaxpr's text."""
        return self._resolved("_program")

    def __eq__(self, other) -> bool:
        return (isinstance(other, PlanFingerprint) and self.program == other.program
                and self.num_equations == other.num_equations
                and self.num_devices == other.num_devices
                and self.devices_per_host == other.devices_per_host
                and self.num_micro_batches == other.num_micro_batches)

    def __hash__(self) -> int:
        return hash((self.program, self.num_equations, self.num_devices))


@dataclass(frozen=True, kw_only=True)
class ShardingPlan:
    """A mesh shape plus a PartitionSpec per input, output and constrained intermediate.

    Plain data with no devices in it: a plan can be computed for a cluster larger than this
    machine, printed, compared and saved; applying it needs a real mesh of the same shape.
    """

    method: str
    """Name of the method that produced the plan."""
    mesh_shape: tuple[int, ...]
    """Logical mesh shape."""
    axis_names: tuple[str, ...]
    """Mesh axis names, one per entry of ``mesh_shape``."""
    inputs: tuple[LeafPlan, ...]
    """One entry per flattened input leaf (static arguments excluded)."""
    outputs: tuple[LeafPlan, ...]
    """One entry per flattened output leaf."""
    intermediates: tuple[tuple[str, PartitionSpec], ...] = ()
    """(site, spec) for every constrained intermediate. A site (``autoshard.ir._walk.site``) is
    the path of the equation that makes the value and its output position, e.g. ``"12/3:0"``:
    the same on every trace of the same program."""
    operand_specs: tuple[tuple[str, int, PartitionSpec], ...] = ()
    """(equation path, operand index, spec) where an operand is resharded before its
    consumer."""
    collectives: tuple[Collective, ...] = ()
    """Collectives the plan expects."""
    objective: Objective | None = None
    """ILP objective (automatic plans only)."""
    notes: tuple[str, ...] = field(default=())
    """Free-form remarks (replicated leaves that could not be split, solver status, ...)."""
    cluster: str = ""
    """The cluster the costs are for (``Cluster.describe()``); empty: the default constants."""
    fingerprint: PlanFingerprint | None = None
    """The program and devices the plan was made for (``autoshard.plan``); checked on apply."""
    partial_sums: tuple[PartialSum, ...] = ()
    """Sums of partial sums reduced once after the sum (``sharding.partial_sums``)."""
    reduce_scattered: tuple[PartialSum, ...] = ()
    """The other gradients the plan reduce-scatters, each a sum of one term: the step
    reduces them together, one reduce-scatter per mesh axes and dtype, with the partial sums
    reduce-scattered (``sharding.partial_sums``)."""

    def __post_init__(self):
        assert len(self.mesh_shape) == len(self.axis_names), (self.mesh_shape, self.axis_names)

    @property
    def mesh_sizes(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.mesh_shape, strict=True))

    @property
    def in_specs(self) -> tuple[PartitionSpec, ...]:
        return tuple(leaf.spec for leaf in self.inputs)

    @property
    def out_specs(self) -> tuple[PartitionSpec, ...]:
        return tuple(leaf.spec for leaf in self.outputs)

    def explain(self) -> str:
        sizes = self.mesh_sizes
        mesh = " x ".join(f"{n}={s}" for n, s in sizes.items())
        one_device = math.prod(self.mesh_shape) == 1
        lines = [f"{self.method} plan on mesh ({mesh})",
                 "  legend: spec has one entry per dim: '-' keeps the dim whole, an axis name "
                 "splits it over that mesh axis, 'x+y' over both; bytes/device is what one "
                 "device holds of the leaf"]
        if one_device:  # nothing can be split: a per-leaf reason would only repeat that
            lines.append("  one device: every leaf is whole")
        for title, leaves in (("inputs", self.inputs), ("outputs", self.outputs)):
            lines.append(f"  {title}:")
            width = max((len(leaf.path) for leaf in leaves), default=4)
            lines.append(f"    {'leaf':<{width}}  {'shape':<18} {'spec':<22} bytes/device")
            for leaf in leaves:
                shape = "x".join(map(str, leaf.shape)) or "scalar"
                row = (f"    {leaf.path:<{width}}  {shape:<18} {format_spec(leaf.spec):<22} "
                       f"{leaf.bytes_per_device(sizes):,}")
                lines.append(row + (f"   [{leaf.note}]" if leaf.note and not one_device else ""))
        total_in = sum(leaf.bytes_per_device(sizes) for leaf in self.inputs)
        lines.append(f"  input bytes per device: {total_in:,}")
        if self.intermediates:
            lines.append(f"  constrained intermediates: {len(self.intermediates)}")
        if self.collectives:
            lines.append("  expected collectives (kind, mesh axes, bytes of the whole array, times "
                         "per step, alpha-beta cost, cause):")
            for c in self.collectives:
                times = f"x{c.count:g}" if c.count != 1 else ""
                lines.append(f"    {c.kind:<15} over {'+'.join(c.axes) or '-':<8} "
                             f"{c.num_bytes:>12,} B {times:>5} {c.cost_s * 1e6:10.2f} us  "
                             f"{c.where}")
        for ps in self.partial_sums:
            lines.append(f"  partial sums reduced once over {'+'.join(ps.axes)}: {ps.where}")
        by_axes: dict = {}
        for ps in self.reduce_scattered:
            by_axes[ps.axes] = by_axes.get(ps.axes, 0) + 1
        for axes, n in by_axes.items():
            lines.append(f"  {n} gradients reduce-scattered together over {'+'.join(axes)}")
        if self.objective is not None:
            o = self.objective
            lines.append(f"  objective: {o.total_s * 1e3:.4f} ms = communication "
                         f"{o.communication_s * 1e3:.4f} + resharding {o.resharding_s * 1e3:.4f} "
                         f"+ compute {o.compute_s * 1e3:.4f} ({o.solver_status})")
            if o.data_parallel_s is not None:
                lines.append(f"  pure data parallel on the same mesh: {o.data_parallel_s * 1e3:.4f} ms")
            if o.peak_bytes_per_device is not None:
                lines.append(f"  estimated peak memory per device: {o.peak_bytes_per_device:,} B"
                             + (f" (budget {o.memory_budget_per_device:,} B)"
                                if o.memory_budget_per_device is not None else ""))
            lines.extend(self._estimate_lines())
            lines.extend(table_lines(o.trade_off, self.mesh_shape))
        for note in self.notes:
            lines.append(f"  note: {note}")
        return "\n".join(lines)

    def _estimate_lines(self) -> list[str]:
        o = self.objective
        num_devices = math.prod(self.mesh_shape)
        lines = [f"  estimated step time: {o.total_s:.4g} s = compute {o.compute_s:.4g} s + "
                 f"communication {o.communication_s + o.resharding_s:.4g} s (collectives "
                 f"{o.communication_s:.4g} + resharding {o.resharding_s:.4g})"
                 + (f" on {self.cluster}" if self.cluster else "")]
        if o.flops and o.total_s > 0:
            lines.append(f"  traced FLOPs per step: {o.flops:.4g} (what the step runs); at the "
                         f"estimated step time {o.flops / o.total_s / num_devices / 1e12:.4g} "
                         "TFLOP/s per device")
        if o.model_flops and o.total_s > 0:
            lines.append(f"  model FLOPs per step (Megatron-LM eq. 3: 3 x forward + recomputed "
                         f"forward): {o.model_flops:.4g}; "
                         f"{o.model_flops / o.total_s / num_devices / 1e12:.4g} TFLOP/s per "
                         "device, as published figures count")
        if len(o.meshes_tried) + len(o.meshes_pruned) > 1:
            lines.append("  meshes (objective; the chosen one marked *):")
            for shape, objective in sorted(o.meshes_tried, key=lambda t: t[1]):
                mark = "*" if tuple(shape) == tuple(self.mesh_shape) else " "
                ratio = objective / o.total_s if o.total_s > 0 else float("nan")
                lines.append(f"   {mark} {str(tuple(shape)):<12} {objective:.4g} s "
                             f"({ratio:.3g}x the chosen)")
            for shape, why in o.meshes_pruned:
                lines.append(f"     {str(tuple(shape)):<12} not solved: {why}")
        return lines

    # Saving and loading ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The plan as JSON-ready data (``from_dict`` reads it back)."""
        return {"format": PLAN_FORMAT, **_encode(self)}

    @classmethod
    def from_dict(cls, data: dict) -> ShardingPlan:
        if data.get("format") != PLAN_FORMAT:
            raise ValueError(
                f"The plan data has format {data.get('format')!r}, this autoshard reads "
                f"{PLAN_FORMAT!r}. Re-plan with autoshard.plan and save again.")
        return _decode_plan(data)

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan to ``path`` as JSON."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike) -> ShardingPlan:
        """Read a plan written by ``save``."""
        with open(path) as f:
            return cls.from_dict(json.load(f))


PLAN_FORMAT = "autoshard.ShardingPlan/1"


def _spec_to_json(spec: PartitionSpec) -> list:
    return [e if e is None or isinstance(e, str) else list(e) for e in spec]


def _spec_from_json(entries: list) -> PartitionSpec:
    return PartitionSpec(*(e if e is None or isinstance(e, str) else tuple(e) for e in entries))


def _encode(obj):
    if isinstance(obj, PartitionSpec):
        return {"spec": _spec_to_json(obj)}
    if dataclasses.is_dataclass(obj):   # a private field is written as its public property
        return {f.name.lstrip("_"): _encode(getattr(obj, f.name.lstrip("_")))
                for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple | list):
        return [_encode(x) for x in obj]
    return obj


def _tuples(x):
    return tuple(_tuples(y) for y in x) if isinstance(x, list) else x


def _decode_plan(data: dict) -> ShardingPlan:
    def spec(x):
        return _spec_from_json(x["spec"])

    def leaf(d):
        return LeafPlan(path=d["path"], shape=tuple(d["shape"]), dtype=d["dtype"],
                        spec=spec(d["spec"]), note=d.get("note", ""))

    objective = None
    if data.get("objective") is not None:
        o = dict(data["objective"])
        o["meshes_tried"] = tuple((tuple(s), v) for s, v in o.get("meshes_tried", ()))
        o["meshes_pruned"] = tuple((tuple(s), v) for s, v in o.get("meshes_pruned", ()))
        o["_trade_off"] = tuple(TradeOffRow(**r) for r in o.pop("trade_off", ()))
        o["_data_parallel_s"] = o.pop("data_parallel_s", None)
        objective = Objective(**o)
    fingerprint = data.get("fingerprint")
    def partial_sum(d):
        return PartialSum(
            axes=tuple(d["axes"]),
            sources=tuple(PartialSource(site=x["site"], spec=spec(x["spec"]),
                                        operand_specs=tuple(spec(o) for o in x["operand_specs"]),
                                        where=x.get("where", ""))
                          for x in d["sources"]),
            chain=tuple((c, spec(p)) for c, p in d.get("chain", ())),
            total=d["total"], total_spec=spec(d["total_spec"]), where=d.get("where", ""))

    return ShardingPlan(
        method=data["method"], mesh_shape=tuple(data["mesh_shape"]),
        axis_names=tuple(data["axis_names"]),
        inputs=tuple(leaf(d) for d in data["inputs"]),
        outputs=tuple(leaf(d) for d in data["outputs"]),
        intermediates=tuple((v, spec(p)) for v, p in data.get("intermediates", ())),
        operand_specs=tuple((n, i, spec(p)) for n, i, p in data.get("operand_specs", ())),
        collectives=tuple(Collective(**{**c, "axes": tuple(c["axes"])})
                          for c in data.get("collectives", ())),
        objective=objective, notes=_tuples(data.get("notes", [])),
        cluster=data.get("cluster", ""),
        fingerprint=PlanFingerprint(_program=fingerprint.pop("program"), **fingerprint)
        if fingerprint else None,
        partial_sums=tuple(partial_sum(d) for d in data.get("partial_sums", ())),
        reduce_scattered=tuple(partial_sum(d) for d in data.get("reduce_scattered", ())))
