"""Measure what the devices at hand deliver, for ``Cluster.measure``.

Four short micro-benchmarks, each run on every device at once (as a step runs them) and timed
as the median of several calls after a warm-up:

* **FLOP/s**: a square matrix product per device (the compute term of products);
* **memory bandwidth**: an element-wise pass over a large array per device (bytes read and
  written: the compute term of memory-bound ops);
* **collective latency**: a chain of all-reduces of one float over a mesh axis, divided by the
  chain's length and by the ``n - 1`` hops of a ring pass (``sharding.cost``, "Ring latency");
* **collective bandwidth**: one large all-reduce over the axis, its bus bandwidth
  ``2 (n - 1) / n * bytes / time`` after the latency (what ``nccl-tests`` report as busbw).

The axes are the hosts' devices (the intra-host link) and, with several hosts, one device per
host (the inter-host link). Sizes depend on the platform: an accelerator gets products and
arrays large enough to reach its sustained rate, a CPU small ones (the whole measurement takes
a few seconds there). Every process runs the same programs (collectives span processes).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

LATENCY_CHAIN = 16
"""All-reduces of one float chained in one program for the latency figure."""


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """Problem sizes of the micro-benchmarks on one platform."""

    matmul: int
    """Side of the square product each device computes."""
    matmul_dtype: Any
    """Its dtype (bfloat16 on accelerators, as models compute)."""
    stream_bytes: int
    """Bytes of the array each device streams through."""
    all_reduce_bytes: int
    """Bytes per device of the large all-reduce."""


SIZES = {
    "cpu": Sizes(matmul=512, matmul_dtype=jnp.float32, stream_bytes=16 << 20,
                 all_reduce_bytes=4 << 20),
    "accelerator": Sizes(matmul=8192, matmul_dtype=jnp.bfloat16, stream_bytes=1 << 30,
                         all_reduce_bytes=256 << 20),
}


@dataclass(frozen=True, kw_only=True)
class Measured:
    """What the micro-benchmarks found (per device; seconds per ring hop)."""

    flops: float
    memory_bandwidth: float
    intra_host_bandwidth: float | None
    intra_host_latency_s: float | None
    inter_host_bandwidth: float | None
    inter_host_latency_s: float | None


def _median_time(fn: Callable[[], Any], repeats: int) -> float:
    jax.block_until_ready(fn())  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _filled(mesh, shape, spec, dtype=jnp.float32):
    """An array of ones laid out as ``spec`` on ``mesh`` (made on the devices, any process)."""
    return jax.jit(lambda: jnp.ones(shape, dtype), out_shardings=NamedSharding(mesh, spec))()


def _per_device(mesh, body, per_device_shape, dtype=jnp.float32):
    """``body`` on every device's own block; returns (jitted fn, its input)."""
    names = tuple(mesh.axis_names)
    spec = P(names)
    shape = (mesh.size * per_device_shape[0],) + tuple(per_device_shape[1:])
    x = _filled(mesh, shape, spec, dtype)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    return fn, x


def measure_flops(mesh, sizes: Sizes, repeats: int) -> float:
    n = sizes.matmul

    fn, a = _per_device(mesh, lambda b: b @ b, (n, n), sizes.matmul_dtype)
    return 2.0 * n ** 3 / _median_time(lambda: fn(a), repeats)


def measure_memory_bandwidth(mesh, sizes: Sizes, repeats: int) -> float:
    count = sizes.stream_bytes // 4
    fn, x = _per_device(mesh, lambda v: v * 1.5 + 1.0, (count,))
    return 2.0 * sizes.stream_bytes / _median_time(lambda: fn(x), repeats)


def measure_all_reduce(mesh, axis: str, sizes: Sizes, repeats: int) -> tuple[float, float]:
    """(seconds per ring hop, bus bandwidth in bytes/s per device) of an all-reduce over
    ``axis``: every other axis runs its own all-reduces at the same time, as a step's do."""
    n = mesh.shape[axis]

    def chain(v):
        for _ in range(LATENCY_CHAIN):
            v = jax.lax.psum(v, axis) * (1.0 / n)
        return v

    fn, x = _per_device(mesh, chain, (1,))
    per_op = _median_time(lambda: fn(x), repeats) / LATENCY_CHAIN
    hop = per_op / max(n - 1, 1)
    count = sizes.all_reduce_bytes // 4
    big, y = _per_device(mesh, lambda v: jax.lax.psum(v, axis), (count,))
    seconds = max(_median_time(lambda: big(y), repeats) - per_op, 1e-9)
    bus = 2.0 * (n - 1) / n * sizes.all_reduce_bytes / seconds
    return hop, bus


def measure(devices: Sequence[Any], num_hosts: int, devices_per_host: int,
            repeats: int = 5) -> Measured:
    """The figures of ``devices`` (``num_hosts`` hosts of ``devices_per_host`` each, in host
    order)."""
    platform = devices[0].platform
    sizes = SIZES["cpu" if platform == "cpu" else "accelerator"]
    grid = np.asarray(list(devices), dtype=object).reshape(num_hosts, devices_per_host)
    mesh = jax.sharding.Mesh(grid, ("host", "device"))
    flops = measure_flops(mesh, sizes, repeats)
    bandwidth = measure_memory_bandwidth(mesh, sizes, repeats)
    intra = (measure_all_reduce(mesh, "device", sizes, repeats) if devices_per_host > 1
             else (None, None))
    inter = (measure_all_reduce(mesh, "host", sizes, repeats) if num_hosts > 1
             else (None, None))
    return Measured(flops=flops, memory_bandwidth=bandwidth,
                    intra_host_latency_s=intra[0], intra_host_bandwidth=intra[1],
                    inter_host_latency_s=inter[0], inter_host_bandwidth=inter[1])
