"""``autoshard.custom_partitioning``: tell the partitioner how a hand-written operation shards.

An FFT, a fused attention kernel or a custom reduction is opaque to XLA, which then gathers
its operands on every device. ``custom_partitioning`` has the signature of
``jax.experimental.custom_partitioning`` and builds on it (the XLA partitioner callbacks stay
JAX's), and closes its gaps::

    @autoshard.custom_partitioning
    def my_fft(x):
        return jnp.fft.fft(x)

    my_fft.def_partition(partition, infer_sharding_from_operands=infer,
                         sharding_rule="... i -> ... i", need_replication_factors=("i",))
    my_fft.def_vjp(fwd, bwd)            # jax.grad; bwd may itself be custom-partitioned

* Both rule forms work under either partitioner: a ``sharding_rule`` (einsum-like string or
  ``SdyShardingRule``) also gives GSPMD an ``infer_sharding_from_operands``, and an
  ``infer_sharding_from_operands`` alone gives Shardy a rule, found by probing the callback one
  operand dim at a time (a dim whose split reaches no result is kept whole).
* ``jax.grad`` uses the backward given by ``def_vjp(fwd, bwd)``: ``fwd(*args) -> (out, res)``,
  ``bwd(*static_args, res, out_cotangent) -> one cotangent per non-static argument``.
* ``jax.vmap`` works when every operand and result of the rule starts with ``...``: the
  vmapped dim joins the batching dims (unbatched operands are broadcast).
* ``autoshard.parallelize(..., method=ShardParallel())`` plans through the operation: each
  factor of its rule may be split on a mesh axis (a split reduction factor costs an
  all-reduce; need-replication factors are never split), so the chosen plan keeps operands
  split instead of gathering them.
* ``static_argnums`` as in JAX: arguments are bound to ``fun``'s signature with its defaults
  filled in (so a static argument may be left to its default), and the static values reach the
  callbacks in the order ``static_argnums`` lists them.
* Inside a ``shard_map`` that is manual over every mesh axis, the operation runs ``fun`` on the
  local block and its rule is not applied (as JAX lowers it there).
* A ``lower_fn`` that returns the wrong per-shard shape raises JAX's ``"Mismatch in result
  shapes."`` with the operation, the shardings and both shapes; rule strings that do not parse
  point at the bad character.
* An exception raised in ``partition``, ``infer_sharding_from_operands`` or
  ``propagate_user_sharding`` while XLA compiles reaches the caller of ``jax.jit`` as itself,
  raised from the ``JaxRuntimeError`` XLA makes of it. This is the one hook the module installs
  (``_cp_errors``): a handler of JAX's compilation errors, registered on the first call of a
  custom-partitioned operation, that only replaces errors carrying an exception one of these
  callbacks raised.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from ._cp_errors import raised_in_xla, register_handler, surfaced
from ._cp_rules import (
    FactorRule,
    from_sdy,
    infer_from_rule,
    parse_rule,
    probe_rule,
    resolve,
    to_sdy,
)
from .ir._compat import cp_rule_types, is_tracer, uses_shardy


@dataclass(frozen=True, kw_only=True)
class _Definition:
    """What ``def_partition`` was given, normalised."""

    partition: Callable
    """``partition(*static_args, mesh, arg_shapes, result_shape)``."""
    infer: Callable | None
    """``infer_sharding_from_operands(*static_args, mesh, arg_shapes, result_shape)``."""
    propagate: Callable | None
    """``propagate_user_sharding(*static_args, mesh, user_shape)``."""
    decode_shardings: bool
    """Hand the callbacks NamedShardings (JAX's ``decode_shardings``)."""
    rule: FactorRule | None
    """The sharding rule as data (None without one, or when it is a callable)."""
    rule_fn: Callable | None
    """A callable ``sharding_rule(*static_args, mesh, operand_types, result_types)``."""


@dataclass(frozen=True, eq=False)
class BoundOp:
    """One call of a custom-partitioned operation: its callbacks with the static args bound.

    JAX receives it as the ``partition`` parameter of its ``custom_partitioning`` equation, so
    the planner finds the rule and the callbacks on the equation.
    """

    name: str
    definition: _Definition
    static_args: tuple
    in_avals: tuple
    in_tree: Any
    out: dict = field(default_factory=dict)
    """``avals`` and ``tree`` of the results, filled while JAX traces the operation."""

    def __repr__(self) -> str:  # part of the planner's cache key: stable, no ids
        return f"autoshard.custom_partitioning({self.name}, static_args={self.static_args!r})"

    @surfaced
    def __call__(self, mesh, arg_shapes, result_shape):
        got = self.definition.partition(*self.static_args, mesh, arg_shapes, result_shape)
        if not (isinstance(got, (tuple, list)) and len(got) == 4):
            raise ValueError(
                f"partition of custom_partitioning {self.name!r} returned {type(got).__name__}; "
                "it must return (mesh, lower_fn, result_shardings, arg_shardings).")
        p_mesh, lower_fn, result_shardings, arg_shardings = got
        outs = jax.tree.leaves(result_shape)
        shardings = jax.tree.leaves(result_shardings)
        expected = [_shard_aval(s, o) for s, o in zip(shardings, outs, strict=False)]

        def checked_lower_fn(*xs):
            try:
                y = lower_fn(*xs)
            except Exception as exc:
                raised_in_xla(exc)
                raise
            actual = [_short(jnp.shape(leaf), jnp.result_type(leaf))
                      for leaf in jax.tree.leaves(y)]
            if None not in expected and actual != expected:
                specs = ", ".join(str(getattr(s, "spec", s)) for s in shardings)
                message = (
                    f"Mismatch in result shapes. custom_partitioning {self.name!r}: lower_fn "
                    f"returned per-shard results [{', '.join(actual)}], but the result "
                    f"shardings [{specs}] that partition returned make the global results "
                    f"[{', '.join(_short(o.shape, o.dtype) for o in outs)}] per-shard results "
                    f"[{', '.join(expected)}]. lower_fn runs on one shard: return arrays of the "
                    "per-shard shape, or make partition return result shardings that match what "
                    "lower_fn computes.")
                raised_in_xla(ValueError(message))  # unraised: no notes, no frames
                raise ValueError(message)
            return y

        return p_mesh, checked_lower_fn, result_shardings, arg_shardings

    @surfaced
    def infer(self, mesh, arg_shapes, result_shape):
        d = self.definition
        if d.infer is not None:
            return d.infer(*self.static_args, mesh, arg_shapes, result_shape)
        if d.rule is not None:
            return infer_from_rule(d.rule, self.name, mesh, arg_shapes, result_shape)
        return jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), result_shape)

    @surfaced
    def propagate(self, mesh, user_shape):
        return self.definition.propagate(*self.static_args, mesh, user_shape)

    def sdy_rule(self, mesh, operand_types, result_types):
        """The rule JAX hands Shardy; probed from ``infer`` when no rule was given."""
        d = self.definition
        if d.rule_fn is not None:
            return d.rule_fn(*self.static_args, mesh, operand_types, result_types)
        rule = self.planner_rule(mesh)
        assert rule is not None, "lowered before tracing filled self.out"
        return to_sdy(rule)

    def jax_rule(self):
        d = self.definition
        if d.rule is not None:
            return to_sdy(d.rule)
        if d.rule_fn is not None or d.infer is not None:
            return self.sdy_rule
        return None

    def planner_rule(self, mesh) -> FactorRule | None:
        """The rule the planner costs: the given one, else probed from ``infer``, else None."""
        d = self.definition
        if d.rule is not None:
            return d.rule
        if d.infer is None or not self.out:
            return None
        return probe_rule(d.infer, self.static_args, mesh, self.in_avals, self.in_tree,
                          self.out["avals"], self.out["tree"])


def _short(shape, dtype) -> str:
    return f"{jnp.dtype(dtype).name}[{','.join(map(str, shape))}]"


def _shard_aval(sharding, aval) -> str | None:
    """The per-shard shape and dtype of ``aval`` under ``sharding`` (None when unknown)."""
    shape = tuple(aval.shape)
    if isinstance(sharding, NamedSharding):  # uneven splits round up, as XLA's tiles do
        mesh_shape = dict(sharding.mesh.shape)
        spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
        per = []
        for size, entry in zip(shape, spec, strict=False):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            per.append(-(-size // math.prod(mesh_shape[a] for a in axes)))
        return _short(per, aval.dtype)
    try:
        return _short(sharding.shard_shape(shape), aval.dtype)
    except Exception:  # noqa: BLE001 -- a sharding we cannot tile: JAX's own check still runs
        return None


class custom_partitioning:  # noqa: N801  (the name of jax.experimental.custom_partitioning)
    """A function with user-given partitioning: ``def_partition``, ``def_vjp``; see the module."""

    def __init__(self, fun: Callable, static_argnums: int | tuple[int, ...] = ()):
        if not callable(fun):
            raise TypeError(f"custom_partitioning needs a function, got {type(fun).__name__}.")
        nums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
        if not all(isinstance(i, int) and i >= 0 for i in nums):
            raise TypeError(f"static_argnums ({static_argnums!r}) must be non-negative ints, "
                            "the positions of the static arguments.")
        self.fun = fun
        self.static_argnums = nums  # JAX's order: the callbacks get the static args in it
        self._definition: _Definition | None = None
        self._vjp: tuple[Callable, Callable] | None = None
        self.__name__ = getattr(fun, "__name__", "custom_partitioning")
        functools.update_wrapper(self, fun)

    def def_partition(self, partition: Callable,
                      infer_sharding_from_operands: Callable | None = None,
                      propagate_user_sharding: Callable | None = None,
                      decode_shardings: bool = True, sharding_rule=None, **rule_kwargs):
        """Give the per-shard lowering and how the operation shards (JAX's signature)."""
        for what, fn in (("partition", partition),
                         ("infer_sharding_from_operands", infer_sharding_from_operands),
                         ("propagate_user_sharding", propagate_user_sharding)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{what} of custom_partitioning {self.__name__!r} must be "
                                f"callable, got {type(fn).__name__}.")
        if partition is None:
            raise TypeError(f"custom_partitioning {self.__name__!r}: partition is required "
                            "(it returns mesh, lower_fn, result_shardings, arg_shardings).")
        rule, rule_fn = None, None
        if isinstance(sharding_rule, str):
            rule = parse_rule(sharding_rule, **rule_kwargs)
        elif rule_kwargs:
            raise TypeError(
                f"custom_partitioning {self.__name__!r}: {sorted(rule_kwargs)} only go with a "
                "string sharding_rule; put them into the SdyShardingRule or drop them.")
        elif isinstance(sharding_rule, cp_rule_types().SdyShardingRule):
            rule = from_sdy(sharding_rule)
        elif callable(sharding_rule):
            rule_fn = sharding_rule
        elif sharding_rule is not None:
            raise TypeError(
                f"sharding_rule of custom_partitioning {self.__name__!r} must be an einsum-like "
                f"str, an SdyShardingRule or a callable, got {type(sharding_rule).__name__}.")
        self._definition = _Definition(
            partition=partition, infer=infer_sharding_from_operands,
            propagate=propagate_user_sharding, decode_shardings=bool(decode_shardings),
            rule=rule, rule_fn=rule_fn)
        return partition

    def def_vjp(self, fwd: Callable, bwd: Callable):
        """``fwd(*args) -> (out, res)``; ``bwd(*static_args, res, g) -> cotangents``."""
        if not (callable(fwd) and callable(bwd)):
            raise TypeError(f"def_vjp of custom_partitioning {self.__name__!r} needs two "
                            f"functions, got {type(fwd).__name__} and {type(bwd).__name__}.")
        self._vjp = (fwd, bwd)
        return fwd

    def __call__(self, *args, **kwargs):
        name = self.__name__
        if self._definition is None:
            raise TypeError(f"custom_partitioning {name!r} has no partitioning yet: call "
                            f"{name}.def_partition(partition, ...) before calling {name}.")
        args = _positional(self.fun, args, kwargs)
        for i in self.static_argnums:
            if i >= len(args):
                raise ValueError(
                    f"static_argnums ({self.static_argnums}) names argument {i}, but {name} got "
                    f"{len(args)} arguments (with its defaults filled in). Pass argument {i}, "
                    f"give it a default in {name}'s signature, or drop it from static_argnums.")
            if any(is_tracer(x) for x in jax.tree.leaves(args[i])):
                raise jax.errors.UnexpectedTracerError(
                    f"argument {i} of custom_partitioning {name!r} is static (static_argnums="
                    f"{self.static_argnums}) but is a tracer; pass a Python value, or drop it "
                    "from static_argnums.")
        static = tuple(args[i] for i in self.static_argnums)
        dyn_pos = [i for i in range(len(args)) if i not in self.static_argnums]

        def full(dyn):
            merged = list(args)
            for i, x in zip(dyn_pos, dyn, strict=True):
                merged[i] = x
            return merged

        @custom_vmap
        def primal(*dyn):
            return self._bind(static, full, dyn)

        primal.def_vmap(functools.partial(self._vmap_rule, primal))
        diff = jax.custom_vjp(primal)
        diff.defvjp(lambda *dyn: self._fwd(full(dyn)),
                    lambda res, g: self._bwd(static, len(dyn_pos), res, g))
        return diff(*(args[i] for i in dyn_pos))

    def _bind(self, static, full, dyn):
        register_handler()
        flat, in_tree = jax.tree.flatten(tuple(dyn))
        bound = BoundOp(self.__name__, self._definition, static,
                        tuple(jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
                              for x in flat), in_tree)

        def traced(*dyn_args):
            out = self.fun(*full(dyn_args))
            leaves, tree = jax.tree.flatten(out)
            bound.out.update(tree=tree, avals=tuple(
                jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in leaves))
            return out

        traced.__name__ = self.__name__
        d = self._definition
        op = cp_rule_types().custom_partitioning(traced)
        # Without any rule or callback, Shardy keeps the operand shardings and GSPMD needs an
        # infer callback (it crashes without one): hand it "replicated results".
        given = d.rule is not None or d.infer is not None or not uses_shardy()
        op.def_partition(bound, infer_sharding_from_operands=bound.infer if given else None,
                         propagate_user_sharding=bound.propagate if d.propagate else None,
                         decode_shardings=d.decode_shardings, sharding_rule=bound.jax_rule())
        out = op(*dyn)
        # A rule that does not fit the shapes fails here, not in XLA. Inside a shard_map manual
        # over every axis JAX lowers fun on the local block and never reads the rule.
        if d.rule is not None and not _in_fully_manual_shard_map():
            resolve(d.rule, [a.shape for a in bound.in_avals],
                    [a.shape for a in bound.out["avals"]], self.__name__)
        return out

    def _vmap_rule(self, primal, axis_size, in_batched, *dyn):
        rule = self._definition.rule
        if rule is None or not rule.all_batched():
            have = f"'{rule}'" if rule is not None else "none (or a callable)"
            raise ValueError(
                f"jax.vmap of custom_partitioning {self.__name__!r} needs a sharding_rule whose "
                f"operands and results all start with '...' (the vmapped dim joins them); the "
                f"rule is {have}. Give def_partition(..., sharding_rule='... i -> ... i') with "
                "partition and lower_fn accepting any number of leading dims.")
        flags = jax.tree.leaves(in_batched)
        flat, tree = jax.tree.flatten(dyn)
        flat = [x if b else jnp.broadcast_to(x, (axis_size,) + jnp.shape(x))
                for x, b in zip(flat, flags, strict=True)]
        out = primal(*jax.tree.unflatten(tree, flat))
        return out, jax.tree.map(lambda _: True, out)

    def _fwd(self, args):
        if self._vjp is None:
            raise TypeError(
                f"jax.grad reached custom_partitioning {self.__name__!r}, which has no backward. "
                f"Give one with {self.__name__}.def_vjp(fwd, bwd): fwd(*args) -> (out, "
                "residuals), bwd(*static_args, residuals, out_cotangent) -> a tuple with one "
                "cotangent per non-static argument; bwd may itself use custom_partitioning.")
        return self._vjp[0](*args)

    def _bwd(self, static, num_dyn, res, g):
        cts = self._vjp[1](*static, res, g)
        cts = tuple(cts) if isinstance(cts, (tuple, list)) else (cts,)
        if len(cts) != num_dyn:
            raise ValueError(
                f"bwd of custom_partitioning {self.__name__!r} returned {len(cts)} cotangents; it "
                f"must return one per non-static argument ({num_dyn}).")
        return cts


def _in_fully_manual_shard_map() -> bool:
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and all(t == AxisType.Manual for t in mesh.axis_types)


def _positional(fun, args, kwargs) -> tuple:
    """All arguments by position, defaults filled in (JAX's custom_partitioning binds them so)."""
    try:
        signature = inspect.signature(fun)
    except (TypeError, ValueError):  # a callable without a signature: take the call as it is
        if kwargs:
            raise TypeError(f"custom_partitioning {getattr(fun, '__name__', fun)!r}: keyword "
                            f"arguments {sorted(kwargs)} cannot be matched to positions (the "
                            "function has no signature); pass them positionally.") from None
        return tuple(args)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    passed = sorted(k for k in bound.kwargs if k in kwargs)  # keyword-only ones left unset keep
    if passed:                                               # fun's defaults
        raise TypeError(f"custom_partitioning {fun.__name__!r}: keyword-only arguments "
                        f"{passed} cannot be passed; make them positional.")
    return tuple(bound.args)
