"""Tracing a user function into a flat ClosedJaxpr, walking it, and splitting it at markers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _compat
from ._markers import pipeline_p
from ._prims import RANDOM, VALUE_PRESERVING
from ._walk import Walker, any_eqn, sub_jaxprs


# Flattening arguments into dynamic (array) and static (hashable) leaves ---------------------------
def is_array_leaf(x) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct) or (
        _compat.is_tracer(x))


@dataclass(frozen=True)
class FlatArgs:
    """Arguments split into array leaves (traced) and the hashable rest (baked into the trace)."""

    treedef: Any
    """Tree structure of the positional argument tuple."""
    is_dynamic: tuple[bool, ...]
    """Per leaf: True for array leaves."""
    static_leaves: tuple[Any, ...]
    """The non-array leaves, in order (hashable)."""
    dynamic_leaves: tuple[Any, ...]
    """The array leaves, in order (arrays, or ShapeDtypeStructs once made abstract)."""
    leaf_argnum: tuple[int, ...]
    """Per dynamic leaf: the positional argument it belongs to."""
    paths: tuple[str, ...]
    """Per dynamic leaf: readable path."""
    static_paths: tuple[str, ...] = ()
    """Per static leaf: readable path."""

    def key(self):
        return (self.treedef, self.is_dynamic, self.static_leaves, self.avals())

    def avals(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """Abstract dynamic leaves (weak types kept, so Python scalars match on later calls)."""
        return tuple(jax.ShapeDtypeStruct(tuple(x.shape), x.dtype,
                                          weak_type=bool(getattr(x, "weak_type", False)))
                     for x in self.dynamic_leaves)

    def abstract(self) -> FlatArgs:
        """The same split with ShapeDtypeStruct leaves: holds no user arrays."""
        return dataclasses.replace(self, dynamic_leaves=self.avals())

    def rebuild(self, dynamic):
        it_dyn, it_static = iter(dynamic), iter(self.static_leaves)
        leaves = [next(it_dyn) if d else next(it_static) for d in self.is_dynamic]
        return jax.tree.unflatten(self.treedef, leaves)


def _is_number(x) -> bool:
    return isinstance(x, int | float | complex) and not isinstance(x, bool)


def flatten_args(args: tuple, static_argnums: Sequence[int]) -> FlatArgs:
    """Split ``args``; slow (paths for every leaf), so callers run it on cache misses only."""
    is_dynamic, static, dynamic, argnum, paths, static_paths = [], [], [], [], [], []
    per_arg = [jax.tree_util.tree_flatten_with_path(a)[0] for a in args]
    for i, leaves in enumerate(per_arg):
        if i in static_argnums:
            _check_static_arg(i, leaves, static_argnums)
        # A Python number next to arrays in one argument (a train state's step counter) is
        # data, not configuration: it becomes a weakly typed scalar array.
        mixed = i not in static_argnums and any(
            is_array_leaf(x) or isinstance(x, jax.core.ShapedArray) for _, x in leaves)
        for path, leaf in leaves:
            name = f"arg{i}{jax.tree_util.keystr(path)}"
            if mixed and _is_number(leaf):
                leaf = jnp.asarray(leaf)
            if isinstance(leaf, jax.core.ShapedArray):  # an abstract value, as Alpa takes
                leaf = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
            if i not in static_argnums and is_array_leaf(leaf):
                is_dynamic.append(True)
                dynamic.append(leaf)
                argnum.append(i)
                paths.append(name)
                continue
            try:
                hash(leaf)
            except TypeError:
                raise TypeError(
                    f"{name} is a non-array value of type {type(leaf).__name__} that is not "
                    "hashable, so it cannot be a static value. Pass it as an array or make "
                    "it hashable.") from None
            is_dynamic.append(False)
            static.append(leaf)
            static_paths.append(name)
    treedef = jax.tree.structure(args)
    return FlatArgs(treedef, tuple(is_dynamic), tuple(static), tuple(dynamic), tuple(argnum),
                    tuple(paths), tuple(static_paths))


def _check_static_arg(i: int, leaves, static_argnums):
    for path, leaf in leaves:
        name = f"arg{i}{jax.tree_util.keystr(path)}"
        if _compat.is_tracer(leaf):
            raise TypeError(
                f"{name} is a static argument (static_argnums={tuple(static_argnums)}) but got a "
                f"tracer {leaf}. A static value must be concrete: mark it static with "
                "static_argnums only if it is a Python value, or do not call a parallelized "
                "function inside jax.jit/vmap/grad.")
        if is_array_leaf(leaf):
            raise TypeError(
                f"{name} is an array of shape {tuple(leaf.shape)}, but static_argnums="
                f"{tuple(static_argnums)} marks argument {i} static. Arrays cannot be static "
                f"(they are not hashable); remove {i} from static_argnums, or pass a Python "
                "value.")


def output_paths(out_tree) -> list[str]:
    leaves = jax.tree_util.tree_flatten_with_path(out_tree)[0]
    return [f"out{jax.tree_util.keystr(p)}" for p, _ in leaves]


# Walking ---------------------------------------------------------------------------------------
def grad_marker_index(jaxpr) -> int | None:
    """Index of the top-level gradient marker equation, or None; more than one is an error."""
    found = [i for i, e in enumerate(jaxpr.eqns)
             if e.primitive is pipeline_p and e.params["mark_type"] == "grad"]
    if len(found) > 1:
        raise ValueError(
            f"The traced function has {len(found)} gradient markers; gradient accumulation "
            "needs exactly one. Call autoshard.grad/value_and_grad once per step, or mark all "
            "gradients together with autoshard.markers.mark_gradient.")
    return found[0] if found else None




def differentiated_inputs(jaxpr) -> list:
    """Top-level input variables that reach a ``params`` marker (what autoshard.grad differentiates).

    A parameter may pass through casts (a bf16 copy of float32 weights) on its way there.
    """
    producer = {o: e for e in jaxpr.eqns for o in e.outvars}
    inputs, found, seen = set(jaxpr.invars), [], set()
    for e in jaxpr.eqns:
        if e.primitive is not pipeline_p or e.params["mark_type"] != "params":
            continue
        for v in e.invars:
            while isinstance(v, _compat.Var) and v not in inputs and v in producer and (
                    producer[v].primitive.name in VALUE_PRESERVING):
                src = producer[v]
                v = src.invars[src.outvars.index(v)] if len(src.invars) == len(
                    src.outvars) else src.invars[0]
            if isinstance(v, _compat.Var) and v in inputs and v not in seen:
                seen.add(v)
                found.append(v)
    return found



def draws_random(eqn) -> bool:
    """Whether an equation (or a jaxpr inside it) draws random numbers."""
    return eqn.primitive.name in RANDOM or any(
        any_eqn(sub, lambda e: e.primitive.name in RANDOM) for sub in sub_jaxprs(eqn))


def dependents(eqns, seeds: set) -> set:
    """Variables computed (transitively) from ``seeds`` by ``eqns``."""
    out = set(seeds)
    for e in eqns:
        if any(isinstance(v, _compat.Var) and v in out for v in e.invars):
            out.update(e.outvars)
    return out


def used_vars(eqns) -> set:
    return {v for e in eqns for v in e.invars if isinstance(v, _compat.Var)}


# Evaluation ------------------------------------------------------------------------------------
class Env(Walker):
    """Values of jaxpr variables while re-evaluating equations one by one (calls, loops and
    identities are bound as they are)."""

    inline_calls = False
    forward_identities = False

    def __init__(self):
        self.values: dict = {}
        self._on_eqn: Callable | None = None

    def read(self, v):
        return self.lookup(self.values, v)

    def write(self, v, value):
        if not isinstance(v, _compat.DropVar):
            self.values[v] = value

    def equation(self, eqn, ins, path):
        outs = _compat.bind_eqn(eqn, ins)
        return outs if self._on_eqn is None else self._on_eqn(eqn, outs)

    def run(self, eqns, on_eqn: Callable | None = None):
        """Evaluate ``eqns`` on ``values``; ``on_eqn(eqn, outs)`` may replace the outputs."""
        self._on_eqn = on_eqn
        try:
            self.run_eqns(eqns, self.values)
        finally:
            self._on_eqn = None
