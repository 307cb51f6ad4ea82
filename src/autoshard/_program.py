"""Program: a traced step with everything a method needs to plan it."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from . import combine
from .grad_accum import StepHooks, build_step
from .ir._jaxpr import FlatArgs, differentiated_inputs, output_paths


@dataclass(frozen=True, eq=False)
class Program:
    """A traced step plus its roles: batch inputs, donated state, parameters, aliases."""

    closed: Any
    """ClosedJaxpr of the user's step (batch inputs have micro-batch shape when accumulating)."""
    in_avals: tuple[jax.ShapeDtypeStruct, ...]
    """Full-batch abstract inputs, one per array leaf."""
    out_avals: tuple[jax.ShapeDtypeStruct, ...]
    """Abstract outputs, one per leaf."""
    in_paths: tuple[str, ...]
    """Readable input leaf paths."""
    out_paths: tuple[str, ...]
    """Readable output leaf paths."""
    batch_invars: tuple[bool, ...]
    """Inputs that are batch arguments (split on dim 0)."""
    donated_invars: tuple[bool, ...]
    """Inputs whose buffers are donated."""
    param_invars: tuple[bool, ...]
    """Inputs that autoshard.grad differentiates: the model parameters, found by structure."""
    aliases: tuple[tuple[int, int], ...]
    """(input, output) leaf pairs where the output replaces the input (state; same spec)."""
    num_micro_batches: int
    """Micro-batches for gradient accumulation."""
    args_shape: Any = None
    """The positional arguments with array leaves as ShapeDtypeStruct and the rest as None."""
    out_shape: Any = None
    """The output pytree with ShapeDtypeStruct leaves."""
    flat_fun: Callable | None = None
    """The user's step as a function of the array leaves (None where not traced here)."""

    def step(self, hooks: StepHooks | None = None) -> Callable:
        return build_step(self.closed, batch_invars=self.batch_invars,
                          num_micro_batches=self.num_micro_batches, hooks=hooks or StepHooks(),
                          whole_batch=self.whole_batch_closed if self.flat_fun else None,
                          batch_paths=[p for p, b in zip(self.in_paths, self.batch_invars,
                                                         strict=True) if b])

    @functools.cached_property
    def has_grad_marker(self) -> bool:
        from .ir._jaxpr import grad_marker_index
        return grad_marker_index(self.closed.jaxpr) is not None

    def whole_batch_closed(self):
        """The user's step traced on the full-batch inputs, without accumulation (``closed``
        itself when ``num_micro_batches`` is 1)."""
        if self.num_micro_batches == 1:
            return self.closed
        if "_whole" not in self.__dict__:
            if self.flat_fun is None:
                raise ValueError("This Program was built without its function; trace it with "
                                 "trace_program to re-trace it on the full batch.")
            self.__dict__["_whole"] = jax.make_jaxpr(self.flat_fun)(*self.in_avals)
        return self.__dict__["_whole"]

    def scaled_batch_closed(self) -> tuple[Any, int] | None:
        """(the user's step traced on more rows, how many times more): the whole batch when
        ``num_micro_batches`` is above 1, else twice the batch. Paired with ``closed``, it
        tells which dim of each value holds the rows (``after_grad.row_dims``). None, once
        and for all, where the step was built without its function or does not trace on
        other rows (a "batch" argument that is not one)."""
        if "_scaled" not in self.__dict__:
            self.__dict__["_scaled"] = self._scaled_batch() if self.flat_fun else None
        return self.__dict__["_scaled"]

    def _scaled_batch(self):
        k = self.num_micro_batches
        # the rows: the dim 0 most batch leaves share (a key carried in the batch is not)
        sizes = [a.shape[0] for a, b in zip(self.in_avals, self.batch_invars, strict=True)
                 if b and a.shape]
        rows = max(set(sizes), key=sizes.count) if sizes else None
        avals = [jax.ShapeDtypeStruct((2 * a.shape[0],) + tuple(a.shape[1:]), a.dtype,
                                      weak_type=a.weak_type)
                 if b and a.shape and a.shape[0] == rows else a
                 for a, b in zip(self.in_avals, self.batch_invars, strict=True)]
        try:
            return (self.whole_batch_closed(), k) if k > 1 else (
                jax.make_jaxpr(self.flat_fun)(*avals), 2)
        except Exception:  # noqa: BLE001 - the step's code depends on the batch size
            return None

    def full_jaxpr(self):
        """The whole step (accumulation included) as one ClosedJaxpr on full-batch inputs."""
        if "_full" not in self.__dict__:
            self.__dict__["_full"] = jax.make_jaxpr(self.step())(*self.in_avals)
        return self.__dict__["_full"]


def trace_program(fun: Callable, args: tuple, flat: FlatArgs, *, batch_argnums: Sequence[int],
                  donate_argnums, num_micro_batches: int, name: str = "the function"
                  ) -> tuple[Program, Any]:
    """Trace ``fun`` on abstract values of ``flat``; return the Program and the output treedef."""
    _check_batch_argnums(args, flat, batch_argnums)
    k = num_micro_batches
    batch_invars = tuple(a in batch_argnums for a in flat.leaf_argnum)
    in_avals = flat.avals()
    trace_avals = _micro_batch_avals(
        in_avals, batch_invars, flat.paths, k,
        f"(batch_argnums={tuple(batch_argnums)}). Choose a divisor of {{size}} or change "
        "batch_argnums.")
    shape_only = flat.abstract()  # the re-traceable function keeps no user array alive

    def flat_fun(*dynamic):
        return fun(*shape_only.rebuild(dynamic))

    closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*trace_avals)
    out_leaves, out_tree = jax.tree.flatten(out_shape)
    out_avals = tuple(jax.ShapeDtypeStruct(o.shape, o.dtype) for o in out_leaves)
    state_args = set(flat.leaf_argnum) - set(batch_argnums)
    aliases = _aliases(args, flat, out_shape, state_args)
    closed = _resolve(closed, flat_fun, in_avals, batch_invars, k, aliases, out_shape)
    donated = _donated_args(args, flat, donate_argnums, batch_argnums, name)
    donated_invars = tuple(a in donated for a in flat.leaf_argnum)
    program = Program(
        closed=closed, in_avals=in_avals, out_avals=out_avals, in_paths=flat.paths,
        out_paths=tuple(output_paths(out_shape)), batch_invars=batch_invars,
        donated_invars=donated_invars, param_invars=_param_invars(closed.jaxpr),
        aliases=aliases, num_micro_batches=k, args_shape=_args_shape(flat, in_avals),
        out_shape=out_shape, flat_fun=flat_fun)
    return program, out_tree


def with_micro_batches(program: Program, k: int, fix: str) -> Program:
    """``program``'s step traced again for ``k`` micro-batches: the same function, inputs,
    roles and aliases (``program`` itself when it has ``k``). ``fix`` ends the error raised
    when ``k`` does not divide a batch input's rows (``{size}``: those rows)."""
    if k == program.num_micro_batches:
        return program
    if program.flat_fun is None:
        raise ValueError("This Program was built without its function; trace it with "
                         "trace_program to change its micro-batches.")
    trace_avals = _micro_batch_avals(program.in_avals, program.batch_invars, program.in_paths,
                                     k, fix)
    closed, out_shape = jax.make_jaxpr(program.flat_fun, return_shape=True)(*trace_avals)
    closed = _resolve(closed, program.flat_fun, program.in_avals, program.batch_invars, k,
                      program.aliases, out_shape)
    out = dataclasses.replace(program, closed=closed, num_micro_batches=k,
                              param_invars=_param_invars(closed.jaxpr), out_shape=out_shape)
    if "_whole" in program.__dict__:  # the step on the whole batch does not depend on k
        out.__dict__["_whole"] = program.__dict__["_whole"]
    return out


def _micro_batch_avals(in_avals, batch_invars, paths, k: int, fix: str) -> list:
    """The inputs of one micro-batch: batch inputs' rows divided by ``k``."""
    out = []
    for aval, b, path in zip(in_avals, batch_invars, paths, strict=True):
        if b and k > 1:
            if not aval.shape or aval.shape[0] % k:
                size = aval.shape[0] if aval.shape else "scalar"
                raise ValueError(f"num_micro_batches ({k}) must divide the batch size ({size}) "
                                 f"of {path} " + fix.format(size=size))
            aval = jax.ShapeDtypeStruct((aval.shape[0] // k,) + aval.shape[1:], aval.dtype,
                                        weak_type=aval.weak_type)
        out.append(aval)
    return out


def _resolve(closed, flat_fun, in_avals, batch_invars, k, aliases, out_shape):
    """``closed`` with its "auto" aux reductions made what each value needs (before any
    method plans it)."""
    return combine.resolve(
        closed, batch_invars=batch_invars, num_micro_batches=k, aliases=aliases,
        whole_batch=lambda: jax.make_jaxpr(flat_fun)(*in_avals),
        out_paths=tuple(output_paths(out_shape)))


def _check_batch_argnums(args, flat: FlatArgs, batch_argnums):
    for b in batch_argnums:
        if not isinstance(b, int) or not -len(args) <= b < len(args):
            raise ValueError(
                f"batch_argnums ({tuple(batch_argnums)}) names argument {b!r}, but the function "
                f"was called with {len(args)} positional argument(s). Use indices in "
                f"range(0, {len(args)}), or batch_argnums=() when there is no batch.")
        if b not in flat.leaf_argnum and not (
                isinstance(args[b], dict | list | tuple) and not _holds_array(args[b])):
            raise ValueError(
                f"batch_argnums ({tuple(batch_argnums)}) names argument {b}, which holds no "
                f"array (got {type(args[b]).__name__}). A batch argument must be an array or a "
                "pytree of arrays split on dim 0; fix batch_argnums.")


def _holds_array(tree) -> bool:
    """Whether a pytree has an array leaf (an empty dict of rngs, say, has none: it is a batch
    argument with nothing to split, as Alpa accepts)."""
    return any(hasattr(x, "shape") and hasattr(x, "dtype") for x in jax.tree.leaves(tree))


# Train states: what donate_argnums="auto" donates -------------------------------------------------
_STATE_TYPES: list[type] = []


def register_state_type(cls: type) -> type:
    """Make ``donate_argnums="auto"`` donate arguments of type ``cls`` (usable as a decorator).

    flax's ``TrainState`` (and its subclasses) is donated without registration.
    """
    if not isinstance(cls, type):
        raise TypeError(f"register_state_type expects a class, got {cls!r}.")
    if cls not in _STATE_TYPES:
        _STATE_TYPES.append(cls)
    return cls


def is_train_state(x) -> bool:
    if isinstance(x, tuple(_STATE_TYPES)):
        return True
    try:
        from flax.training.train_state import TrainState
    except ImportError:
        return False
    return isinstance(x, TrainState)


def _donated_args(args, flat: FlatArgs, donate_argnums, batch_argnums, name) -> set[int]:
    if donate_argnums == "auto":
        return {i for i in set(flat.leaf_argnum) - set(batch_argnums) if is_train_state(args[i])}
    nums = tuple(donate_argnums)
    for i in nums:
        if not 0 <= i < len(args):
            raise ValueError(
                f"donate_argnums ({nums}) names argument {i}, but {name} was called with "
                f"{len(args)} positional arguments. Use indices below {len(args)}, 'auto' or ().")
    return {i for i in nums if i in flat.leaf_argnum}


def _aliases(args, flat: FlatArgs, out_shape, candidates: set[int]):
    """Pair each state argument with an output of the same structure and leaf types."""
    outs = list(out_shape) if isinstance(out_shape, tuple | list) else [out_shape]
    out_offsets, offset = [], 0
    for o in outs:
        out_offsets.append(offset)
        offset += len(jax.tree.leaves(o))
    if not isinstance(out_shape, tuple | list):
        out_offsets = [0]
    taken, pairs = set(), []
    for i in sorted(candidates):
        in_idx = [j for j, a in enumerate(flat.leaf_argnum) if a == i]
        sig = (jax.tree.structure(args[i]),
               tuple((tuple(flat.dynamic_leaves[j].shape), str(flat.dynamic_leaves[j].dtype))
                     for j in in_idx))
        for n, o in enumerate(outs):
            if n in taken or _signature(o) != sig or not in_idx:
                continue
            taken.add(n)
            pairs += [(j, out_offsets[n] + m) for m, j in enumerate(in_idx)]
            break
    return tuple(pairs)


def _signature(tree):
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x))))
                          for x in leaves)


def _param_invars(jaxpr) -> tuple[bool, ...]:
    """Inputs that autoshard.grad differentiates (its parameter marker), found by structure."""
    found = set(differentiated_inputs(jaxpr))  # once: a set built per input was quadratic
    return tuple(v in found for v in jaxpr.invars)


def _args_shape(flat: FlatArgs, in_avals):
    it = iter(in_avals)
    leaves = [next(it) if d else None for d in flat.is_dynamic]
    return jax.tree.unflatten(flat.treedef, leaves)
