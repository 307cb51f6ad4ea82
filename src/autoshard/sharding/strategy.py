"""Strategies and the rule registry: what one way to run a node is, and how rules are found.

A rule gets the shapes and params of one equation and returns its candidate strategies. Rules
register per primitive name here; ``rules``, ``rules_linalg`` and ``rules_custom`` hold them.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .cost import CostModel
from .options import AutoShardingOption
from .spec import Spec, candidate_specs, replicated


@dataclass(frozen=True)
class Strategy:
    """One way to run one node."""

    out_specs: tuple[Spec, ...]
    in_specs: tuple[Spec | None, ...]
    """Spec each operand must arrive in; None for a literal operand."""
    comm_s: float = 0.0
    compute_s: float = 0.0
    collectives: tuple[tuple[str, tuple[int, ...], int], ...] = ()
    """(kind, mesh axes, bytes) of the collectives the strategy implies."""


@dataclass
class RuleContext:
    mesh_shape: tuple[int, ...]
    cost: CostModel
    option: AutoShardingOption
    warned: set[str] = field(default_factory=set)
    allow_recompute_heavy_op: bool = False
    light_flops: float = 0.0
    """Dots and convolutions of at most this many FLOPs may run recomputed on several devices."""
    keep_whole: dict = field(default_factory=dict)
    """Shape -> dims never split in values of that shape (the spatial dims of conv images)."""
    axis_names: tuple[str, ...] = ()
    """Names the plan will give the mesh axes (to read users' sharding constraints)."""
    dropped_constraints: set[str] = field(default_factory=set)
    """Users' constraints that name another mesh than the plan's (kept as free identities)."""
    scatter_gradients: bool = False
    """Weight gradients may be reduce-scattered into their update's shards: under a budget the
    user gave, or in the default that weighs memory (``build.build_problem``)."""

    @property
    def scatter_reductions(self) -> bool:
        """Offer reduce-scatters of contractions and sums beside their all-reduces: with
        ``prefer_reduce_scatter``, or with ``scatter_gradients`` (``build`` then excludes
        those of activations: ``_scatter_gradients_only``)."""
        return self.option.prefer_reduce_scatter or self.scatter_gradients

    def candidates(self, shape) -> list[Spec]:
        found = candidate_specs(tuple(shape), self.mesh_shape)
        dims = self.keep_whole.get(tuple(shape))
        if dims:
            found = [s for s in found if not any(s[d] for d in dims)]
        return found

    def all_reduce(self, axes, num_bytes) -> tuple[float, tuple]:
        axes = tuple(a for a in axes if self.mesh_shape[a] > 1)
        if not axes:
            return 0.0, ()
        return (self.cost.collective("all-reduce", axes, num_bytes),
                (("all-reduce", axes, int(num_bytes)),))

    def warn_unknown(self, name: str):
        if name not in self.warned:
            self.warned.add(name)
            warnings.warn(
                f"autoshard: no sharding rule for primitive {name!r}; it runs replicated on every "
                "device. Register a rule with autoshard.sharding.strategy.register to split it.", stacklevel=3)


def itemsize(dtype) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:  # extended dtypes (PRNG keys)
        return 8


def nbytes(aval) -> int:
    return math.prod(aval.shape) * itemsize(aval.dtype)


Rule = Callable[[RuleContext, list, list, dict], list[Strategy]]
RULES: dict[str, Rule] = {}

def register(*names: str):
    def wrap(fn: Rule) -> Rule:
        for n in names:
            RULES[n] = fn
        return fn
    return wrap


def strategies_for(ctx: RuleContext, name: str, in_avals, out_avals, params) -> list[Strategy]:
    rule = RULES.get(name)
    if rule is None:
        if name not in ctx.warned:
            ctx.warn_unknown(name)
        return [replicated_strategy(in_avals, out_avals)]
    found = rule(ctx, in_avals, out_avals, params)
    return found or [replicated_strategy(in_avals, out_avals)]


def replicated_strategy(in_avals, out_avals) -> Strategy:
    return Strategy(tuple(replicated(len(a.shape)) for a in out_avals),
                    tuple(replicated(len(a.shape)) for a in in_avals))
