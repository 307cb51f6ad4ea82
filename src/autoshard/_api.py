"""Front end: init/shutdown, ``parallelize``, ParallelizedFunc and Executable, the cache."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, overload

import jax
import numpy as np
from jax.sharding import NamedSharding

from . import _compat
from ._config import CLUSTERS, Cluster, required_cluster
from ._jaxpr import FlatArgs, flatten_args
from ._methods import ParallelMethod, ShardParallel
from ._program import Program, trace_program
from .sharding.plan import ShardingPlan

_state: dict[str, Any] = {"cluster": None}
_all_funcs: weakref.WeakSet = weakref.WeakSet()


# init / shutdown -------------------------------------------------------------------------------
def init(cluster: Cluster = "local", **kwargs) -> None:
    """Join a cluster. Idempotent; ``local`` needs no call (it happens implicitly).

    ``distributed`` calls ``jax.distributed.initialize(**kwargs)`` (coordinator address, process
    count and id from kwargs or the environment); ``ray`` connects to a Ray cluster first.
    """
    if cluster not in CLUSTERS:
        raise ValueError(f"cluster ({cluster!r}) must be one of {CLUSTERS}.")
    current = _state["cluster"]
    if current == cluster:
        return
    if current is not None and current != "local":
        raise RuntimeError(
            f"autoshard is already initialized with cluster={current!r}; call "
            "autoshard.shutdown() before init(cluster={cluster!r}).")
    if cluster == "distributed":
        jax.distributed.initialize(**kwargs)
    elif cluster == "ray":
        try:
            import ray
        except ImportError:
            raise ImportError(
                "init(cluster='ray') needs Ray: pip install 'ray[default]'.") from None
        if not ray.is_initialized():
            ray.init(**kwargs)
        jax.distributed.initialize()
    _state["cluster"] = cluster


def shutdown() -> None:
    """Leave the cluster and drop compiled executables."""
    cluster = _state["cluster"]
    clear_executable_cache()
    if cluster in ("distributed", "ray"):
        jax.distributed.shutdown()
    _state["cluster"] = None


def _ensure_init():
    if _state["cluster"] is not None:
        return
    wanted = required_cluster()
    if wanted != "local":
        raise RuntimeError(
            f"This process was launched for cluster={wanted!r} (AUTOSHARD_CLUSTER), but "
            f"autoshard.init(cluster={wanted!r}) was not called. Call it before the first "
            "parallelized function runs.")
    init("local")


def clear_executable_cache() -> None:
    """Forget every compiled executable; the next call of each function traces again."""
    for f in list(_all_funcs):
        f._cache.clear()
        f._last = None


# parallelize -----------------------------------------------------------------------------------
@overload
def parallelize(fun: Callable, *, static_argnums="auto", donate_argnums="auto",
                batch_argnums=(1,), method: ParallelMethod | None = None) -> ParallelizedFunc: ...
@overload
def parallelize(fun: None = None, *, static_argnums="auto", donate_argnums="auto",
                batch_argnums=(1,), method: ParallelMethod | None = None
                ) -> Callable[[Callable], ParallelizedFunc]: ...
def parallelize(fun=None, *, static_argnums: str | Sequence[int] = "auto",
                donate_argnums: str | Sequence[int] = "auto",
                batch_argnums: Sequence[int] = (1,), method: ParallelMethod | None = None):
    """Make ``fun`` run on many devices; ``method`` decides how (default ``ShardParallel()``)."""
    def wrap(f):
        return ParallelizedFunc(f, static_argnums=static_argnums, donate_argnums=donate_argnums,
                                batch_argnums=batch_argnums, method=method)
    return wrap if fun is None else wrap(fun)


def _argnums(value, name: str):
    if value == "auto":
        return "auto"
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, Sequence) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    raise TypeError(f"{name} ({value!r}) must be 'auto', an int or a sequence of ints.")


class ParallelizedFunc:
    """The result of ``parallelize``: call it like the original function."""

    def __init__(self, fun, *, static_argnums, donate_argnums, batch_argnums, method):
        if not callable(fun):
            raise TypeError(f"parallelize expects a function, got {fun!r}.")
        if method is None:
            method = ShardParallel()
        if not isinstance(method, ParallelMethod):
            raise TypeError(
                f"method ({method!r}) must be a ParallelMethod such as autoshard.ShardParallel(), "
                "DataParallel(), Zero2Parallel() or Zero3Parallel().")
        self.fun = fun
        self.method = method
        self.static_argnums = _argnums(static_argnums, "static_argnums")
        self.donate_argnums = _argnums(donate_argnums, "donate_argnums")
        batch = _argnums(batch_argnums, "batch_argnums")
        if batch == "auto":
            raise TypeError("batch_argnums must be a sequence of ints, e.g. (1,); not 'auto'.")
        self.batch_argnums = batch
        self._cache: dict = {}
        self._last: Executable | None = None
        _all_funcs.add(self)
        self.__wrapped__ = fun
        self.__name__ = getattr(fun, "__name__", "parallelized")

    def __call__(self, *args, **kwargs):
        executable = self.get_executable(*args, **kwargs)
        return executable(*args)

    def get_executable(self, *args, **kwargs) -> Executable:
        """The compiled executable for these arguments (traced and planned on first use)."""
        if kwargs:
            raise TypeError(
                f"{self.__name__} was called with keyword argument(s) {sorted(kwargs)}; "
                "parallelized functions take positional arguments only. Pass them positionally.")
        _ensure_init()
        static = () if self.static_argnums == "auto" else self.static_argnums
        for i in static:
            if not -len(args) <= i < len(args):
                raise ValueError(
                    f"static_argnums ({self.static_argnums}) names argument {i}, but "
                    f"{len(args)} positional arguments were given.")
        static = tuple(i % len(args) for i in static)
        flat = flatten_args(args, static)
        for x, path in zip(flat.dynamic_leaves, flat.paths, strict=True):
            if _compat.is_tracer(x):
                raise TypeError(
                    f"{path} is a tracer: parallelized functions run compiled executables and "
                    "cannot be called inside jax.jit, grad or vmap. Call them on concrete "
                    "arrays, or mark the argument static with static_argnums if it is a "
                    "Python value.")
        batch = tuple(b % len(args) if -len(args) <= b < len(args) else b
                      for b in self.batch_argnums)
        key = flat.key()
        executable = self._cache.get(key)
        if executable is None:
            executable = self._compile(args, flat, batch, static)
            self._cache[key] = executable
        self._last = executable
        return executable

    def preshard_dynamic_args(self, *args):
        """The arguments with every array already placed where the executable wants it."""
        executable = self.get_executable(*args)
        flat = flatten_args(args, executable.static_argnums)
        placed = [jax.device_put(x, s) for x, s in
                  zip(flat.dynamic_leaves, executable.in_shardings, strict=True)]
        return flat.rebuild(placed)

    def get_last_executable(self) -> Executable | None:
        """The executable of the latest call, or None before the first call."""
        return self._last

    def _compile(self, args, flat: FlatArgs, batch_argnums, static_argnums) -> Executable:
        t0 = time.perf_counter()
        program, out_tree = trace_program(
            self.fun, args, flat, batch_argnums=batch_argnums,
            donate_argnums=self.donate_argnums,
            num_micro_batches=self.method.micro_batches)
        t1 = time.perf_counter()
        compiled = self.method.compile(program)
        t2 = time.perf_counter()
        mesh, plan = compiled.mesh, compiled.plan
        in_shardings = tuple(NamedSharding(mesh, leaf.spec) for leaf in plan.inputs)
        out_shardings = tuple(NamedSharding(mesh, leaf.spec) for leaf in plan.outputs)
        donate = tuple(i for i, d in enumerate(program.donated_invars) if d)
        abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                    for a, s in zip(program.in_avals, in_shardings, strict=True)]
        fn = compiled.fn
        jitted = jax.jit(lambda *a: tuple(fn(*a)), in_shardings=in_shardings, out_shardings=out_shardings,
                         donate_argnums=donate)
        lowered = jitted.lower(*abstract)
        t3 = time.perf_counter()
        xla = lowered.compile()
        t4 = time.perf_counter()
        timings = {"trace_s": t1 - t0, "planning_s": t2 - t1, "lowering_s": t3 - t2,
                   "compile_s": t4 - t3}
        return Executable(xla, plan, mesh, in_shardings, out_shardings, flat, out_tree,
                          program, static_argnums, timings)


class Executable:
    """A compiled, planned step: call it, inspect its HLO, memory and placements."""

    def __init__(self, compiled, plan: ShardingPlan, mesh, in_shardings, out_shardings,
                 flat: FlatArgs, out_tree, program: Program, static_argnums, timings):
        self.compiled = compiled
        self.plan = plan
        self.mesh = mesh
        self.in_shardings = in_shardings
        self.out_shardings = out_shardings
        self.program = program
        self.static_argnums = static_argnums
        self._flat = flat
        self._out_tree = out_tree
        self.timings: dict[str, float] = dict(timings)
        """Seconds spent tracing, planning, lowering and XLA-compiling this executable."""

    def __call__(self, *args):
        flat = flatten_args(args, self.static_argnums)
        leaves = [jax.device_put(x, s) if not _placed(x, s) else x
                  for x, s in zip(flat.dynamic_leaves, self.in_shardings, strict=True)]
        outs = self.compiled(*leaves)
        return jax.tree.unflatten(self._out_tree, outs)

    @property
    def auto_sharding_objective(self) -> float | None:
        """The objective (seconds) the ILP minimised, or None for fixed-plan methods."""
        return None if self.plan.objective is None else self.plan.objective.total_s

    def get_hlo_text(self) -> str:
        """Optimized HLO after SPMD partitioning (per-device shapes and collectives)."""
        return self.compiled.as_text()

    def get_total_allocation_size(self) -> int:
        """Bytes per device: arguments + outputs + temporaries, minus aliased (donated) bytes."""
        m = self.compiled.memory_analysis()
        return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                   - m.alias_size_in_bytes)

    def get_input_placement_specs(self):
        """Pytree like the arguments: a NamedSharding per array leaf, None for static leaves."""
        it = iter(self.in_shardings)
        leaves = [next(it) if d else None for d in self._flat.is_dynamic]
        return jax.tree.unflatten(self._flat.treedef, leaves)

    def get_output_placement_specs(self):
        """Pytree like the outputs: a NamedSharding per leaf."""
        return jax.tree.unflatten(self._out_tree, list(self.out_shardings))


def _placed(x, sharding) -> bool:
    return isinstance(x, jax.Array) and not isinstance(x, np.ndarray) and (
        x.sharding == sharding or x.sharding.is_equivalent_to(sharding, x.ndim))


__all__ = ["init", "shutdown", "parallelize", "ParallelizedFunc", "Executable",
           "clear_executable_cache"]
