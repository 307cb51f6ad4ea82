"""Measured stage times for ``AutoStageOption(profile=True)``.

A candidate stage (layers ``[i, j)`` on a sub-mesh of ``n`` devices) is the stage of the
partition that holds those layers alone (``Cut.span``); its forward and backward tasks are
planned by ``tasks.plan_tasks`` as the runtime plans them (on the sub-mesh's logical shape
``logical_shape(n)`` with the stage's options ``option_of``, on the first ``n`` devices'
costs, the backward per device over its batch axes where its rows arrive split) and compiled
as the runtime compiles them (``compile.CompiledTask``). They run once to warm up and
``repeats`` more times, forward then backward; the time is the median, the memory the most
XLA allocated per device for either. Results are kept in a JSON file keyed by a hash of the
tasks, their layouts, the device count and kind and the JAX version, so a second search over
the same model compiles nothing.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from ..ir import _compat
from .compile import CompiledTask
from .reduce import acc_dtype
from .tasks import Target, mesh_cluster, plan_tasks


class StageProfiler:
    """``measure(i, j, n) -> (seconds, bytes per device)`` of a candidate stage, cached."""

    def __init__(self, span, program, devices, *, cache_file: str | None, repeats: int = 3,
                 logical_shape=None, option_of=None):
        self.span, self.program, self.devices, self.repeats = span, program, devices, repeats
        self.logical_shape = logical_shape or (lambda n: (n,))
        self.option_of = option_of
        self.plans: dict = {}
        """(i, j, n) -> the TaskPlans a candidate ran (its forward and backward)."""
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
        part, s = self.span(i, j)
        shape = tuple(self.logical_shape(n))
        names = ("x",) if len(shape) == 1 else tuple(f"x{a}" for a in range(len(shape)))
        mesh = _compat.make_auto_mesh(
            np.array(self.devices[:n], dtype=object).reshape(shape), names)
        option = self.option_of(mesh) if self.option_of is not None else None
        target = Target(0, shape, names, mesh_cluster(mesh), mesh)
        planned: list = []
        plan_tasks(part, [target] * part.num_stages, False, [option] * part.num_stages,
                   program=self.program, realize=planned.append,
                   select=lambda kind, t: t.stage == s and kind != "apply")
        self.plans[(i, j, n)] = planned
        key = self._key(planned, n)
        hit = self.cache.get(key)
        if hit is not None:
            return float(hit["seconds"]), int(hit["bytes"])
        seconds, nbytes = self._run([CompiledTask(tp, mesh) for tp in planned])
        self.cache[key] = {"seconds": seconds, "bytes": nbytes, "layers": [i, j], "devices": n,
                           "mesh": list(shape),
                           "planned": all(tp.plan is not None for tp in planned)}
        return seconds, nbytes

    def _key(self, planned, n) -> str:
        dev = self.devices[0]
        tasks = [("\n".join(str(e) for e in tp.task.eqns), [str(p) for p in tp.in_specs],
                  [str(p) for p in tp.out_specs]) for tp in planned]
        blob = (f"{tasks}|{n}|{dev.platform}|{dev.device_kind}|{jax.__version__}|"
                f"{self.repeats}")
        return hashlib.sha256(blob.encode()).hexdigest()

    def _run(self, compiled) -> tuple[float, int]:
        """Median seconds of the tasks run one after the other, and the most bytes per device
        any of them takes."""
        self.num_compiled += len(compiled)
        args = []
        for c in compiled:
            shapes = [(v.aval.shape, v.aval.dtype) for v in c.invars] + [
                (shape, acc_dtype(v.aval.dtype))
                for v, shape in zip(c.accumulated, c.acc_shapes, strict=True)]
            shapes += [((), jnp.int32)] if c.random else []
            args.append([jax.device_put(_example(jax.ShapeDtypeStruct(sh, dt)), x)
                         for (sh, dt), x in zip(shapes, c.in_shardings, strict=True)])

        def once():
            for c, a in zip(compiled, args, strict=True):
                n = len(c.invars)
                outs = c(a)
                a[n:n + len(c.accumulated)] = outs[len(c.outvars):]  # donated: use the new
            jax.block_until_ready(args)
        once()
        times = []
        for _ in range(self.repeats):
            t0 = time.perf_counter()
            once()
            times.append(time.perf_counter() - t0)
        nbytes = 0
        for c in compiled:
            m = c.compiled.memory_analysis()
            nbytes = max(nbytes, int(m.argument_size_in_bytes + m.output_size_in_bytes
                                     + m.temp_size_in_bytes - m.alias_size_in_bytes))
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
