"""PipeshardParallel with a ``ManualShardingOption``: the user's specs fixed in the task plans.

Alpa's meaning, on sub-meshes whose axes the user names:

* ``submesh_axis_names[r]`` names the axes of sub-mesh ``r`` (else every sub-mesh takes
  ``mesh_axis_names``); a name per axis of the sub-mesh's logical shape.
* ``in_axis_resources`` gives a step input's spec over the axes of each sub-mesh that reads it
  (a parameter of two stages must be valid on both); a None leaf is replicated, inputs not
  covered (``in_axis_resources=None``) are left to the planner. Every task that reads the
  input is planned with it fixed there (``plan_auto``'s ``fixed_in_specs``), and the step's
  input arrives in it.
* ``out_axis_resources`` gives a step output's spec on the sub-mesh that computes it: the
  producing task's result is pinned (a ``with_sharding_constraint`` the planner keeps), and
  the output is returned in it. A state output defaults to its input's spec.
* ``pipeline_intermediate_axes``: ``(axis, dim)`` pairs. A value that crosses between stages
  (an activation, or its cotangent in the backward) is split on ``dim`` over ``axis`` on each
  side whose sub-mesh has that axis: pinned as the producer's output there and as the
  consumer's input there. A value whose ``dim`` is missing or not divisible is left to the
  planner for that pair.

Task plans still choose every other layout; a task whose plan cannot take the pinned inputs
is planned without them and its inputs are resharded inside it (the plan's notes say so).
"""

from __future__ import annotations

import math

from jax.sharding import PartitionSpec as P

from ..ir._compat import Var
from ..methods._manual import _UNSET, _leaf_specs, validate_spec
from ..methods._methods import ManualShardingOption
from ..sharding.plan import format_spec


def submesh_axis_names(option, logical_shapes) -> list[tuple[str, ...]] | None:
    """The axis names of each sub-mesh (None without an option: the default names)."""
    if option is None:
        return None
    if not isinstance(option, ManualShardingOption):
        raise TypeError(
            f"manual_sharding_option ({option!r}) must be a autoshard.ManualShardingOption."
        )
    shapes = [tuple(s) for s in logical_shapes]
    if option.submesh_axis_names is not None:
        names = [tuple(n) for n in option.submesh_axis_names]
        if len(names) != len(shapes):
            raise ValueError(
                f"manual_sharding_option.submesh_axis_names has {len(names)} entries but the "
                f"pipeline has {len(shapes)} sub-meshes (logical shapes {shapes}). Give one "
                "tuple of axis names per sub-mesh."
            )
        what = "submesh_axis_names[{r}]"
    else:
        names = [option.mesh_axis_names] * len(shapes)
        what = "mesh_axis_names"
    for r, (n, shape) in enumerate(zip(names, shapes, strict=True)):
        if len(n) != len(shape) or len(set(n)) != len(n):
            raise ValueError(
                f"manual_sharding_option.{what.format(r=r)} {n} must name each axis of "
                f"sub-mesh {r} once, but its logical shape is {shape}. Give {len(shape)} "
                "distinct names, or set the logical shape (UniformStageOption("
                "submesh_logical_shape=...) or ManualStageOption(submesh_logical_shapes=...))."
            )
    return names


class ManualSpecs:
    """The option resolved against one pipeline: the pins of each task's inputs and outputs."""

    def __init__(self, option: ManualShardingOption, part, program, meshes):
        self.part, self.meshes = part, meshes
        jaxpr = part.jaxpr
        paths = dict(zip(jaxpr.invars, program.in_paths, strict=True))
        self.input_specs: dict = {}
        if option.in_axis_resources is not None:
            specs = _leaf_specs(
                option.in_axis_resources,
                program.args_shape,
                "in_axis_resources",
                len(program.in_avals),
            )
            for v, s in zip(jaxpr.invars, specs, strict=True):
                self.input_specs[v] = P() if s is _UNSET else s
        self.output_specs: dict = {}
        out_given = (
            [_UNSET] * len(jaxpr.outvars)
            if option.out_axis_resources is None
            else _leaf_specs(
                option.out_axis_resources,
                program.out_shape,
                "out_axis_resources",
                len(program.out_avals),
            )
        )
        for i, o in program.aliases:
            v, w = jaxpr.invars[i], jaxpr.outvars[o]
            given, held = out_given[o], self.input_specs.get(v)
            if given is _UNSET:
                out_given[o] = _UNSET if held is None else held
            elif held is not None and given != held:
                raise ValueError(
                    f"out_axis_resources for {program.out_paths[o]} is {format_spec(given)} but "
                    f"the input it updates ({paths[v]}) has {format_spec(held)}: a pipeline "
                    "keeps its state in one layout. Give both the same spec."
                )
        for o, (w, s) in enumerate(zip(jaxpr.outvars, out_given, strict=True)):
            if s is not _UNSET and isinstance(w, Var):
                self.output_specs.setdefault(w, (s if s is not None else P(), program.out_paths[o]))
        self.intermediate_axes = _intermediate_axes(option.pipeline_intermediate_axes, meshes)
        self.crossing = _crossing_values(part, meshes)
        self._check_inputs(paths)

    def _check_inputs(self, paths):
        for t in self._tasks():
            mesh = self.meshes[t.stage]
            sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
            for v in t.invars:
                spec = self.input_specs.get(v)
                if spec is not None:
                    validate_spec(
                        spec,
                        v.aval.shape,
                        sizes,
                        where=(
                            f"in_axis_resources for {paths[v]} (read by {t.name} on stage "
                            f"{t.stage}, sub-mesh axes {tuple(mesh.axis_names)}, shape per "
                            f"micro-batch {tuple(v.aval.shape)})"
                        ),
                    )
        for w, (spec, path) in self.output_specs.items():
            stage = self.part.home.get(w)
            if stage is None:
                continue
            mesh = self.meshes[stage]
            sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
            validate_spec(
                spec,
                w.aval.shape,
                sizes,
                where=(
                    f"out_axis_resources for {path} (computed on stage {stage}, sub-mesh axes "
                    f"{tuple(mesh.axis_names)})"
                ),
            )

    def _tasks(self):
        p = self.part
        return p.forward + p.backward + [t for pair in p.split_backward for t in pair] + p.apply

    def input_spec(self, v, stage: int) -> P | None:
        """The spec a task on ``stage`` takes ``v`` in, or None (the planner chooses)."""
        spec = self.input_specs.get(v)
        if spec is not None:
            return spec
        if v in self.crossing:
            return self.intermediate_spec(v, stage)
        return None

    def output_pins(self, task) -> dict[int, P]:
        """Output position (among the task's outputs that are not accumulated) -> the spec
        the task's result is pinned to."""
        pins = {}
        outs = [v for v in task.outvars if v not in task.accumulated]
        for i, v in enumerate(outs):
            if v in self.output_specs and self.part.home.get(v) == task.stage:
                pins[i] = self.output_specs[v][0]
            elif v in self.crossing:
                spec = self.intermediate_spec(v, task.stage)
                if spec is not None:
                    pins[i] = spec
        return pins

    def output_sharding_spec(self, v):
        """(stage, spec) a step output is returned in, or None."""
        if v not in self.output_specs or self.part.home.get(v) is None:
            return None
        return self.part.home[v], self.output_specs[v][0]

    def intermediate_spec(self, v, stage: int) -> P | None:
        """``v`` split as ``pipeline_intermediate_axes`` says on ``stage``'s sub-mesh."""
        mesh = self.meshes[stage]
        sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
        shape = tuple(getattr(v.aval, "shape", ()))
        entries: list[list[str]] = [[] for _ in shape]
        for axis, dim in self.intermediate_axes:
            if axis not in sizes or dim >= len(shape):
                continue
            parts = math.prod(sizes[a] for a in entries[dim]) * sizes[axis]
            if shape[dim] % parts == 0:
                entries[dim].append(axis)
        if not any(entries):
            return None
        while not entries[-1]:
            entries.pop()
        return P(*[None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries])


def _intermediate_axes(pairs, meshes) -> tuple[tuple[str, int], ...]:
    if pairs is None:
        return ()
    known = sorted({n for m in meshes for n in m.axis_names})
    out = []
    for pair in pairs:
        if (
            not isinstance(pair, tuple)
            or len(pair) != 2
            or not isinstance(pair[0], str)
            or not isinstance(pair[1], int)
            or isinstance(pair[1], bool)
            or pair[1] < 0
        ):
            raise ValueError(
                f"pipeline_intermediate_axes entry {pair!r} must be an (axis name, dim) pair "
                "with dim >= 0, e.g. (('data', 0),)."
            )
        if pair[0] not in known:
            raise ValueError(
                f"pipeline_intermediate_axes names axis {pair[0]!r}, which no sub-mesh has "
                f"(their axes: {known}). Use one of those names, or name the sub-meshes' axes "
                "with submesh_axis_names."
            )
        out.append(pair)
    return tuple(out)


def _crossing_values(part, meshes) -> set:
    """Values computed per micro-batch on one sub-mesh and read on another."""
    made = {}
    tasks = part.forward + part.backward + [t for pair in part.split_backward for t in pair]
    for t in tasks:
        for v in t.outvars:
            made.setdefault(v, t.stage)
    out = set()
    for t in tasks:
        for v in t.invars:
            if v in made and v in part.per_micro_batch and meshes[made[v]] is not meshes[t.stage]:
                out.add(v)
    return out


__all__ = ["ManualSpecs", "submesh_axis_names"]
