"""Every JAX-version workaround lives here and nowhere else (tested range: jax 0.10.x)."""

from __future__ import annotations

import jax
import jax.extend.core
from jax.interpreters import ad, batching, mlir
from jax.sharding import AxisType, Mesh

# Internal-but-stable registries used to define primitives (public aliases in jax 0.10).
primitive_jvps = ad.primitive_jvps
primitive_transposes = ad.primitive_transposes
primitive_batchers = batching.primitive_batchers
register_lowering = mlir.register_lowering
Zero = ad.Zero
is_undefined_primal = ad.is_undefined_primal
instantiate_zeros = ad.instantiate_zeros

Primitive = jax.extend.core.Primitive
ClosedJaxpr = jax.extend.core.ClosedJaxpr
Jaxpr = jax.extend.core.Jaxpr
JaxprEqn = jax.extend.core.JaxprEqn
Var = jax.extend.core.Var
Literal = jax.extend.core.Literal
DropVar = jax.extend.core.DropVar


def make_auto_mesh(device_array, axis_names) -> Mesh:
    """A Mesh whose axes are all ``AxisType.Auto`` (the XLA partitioner propagates shardings)."""
    names = tuple(axis_names)
    return Mesh(device_array, names, axis_types=(AxisType.Auto,) * len(names))


def is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def bind_eqn(eqn, invals):
    """Re-bind one jaxpr equation on concrete or traced values (as jax.core.eval_jaxpr does)."""
    params = eqn.primitive.get_bind_params(eqn.params)  # jax 0.10: params only, no subfuns
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **params)
    return out if eqn.primitive.multiple_results else [out]


def sharding_pinner():
    """``pin(x, sharding)``: ``lax.with_sharding_constraint(x, sharding)`` for one array and a
    ``NamedSharding`` over an Auto mesh, binding its primitive directly with the parameters
    that function gives it (the same equation). A planned step pins thousands of values, and
    the public function's per-call checks (pytree flattening, the sharding's preparation and
    validation, the context mesh) were a third of lowering it (5,915 pins, 0.87 of 2.6 s on the
    16-layer families decoder); ``apply`` checks a pin's rank itself. The context mesh is read
    once, where the pinner is made (inside the trace)."""
    from jax._src import mesh as mesh_lib
    from jax._src.pjit import sharding_constraint_p

    if not mesh_lib.get_concrete_mesh().empty or not mesh_lib.get_abstract_mesh().empty:
        return lambda x, sharding: jax.lax.with_sharding_constraint(x, sharding)
    context_mesh = mesh_lib.thread_resources.env.physical_mesh
    unconstrained = frozenset()

    def pin(x, sharding):
        return sharding_constraint_p.bind(x, sharding=sharding, layout=None,
                                          context_mesh=context_mesh,
                                          unconstrained_dims=unconstrained)
    return pin


def source_line(eqn) -> str | None:
    """``file:line (function)`` of the user code that emitted ``eqn`` (None where unknown)."""
    from jax._src import source_info_util

    try:
        where = source_info_util.summarize(eqn.source_info)
    except Exception:  # an equation built without source information
        return None
    return None if not where or where.startswith("unknown") else where


# -- Internals used by autoshard.mpi (jax 0.10) ---------------------------------------------------
# The MPI primitives build their own ordering chain at lowering time instead of using an ordered
# effect (which costs ~350 us per jitted call here). That needs JAX's private lowering, DCE and
# sharding-context modules; they are imported here and nowhere else.
def mpi_internals():
    """Private JAX modules and classes that ``autoshard.mpi`` builds on, as a namespace."""
    from types import SimpleNamespace

    from jax._src import ad_checkpoint, custom_derivatives, dispatch, pjit, shard_map
    from jax._src import core as private_core
    from jax._src.interpreters import mlir as private_mlir
    from jax._src.interpreters import partial_eval
    from jax._src.lax.control_flow import conditionals, loops
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import hlo
    from jax._src.sharding_impls import (
        SdyArray,
        SdyArrayList,
        SdyDim,
        ShardingContext,
        SPMDAxisContext,
    )

    return SimpleNamespace(
        apply_primitive=dispatch.apply_primitive, core=private_core, mlir=private_mlir,
        pe=partial_eval, ir=ir, hlo=hlo, SdyArray=SdyArray, SdyArrayList=SdyArrayList,
        SdyDim=SdyDim, ShardingContext=ShardingContext, SPMDAxisContext=SPMDAxisContext,
        higher_order_primitives=(
            conditionals.cond_p, loops.while_p, loops.scan_p, pjit.jit_p,
            private_core.closed_call_p, private_core.call_p,
            custom_derivatives.custom_jvp_call_p, custom_derivatives.custom_vjp_call_p,
            ad_checkpoint.remat_p, shard_map.shard_map_p))


def apply_primitive(primitive, *args, **params):
    """Eager implementation of a primitive by compiling it alone (``def_impl`` of MPI ops)."""
    from jax._src import dispatch

    return dispatch.apply_primitive(primitive, *args, **params)


# -- Front-end dispatch (jax 0.10) -----------------------------------------------------------------
def _array_impl():
    from jax._src.array import ArrayImpl

    return ArrayImpl


ArrayImpl = _array_impl()
"""The concrete class of ``jax.Array`` values; its ``is_deleted`` is a C++ method."""


def any_deleted(leaves) -> bool:
    """True if an array among ``leaves`` was deleted or donated (C-level loop in the common case).

    Passing a deleted buffer to a multi-device executable crashes the process in jaxlib 0.10
    (instead of raising), so callers check first.
    """
    try:
        return any(map(ArrayImpl.is_deleted, leaves))
    except TypeError:  # a numpy array, Python scalar or ShapeDtypeStruct among the leaves
        return any(x.is_deleted() for x in leaves if isinstance(x, ArrayImpl))


# -- Custom partitioning (autoshard.custom_partitioning, jax 0.10) --------------------------------
# autoshard builds on JAX's custom_partitioning (the XLA partitioner callbacks stay JAX's). Its
# rule classes live in jax.experimental.custom_partitioning. Which partitioner runs (Shardy or
# GSPMD, the jax_use_shardy_partitioner flag) decides whether JAX reads the sharding rule or the
# infer/propagate callbacks; autoshard always hands JAX both forms.
def cp_rule_types():
    """JAX's custom-partitioning classes: custom_partitioning and the SdyShardingRule types."""
    from types import SimpleNamespace

    from jax.experimental import custom_partitioning as cp

    return SimpleNamespace(custom_partitioning=cp.custom_partitioning, BATCHING=cp.BATCHING,
                           ArrayMapping=cp.ArrayMapping, CompoundFactor=cp.CompoundFactor,
                           SdyShardingRule=cp.SdyShardingRule)


def uses_shardy() -> bool:
    """Whether jit partitions with Shardy (reads sharding rules) rather than GSPMD (callbacks)."""
    return bool(jax.config.jax_use_shardy_partitioner)


def add_compile_error_handler(handler) -> None:
    """Let ``handler(JaxRuntimeError) -> Exception | None`` replace an XLA compilation error.

    XLA runs the partition callbacks of custom_partitioning while it compiles and turns a
    Python exception raised there into ``JaxRuntimeError: INTERNAL: custom_partitioner:
    Traceback ...``. JAX's hook for re-raising a clearer exception instead (it raises the
    handler's exception ``from`` the runtime error) is private in jax 0.10.
    """
    from jax._src import compiler

    compiler.register_xla_runtime_error_handler(handler)


# -- autoshard.mpi: narrow lowering hook and token types (jax 0.10) ------------------------------
# autoshard.mpi patches nothing at import. Its one lowering hook is JAX's lowering event listener
# (jax._src.util.test_event_listener), set only while a module that holds an MPI call is being
# lowered (chained to any listener already set) and restored when that module is done.
def lowering_event_listener():
    """The listener JAX calls with lowering events (None when unset)."""
    from jax._src import util

    return util.test_event_listener


def set_lowering_event_listener(listener) -> None:
    from jax._src import util

    util.test_event_listener = listener


def is_jax_token(value) -> bool:
    """True for a JAX token: concrete (``jax.lax.create_token()`` outside jit) or traced."""
    from jax._src import core as private_core

    if isinstance(value, private_core.Token):
        return True
    return isinstance(getattr(value, "aval", None), private_core.AbstractToken)


# -- Multi-process runtime (autoshard.distributed, jax 0.10) --------------------------------------
# JAX's distributed runtime keeps its client (key-value store, barriers) in a private module, and
# only a private call drops the backends so that jax.distributed.initialize can run again after
# shutdown. Both are reached here and nowhere else.
def distributed_client():
    """The distributed runtime client of this process (key-value store, barriers), or None."""
    from jax._src.distributed import global_state

    return global_state.client


def backends_are_initialized() -> bool:
    """Whether a JAX computation or device query has already created the backends."""
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def clear_backends() -> None:
    """Drop JAX's backend clients and caches (arrays made before are unusable afterwards)."""
    from jax._src import api

    api.clear_backends()


# -- autoshard.pipeline: device_put's resharding paths (jax 0.10) ---------------------------------
# jax.device_put between sub-meshes copies device to device only when every destination shard
# exists as a source shard (same indices); otherwise jax._src.array reshards through these
# functions, which read shards back to the host and block. The pipeline tests spy on them.
def device_put_host_paths():
    """The module and function names ``jax.device_put`` uses when it reshards via the host."""
    from jax._src import array

    return array, ("shard_sharded_device_array_slow_path", "shard_device_array")
