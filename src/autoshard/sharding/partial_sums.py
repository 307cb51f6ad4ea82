"""Partial sums: a sum of terms that are each a partial sum over some mesh axes, reduced once.

A tied word embedding gets two gradient terms: the LM head's product (its contracting dim, the
tokens, split over the batch axis) and the lookup's scatter-add (its updates split the same
way). Each is a partial sum over the batch axis; reduced on its own, the gradient moves twice
its bytes. Summed first, it is reduced once. XLA does not reassociate the two all-reduces
(XLA:CPU has no such pass) and JAX's unreduced layouts exist only on Explicit mesh axes, so
the plan says which values stay partial and the step runs them on local shards.

Planning (``fold_partial_sums``, ``partial_sum_regions``): an ``add`` whose two operands come,
through single-use layout ops (transpose, reshape), from two single-use dots or scatter-adds
outside loops is a candidate. The two terms share one ILP variable whose strategies are all
pairs of theirs (every plan possible before stays possible); in a pair whose two strategies
reduce over the same axes with the same collective, the second term's reduction is dropped,
so the ILP pays it once. Anything else keeps its plan.

The same machinery reduces every other weight gradient the chosen plan reduce-scatters, as a
sum of one term (``reduce_scattered_regions``; ``ShardingPlan.reduce_scattered``), so that
the step reduces all of them in one collective.

Applying: ``sharding.partial_run``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..ir._prims import ADDS
from .build import COMBINED_KINDS, feeds_chain_mask
from .partial_run import SCATTER_KINDS
from .plan import PartialSource, PartialSum
from .problem import Problem
from .spec import Spec, to_partition_spec

SOURCE_KINDS = frozenset({"dot_general"}) | SCATTER_KINDS
"""Equations whose result can be a partial sum computed on local shards."""
CHAIN_KINDS = frozenset({"transpose", "reshape", "squeeze", "expand_dims", "copy", "copy_p"})
"""Layout ops a partial term may pass through on its way to the sum (linear, one operand,
exact: a sum of their results is their result of the sum)."""
LONE_KINDS = SOURCE_KINDS | {"reduce_sum"}
"""Equations whose reduce-scattered result may be reduced with the others (``reduce_scattered_regions``)."""
MAX_CHAIN = 8
"""Most layout ops between a term and the sum."""
MAX_JOINT_STRATEGIES = 1024
"""Most strategy pairs of the two terms' shared ILP variable; more keeps today's plan."""


@dataclass(frozen=True)
class Candidate:
    """A sum of two terms that may be reduced once (one ILP variable for both terms)."""

    total: int
    """Node id of the add."""
    sources: tuple[int, int]
    """Node ids of the two terms (dots or scatter-adds)."""
    chains: tuple[tuple[int, ...], tuple[int, ...]]
    """Per term, the layout nodes from it to the add, in program order."""
    reduced_once: dict
    """Joint strategy index -> (kind, axes, bytes) of the one reduction, for the pairs whose
    second reduction is dropped."""


def _plain(node) -> bool:
    """Outside loops, run once per step, one output."""
    return (node.body < 0 and node.mult == 1 and node.comm_times == 1
            and len(node.outputs) == 1)


def _layout(prob: Problem, node) -> bool:
    """A layout op (``CHAIN_KINDS``), or a sum over dims of size 1 (how JAX transposes the
    broadcast of a bias into ``(1, 1, n)``)."""
    if node.kind in CHAIN_KINDS:
        return True
    if node.kind != "reduce_sum" or len(node.operands) != 1 or node.operands[0] is None:
        return False
    shape = prob.graph.values[node.operands[0]].shape
    return all(shape[d] == 1 for d in node.params["axes"])


def _trace(prob: Problem, consumers, value_id: int):
    """(term node id, layout node ids in program order) behind ``value_id``, or None."""
    g = prob.graph
    chain = []
    while len(chain) <= MAX_CHAIN:
        node = g.nodes[g.values[value_id].producer]
        if len(consumers[node.id]) != 1 or not _plain(node) or node.id in prob.free:
            return None
        if node.kind in SOURCE_KINDS:
            if any(u is None for u in node.operands):
                return None
            return node.id, tuple(reversed(chain))
        if not _layout(prob, node) or len(node.operands) != 1 or node.operands[0] is None:
            return None
        chain.append(node.id)
        value_id = node.operands[0]
    return None


def _reduction(prob: Problem, node, s):
    """(kind, axes, bytes) of the one reduction of strategy ``s`` of a term, if the term can run
    on its local shards under it; else None."""
    if len(s.collectives) != 1:
        return None
    kind, axes, num_bytes = s.collectives[0]
    if kind not in COMBINED_KINDS or not axes:
        return None
    out = s.out_specs[0]
    on_out = [d for d, dim_axes in enumerate(out) if set(dim_axes) & set(axes)]
    if kind == "all-reduce" and on_out:
        return None
    if kind == "reduce-scatter" and (len(on_out) != 1 or out[on_out[0]][-len(axes):] != axes):
        return None  # scattered into one dim, its axes the minor ones of that dim
    if node.kind in SCATTER_KINDS:  # the scattered operand dims stay whole
        dn = node.params["dimension_numbers"]
        operand = s.in_specs[0]
        if any(operand[d] for d in (*dn.inserted_window_dims, *dn.operand_batching_dims)):
            return None
    return kind, tuple(axes), int(num_bytes)


def _reduction_cost(prob: Problem, node_id: int, kind: str, axes, num_bytes: int) -> float:
    """What a term's strategy pays for its reduction (as its rule and ``build`` priced it)."""
    cost = prob.ctx.cost
    group = num_bytes * (math.prod(prob.ctx.mesh_shape[a] for a in axes)
                         if kind == "reduce-scatter" else 1)
    paid = cost.collective(kind, axes, group)
    if node_id in prob.combined or node_id in prob.siblings:  # latency paid once per group
        paid -= cost.latency(axes)
    return paid


def fold_partial_sums(prob: Problem) -> int:
    """Give each candidate sum's two terms one ILP variable over their strategy pairs, the
    second reduction dropped where both reduce alike; returns how many sums were folded.

    Call it after the problem's strategies, masks and ties are final and before
    ``repeats.tie_repeated`` and the ILP."""
    g = prob.graph
    consumers = g.consumers()
    members: dict[int, list[int]] = {}
    for n in g.nodes:
        members.setdefault(prob.var(n.id), []).append(n.id)
    taken: set[int] = set()
    folded = 0
    for node in g.nodes:
        if node.kind not in ADDS or not _plain(node) or len(node.operands) != 2:
            continue
        a, b = node.operands
        if a is None or b is None or a == b:
            continue
        found = [_trace(prob, consumers, u) for u in (a, b)]
        if None in found:
            continue
        (s1, ch1), (s2, ch2) = found
        group = {s1, s2, *ch1, *ch2}
        if prob.var(s1) == prob.var(s2) or taken & group:
            continue
        cand = _fold(prob, node.id, (s1, s2), (ch1, ch2), members)
        if cand is not None:
            prob.partial_sums.append(cand)
            taken |= group
            folded += 1
    if folded:
        prob.notes.append(f"{folded} sums of partial sums may be reduced once")
    return folded


def _pair(red_a, red_b, out_a, out_b, movable: tuple[bool, bool]):
    """Which term keeps its reduction when a pair of strategies reduces once (0 or 1), or None.

    Both must reduce over the same axes into the same layout on the other axes. With the same
    collective the second term drops its own; where one all-reduces and the other
    reduce-scatters, the all-reducing term drops its reduction and takes the other's layout
    (its partial result is scattered with the sum), if nothing else reads its layout."""
    if red_a is None or red_b is None or red_a[1] != red_b[1]:
        return None
    axes = red_a[1]
    if _strip(out_a, axes) != _strip(out_b, axes):
        return None
    if red_a[0] == red_b[0]:
        return 0 if out_a == out_b else None
    keeper = 0 if red_a[0] == "reduce-scatter" else 1
    return keeper if movable[1 - keeper] else None


def _fold(prob: Problem, total: int, sources, chains, members) -> Candidate | None:
    g = prob.graph
    s1, s2 = sources
    lists = prob.strategies[s1], prob.strategies[s2]
    if len(lists[0]) * len(lists[1]) > MAX_JOINT_STRATEGIES:
        return None
    reds = [[_reduction(prob, g.nodes[s], x) for x in lst] for s, lst in zip(sources, lists,
                                                                          strict=True)]
    movable = tuple(not chain and members[prob.var(s)] == [s]
                    for s, chain in zip(sources, chains, strict=True))
    pairs = [(i, j) for i in range(len(lists[0])) for j in range(len(lists[1]))]
    once = {}
    for k, (i, j) in enumerate(pairs):
        keeper = _pair(reds[0][i], reds[1][j], lists[0][i].out_specs[0], lists[1][j].out_specs[0],
                       movable)
        if keeper is not None:
            once[k] = (keeper, (reds[0][i], reds[1][j])[keeper])
    if not once:
        return None
    # Every node of each term's variable (the term and its followers) gets the pairs, in the
    # same order, so followers' strategy indices still match their leader's.
    r1, r2 = prob.var(s1), prob.var(s2)
    for root, index in ((r1, 0), (r2, 1)):
        expanded: dict[int, list] = {}
        for node_id in members[root]:
            old = prob.strategies[node_id]
            new = expanded.get(id(old))
            if new is None:
                new = expanded[id(old)] = [old[p[index]] for p in pairs]
            prob.strategies[node_id] = new
            allowed = prob.allowed.get(node_id)
            if allowed is not None:
                prob.allowed[node_id] = {k for k, p in enumerate(pairs) if p[index] in allowed}
        prob.keepalive.extend(expanded.values())
    joint = [list(prob.strategies[s1]), list(prob.strategies[s2])]
    for k, (keeper, _) in once.items():
        drop = 1 - keeper
        s = joint[drop][k]
        kind, axes, num_bytes = reds[drop][pairs[k][drop]]
        paid = _reduction_cost(prob, sources[drop], kind, axes, num_bytes)
        joint[drop][k] = dataclasses.replace(s, out_specs=joint[keeper][k].out_specs,
                                             comm_s=max(0.0, s.comm_s - paid), collectives=())
    prob.strategies[s1], prob.strategies[s2] = joint
    prob.keepalive.extend(joint)
    prob.union(r1, r2)
    return Candidate(total=total, sources=(s1, s2), chains=tuple(chains),
                     reduced_once={k: red for k, (_, red) in once.items()})


def _strip(spec: Spec, axes) -> Spec:
    return tuple(tuple(a for a in dim_axes if a not in axes) for dim_axes in spec)


def partial_sum_regions(prob: Problem, choice_of, names: tuple[str, ...]
                        ) -> tuple[PartialSum, ...]:
    """The plan's ``PartialSum`` of every candidate whose chosen pair reduces once.
    ``choice_of(node_id)`` is the chosen strategy index of a node (``Solution.k``)."""
    g = prob.graph
    found = []
    for cand in prob.partial_sums:
        k = choice_of(cand.sources[0])
        if k not in cand.reduced_once:
            continue
        _, axes, _ = cand.reduced_once[k]

        def chosen(node_id):
            return prob.strategies[node_id][choice_of(node_id)]

        sources = tuple(PartialSource(
            site=g.node_sites[s],
            operand_specs=tuple(to_partition_spec(spec, names) for spec in chosen(s).in_specs),
            spec=to_partition_spec(_strip(chosen(s).out_specs[0], axes), names),
            where=g.nodes[s].where)
            for s in cand.sources)
        chain = tuple((g.node_sites[c], to_partition_spec(_strip(chosen(c).out_specs[0], axes),
                                                          names))
                      for ch in cand.chains for c in ch)
        where = " + ".join(g.nodes[s].where for s in cand.sources)
        found.append(PartialSum(
            axes=tuple(names[a] for a in axes), sources=sources, chain=chain,
            total=g.node_sites[cand.total],
            total_spec=to_partition_spec(chosen(cand.total).out_specs[0], names),
            where=f"{g.nodes[cand.total].where} of {where}"))
    return tuple(found)


def reduce_scattered_regions(prob: Problem, choice_of, names: tuple[str, ...],
                             partial_sums: tuple[PartialSum, ...]) -> tuple[PartialSum, ...]:
    """A ``PartialSum`` of one term for every other weight gradient (a product, scatter-add or
    sum outside loops that feeds no heavy op: ``feeds_chain_mask``) the chosen plan
    reduce-scatters, so the step reduces them all in one collective
    (``partial_run.PartialSums.flush``). Its ``total`` is the last of the single-use layout ops after the term (the transpose or
    reshape into the parameter's shape), or the term itself. Where every reader of the total
    gathers it again over the axes (the plan's reduce-scatter of test_moe_lm's LM head bias
    gradient, then an all-gather before the sum over its dims of size 1), it is all-reduced
    there instead: the pair's bytes in one collective.

    XLA:GPU's combiner merges such reduce-scatters by itself. XLA:CPU lowers each as an
    all-reduce and a slice, and its all-reduce combiner, which closes a group at the first
    reduction that reads a member, merged each gradient's with the previous gradient's
    optimizer statistics (Adafactor's row and column sums) instead."""
    g = prob.graph
    feeds_chain = feeds_chain_mask(g)
    consumers = g.consumers()
    sites = {src.site for ps in partial_sums for src in ps.sources}
    taken = {n for n, key in g.node_sites.items() if key in sites}

    def chosen(node_id):
        return prob.strategies[node_id][choice_of(node_id)]

    found = []
    for node in g.nodes:
        if (node.kind not in LONE_KINDS or node.id in taken or feeds_chain[node.id]
                or not _plain(node) or node.id in prob.free
                or any(u is None for u in node.operands)):
            continue
        red = _reduction(prob, node, chosen(node.id))
        if red is None or red[0] != "reduce-scatter":
            continue
        axes = red[1]
        chain, last = [], node.id
        while len(chain) < MAX_CHAIN and len(consumers[last]) == 1:
            nxt = g.nodes[consumers[last][0][0]]
            if (not _layout(prob, nxt) or len(nxt.operands) != 1 or not _plain(nxt)
                    or nxt.id in prob.free or nxt.id in taken):
                break
            chain.append(nxt.id)
            last = nxt.id
        while chain and _scattered_dims(chosen(chain[-1]).out_specs[0], axes) != 1:
            chain.pop()  # the sum is held split over the axes on one dim, as the term is
        total = chain[-1] if chain else node.id
        total_spec = chosen(total).out_specs[0]
        read = {chosen(c).in_specs[p] for c, p in consumers[total]}
        if read == {_strip(total_spec, axes)}:
            total_spec = read.pop()  # gathered again at once: one all-reduce, not the pair
        taken.update((node.id, *chain))
        found.append(PartialSum(
            axes=tuple(names[a] for a in axes),
            sources=(PartialSource(
                site=g.node_sites[node.id],
                operand_specs=tuple(to_partition_spec(sp, names)
                                    for sp in chosen(node.id).in_specs),
                spec=to_partition_spec(_strip(chosen(node.id).out_specs[0], axes), names),
                where=node.where),),
            chain=tuple((g.node_sites[c], to_partition_spec(
                _strip(chosen(c).out_specs[0], axes), names)) for c in chain[:-1]),
            total=g.node_sites[total], total_spec=to_partition_spec(total_spec, names),
            where=node.where))
    return tuple(found)


def _scattered_dims(spec: Spec, axes) -> int:
    """How many dims of ``spec`` are split over ``axes``, -1 if one is not split over them as
    its minor axes."""
    dims = [d for d in spec if set(d) & set(axes)]
    return len(dims) if all(tuple(d[-len(axes):]) == tuple(axes) for d in dims) else -1
