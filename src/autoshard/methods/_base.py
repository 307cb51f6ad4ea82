"""What every parallel method shares: the one interface the front end calls
(``compile_executable`` on devices, ``plan_for`` on a described cluster), the call it is
given, the Compiled result of single-jit methods, leaf plans."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .._executable import Executable, abstract_leaf
from .._program import Program
from ..distributed.plan_sync import agree_on_plan
from ..sharding.plan import LeafPlan, ShardingPlan
from ._mesh import check_devices


@dataclass(frozen=True, kw_only=True)
class Call:
    """What the front end knows of one call besides its traced program."""

    flat: Any
    """The flattened arguments (``_jaxpr.FlatArgs``)."""
    out_tree: Any
    """The output pytree's structure."""
    static_argnums: tuple[int, ...]
    """Positions of the static arguments."""
    name: str
    """The function's name, for messages."""
    trace_s: float = 0.0
    """Seconds the trace took."""

    def agree(self, program: Program, plan):
        """The plan every process runs: ``plan`` (or what a function ``plan`` returns, called
        on process 0 only) after checking that every process traced ``program``. Every method
        agrees on its plans through here, the one place processes do."""
        return agree_on_plan(self.name, program, plan)


@dataclass(frozen=True, kw_only=True)
class Compiled:
    """What a method hands the front end: a plan, a mesh, and the function to jit."""

    plan: ShardingPlan
    mesh: Any
    fn: Any


class ParallelMethod:
    """Base class: turns a traced Program into an executable on devices
    (``compile_executable``) or a priced plan for a described cluster (``plan_for``).

    A method that runs one jit implements ``compile``; ``compile_executable`` lowers and
    compiles what it returns. Pipelines, which run many, implement ``compile_executable``.
    """

    devices: Any = None
    num_micro_batches: int | None = None

    def compile_executable(self, program: Program, call: Call) -> Executable:
        """The executable that runs ``program`` on this method's devices."""
        t0 = time.perf_counter()
        compiled = self.compile(program, call)
        t1 = time.perf_counter()
        mesh, plan = compiled.mesh, compiled.plan
        in_shardings = tuple(NamedSharding(mesh, leaf.spec) for leaf in plan.inputs)
        out_shardings = tuple(NamedSharding(mesh, leaf.spec) for leaf in plan.outputs)
        donate = tuple(i for i, d in enumerate(program.donated_invars) if d)
        abstract = [abstract_leaf(a, s) for a, s in zip(program.in_avals, in_shardings,
                                                        strict=True)]
        fn = compiled.fn
        jitted = jax.jit(lambda *a: tuple(fn(*a)), in_shardings=in_shardings,
                         out_shardings=out_shardings, donate_argnums=donate)
        lowered = jitted.lower(*abstract)
        t2 = time.perf_counter()
        xla = lowered.compile()
        t3 = time.perf_counter()
        timings = {"trace_s": call.trace_s, "planning_s": t1 - t0, "lowering_s": t2 - t1,
                   "compile_s": t3 - t2}
        return Executable(xla, lowered, plan, mesh, in_shardings, out_shardings, call.flat,
                          call.out_tree, program, call.static_argnums, timings, name=call.name)

    def compile(self, program: Program, call: Call) -> Compiled:
        """The plan (agreed through ``call.agree``), mesh and function of a one-jit method."""
        raise NotImplementedError(f"{type(self).__name__} implements compile_executable.")

    def plan_for(self, program: Program, cluster) -> Any:
        """The plan of ``program`` for ``cluster`` without its devices (``autoshard.plan``)."""
        raise TypeError(
            f"autoshard.plan plans ShardParallel or PipeshardParallel (got "
            f"{type(self).__name__}). Pass method=ShardParallel() for one mesh, or "
            "PipeshardParallel(...) for stages on sub-meshes.")

    @property
    def micro_batches(self) -> int:
        return self.num_micro_batches or 1

    def _validate_common(self):
        check_devices(self.devices)
        k = self.num_micro_batches
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise ValueError(
                f"num_micro_batches ({k!r}) must be a positive int or None (no accumulation).")


def leaf_plan(program: Program, i: int, spec, note: str = "", *, output: bool = False):
    aval = program.out_avals[i] if output else program.in_avals[i]
    path = program.out_paths[i] if output else program.in_paths[i]
    return LeafPlan(path=path, shape=tuple(aval.shape), dtype=aval.dtype.name, spec=spec,
                    note=note)


def batch_spec(program: Program, axes: Sequence[str], num_devices: int) -> list:
    """Specs of the inputs for splitting batch arguments on dim 0 over ``axes``."""
    specs = []
    for i, is_batch in enumerate(program.batch_invars):
        if not is_batch:
            specs.append(P())
            continue
        aval = program.in_avals[i]
        size = aval.shape[0]
        per = num_devices * program.num_micro_batches
        if size % per:
            raise ValueError(
                f"The batch size ({size}) of {program.in_paths[i]} must be divisible by the "
                f"number of devices ({num_devices}) times num_micro_batches "
                f"({program.num_micro_batches}) for data parallelism. Choose a batch size "
                f"that is a multiple of {per}, or fewer devices.")
        specs.append(P(tuple(axes) if len(axes) > 1 else axes[0]))
    return specs
