"""Resharding prices the sharding ILPs share: per-axis terms and the memo of pairwise matrices.

An edge whose two ends are chosen independently has a resharding cost per (producer strategy,
consumer strategy) pair. The ILP takes it in one of two forms (``ilp.build_ilp``):

* **Per-axis terms** (``axis_terms``): a sum over mesh axes of a term that depends only on
  where the axis sits in the producer's spec and in the required spec, and on which other
  axes split the producer's. Small (a few columns per edge and axis), exact on a 1-D mesh.
* **Pairwise matrices**: ``CostModel.reshard`` for every pair, exact on any mesh, one column
  per distinct pair. Only edges the per-axis terms misprice get one (``per_axis_matrix``, the
  terms summed, is compared with it float for float).

The term of axis ``a`` is ``CostModel.axis_step`` on the bytes one group of devices along
``a`` holds: the array cut by the other axes that split it in the producer's spec. The exact
chain (``CostModel.reshard_steps``) differs in two ways, both bounded (tested in
``tests/sharding/test_axis_terms.py``):

* a split the consumer adds on another axis is a local slice taken *before* the collective,
  so the exact step moves that many times fewer bytes: the terms read high by at most the
  product of the added axes' sizes (pricing the consumer's side too makes the terms
  pairwise in the two ends' classes, as large as the exact matrices);
* several dropped splits are one hierarchical all-gather (``CostModel.collective_steps``),
  whose faster phases run on the larger arrays: the terms read low by at most the product of
  the dropped axes' sizes over the smallest.

Otherwise (at most one split dropped, none added on another axis) they are the exact cost.
Before, every term was priced on the array as if every other axis split it, so gathering a
weight only the tensor axis splits read ``num_devices / tensor`` times too cheap beside
keeping it split and moving activations (issue 26 item 6: the 39.1B row's pipeline stages
gathered every weight each micro-batch).

The costs and matrices are pure functions of the frozen ``CostModel`` and the specs, so they
are memoised across ILPs (``MEMO``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .cost import byte_cost, flop_cost
from .spec import axis_place

MOVED = ("elsewhere",)
"""A place different from any other: prices moving a split (all-to-all)."""

MEMO_MAX_BYTES = 512 * 2**20
"""Most bytes the resharding costs shared across ILPs (``_Memo``) hold before an ILP starts:
the pairwise edge matrices' data plus ``MEMO_ENTRY_BYTES`` per memoised cost or matrix. Over
it, the cost models memoised first are dropped until it fits (an ILP being built keeps what
it uses). 512 MiB holds the matrices of every sub-mesh of a Table 1 pipeline search."""
MEMO_ENTRY_BYTES = 160
"""What one memoised entry costs besides a matrix's data: its dict slot and key tuple (the
specs in a key are shared with the strategies, not copied)."""


@dataclass
class _Tables:
    """What one cost model's ILPs share: resharding costs and pairwise edge matrices."""

    costs: dict = field(default_factory=dict)
    """(src spec, dst spec, shape, itemsize) -> ``CostModel.reshard`` seconds."""
    matrices: dict = field(default_factory=dict)
    """(src specs, dst specs, shape, itemsize) -> exact pairwise cost matrix, or None where the
    per-axis terms are exact."""
    matrix_bytes: int = 0
    terms: dict = field(default_factory=dict)
    """(src specs, dst specs, shape, itemsize, by_shards) -> ``axis_terms``: the edges of every
    unrolled layer (unshared strategy lists of equal specs) and of the data-parallel ILP beside
    the plan priced once. Not in ``nbytes``: a few small arrays per distinct edge, about as many
    entries as ``matrices``, evicted with them."""

    @property
    def nbytes(self) -> int:
        return self.matrix_bytes + MEMO_ENTRY_BYTES * (len(self.costs) + len(self.matrices))


class _Memo:
    """Resharding costs shared across ILPs, per cost model (and device speed).

    ``CostModel.reshard`` and the pairwise matrices built from it are pure functions of the
    frozen ``CostModel`` and the specs, so the same mesh planned again (another candidate of a
    mesh search, the forward, backward and apply tasks of a pipeline stage, the stages of one
    sub-mesh shape) prices them once. Bounded by ``max_bytes`` (checked when an ILP starts)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.tables: dict = {}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tables.values())

    def tables_of(self, cost) -> _Tables:
        # The device speed is in the key too: the costs read none today, but a rule that
        # prices a local step as compute would read it, and a stale memo would be silent.
        key = (cost, flop_cost(1.0, 1), byte_cost(1.0, 1))
        while self.tables and self.nbytes > self.max_bytes:
            del self.tables[next(iter(self.tables))]  # the oldest cost model first
        found = self.tables.get(key)
        if found is None:
            found = self.tables[key] = _Tables()
        return found

    def existing(self, cost):
        """The tables of ``cost`` if an ILP made them (no eviction, nothing created), else None."""
        return self.tables.get((cost, flop_cost(1.0, 1), byte_cost(1.0, 1)))

    def clear(self):
        self.tables.clear()


MEMO = _Memo(MEMO_MAX_BYTES)
"""The resharding costs every ILP of this process shares (``MEMO.clear()`` empties it)."""


def other_axes(cost, spec, a: int) -> frozenset[int]:
    """The mesh axes other than ``a`` (of size > 1) that split an array of ``spec``."""
    return frozenset(b for axes in spec for b in axes if b != a and cost.mesh_shape[b] > 1)


def pieces(cost, axes) -> int:
    """The pieces ``axes`` cut an array into: what a per-axis term divides it by."""
    return math.prod(cost.mesh_shape[b] for b in axes)


def per_axis_matrix(cost, srcs, dsts, shape, isize) -> np.ndarray:
    """``cost.reshard_per_axis(a, b, shape, isize)`` for every ``a`` of ``srcs`` and ``b`` of
    ``dsts``, the same floats: per mesh axis, each distinct pair of (producer place, other
    axes splitting it) and consumer place priced once (``CostModel.axis_step``) and added in
    axis order."""
    total_bytes = math.prod(shape) * isize
    out = np.zeros((len(srcs), len(dsts)))
    for a in range(len(cost.mesh_shape)):
        ps = [(axis_place(x, a), pieces(cost, other_axes(cost, x, a))) for x in srcs]
        pd = [axis_place(x, a) for x in dsts]
        (us, si), (ud, di) = _distinct(ps), _distinct(pd)
        table = np.zeros((len(us), len(ud)))
        for i, (x, cut) in enumerate(us):
            for j, y in enumerate(ud):
                step = cost.axis_step(a, x, y, total_bytes, other_shards=cut)
                if step is not None:
                    table[i, j] = step[2]
        out += table[np.ix_(si, di)]
    return out


def axis_terms(cost, srcs, dsts, shape, isize, *, by_shards: bool = True) -> list[tuple]:
    """An edge's per-axis terms: ``(src_dims, classes, dst_dims, gathers, moves)`` per mesh
    axis that some producer spec splits.

    ``src_dims[k]`` is where the axis sits in producer spec ``srcs[k]`` (None: not split),
    ``dst_dims[j]`` where it sits in required spec ``dsts[j]``; ``classes[k]`` indexes
    ``gathers`` / ``moves``, the costs of dropping / moving the split on the array producer
    ``k``'s other axes leave (one class per distinct size). The ILP charges producer ``k``
    (``src_dims[k]`` not None) and consumer ``j`` ``gathers[classes[k]]`` if ``dst_dims[j]`` is
    None, nothing if it equals ``src_dims[k]``, else ``moves[classes[k]]``: summed over the
    terms, ``per_axis_matrix``'s entry. ``by_shards=False``: one class, its costs unused (an
    ILP that forbids resharding reads only the dims). Memoised in ``MEMO`` by content while
    an ILP of ``cost`` is built (callers must not change the arrays).
    """
    tables = MEMO.existing(cost)
    if tables is None:
        return _axis_terms(cost, srcs, dsts, shape, isize, by_shards)
    key = (tuple(srcs), tuple(dsts), tuple(shape), isize, by_shards)
    found = tables.terms.get(key)
    if found is None:
        found = tables.terms[key] = _axis_terms(cost, key[0], key[1], shape, isize, by_shards)
    return found


def _axis_terms(cost, srcs, dsts, shape, isize, by_shards) -> list[tuple]:
    total_bytes = float(isize * np.prod(shape, dtype=np.float64))
    terms = []
    for a, size in enumerate(cost.mesh_shape):
        if size == 1:
            continue
        src_dims = tuple(axis_place(x, a) for x in srcs)
        if all(d is None for d in src_dims):
            continue  # adding a split is a local slice
        cuts = [pieces(cost, other_axes(cost, x, a)) if by_shards else None for x in srcs]
        distinct = sorted({n for n, d in zip(cuts, src_dims, strict=True) if d is not None},
                          key=lambda n: -1 if n is None else n)
        index = {n: c for c, n in enumerate(distinct)}
        classes = tuple(index.get(n, 0) for n in cuts)
        gathers = np.array([cost.axis_step(a, MOVED, None, total_bytes, other_shards=n)[2]
                            for n in distinct])
        moves = np.array([cost.axis_step(a, MOVED, MOVED + (0,), total_bytes,
                                         other_shards=n)[2] for n in distinct])
        terms.append((src_dims, classes, tuple(axis_place(x, a) for x in dsts), gathers,
                      moves))
    return terms


def _distinct(items) -> tuple[list, list[int]]:
    """(the distinct items in first-seen order, each item's index among them)."""
    index: dict = {}
    at = [index.setdefault(x, len(index)) for x in items]
    return list(index), at
