"""Running a cross-stage sum: one all-reduce over a mesh spanning every stage's devices.

A ``sums.CrossStageSum`` has terms on several sub-meshes (a tied parameter's gradient
contributions, the squared sums of the global norm). Each sub-mesh adds its own terms and
lays the sum out as one row per device (a jit on the sub-mesh, replicated: every device holds
it). The rows of all sub-meshes form one array over the pipeline's devices (no copy: the
devices' buffers as they are), and one jit over a 1-D mesh of those devices, a ``shard_map``
with ``psum``, adds the first device's row of every sub-mesh. XLA compiles it to a single
all-reduce; across processes it is the backend's collective (gloo on CPU, NCCL on GPU), which
every process issues in the same order since all walk the same apply list. The result is
replicated over every device, so each sub-mesh reads its own devices' copies (no copy again).
"""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..ir._compat import Var
from ._cross_process import job_mesh, placeholder

AXIS = "x"
"""The axis of ``_cross_process.job_mesh``: every device of the pipeline, in stage order."""


class SpanReduce:
    """A compiled ``CrossStageSum`` of a pipeline whose model stage ``s`` runs on
    ``meshes[s]`` (sub-meshes in ``rank_meshes`` order). The audit reads it as a task without
    a plan that predicts its one all-reduce (listed under stage 0)."""

    plan = None
    stage = 0

    def __init__(self, cross_sum, home: dict, meshes: list, rank_meshes: list):
        self.sum = cross_sum
        self.task = SimpleNamespace(name=cross_sum.name)
        out = cross_sum.out.aval
        self.shape, self.dtype = tuple(out.shape), out.dtype
        self.rank_meshes = list(rank_meshes)
        self.mesh = job_mesh(tuple(self.rank_meshes))
        rank_of = {id(m): r for r, m in enumerate(self.rank_meshes)}
        by_rank: dict = {r: [] for r in range(len(self.rank_meshes))}
        for t in cross_sum.terms:  # literals go with the first sub-mesh's terms
            r = rank_of[id(meshes[home[t]])] if isinstance(t, Var) else 0
            by_rank[r].append(t)
        self.terms = by_rank
        self.replicated = [NamedSharding(m, P()) for m in self.rank_meshes]
        self._lift = [self._lift_fn(r) for r in range(len(self.rank_meshes))]
        devices = list(self.mesh.devices.flat)
        first = np.zeros(len(devices), bool)
        for m in self.rank_meshes:
            first[devices.index(m.devices.flat[0])] = True
        self.rows = NamedSharding(self.mesh, P(AXIS))
        self.compiled = self._reduce_fn(first).lower(
            jax.ShapeDtypeStruct((len(devices),) + self.shape, self.dtype, sharding=self.rows)
        ).compile()
        """The all-reduce over the spanning mesh (for inspection: ``as_text()``)."""
        itemsize = np.dtype(self.dtype).itemsize
        if devices[0].platform == "cpu" and jnp.issubdtype(self.dtype, jnp.floating):
            itemsize = max(itemsize, 4)  # XLA:CPU all-reduces bf16/f16 in float32
        self.predicted = {("all-reduce", (AXIS,)): int(np.prod(self.shape)) * itemsize}
        """(collective kind, axes) -> bytes of its result on one device per step."""

    def _lift_fn(self, r):
        terms, shape, dtype = self.terms[r], self.shape, self.dtype
        variables = [t for t in terms if isinstance(t, Var)]

        def lift(*xs):
            vals = iter(xs)
            total = None
            for t in terms:  # in program order, as the additions it replaces
                x = next(vals) if isinstance(t, Var) else jnp.asarray(t.val, dtype)
                total = x if total is None else total + x
            total = jnp.zeros(shape, dtype) if total is None else total.astype(dtype)
            return total[None]

        return variables, jax.jit(lift, out_shardings=self.replicated[r])

    def _reduce_fn(self, first):
        def body(row):  # row: (1, *shape), this device's sub-mesh sum
            keep = jnp.asarray(first)[jax.lax.axis_index(AXIS)]
            return jax.lax.psum(jnp.where(keep, row[0], jnp.zeros_like(row[0])), AXIS)

        mapped = jax.shard_map(body, mesh=self.mesh, in_specs=P(AXIS), out_specs=P(),
                               check_vma=False)
        return jax.jit(mapped, out_shardings=NamedSharding(self.mesh, P()))

    def __call__(self, step: dict) -> None:
        """Reduce the terms found in ``step`` (var -> {sharding: array}); put the sum there on
        every sub-mesh."""
        me = jax.process_index()
        shards = []
        for r, mesh in enumerate(self.rank_meshes):
            if all(d.process_index != me for d in mesh.devices.flat):
                continue  # another process adds this sub-mesh's terms
            variables, fn = self._lift[r]
            row = fn(*[_on(step[v], mesh) for v in variables])
            shards += [s.data for s in row.addressable_shards]
        rows = jax.make_array_from_single_device_arrays(
            (len(self.mesh.devices.flat),) + self.shape, self.rows, shards, dtype=self.dtype)
        total = self.compiled(rows)
        local = {s.device: s.data for s in total.addressable_shards}
        copies = {}
        for sh in self.replicated:
            mine = [local[d] for d in sh.mesh.devices.flat if d in local]
            copies[sh] = jax.make_array_from_single_device_arrays(
                self.shape, sh, mine, dtype=self.dtype) if mine else placeholder(
                self.shape, self.dtype, sh)
        step[self.sum.out] = copies


def _on(copies: dict, mesh):
    """The copy of a value held on ``mesh``'s devices."""
    devices = set(mesh.devices.flat)
    for sh, x in copies.items():
        if sh is not None and sh.device_set <= devices:
            return x
    raise AssertionError(f"no copy on {mesh}: {list(copies)}")


def run_sums(spans: list, before: int, step: dict) -> None:
    """Run the cross-stage sums due before apply task ``before``."""
    for s in spans:
        if s.sum.before == before:
            s(step)


__all__ = ["SpanReduce", "run_sums"]
