"""Measured stage times for ``AutoStageOption(profile=True)``.

A candidate stage (layers ``[i, j)`` on a sub-mesh of ``n`` devices) is the forward equations
of those layers plus the backward equations the partition would give them, as one jit on the
first ``n`` devices in the layout the stage would run: planned by ShardParallel's planner on
the sub-mesh's logical shape with the stage's options (``logical_shape(n)``, ``option_of``),
the micro-batch's rows as batch inputs, on its devices' costs (``tasks.plan_task``, as the
runtime plans a task). If the planner fails, rows are split over the
devices and the rest replicated (the plan's note says so). It is compiled, run once to warm
up and ``repeats`` more times; its time is the median, its memory what XLA allocated per
device. Results are kept in a JSON file keyed by a hash of the candidate's program, its
layout, the device count and kind and the JAX version, so a second search over the same model
compiles nothing.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from ..ir import _compat
from ..ir._jaxpr import Env
from ..sharding import apply_plan
from .partition import _task, assign_backward, free_eqns
from .tasks import mesh_cluster, plan_task


class StageProfiler:
    """``measure(i, j, n) -> (seconds, bytes per device)`` of a candidate stage, cached."""

    def __init__(self, closed, pre, fwd_end: int, layer_of: dict, num_layers: int, devices,
                 batch_vars, *, cache_file: str | None, repeats: int = 3,
                 logical_shape=None, option_of=None):
        self.closed, self.devices, self.repeats = closed, devices, repeats
        self.logical_shape = logical_shape or (lambda n: (n,))
        self.option_of = option_of
        self.plans: dict = {}
        """(i, j, n) -> the ShardingPlan a candidate ran (absent: it ran data parallel)."""
        self.consts = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
        self.layer_eqns: list[list] = [[] for _ in range(num_layers)]
        bwd = assign_backward(pre, fwd_end, layer_of, num_layers, closed.jaxpr.invars)
        for i, e in enumerate(pre):
            layer = layer_of.get(i) if i < fwd_end else bwd.get(i)
            if layer is not None:
                self.layer_eqns[layer].append((i, e))
        self.free = free_eqns(pre, [], closed.jaxpr.constvars)
        self.producer = {v: e for e in pre for v in e.outvars}
        self.readers: dict = {}
        for e in closed.jaxpr.eqns:
            for v in e.invars:
                if isinstance(v, _compat.Var):
                    self.readers.setdefault(v, set()).add(id(e))
        self.step_outs = {v for v in closed.jaxpr.outvars if isinstance(v, _compat.Var)}
        self.batch_vars = set(batch_vars)
        self.mb_rows = next((v.aval.shape[0] for v in self.batch_vars if v.aval.shape), None)
        self.cache_file = Path(cache_file) if cache_file else None
        self.cache = _load(self.cache_file)
        self.num_compiled = 0

    def measure_all(self, candidates) -> dict:
        """``{(i, j, n): (seconds, bytes)}`` for every candidate, with a progress bar."""
        out = {}
        for cand in tqdm(candidates, desc="autoshard: profiling stages", leave=False, disable=None):
            out[cand] = self.measure(*cand)
        _save(self.cache_file, self.cache)
        return out

    def measure(self, i: int, j: int, n: int) -> tuple[float, int]:
        eqns = [e for _, e in sorted((x for layer in range(i, j) for x in self.layer_eqns[layer]),
                                     key=lambda x: x[0])]
        task = _task(f"profile{i}:{j}", "F", 0, [e for e in eqns if id(e) not in self.free],
                     self.producer, self.free)
        invars = [v for v in task.invars if v not in self.consts]
        ids = {id(e) for e in task.eqns}
        outvars = [v for e in task.eqns for v in e.outvars  # what later work reads
                   if v in self.step_outs or self.readers.get(v, set()) - ids]
        consts = self.consts

        def fn(*args):
            env = Env()
            env.values = dict(zip(invars, args, strict=True))
            env.values.update(consts)
            env.run(task.eqns)
            return [env.values[v] for v in outvars]

        abstract = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in invars]
        closed = jax.make_jaxpr(fn)(*abstract)
        mesh, run, shardings, plan = self._layout(closed, fn, invars, n, f"profile{i}:{j}")
        if plan is not None:
            self.plans[(i, j, n)] = plan
        key = self._key(closed, shardings, n)
        hit = self.cache.get(key)
        if hit is not None:
            return float(hit["seconds"]), int(hit["bytes"])
        seconds, nbytes = self._run(run, abstract, shardings)
        self.cache[key] = {"seconds": seconds, "bytes": nbytes, "layers": [i, j], "devices": n,
                           "mesh": list(mesh.devices.shape), "planned": plan is not None}
        return seconds, nbytes

    def _layout(self, closed, fn, invars, n, name):
        """(mesh, function, input shardings, plan): the candidate as the stage would run it."""
        shape = tuple(self.logical_shape(n))
        names = ("x",) if len(shape) == 1 else tuple(f"x{a}" for a in range(len(shape)))
        mesh = _compat.make_auto_mesh(
            np.array(self.devices[:n], dtype=object).reshape(shape), names)
        rows = [bool(getattr(v.aval, "shape", ())) and v.aval.shape[0] == self.mb_rows
                for v in invars]
        if self.option_of is not None:
            try:
                plan = plan_task(closed, name, num_devices=n, option=self.option_of(mesh),
                                 batch=rows, aliases=(), cluster=mesh_cluster(mesh),
                                 axis_names=names)
                return (mesh, jax.jit(apply_plan(closed, plan, mesh), out_shardings=[
                    NamedSharding(mesh, s) for s in plan.out_specs]),
                        [NamedSharding(mesh, s) for s in plan.in_specs], plan)
            except Exception as err:  # a candidate the planner cannot plan still gets a time
                warnings.warn(f"autoshard pipeline: {name} on {n} devices profiled data "
                              f"parallel: the planner failed ({type(err).__name__}: {err})",
                              stacklevel=2)
        split = P(names if len(names) > 1 else names[0])
        shardings = [NamedSharding(mesh, split if r and v.aval.shape[0] % n == 0 else P())
                     for r, v in zip(rows, invars, strict=True)]
        return mesh, fn, shardings, None

    def _key(self, closed, shardings, n) -> str:
        dev = self.devices[0]
        layout = [(tuple(s.mesh.devices.shape), str(s.spec)) for s in shardings]
        blob = (f"{closed}|{layout}|{n}|{dev.platform}|{dev.device_kind}|{jax.__version__}|"
                f"{self.repeats}")
        return hashlib.sha256(blob.encode()).hexdigest()

    def _run(self, fn, abstract, shardings) -> tuple[float, int]:
        compiled = jax.jit(fn, in_shardings=shardings).lower(*[
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
            for a, s in zip(abstract, shardings, strict=True)]).compile()
        self.num_compiled += 1
        args = [jax.device_put(_example(a), s) for a, s in zip(abstract, shardings, strict=True)]
        jax.block_until_ready(compiled(*args))
        times = []
        for _ in range(self.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times.append(time.perf_counter() - t0)
        m = compiled.memory_analysis()
        nbytes = int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes -
                     m.alias_size_in_bytes)
        return statistics.median(times), nbytes


def _example(a):
    """A value of ``a``'s shape and dtype: small floats, zeros, or distinct keys."""
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        keys = jax.random.split(jax.random.key(0), max(1, math.prod(a.shape)))
        return keys.reshape(a.shape)
    if jnp.issubdtype(a.dtype, jnp.floating):
        return jnp.full(a.shape, 0.01, a.dtype)
    return jnp.zeros(a.shape, a.dtype)


def _load(path: Path | None) -> dict:
    if path is None or not path.exists():
        return {}
    with open(path) as f:
        return json.load(f)


def _save(path: Path | None, cache: dict) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(cache, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def cache_file_of(option) -> str | None:
    """The file an AutoStageOption keeps measured times in (None: not kept)."""
    if option.cached_profile_result is not None:
        return option.cached_profile_result
    if option.profile_cache_dir is not None:
        return os.path.join(option.profile_cache_dir, "stage_profiles.json")
    return None


__all__ = ["StageProfiler", "cache_file_of"]
