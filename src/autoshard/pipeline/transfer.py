"""Moving a value to the layout a task wants, device to device.

* Same devices, other layout: a cached identity jit with the wanted output sharding (XLA's
  collectives on those devices).
* Other devices, as many: the wanted layout is first laid out on the source devices (device i
  of the source sub-mesh standing for device i of the destination), by the same kind of jit,
  then ``jax.device_put`` copies shard i to device i. ``device_put`` between layouts that do
  not match shard for shard would copy through the host, silently.
* Other devices, a different count: replicated on the source, each destination device gets a
  copy of one source shard (single-device copies), then resharded on the destination.

Sub-meshes of other processes work the same way: every process issues every move, in the same
order, and ``jax.device_put`` between processes is JAX's cross-host transfer (see
``_cross_process``).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..ir import _compat
from ._cross_process import copy_replicated, crosses, process_local, settle


class Mover:
    """Moves arrays between shardings of sub-meshes; caches the resharding jits."""

    def __init__(self):
        self._reshard: dict = {}
        self._like: dict = {}
        self.counts = {"reshard": 0, "copy": 0, "placed": 0}
        """Dispatches so far: resharding jits, device-to-device copies, first placements."""

    def __call__(self, x, target: NamedSharding):
        src = getattr(x, "sharding", None)
        if src == target:
            return x
        if not isinstance(src, NamedSharding) or not getattr(x, "committed", True):
            self.counts["placed"] += 1
            return jax.device_put(process_local(x, target), target)
        if src.is_equivalent_to(target, x.ndim):
            return x
        if src.device_set == target.device_set:
            return self.reshard(x, target)
        if len(src.device_set) == len(target.device_set):
            like = self.like(src, target)
            if not src.is_equivalent_to(like, x.ndim):
                x = self.reshard(x, like)
            self.counts["copy"] += 1
            moved = jax.device_put(x, target)
            if crosses(src, target):
                settle([moved])
            return moved
        x = self.reshard(x, NamedSharding(src.mesh, P()))
        self.counts["copy"] += 1
        x = copy_replicated(x, target.mesh)
        return x if target == x.sharding else self.reshard(x, target)

    def reshard(self, x, target: NamedSharding):
        key = (x.sharding, target, x.shape, x.dtype)
        fn = self._reshard.get(key)
        if fn is None:
            fn = self._reshard[key] = jax.jit(lambda a: a, out_shardings=target)
        self.counts["reshard"] += 1
        return fn(x)

    def like(self, src: NamedSharding, target: NamedSharding) -> NamedSharding:
        """``target``'s layout on ``src``'s devices (flat device order kept)."""
        key = (src.mesh, target.mesh)
        mesh = self._like.get(key)
        if mesh is None:
            devs = np.array(list(src.mesh.devices.flat), dtype=object).reshape(
                target.mesh.devices.shape)
            mesh = self._like[key] = _compat.make_auto_mesh(devs, target.mesh.axis_names)
        return NamedSharding(mesh, target.spec)


__all__ = ["Mover"]
