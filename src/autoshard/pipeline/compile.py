"""Compile a step's tasks: sub-meshes, one spec per value, one jit per task.

Shardings inside a stage: a value computed per micro-batch whose dim 0 is the micro-batch's
rows is split on dim 0 over every axis of the sub-mesh (when that divides it, and only when
every stage holding the value has a sub-mesh of the same shape); everything else (parameters,
gradients, accumulators) is replicated on the sub-mesh and XLA propagates from there. A value
crossing stages therefore has the same shard layout on both sub-meshes, device i to device i,
which keeps ``jax.device_put`` device-to-device.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .. import _compat
from .._compat import Var
from .._jaxpr import Env
from .._local import LocalEval
from ..grad_accum import KEY_USERS, reductions_of
from .partition import Partition, Task


def make_submeshes(devices, sizes, logical_shapes):
    """Disjoint sub-meshes over ``devices`` in order, one per stage."""
    meshes, start = [], 0
    for n, shape in zip(sizes, logical_shapes, strict=True):
        devs = np.array(devices[start:start + n], dtype=object).reshape(shape)
        names = ("x",) if len(shape) == 1 else tuple(f"x{i}" for i in range(len(shape)))
        meshes.append(_compat.make_auto_mesh(devs, names))
        start += n
    return meshes


class Specs:
    """One PartitionSpec per value (the same on every stage that holds it)."""

    def __init__(self, part: Partition, meshes, mb_rows: int | None, batch_axis_of=None):
        self.part, self.meshes = part, meshes
        holders: dict = {}
        for t in self._tasks():
            for v in t.invars:
                holders.setdefault(v, set()).add(t.stage)
            for v in t.outvars:
                holders.setdefault(v, set()).add(t.stage)
        marker_in = set(part.marker.invars) if part.marker is not None else set()
        self.spec: dict = {}
        for v, stages in holders.items():
            shapes = {tuple(meshes[s].devices.shape) for s in stages}
            aval = v.aval
            rows_like = (mb_rows is not None and v in part.batch_dependent and
                         getattr(aval, "shape", ()) and aval.shape[0] == mb_rows and
                         v not in marker_in and len(shapes) == 1)
            if rows_like:
                mesh = meshes[next(iter(stages))]
                axes = tuple(mesh.axis_names) if batch_axis_of is None else batch_axis_of(mesh)
                n = math.prod(mesh.shape[a] for a in axes)
                if aval.shape[0] % n == 0:
                    self.spec[v] = P(axes if len(axes) > 1 else axes[0])
                    continue
            self.spec[v] = P()

    def _tasks(self):
        p = self.part
        return p.forward + p.backward + [t for pair in p.split_backward for t in pair] + p.apply

    def sharding(self, v, stage: int) -> NamedSharding:
        return NamedSharding(self.meshes[stage], self.spec.get(v, P()))


def acc_dtype(dtype):
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
        return jnp.float32
    return dtype


class CompiledTask:
    """A task as a jit: ``(*inputs, *accumulators[, micro_batch]) -> (*outputs, *accumulators)``."""

    def __init__(self, task: Task, part: Partition, specs: Specs, *, with_index: bool):
        self.task = task
        self.stage = task.stage
        consts = dict(zip(part.jaxpr.constvars, part.consts, strict=True))
        self.invars = [v for v in task.invars if v not in consts]
        self.outvars = [v for v in task.outvars if v not in task.accumulated]
        self.accumulated = list(task.accumulated)
        self.random = with_index and task.draws_random
        eqns, invars, outvars, acc = task.eqns, self.invars, self.outvars, self.accumulated
        random = self.random

        def fn(*args):
            n = len(invars)
            values = dict(zip(invars, args[:n], strict=True))
            values.update(consts)
            if random:
                j = args[-1]

                def hook(e, ins):
                    if e.primitive.name in KEY_USERS:
                        ins = [jax.random.fold_in(ins[0], j)] + list(ins[1:])
                    return ins
                LocalEval((), 1, key_hook=hook).run(eqns, values, {})
            else:
                env = Env()
                env.values = values
                env.run(eqns)
            accs = args[n:n + len(acc)]
            new = [a + values[v].astype(a.dtype) for a, v in zip(accs, acc, strict=True)]
            return [values[v] for v in outvars] + new

        mesh = specs.meshes[task.stage]
        rep = NamedSharding(mesh, P())
        in_sh = [specs.sharding(v, task.stage) for v in invars] + [rep] * len(acc) + (
            [rep] if random else [])
        out_sh = [specs.sharding(v, task.stage) for v in outvars] + [rep] * len(acc)
        donate = tuple(range(len(invars), len(invars) + len(acc)))
        self.in_shardings, self.out_shardings = in_sh, out_sh
        self.jitted = jax.jit(fn, in_shardings=in_sh, out_shardings=out_sh,
                              donate_argnums=donate)
        abstract = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, sharding=s)
                    for v, s in zip(invars, in_sh, strict=False)]
        abstract += [jax.ShapeDtypeStruct(v.aval.shape, acc_dtype(v.aval.dtype), sharding=rep)
                     for v in acc]
        if random:
            abstract.append(jax.ShapeDtypeStruct((), jnp.int32, sharding=rep))
        self.lowered = self.jitted.lower(*abstract)
        self.compiled = self.lowered.compile()

    def __call__(self, args):
        return self.compiled(*args)


def finalize_fn(part: Partition, stage: int, k: int):
    """Per stage: accumulators -> gradient-marker outputs (mean divides by ``k``)."""
    if part.marker is None:
        return None, []
    reds = reductions_of(part.marker)
    pairs = [(v, o, r) for v, o, r in zip(part.marker.invars, part.marker.outvars, reds,
                                          strict=True)
             if isinstance(v, Var) and part.home.get(o) == stage and v in part.per_micro_batch]

    def fn(*accs):
        return [(a / k if r == "mean" else a).astype(v.aval.dtype)
                for a, (v, _, r) in zip(accs, pairs, strict=True)]
    return fn, pairs


__all__ = ["CompiledTask", "Specs", "acc_dtype", "finalize_fn", "make_submeshes"]
