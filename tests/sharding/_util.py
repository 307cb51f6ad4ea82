"""Helpers of the planner tests: plan a function, run it on a mesh, read collectives from HLO."""

from __future__ import annotations

import re

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding

import autoshard
from autoshard.sharding import AutoShardingOption, apply_plan, plan_auto

_COLLECTIVE = re.compile(
    r"=\s*(\(?[^=]*?\)?)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?:-start)?\(")
_SHAPE = re.compile(r"(pred|s8|u8|s16|u16|s32|u32|s64|u64|bf16|f16|f32|f64)\[([\d,]*)\]")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4,
             "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def plan_fn(fn, args, *, batch=None, aliases=(), option=None, num_devices=8, plan_kw=None,
            **opt):
    """Trace ``fn(*args)`` and plan it; ``batch``: per flat input leaf, is it a batch leaf;
    ``plan_kw``: more keywords of ``plan_auto``; ``opt``: the option's fields."""
    closed = jax.make_jaxpr(fn)(*args)
    flat = jax.tree.leaves(args)
    option = option or AutoShardingOption(**{"show_progress": False, **opt})
    batch = [False] * len(flat) if batch is None else list(batch)
    plan = plan_auto(closed, num_devices=num_devices, option=option,
                     in_paths=[f"in{i}" for i in range(len(flat))],
                     out_paths=[f"out{i}" for i in range(len(closed.jaxpr.outvars))],
                     batch_invars=batch, aliases=aliases, **(plan_kw or {}))
    return closed, plan


def mesh_for(plan):
    devices = np.array(jax.devices()[: int(np.prod(plan.mesh_shape))])
    return Mesh(devices.reshape(plan.mesh_shape), plan.axis_names,
                axis_types=(AxisType.Auto,) * len(plan.mesh_shape))


def compile_plan(closed, plan):
    mesh = mesh_for(plan)
    fn = apply_plan(closed, plan, mesh)
    return jax.jit(lambda *a: fn(*a),
                   in_shardings=tuple(NamedSharding(mesh, s) for s in plan.in_specs),
                   out_shardings=[NamedSharding(mesh, s) for s in plan.out_specs])


def run_plan(closed, plan, args):
    return compile_plan(closed, plan)(*jax.tree.leaves(args))


def collectives(hlo: str) -> list[tuple[str, int]]:
    """(kind, bytes of the result) of every collective in compiled HLO text."""
    found = []
    for line in hlo.splitlines():
        m = _COLLECTIVE.search(line)
        if not m:
            continue
        size = 0
        for dtype, dims in _SHAPE.findall(m.group(1)):
            n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
            size += n * _ITEMSIZE[dtype]
        found.append((m.group(2), size))
    return found


def hlo_of(closed, plan, args) -> str:
    return compile_plan(closed, plan).lower(*jax.tree.leaves(args)).compile().as_text()


def assert_close(a, b, rtol=1e-4, atol=1e-5):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def compiled_vs_estimated(step, state, batch, mesh_shape=(2, 4)):
    """Plan ``step`` on a fixed mesh of the first 8 devices (state donated) and return
    (XLA's allocation per device, the planner's peak estimate, the audit)."""
    opt = autoshard.AutoShardingOption(show_progress=False, logical_mesh_shape=mesh_shape)
    f = autoshard.parallelize(step, donate_argnums=(0,), method=autoshard.ShardParallel(
        devices=jax.devices()[:8], auto_sharding_option=opt))
    ex = f.get_executable(state, *batch)
    a = ex.audit()
    m = ex.compiled.memory_analysis()
    compiled = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                - m.alias_size_in_bytes)
    assert a.compiled_memory == compiled, (a.compiled_memory, compiled)
    return compiled, a.predicted_memory, a
