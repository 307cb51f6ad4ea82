"""What every parallel method shares: the Compiled result, the base class, leaf plans."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jax.sharding import PartitionSpec as P

from ._mesh import check_devices
from ._program import Program
from .sharding.plan import LeafPlan, ShardingPlan


@dataclass(frozen=True, kw_only=True)
class Compiled:
    """What a method hands the front end: a plan, a mesh, and the function to jit."""

    plan: ShardingPlan
    mesh: Any
    fn: Any


class ParallelMethod:
    """Base class: turns a traced Program into a plan and a function to compile."""

    devices: Any = None
    num_micro_batches: int | None = None

    def compile(self, program: Program) -> Compiled:
        raise NotImplementedError

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
