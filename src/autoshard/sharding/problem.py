"""The planning problem on one logical mesh: strategies per node, grouped into ILP variables.

A ``Problem`` holds the graph, the rule context, every node's strategy list and the union-find
of nodes that share one ILP variable (followers, ties). ``simplify`` fills the strategies,
``build`` assembles a problem, ``repeats`` ties repeated layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import rules_custom, rules_linalg  # noqa: F401  (register their rules)
from .graph import Graph
from .spec import Spec, shards
from .strategy import RuleContext, Strategy, itemsize


@dataclass
class Problem:
    graph: Graph
    ctx: RuleContext
    strategies: list[list[Strategy]]
    parent: list[int]
    """Union-find over node ids; the root names the ILP variable of a node."""
    cache: dict = field(default_factory=dict)
    """Node signature -> strategy list (shared by repeated nodes)."""
    keepalive: list = field(default_factory=list)
    """Strategy lists whose ids are part of cache keys (kept alive so ids stay unique)."""
    no_reshard: bool = False
    """Forbid resharding outright (pure data parallel) instead of pricing it."""
    free: set[int] = field(default_factory=set)
    """Nodes computed from constants only (one replicated strategy, never pinned)."""
    allowed: dict[int, set[int]] = field(default_factory=dict)
    """Node id -> strategy indices it may take (absent: all)."""
    notes: list[str] = field(default_factory=list)
    combined: set[int] = field(default_factory=set)
    """Nodes whose reductions XLA merges with others': their strategies carry no latency, the
    ILP pays it once per mesh axis (``build._combine_tail_reductions``)."""
    siblings: dict[int, int] = field(default_factory=dict)
    """Reductions that feed later work (a normalisation's statistics) -> their level: the
    reducing nodes on the longest path before them. Those of one level in one loop body do
    not depend on each other, so XLA merges them and the ILP pays their latency once per mesh
    axis and level (``build._combine_sibling_reductions``)."""
    derived: dict = field(default_factory=dict)
    """Name -> (key, the strategy lists the key's ids name, value) (``derived_value``)."""
    held_whole: set[int] = field(default_factory=set)
    """Input nodes of parameters that ``prefer_reduce_scatter`` holds between steps as their
    readers read them, and the light nodes computed from them alone: the ILP allows no
    resharding of their values but slices (no all-gather before the forward pass: ZeRO-3's
    layout; ``build._hold_parameters_whole``)."""
    partial_sums: list = field(default_factory=list)
    """Sums whose two terms may stay partial sums and be reduced once
    (``partial_sums.Candidate``, found by ``partial_sums.fold_partial_sums``)."""

    def var(self, node_id: int) -> int:
        p = self.parent
        while p[node_id] != node_id:
            p[node_id] = p[p[node_id]]
            node_id = p[node_id]
        return node_id

    def derived_value(self, name: str, compute):
        """``compute(self)``, computed again only when the strategy lists, the variables or
        the merged reductions it depends on have changed (planning reads the memory model's
        choice-free parts once per solve and per plan made)."""
        key = (tuple(map(id, self.strategies)), tuple(map(self.var, range(len(self.parent)))),
               frozenset(self.combined), tuple(sorted(self.siblings.items())))
        hit = self.derived.get(name)
        if hit is not None and hit[0] == key:
            return hit[2]
        value = compute(self)
        self.derived[name] = (key, list(self.strategies), value)   # the ids stay unique
        return value

    def free_values(self) -> _FreeValues:
        return _FreeValues(self)

    def value_spec(self, value_id: int, k: int) -> Spec:
        v = self.graph.values[value_id]
        node = self.graph.nodes[v.producer]
        return self.strategies[node.id][k].out_specs[node.outputs.index(value_id)]

    def union(self, a: int, b: int):
        ra, rb = self.var(a), self.var(b)
        if ra == rb:
            return
        assert len(self.strategies[ra]) == len(self.strategies[rb]), (ra, rb)
        lo, hi = min(ra, rb), max(ra, rb)
        self.parent[hi] = lo


class _FreeValues:
    def __init__(self, prob: Problem):
        self.prob = prob

    def __contains__(self, value_id: int) -> bool:
        return self.prob.graph.values[value_id].producer in self.prob.free


def value_bytes(prob: Problem, value_id: int, k: int) -> int:
    v = prob.graph.values[value_id]
    size = itemsize(v.dtype)
    for n in v.shape:
        size *= n
    if v.producer in prob.free:  # made slice by slice where it is used
        return size // prob.ctx.cost.num_devices
    return size // shards(prob.value_spec(value_id, k), prob.ctx.mesh_shape)
