"""``autoshard.plan``: the plan of a step for a described cluster, with no device of it at hand.

    plan = autoshard.plan(train_step, state_shapes, batch_shapes,
                          cluster=autoshard.Cluster.a100_80gb(num_hosts=32))
    print(plan.explain())          # split, memory, collectives, estimated step time
    plan.save("gpt_256.json")
    # later, on the 256 GPUs:
    step = autoshard.parallelize(train_step, method=autoshard.ShardParallel(
        plan=autoshard.ShardingPlan.load("gpt_256.json")))

The step is traced exactly as ``parallelize`` traces it (same static, batch and donated
arguments), so the plan's fingerprint matches the program the real run traces.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ._api import _DEFAULT_BATCH, _argnums
from ._auto import plan_program
from ._jaxpr import flatten_args
from ._mesh import resolve_devices
from ._method_base import ParallelMethod
from ._methods import ShardParallel
from ._program import trace_program
from .cluster import Cluster
from .sharding.plan import ShardingPlan


def plan(fun: Callable, *args, method: ParallelMethod | None = None,
         cluster: Cluster | None = None, static_argnums: str | Sequence[int] = "auto",
         batch_argnums: Sequence[int] = _DEFAULT_BATCH,
         donate_argnums: str | Sequence[int] = "auto") -> ShardingPlan:
    """Plan ``fun(*args)`` for ``cluster`` without its devices; returns the ``ShardingPlan``.

    ``args``: arrays or ``jax.ShapeDtypeStruct``s (nothing is allocated). ``method``:
    ``ShardParallel()`` (the default) with any ``auto_sharding_option``. ``cluster``: the
    hardware to cost for (default: the devices of ``method``, ``Cluster.from_devices``).
    ``static_argnums``, ``batch_argnums``, ``donate_argnums``: as in ``parallelize``, so the
    plan fits the program ``parallelize`` traces with the same arguments.
    """
    if not callable(fun):
        raise TypeError(f"autoshard.plan expects a function, got {fun!r}.")
    method = ShardParallel() if method is None else method
    if not isinstance(method, ShardParallel):
        raise TypeError(
            f"autoshard.plan plans ShardParallel (got {type(method).__name__}). "
            "PipeshardParallel's stage search on a described cluster is not wired to "
            "autoshard.plan yet; plan each stage's sub-mesh with ShardParallel meanwhile.")
    if method.manual_sharding_option is not None or method.plan is not None:
        raise ValueError(
            "autoshard.plan: the method already fixes its plan (manual_sharding_option or "
            "plan). Pass ShardParallel() or ShardParallel(auto_sharding_option=...).")
    if cluster is None:
        cluster = Cluster.from_devices(resolve_devices(method.devices)[0])
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster ({cluster!r}) must be an autoshard.Cluster, e.g. "
                        "Cluster.a100_80gb(num_hosts=4).")
    static = _argnums(static_argnums, "static_argnums")
    static = () if static == "auto" else static
    for i in static:
        if not -len(args) <= i < len(args):
            raise ValueError(f"static_argnums ({static_argnums}) names argument {i}, but "
                             f"{len(args)} positional arguments were given.")
    static = tuple(i % len(args) for i in static)
    batch = _argnums(batch_argnums, "batch_argnums")
    if batch == "auto":
        raise TypeError("batch_argnums must be a sequence of ints, e.g. (1,); not 'auto'.")
    if batch_argnums is _DEFAULT_BATCH and len(args) < 2:
        batch = ()  # as parallelize: a one-argument function has no batch argument
    n = len(args)
    batch = tuple(b % n if -n <= b < n else b for b in batch)
    flat = flatten_args(args, static)
    name = getattr(fun, "__name__", "the function")
    program, _ = trace_program(fun, args, flat, batch_argnums=batch,
                               donate_argnums=_argnums(donate_argnums, "donate_argnums"),
                               num_micro_batches=method.micro_batches, name=name)
    if method.devices is not None and len(resolve_devices(method.devices)[0]) != (
            cluster.num_devices):
        raise ValueError(
            f"The method's devices ({len(resolve_devices(method.devices)[0])}) and the cluster "
            f"({cluster.num_devices} devices, {cluster.name}) differ. Give one of the two.")
    return plan_program(method, program, cluster)


__all__ = ["plan"]
