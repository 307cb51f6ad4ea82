"""Sharding rules of custom-partitioned operations, as plain data.

A rule names a *factor* for every dim of every operand and result (``"... i, i j -> ... j"``):
dims that share a factor are split alike. A factor may be split over mesh axes unless it is a
need-replication (or permutation) factor; splitting a reduction factor leaves partial sums that
the results all-reduce over. A compound dim ``(a b)`` is ``a`` major, ``b`` minor.

``FactorRule`` is the one representation autoshard works with: parsed from JAX's einsum-like
string (errors point at the bad character), converted to and from JAX's ``SdyShardingRule``,
derived from an ``infer_sharding_from_operands`` callback by probing it one dim at a time, and
turned back into an ``infer_sharding_from_operands`` for the GSPMD partitioner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
from jax.sharding import NamedSharding, PartitionSpec

from .ir._compat import cp_rule_types

Dim = tuple[str, ...]
"""The factors of one dim: one for a whole-dim factor, several (major first) for a compound."""

_BATCH_PREFIX = "..."


@dataclass(frozen=True, kw_only=True)
class FactorRule:
    """A sharding rule: factors per dim of every operand and result, and the factor kinds."""

    operands: tuple[tuple[Dim, ...], ...]
    """Per operand, its dims after the leading ``...`` (if any)."""
    results: tuple[tuple[Dim, ...], ...]
    """Per result, its dims after the leading ``...`` (if any)."""
    batching: tuple[str | None, ...]
    """Per operand then result: the ``...`` group ("0", "1", ...) it starts with, or None."""
    reduction: tuple[str, ...] = ()
    """Factors summed over: splitting one all-reduces the results."""
    need_replication: tuple[str, ...] = ()
    """Factors that are never split."""
    permutation: tuple[str, ...] = ()
    """Factors whose split needs a collective permute (autoshard never splits them)."""
    factor_sizes: tuple[tuple[str, int], ...] = ()
    """Sizes of factors used only inside compound dims."""

    def __post_init__(self):
        assert len(self.batching) == len(self.operands) + len(self.results)

    @property
    def unsplittable(self) -> frozenset[str]:
        return frozenset(self.need_replication) | frozenset(self.permutation)

    def all_batched(self) -> bool:
        """Every operand and result starts with ``...`` (a vmapped dim can join the batch)."""
        return all(g is not None for g in self.batching)

    def __str__(self) -> str:
        def mapping(dims, group):
            words = [] if group is None else [_BATCH_PREFIX + ("" if group == "0" else group)]
            words += [d[0] if len(d) == 1 else "(" + " ".join(d) + ")" for d in dims]
            return " ".join(words)
        n = len(self.operands)
        lhs = ", ".join(map(mapping, self.operands, self.batching[:n]))
        rhs = ", ".join(map(mapping, self.results, self.batching[n:]))
        return f"{lhs} -> {rhs}"


# -- parsing --------------------------------------------------------------------------------------
def _bad(text: str, pos: int, why: str) -> ValueError:
    return ValueError(
        f"sharding_rule {text!r} does not parse: {why} at position {pos}:\n  {text}\n  "
        f"{' ' * pos}^\nFactor names are a letter followed by letters, digits or '_'; '...' "
        "(optionally followed by a group number) starts a value with batching dims; '(a b)' is a "
        "compound dim; ',' separates values and '->' operands from results.")


def _parse_side(text: str, start: int, end: int):
    values, dims, group, compound = [], [], None, None
    pos = start
    seen_dim = False
    while pos < end:
        c = text[pos]
        if c.isspace():
            pos += 1
        elif text.startswith(_BATCH_PREFIX, pos):
            if seen_dim or group is not None or compound is not None:
                raise _bad(text, pos, "'...' may only start a value")
            pos += 3
            digits = pos
            while pos < end and text[pos].isdigit():
                pos += 1
            group = str(int(text[digits:pos])) if pos > digits else "0"
        elif c.isalpha():
            name_start = pos
            while pos < end and (text[pos].isalnum() or text[pos] == "_"):
                pos += 1
            name = text[name_start:pos]
            if compound is None:
                dims.append((name,))
            else:
                compound.append(name)
            seen_dim = True
        elif c == "(":
            if compound is not None:
                raise _bad(text, pos, "nested '(' (compound dims are one level)")
            compound, open_pos = [], pos
            pos += 1
        elif c == ")":
            if compound is None:
                raise _bad(text, pos, "')' without '('")
            if len(compound) < 2:
                raise _bad(text, pos, "a compound dim needs at least two factors")
            dims.append(tuple(compound))
            compound = None
            pos += 1
        elif c == ",":
            if compound is not None:
                raise _bad(text, pos, "',' inside a compound dim")
            values.append((tuple(dims), group))
            dims, group, seen_dim = [], None, False
            pos += 1
        else:
            why = ("a factor name must start with a letter" if c.isdigit() or c == "_"
                   else f"unexpected character {c!r}")
            raise _bad(text, pos, why)
    if compound is not None:
        raise _bad(text, open_pos, "'(' is never closed")
    values.append((tuple(dims), group))
    return values


def parse_rule(text: str, *, reduction_factors=(), need_replication_factors=(),
               permutation_factors=(), **factor_sizes: int) -> FactorRule:
    """Parse JAX's einsum-like rule string (``"... i j, j k -> ... i k"``)."""
    if not isinstance(text, str):
        raise TypeError(f"sharding_rule must be a str, an SdyShardingRule or a callable, got "
                        f"{type(text).__name__}.")
    arrow = text.find("->")
    if arrow < 0:
        raise _bad(text, len(text), "no '->' between operands and results")
    if text.find("->", arrow + 2) >= 0:
        raise _bad(text, text.find("->", arrow + 2), "a second '->'")
    lhs = _parse_side(text, 0, arrow)
    rhs = _parse_side(text, arrow + 2, len(text))
    rule = FactorRule(operands=tuple(d for d, _ in lhs), results=tuple(d for d, _ in rhs),
                      batching=tuple(g for _, g in lhs + rhs),
                      reduction=tuple(reduction_factors),
                      need_replication=tuple(need_replication_factors),
                      permutation=tuple(permutation_factors),
                      factor_sizes=tuple(sorted(factor_sizes.items())))
    to_sdy(rule)  # JAX's checks of factor kinds and sizes, at definition time
    return rule


# -- conversion to and from JAX's SdyShardingRule --------------------------------------------------
def to_sdy(rule: FactorRule):
    t = cp_rule_types()

    def mapping(dims, group):
        entries = [] if group is None else [t.BATCHING + ("" if group == "0" else group)]
        entries += [d[0] if len(d) == 1 else t.CompoundFactor(*d) for d in dims]
        return t.ArrayMapping(*entries)

    n = len(rule.operands)
    return t.SdyShardingRule(
        tuple(mapping(d, g) for d, g in zip(rule.operands, rule.batching[:n], strict=True)),
        tuple(mapping(d, g) for d, g in zip(rule.results, rule.batching[n:], strict=True)),
        reduction_factors=rule.reduction, need_replication_factors=rule.need_replication,
        permutation_factors=rule.permutation, **dict(rule.factor_sizes))


def from_sdy(sdy) -> FactorRule:
    t = cp_rule_types()

    def split(mapping):
        entries = list(mapping)
        group = None
        if entries and isinstance(entries[0], str) and entries[0].startswith(t.BATCHING):
            group = entries.pop(0)[len(t.BATCHING):] or "0"
        return tuple((e,) if isinstance(e, str) else tuple(e) for e in entries), group

    ops = [split(m) for m in sdy.operand_mappings]
    res = [split(m) for m in sdy.result_mappings]
    return FactorRule(operands=tuple(d for d, _ in ops), results=tuple(d for d, _ in res),
                      batching=tuple(g for _, g in ops + res),
                      reduction=tuple(sdy.reduction_factors),
                      need_replication=tuple(sdy.need_replication_factors),
                      permutation=tuple(sdy.permutation_factors),
                      factor_sizes=tuple(sorted(sdy.factor_sizes.items())))


# -- a rule on concrete shapes ---------------------------------------------------------------------
@dataclass(frozen=True)
class Resolved:
    """A rule on concrete shapes: ``...`` expanded into factors, every factor sized."""

    dims: tuple[tuple[Dim, ...], ...]
    """Per operand then result: the factors of each of its dims."""
    sizes: dict
    """Factor -> size."""
    num_operands: int


def resolve(rule: FactorRule, in_shapes, out_shapes, name: str) -> Resolved:
    mappings = rule.operands + rule.results
    shapes = [tuple(s) for s in in_shapes] + [tuple(s) for s in out_shapes]
    if len(rule.operands) != len(in_shapes) or len(rule.results) != len(out_shapes):
        raise ValueError(
            f"custom_partitioning {name!r}: sharding_rule '{rule}' has {len(rule.operands)} "
            f"operands and {len(rule.results)} results, but the operation has {len(in_shapes)} "
            f"array operands and {len(out_shapes)} array results. Give one comma-separated "
            "value per flat array.")
    batch_rank: dict[str, int] = {}
    sizes = dict(rule.factor_sizes)
    dims_out = []
    for k, (dims, group, shape) in enumerate(zip(mappings, rule.batching, shapes, strict=True)):
        what = f"operand {k}" if k < len(rule.operands) else f"result {k - len(rule.operands)}"
        lead = len(shape) - len(dims) if group is not None else 0
        if lead < 0 or (group is None and len(dims) != len(shape)) or (
                group is not None and batch_rank.setdefault(group, lead) != lead):
            raise ValueError(
                f"custom_partitioning {name!r}: sharding_rule '{rule}' gives {what} "
                f"{len(dims)} dims{' after ...' if group is not None else ''}, but it has shape "
                f"{shape}. Give one factor per dim (or start with '...').")
        full = tuple((f"...{group}_{j}",) for j in range(lead)) + dims
        for dim, size in zip(full, shape, strict=True):
            if len(dim) == 1:
                sizes[dim[0]] = min(size, sizes.get(dim[0], size))
        dims_out.append(full)
    return Resolved(tuple(dims_out), sizes, len(rule.operands))


# -- from and to infer_sharding_from_operands ------------------------------------------------------
def _spec_entries(sharding, rank: int) -> list[tuple[str, ...]]:
    spec = sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
    out = []
    for d in range(rank):
        e = spec[d] if d < len(spec) else None
        out.append(() if e is None else (e,) if isinstance(e, str) else tuple(e))
    return out


def probe_rule(infer, static_args, mesh, in_avals, in_tree, out_avals, out_tree) -> FactorRule:
    """Derive a rule by asking ``infer`` where a split of each operand dim lands in the results.

    An operand dim whose split reaches no result dim is never split (need-replication): from
    the callback alone a reduction cannot be told from a dim the operation needs whole.
    """
    names = [n for n in mesh.axis_names if mesh.shape[n] > 1]
    factor_of: dict[tuple[int, int], str] = {}
    result_factor: dict[tuple[int, int], str] = {}
    need = []

    def args_with(i, d, axis):
        shapes = []
        for j, a in enumerate(in_avals):
            spec = [None] * len(a.shape)
            if j == i:
                spec[d] = axis
            shapes.append(jax.ShapeDtypeStruct(a.shape, a.dtype,
                                               sharding=NamedSharding(mesh, PartitionSpec(*spec))))
        return jax.tree.unflatten(in_tree, shapes)

    result_shape = jax.tree.unflatten(out_tree, [jax.ShapeDtypeStruct(a.shape, a.dtype)
                                                 for a in out_avals])
    for i, a in enumerate(in_avals):
        for d, size in enumerate(a.shape):
            factor = factor_of[(i, d)] = f"o{i}_{d}"
            axis = next((n for n in names if size % mesh.shape[n] == 0), None)
            hits = []
            if axis is not None:
                got = infer(*static_args, mesh, args_with(i, d, axis), result_shape)
                got = out_tree.flatten_up_to(got)
                hits = [(r, e) for r, (s, o) in enumerate(zip(got, out_avals, strict=True))
                        for e, axes in enumerate(_spec_entries(s, len(o.shape))) if axis in axes]
            if not hits:
                need.append(factor)
            for hit in hits:
                factor = factor_of[(i, d)] = result_factor.setdefault(hit, factor)
    operands = tuple(tuple((factor_of[(i, d)],) for d in range(len(a.shape)))
                     for i, a in enumerate(in_avals))
    results = tuple(tuple((result_factor.get((r, e), f"r{r}_{e}"),) for e in range(len(o.shape)))
                    for r, o in enumerate(out_avals))
    used = {f for dims in operands for (f,) in dims}
    return FactorRule(operands=operands, results=results,
                      batching=(None,) * (len(operands) + len(results)),
                      need_replication=tuple(f for f in dict.fromkeys(need) if f in used))


def infer_from_rule(rule: FactorRule, name: str, mesh, arg_shapes, result_shape):
    """The result shardings ``rule`` implies for the operand shardings of ``arg_shapes``."""
    args = jax.tree.leaves(arg_shapes)
    outs, out_tree = jax.tree.flatten(result_shape)
    r = resolve(rule, [a.shape for a in args], [o.shape for o in outs], name)
    axes_of: dict[str, tuple[str, ...]] = {}
    for dims, a in zip(r.dims, args, strict=False):
        for dim, axes in zip(dims, _spec_entries(a.sharding, len(a.shape)), strict=True):
            if len(dim) == 1 and axes and dim[0] not in rule.unsplittable:
                axes_of.setdefault(dim[0], axes)
    shardings = []
    for dims, o in zip(r.dims[r.num_operands:], outs, strict=True):
        used: set[str] = set()
        spec = []
        for dim in dims:
            axes = axes_of.get(dim[0], ()) if len(dim) == 1 else ()
            if used & set(axes) or o.shape[len(spec)] % math.prod(mesh.shape[a] for a in axes):
                axes = ()
            used |= set(axes)
            spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        shardings.append(NamedSharding(mesh, PartitionSpec(*spec)))
    return jax.tree.unflatten(out_tree, shardings)
