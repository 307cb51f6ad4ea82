"""Running a plan's partial sums (``sharding.partial_sums``) while ``apply`` evaluates a step.

Each term runs under ``jax.shard_map`` on its operands' shards and returns its per-device
partial result stacked along a new leading dim split over the sum's axes; the layout ops run
on that stack (``vmap``); the sum adds the stacks and one ``psum`` reduces it. A sum whose spec
splits a dim over the axes (a reduce-scatter: the tied embedding's gradient under
``prefer_reduce_scatter``, and every gradient of ``ShardingPlan.reduce_scattered``) waits: at
the first read of any such sum, all of them are reduced together, one ``psum_scatter`` per
mesh axes and dtype (``PartialSums.flush``). A step's gradients are all made before its update
reads the first, so one reduce-scatter carries them all, as XLA:GPU's combiner merges them;
XLA:CPU's partitioner makes each an all-reduce and a slice, and its combiner merged each with
the previous gradient's optimizer statistics instead.
"""

from __future__ import annotations

import functools
import math

import jax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from ..ir._compat import bind_eqn
from ..ir._walk import eqn_site, site
from .plan import PartialSource, PartialSum

SCATTER_KINDS = frozenset({"scatter-add", "scatter_add"})
"""Terms whose first operand is added once (on the first device of the axes)."""


def _axis_entry(axes: tuple[str, ...]):
    return axes[0] if len(axes) == 1 else axes


def _stacked(axes, spec: PartitionSpec) -> PartitionSpec:
    return PartitionSpec(_axis_entry(axes), *spec)


class Pending:
    """A reduce-scattered sum not reduced yet: the stack of the devices' partial results.
    ``PartialSums.flush`` reduces every pending sum at once; ``value`` is then set."""

    def __init__(self, stacked, ps: PartialSum):
        self.stacked = stacked
        self.ps = ps
        self.value = None


class PartialSums:
    """The plan's partial sums while a planned program is evaluated (``apply._Apply``).

    ``run`` evaluates an equation of a partial sum; every value between a term and the sum is
    the stack of the devices' partial results (leading dim split over the sum's axes). The
    plan's pins of those values and of their operands are spent here, not applied.

    A sum whose spec splits a dim over its axes (a reduce-scatter) is not reduced where it is
    made: ``run`` returns a ``Pending``, and the first read of any pending sum (``resolve``)
    reduces all of them, one reduce-scatter per mesh axes and dtype (``flush``). The
    gradients of a step are all made before the update reads the first, so they are reduced
    together, as XLA:GPU's combiner merges their reduce-scatters."""

    def __init__(self, partial_sums, mesh):
        self.mesh = mesh
        self.roles: dict[str, tuple] = {}
        for ps in partial_sums:
            for src in ps.sources:
                self.roles[src.site] = ("source", ps, src)
            for path, spec in ps.chain:
                self.roles[path] = ("chain", ps, spec)
            if len(ps.sources) > 1:
                self.roles[ps.total] = ("total", ps, None)
            elif ps.total != ps.sources[0].site:  # a layout op after the one term
                self.roles[ps.total] = ("last", ps, None)
            else:
                self.roles[ps.total] = ("lone", ps, ps.sources[0])
        self.seen: set[str] = set()
        self.pending: list[Pending] = []

    def handles(self, path) -> bool:
        return eqn_site(path) in self.roles

    def pin_keys(self, eqn, path) -> list:
        """The plan's pin keys this equation spends (its result, its operands)."""
        key = eqn_site(path)
        return [site(path, 0)] + [(key, p) for p in range(len(eqn.invars))]

    def run(self, eqn, ins, path) -> list:
        key = eqn_site(path)
        role, ps, extra = self.roles[key]
        self.seen.add(key)
        if role == "lone":
            return [self._reduce(self._source(eqn, ins, ps, extra), ps)]
        if role == "last":
            rest = _rest(ps.total_spec, ps.axes)
            return [self._reduce(self._chain(eqn, ins, ps, rest), ps)]
        return [{"source": self._source, "chain": self._chain, "total": self._total}[role](
            eqn, ins, ps, extra)]

    def mark_seen(self, heads: set[str]) -> None:
        """Count the partial sums' equations under the top-level equations ``heads`` as run
        (``apply.PlanEvaluator.mark_used``)."""
        self.seen.update(key for key in self.roles if key.split("/")[0] in heads)

    def missing(self) -> list[str]:
        return sorted(set(self.roles) - self.seen)

    def resolve(self, x):
        """``x``, or the reduced sum of a ``Pending`` (reducing every pending sum)."""
        if not isinstance(x, Pending):
            return x
        if x.value is None:
            self.flush()
        return x.value

    def flush(self) -> None:
        """Reduce every pending sum: per (axes, dtype), one ``psum_scatter`` of a buffer whose
        row i holds, for each sum, the piece device i keeps (its split dim moved first)."""
        groups: dict = {}
        for p in self.pending:
            groups.setdefault((p.ps.axes, jax.numpy.dtype(p.stacked.dtype)), []).append(p)
        self.pending = []
        for (axes, _), members in groups.items():
            n = math.prod(self.mesh.shape[a] for a in axes)
            dims = [_scattered_dim(p.ps.total_spec, axes) for p in members]
            rests = [_rest(p.ps.total_spec, axes) for p in members]

            def reduce(*stacks, dims=dims, n=n, axes=axes):
                parts = [jax.numpy.moveaxis(x[0], d, 0) for x, d in zip(stacks, dims, strict=True)]
                buf = jax.numpy.concatenate([x.reshape(n, -1) for x in parts], axis=1)
                row = lax.psum_scatter(buf, axes, scatter_dimension=0, tiled=True)[0]
                outs, at = [], 0
                for x, d in zip(parts, dims, strict=True):
                    shape = (x.shape[0] // n, *x.shape[1:])
                    width = math.prod(shape)
                    outs.append(jax.numpy.moveaxis(row[at:at + width].reshape(shape), 0, d))
                    at += width
                return tuple(outs)

            specs = [p.ps.total_spec for p in members]
            outs = jax.shard_map(reduce, mesh=self.mesh,
                                 in_specs=tuple(_stacked(axes, r) for r in rests),
                                 out_specs=tuple(specs), check_vma=False)(
                *(p.stacked for p in members))
            for p, out, spec in zip(members, outs, specs, strict=True):
                p.value = self._constrain(out, spec)

    def _constrain(self, x, spec: PartitionSpec):
        return lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def _source(self, eqn, ins, ps: PartialSum, src: PartialSource):
        axes = ps.axes
        is_scatter = eqn.primitive.name in SCATTER_KINDS

        def local(*xs):
            xs = list(xs)
            if is_scatter:  # the operand is added once, on the first device of the axes
                first = functools.reduce(jax.numpy.logical_and,
                                         [lax.axis_index(a) == 0 for a in axes])
                xs[0] = jax.numpy.where(first, xs[0], jax.numpy.zeros_like(xs[0]))
            return bind_eqn(eqn, xs)[0][None]

        out = jax.shard_map(local, mesh=self.mesh, in_specs=tuple(src.operand_specs),
                            out_specs=_stacked(axes, src.spec), check_vma=False)(*ins)
        return self._constrain(out, _stacked(axes, src.spec))

    def _chain(self, eqn, ins, ps: PartialSum, spec: PartitionSpec):
        out = jax.vmap(lambda x: bind_eqn(eqn, [x])[0])(ins[0])
        return self._constrain(out, _stacked(ps.axes, spec))

    def _total(self, eqn, ins, ps: PartialSum, _):
        rest = _rest(ps.total_spec, ps.axes)
        return self._reduce(self._constrain(bind_eqn(eqn, list(ins))[0],
                                            _stacked(ps.axes, rest)), ps)

    def _reduce(self, summed, ps: PartialSum):
        """The sum of the stacked partial results ``summed``: reduced by one ``psum`` now, or,
        where the sum's spec splits a dim over the axes, a ``Pending`` (``flush``)."""
        if _scattered_dim(ps.total_spec, ps.axes) is not None:
            pending = Pending(summed, ps)
            self.pending.append(pending)
            return pending
        axes, rest = ps.axes, _rest(ps.total_spec, ps.axes)
        out = jax.shard_map(lambda x: lax.psum(x[0], axes), mesh=self.mesh,
                            in_specs=_stacked(axes, rest), out_specs=rest,
                            check_vma=False)(summed)
        return self._constrain(out, ps.total_spec)


def _rest(spec: PartitionSpec, axes) -> PartitionSpec:
    """``spec`` without ``axes``: the spec of each device's partial result."""
    return PartitionSpec(*(_without(entry, axes) for entry in spec))


def _scattered_dim(spec: PartitionSpec, axes) -> int | None:
    """The dim ``spec`` splits over ``axes`` (the minor axes of its entry), if any."""
    for d, entry in enumerate(spec):
        named = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        if set(named) & set(axes):
            assert named[-len(axes):] == tuple(axes), (spec, axes)
            return d
    return None


def _without(entry, axes):
    """A PartitionSpec entry without ``axes``."""
    named = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    kept = tuple(a for a in named if a not in axes)
    return None if not kept else kept[0] if len(kept) == 1 else kept
