"""Device meshes: which devices a method uses, and meshes built over them."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from ..ir import _compat


def resolve_devices(devices) -> tuple[tuple, Mesh | None]:
    """``devices`` of a method: None (all devices), a sequence of devices, or a Mesh."""
    check_devices(devices)
    if devices is None:
        return tuple(jax.devices()), None
    if isinstance(devices, Mesh):
        return tuple(devices.devices.flat), devices
    return tuple(devices), None


def check_devices(devices) -> None:
    """Validate a method's ``devices`` without touching the backend (at construction)."""
    if devices is None:
        return
    if isinstance(devices, Mesh):
        flat = list(devices.devices.flat)
        if len(set(flat)) != len(flat):
            dup = sorted({str(d) for d in flat if flat.count(d) > 1})
            raise ValueError(
                f"devices: the Mesh {dict(devices.shape)} holds {', '.join(dup)} more than once. "
                "Build it from distinct devices, e.g. jax.make_mesh(shape, names).")
        return
    if isinstance(devices, Sequence) and not isinstance(devices, str) and devices and all(
            isinstance(d, jax.Device) for d in devices):
        if len(set(devices)) != len(devices):
            raise ValueError(f"devices ({list(devices)}) lists a device more than once; give "
                             "each device once.")
        return
    raise TypeError(
        f"devices ({devices!r}) must be None (all devices), a non-empty list of jax devices "
        "(e.g. jax.devices()[:4]) or a jax.sharding.Mesh.")


def mesh_from_shape(devices: Sequence, shape: Sequence[int], axis_names: Sequence[str]) -> Mesh:
    """A mesh of ``shape`` over ``devices`` in order, every axis ``AxisType.Auto``."""
    shape = tuple(shape)
    if math.prod(shape) != len(devices):
        raise ValueError(
            f"The mesh shape {shape} has {math.prod(shape)} devices but {len(devices)} devices "
            "are used. Choose a shape whose product is the device count, or pass devices=.")
    return _compat.make_auto_mesh(np.array(devices, dtype=object).reshape(shape), axis_names)


def as_auto_mesh(mesh: Mesh) -> Mesh:
    """The same devices and axis names with every axis ``AxisType.Auto``."""
    return _compat.make_auto_mesh(mesh.devices, mesh.axis_names)
