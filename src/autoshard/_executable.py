"""Executable: a compiled, planned step; called through jax's own C++ dispatch when it can be."""

from __future__ import annotations

import json
import os
import warnings
from itertools import compress
from typing import Any

import jax
import numpy as np

from ._program import Program
from .ir import _compat
from .ir._jaxpr import FlatArgs, flatten_args
from .sharding.hlo import accumulate_apply_modules
from .sharding.plan import ShardingPlan

MISS = object()
"""Returned by ``Executable.call_leaves`` when the leaves do not fit this executable."""


class Executable:
    """A compiled, planned step: call it, inspect its HLO, memory and placements.

    It keeps abstract values only (shapes, dtypes, shardings), never the arrays it was
    compiled for.
    """

    def __init__(self, compiled, lowered, plan: ShardingPlan, mesh, in_shardings, out_shardings,
                 flat: FlatArgs, out_tree, program: Program, static_argnums, timings,
                 name: str = "the function"):
        self.compiled = compiled
        self.plan = plan
        self.mesh = mesh
        self.in_shardings = in_shardings
        self.out_shardings = out_shardings
        self.program = program
        self.static_argnums = static_argnums
        self.name = name
        self._lowered = lowered
        self._flat = flat.abstract()
        self._out_tree = out_tree
        self.timings: dict[str, float] = dict(timings)
        """Seconds spent tracing, planning, lowering and XLA-compiling this executable."""
        statics = not all(flat.is_dynamic)
        self._dynamic_sel = flat.is_dynamic if statics else None
        self._static_sel = tuple(not d for d in flat.is_dynamic) if statics else None
        self._static_leaves = flat.static_leaves
        self._num_dynamic = len(flat.dynamic_leaves)

    # Calling -----------------------------------------------------------------------------------
    def __call__(self, *args):
        out = self.call_leaves(jax.tree.leaves(args))
        return self.call_args(args) if out is MISS else out

    def call_leaves(self, leaves: list):
        """Run on flat argument leaves through jax's C++ dispatch, or return MISS.

        MISS means the leaves need the slow path: other static values, shapes or dtypes, or
        committed arrays placed elsewhere (``call_args`` moves them).
        """
        leaves = self.select_dynamic(leaves)
        if leaves is MISS:
            return MISS
        if _compat.any_deleted(leaves):
            raise self._deleted_error(leaves)
        try:
            outs = self.compiled(*leaves)
        except (TypeError, ValueError):  # signature or sharding mismatch, raised before running
            return MISS
        return self._out_tree.unflatten(outs)

    def select_dynamic(self, leaves: list):
        """The array leaves among all argument leaves, or MISS if the static ones differ."""
        return select_dynamic(self, leaves)

    def call_args(self, args: tuple):
        """The slow path: flatten with paths, check, place every leaf, run."""
        flat = flatten_args(args, self.static_argnums)
        if flat.key() != self._flat.key():
            raise TypeError(
                f"These arguments do not match the executable of {self.name}: it was compiled "
                f"for {_describe(self._flat)}, got {_describe(flat)}. Call the parallelized "
                "function instead; it compiles an executable per signature.")
        leaves = list(flat.dynamic_leaves)
        abstract = [p for x, p in zip(leaves, flat.paths, strict=True)
                    if isinstance(x, jax.ShapeDtypeStruct)]
        if abstract:
            raise TypeError(
                f"{abstract[0]} is a jax.ShapeDtypeStruct: an executable runs on arrays. Use "
                f"{self.name}.get_executable(...) to plan and compile from abstract values, then "
                "call it with arrays.")
        if _compat.any_deleted(leaves):
            raise self._deleted_error(leaves)
        placed = [x if _placed(x, s) else jax.device_put(x, s)
                  for x, s in zip(leaves, self.in_shardings, strict=True)]
        return self._out_tree.unflatten(self.compiled(*placed))

    def _deleted_error(self, leaves) -> ValueError:
        return deleted_error(leaves, self._flat.paths, self.name)

    # Inspection --------------------------------------------------------------------------------
    @property
    def auto_sharding_objective(self) -> float | None:
        """The objective (seconds) the ILP minimised, or None for fixed-plan methods; in
        Alpa's units when the option gave Alpa's ``mesh_alpha`` and ``mesh_beta``."""
        o = self.plan.objective
        return None if o is None else o.total_s if o.alpa_units is None else o.alpa_units

    def get_hlo_text(self) -> str:
        """Optimized HLO after SPMD partitioning (per-device shapes and collectives).

        A step that accumulates gradients over micro-batches reads as Alpa's two modules,
        ``accumulate_grad`` (the micro-batch loop and the gradient reduction after it) then
        ``apply_grad`` (the update): the compiled module cut there
        (``sharding.hlo.accumulate_apply_modules``); it still runs as one.
        ``get_compiled_hlo_text()`` is the module as compiled.
        """
        text = self.get_compiled_hlo_text()
        parts = accumulate_apply_modules(text)
        return text if parts is None else "".join(p.rstrip("\n") + "\n\n" for p in parts)

    def get_compiled_hlo_text(self) -> str:
        """The one module XLA compiled for the step (after SPMD partitioning)."""
        return self.compiled.as_text()

    def get_total_allocation_size(self) -> int:
        """Bytes per device: arguments + outputs + temporaries, minus aliased (donated) bytes."""
        m = self.compiled.memory_analysis()
        return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                   - m.alias_size_in_bytes)

    def audit(self):
        """Predicted against compiled collectives and memory (``sharding.audit.Audit``)."""
        from .sharding.audit import audit

        return audit(self.plan, self.get_compiled_hlo_text(), self.get_total_allocation_size(),
                     platform=self.mesh.devices.flat[0].platform)

    def explain(self) -> str:
        """The plan's explain text followed by the audit of the compiled program."""
        return self.plan.explain() + "\n" + self.audit().explain()

    def get_input_placement_specs(self):
        """Pytree like the arguments: a NamedSharding per array leaf, None for static leaves."""
        it = iter(self.in_shardings)
        leaves = [next(it) if d else None for d in self._flat.is_dynamic]
        return jax.tree.unflatten(self._flat.treedef, leaves)

    def get_output_placement_specs(self):
        """Pytree like the outputs: a NamedSharding per leaf."""
        return jax.tree.unflatten(self._out_tree, list(self.out_shardings))

    def dump_debug_info(self, dir_path: str | os.PathLike) -> list[str]:
        """Write what is needed to debug this step into ``dir_path``; return the file names.

        ``before_partitioning.hlo`` (the program as lowered, with sharding annotations),
        ``after_partitioning.hlo`` (per-device program XLA compiled), ``plan.txt`` (the
        plan's explain text), ``plan_specs.json`` (every input and output spec), ``jaxpr.txt``,
        ``timings.json`` and ``memory.json``.
        """
        os.makedirs(dir_path, exist_ok=True)
        m = self.compiled.memory_analysis()
        memory = {k: int(getattr(m, k)) for k in (
            "argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
            "alias_size_in_bytes", "generated_code_size_in_bytes")}
        memory["total_allocation_size"] = self.get_total_allocation_size()
        specs = {
            "method": self.plan.method, "mesh_shape": list(self.plan.mesh_shape),
            "axis_names": list(self.plan.axis_names),
            "inputs": {leaf.path: str(leaf.spec) for leaf in self.plan.inputs},
            "outputs": {leaf.path: str(leaf.spec) for leaf in self.plan.outputs}}
        files = {
            "before_partitioning.hlo": self._lowered.as_text(dialect="hlo"),
            "after_partitioning.hlo": self.get_compiled_hlo_text(),
            "plan.txt": self.plan.explain() + "\n",
            "plan_specs.json": json.dumps(specs, indent=1),
            "jaxpr.txt": str(self.program.closed),
            "timings.json": json.dumps(self.timings, indent=1),
            "memory.json": json.dumps(memory, indent=1)}
        for name, text in files.items():
            with open(os.path.join(dir_path, name), "w") as f:
                f.write(text)
        return sorted(files)


def warn_on_divergence(ex, name: str) -> None:
    """Audit ``ex`` (an Executable or a pipeline executable) and warn where it diverges.

    Called for each new executable when AUTOSHARD_AUDIT=1; the warning points at the caller
    of the parallelized function (``ParallelizedFunc.__call__`` -> ``get_executable`` -> here).
    """
    found = ex.audit().divergences()
    if found:
        warnings.warn(
            f"autoshard audit of {name}: the compiled program diverges from its plan: "
            + "; ".join(found) + f". print({name}.get_last_executable().explain()) shows the plan "
            "beside the audit (AUTOSHARD_AUDIT=1 asked for this check).",
            RuntimeWarning, stacklevel=4)


def select_dynamic(ex, leaves: list):
    """``ex``'s array leaves among all argument leaves, or MISS if its static leaves differ.

    ``ex`` carries ``_static_sel``/``_dynamic_sel`` (None without static leaves),
    ``_static_leaves`` and ``_num_dynamic`` (an Executable or a pipeline executable).
    """
    if ex._static_sel is not None:
        if tuple(compress(leaves, ex._static_sel)) != ex._static_leaves:
            return MISS
        leaves = list(compress(leaves, ex._dynamic_sel))
    return leaves if len(leaves) == ex._num_dynamic else MISS


def deleted_error(leaves, paths, name: str) -> ValueError:
    """The error for arguments whose buffers were donated (or deleted), naming the first."""
    gone = [p for x, p in zip(leaves, paths, strict=True)
            if isinstance(x, _compat.ArrayImpl) and x.is_deleted()]
    more = f" (and {len(gone) - 1} more leaves)" if len(gone) > 1 else ""
    return ValueError(
        f"{gone[0]}{more} was donated to a previous call of {name} (or deleted); pass the state "
        f"that call returned (state, ... = {name}(state, ...)), or parallelize with "
        "donate_argnums=() to keep inputs alive.")


def _placed(x, sharding) -> bool:
    return isinstance(x, jax.Array) and not isinstance(x, np.ndarray) and (
        x.sharding == sharding or x.sharding.is_equivalent_to(sharding, x.ndim))


def _describe(flat: FlatArgs) -> str:
    shapes = [f"{p}: {x.dtype}{list(x.shape)}" for p, x in zip(
        flat.paths, flat.dynamic_leaves, strict=True)][:4]
    more = ", ..." if len(flat.paths) > 4 else ""
    statics = f"; static {list(flat.static_leaves)[:4]}" if flat.static_leaves else ""
    return "(" + ", ".join(shapes) + more + statics + ")"


def abstract_leaf(x: Any, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding,
                                weak_type=bool(getattr(x, "weak_type", False)))
