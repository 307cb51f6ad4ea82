"""Lowering shared by all operations: an MPI custom call ordered by a hidden token chain.

The "token" here is a one-byte scalar threaded through the calls (see _chain.chain_type).

Why no JAX effect: any effect on a jitted function takes JAX off its C++ dispatch fast
path (measured here: 10 us for an effect-free jitted call, 125 us with an unordered
effect, 350 us with an ordered one). The operations are therefore effect-free JAX
primitives, and ordering is established while lowering to StableHLO instead:

* Within one block, every MPI custom call consumes the token produced by the previous one
  (a data dependency XLA must respect).
* When the module is complete (see ``_chain._finish``), calls to functions holding MPI
  calls (nested jits, cached lowerings) are inlined, since XLA inlines them too, after
  which only data dependencies order their contents. The chain is then threaded through
  the whole program as data: a while loop holding MPI calls carries the token as one more
  loop-carried value, a case takes it in (its branches see the enclosing block's values)
  and returns the token of the branch taken, and a shard_map region takes and returns it
  as one more operand and result. Optimization barriers would not do: XLA's CPU pipeline
  removes them before it schedules (a loop's sends once ran after later sends that way).
  JAX reports the finished module through its lowering event listener; the first MPI call
  lowered into a module sets that listener (chained to any listener already set) and it
  is restored as soon as that module is finished, so the lowering of every program without
  MPI calls is untouched (see _chain._listen).
* In a jit over several devices each call runs inside a manual (shard_map) region, on one
  of its devices only (one MPI call per process, see _once_per_process); the region's first
  operand and result carry the chain.
* A DCE rule keeps every MPI equation even when its results are unused (send, barrier). An
  equation of a higher-order primitive (cond, while, scan, jit, ...) that holds MPI calls but
  has no used output would still be removed by that primitive's DCE rule; those rules are
  therefore wrapped when the first MPI operation is traced (never at import, see _keep_holders).
  The wrapper returns exactly what the original rule returns for equations without MPI calls.
"""

from __future__ import annotations

from functools import partial

from jax.interpreters import ad, mlir
from jax.interpreters import batching as jax_batching

from ..ir._compat import apply_primitive, mpi_internals
from ..ir._walk import sub_jaxprs
from . import _check, _sharding
from ._chain import PROCESS_AXIS, chain_type, current_token
from ._native import target_name

_jax = mpi_internals()
_core, _mlir, _pe, ir = _jax.core, _jax.mlir, _jax.pe, _jax.ir
SdyArray, SdyArrayList, SdyDim = _jax.SdyArray, _jax.SdyArrayList, _jax.SdyDim
ShardingContext, SPMDAxisContext = _jax.ShardingContext, _jax.SPMDAxisContext


def _layout(aval):
    return tuple(range(len(aval.shape) - 1, -1, -1))


def _attr(value):
    if isinstance(value, str):
        return ir.StringAttr.get(value)
    if isinstance(value, tuple):
        return ir.DenseI64ArrayAttr.get([int(v) for v in value])
    return mlir.i64_attr(int(value))


def emit(
    ctx: mlir.LoweringRuleContext,
    op: str,
    operands,
    *,
    attrs: dict[str, int | tuple[int, ...]],
    signature: str,
    aliases: dict[int, int] | None = None,
):
    """Emits the custom call for ``op``; returns its array results (the token is chained).

    ``attrs`` are int64 scalars or tuples (int64 arrays). ``signature`` is what the ranks
    must agree on, checked before the MPI call (see _check.py), e.g. ``float32[3], op=SUM``.
    ``aliases`` maps an array operand index to the array result index it is donated to.
    """
    token = current_token(ctx.module_context)
    attrs = {**attrs, "comm": _comm_table(ctx, attrs["comm"]), **_check.attrs(op, signature)}
    result_types = [mlir.aval_to_ir_type(ctx.module_context, a) for a in ctx.avals_out]
    call = _mlir.custom_call(
        target_name(op),
        result_types=[*result_types, chain_type()],
        operands=[token, *operands],
        backend_config={k: _attr(v) for k, v in attrs.items()},
        has_side_effect=True,
        api_version=4,
        operand_layouts=[(), *(_layout(a) for a in ctx.avals_in)],
        result_layouts=[*(_layout(a) for a in ctx.avals_out), ()],
        operand_output_aliases={i + 1: o for i, o in (aliases or {}).items()},
    )
    _mlir.set_sharding(ctx.module_context, call, _placeholder_sharding(ctx))
    return list(call.results)[:-1]


_regions: list[int] = []  # the sizes of the _once_per_process regions being lowered
_table_makers: dict[int, object] = {}  # device-table id -> its communicator's make_table
_tables: dict[tuple[int, int | None], int] = {}  # (device table, region size) -> table id


def pair_comm_tables(device_table: int, make_table) -> None:
    """Records how to build the other tables of a communicator whose device table is given.

    ``make_table(None)`` maps every device to the communicator, for calls that one device
    runs; ``make_table(n)`` does too, for the calls of a region of ``n`` devices, of which
    only the first to reach each call makes it (see "one call per process" in _ffi.cc). Both
    return the table's id.
    """
    _table_makers[device_table] = make_table


def _comm_table(ctx: mlir.LoweringRuleContext, device_table: int) -> int:
    """The table the call looks its communicator up in (see _comm.py, _once_per_process).

    Inside a user's shard_map each device calls through its own communicator (the device
    table); everywhere else the process makes one call, through the communicator itself.
    """
    axis_context = ctx.module_context.axis_context
    if (
        isinstance(axis_context, SPMDAxisContext)
        and PROCESS_AXIS not in axis_context.mesh.axis_names
    ):
        return device_table
    region = _regions[-1] if isinstance(axis_context, SPMDAxisContext) else None
    key = (device_table, region)
    if key not in _tables:
        _tables[key] = _table_makers[device_table](region)
    return _tables[key]


def _placeholder_sharding(ctx: mlir.LoweringRuleContext) -> SdyArrayList:
    """A replicated placeholder sharding for the call.

    Calls only reach the SPMD partitioner inside manual regions (a user's shard_map, or the
    one _once_per_process wraps them in); see _once_per_process.
    """
    ndims = [len(a.shape) for a in ctx.avals_out] + [0]
    return SdyArrayList(
        tuple(
            SdyArray(
                mesh_shape=(),
                dim_shardings=(SdyDim(axes=(), is_open=False),) * n,
                logical_device_ids=(),
            )
            for n in ndims
        )
    )


def _keep_dce_rule(used_outputs, eqn):
    """MPI equations are never removed: their effect is the communication itself."""
    return [True] * len(eqn.invars), eqn


_primitives: set = set()


def _once_per_process(primitive, lowering, calls_mpi):
    """Lowers ``primitive`` so that a process makes one MPI call, however many devices it has.

    In a jit over several local devices the operands are the process's whole arrays (the
    local devices' shards together form the buffer each rank contributes), and every device
    gets the whole result. XLA rejects a side-effecting custom call without a sharding
    there, and a replicated one ("side-effect HLO cannot have a replicated sharding"); the
    maximal sharding that would run it on one device is dropped by Shardy, which keeps
    shardings only on the custom calls it knows. So the call runs in a manual region
    (``shard_map``) over the jit's devices, on the replicated operands. Every device runs
    the custom call, but only the first to reach it in a run calls MPI; the others return
    zeros, or the caller's error (no conditional around the call: the devices' programs
    stay identical; see "one call per process" in _ffi.cc). A sum over the devices
    (bit-exact, see _from_first_device) then hands every device the result.
    Operands whose type shards them (Explicit mesh axes) are gathered first, and results are
    sliced to the sharding their operation gives them (see _sharding.py); shard_map could not
    take them as they are, their axes not being the region's.
    Inside a user's shard_map, by contrast, each device makes its own call, through its own
    communicator (see _comm.py).
    """

    def rule(ctx, *args, **params):
        if not calls_mpi(params):  # e.g. the transpose of allreduce, an identity on every device
            return lowering(ctx, *args, **params)
        axis_context = ctx.module_context.axis_context
        if isinstance(axis_context, SPMDAxisContext):
            axes = frozenset(axis_context.mesh.axis_names)
            if axis_context.manual_axes != axes:
                raise NotImplementedError(
                    f"{primitive.name} inside a shard_map that leaves mesh axes "
                    f"{sorted(axes - axis_context.manual_axes)} automatic: MPI calls need every "
                    f"axis manual (one call per device). Omit axis_names in jax.shard_map (all "
                    f"axes manual) or move the MPI call out of the shard_map."
                )
        if not (isinstance(axis_context, ShardingContext) and axis_context.num_devices > 1):
            return lowering(ctx, *args, **params)
        import jax  # noqa: PLC0415
        from jax.sharding import AbstractMesh, PartitionSpec  # noqa: PLC0415

        mesh = AbstractMesh((axis_context.num_devices,), (PROCESS_AXIS,))
        spec = PartitionSpec()

        def body(anchor, *xs):
            # The anchor gives the region an operand and a result even for send and barrier:
            # without them Shardy does not keep the call in the manual region.
            out = primitive.bind(*xs, **params)
            outs = out if primitive.multiple_results else [out]
            return anchor, *(_from_first_device(o) for o in outs)

        region = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(spec,) * (len(args) + 1),
            out_specs=(spec,) * (len(ctx.avals_out) + 1),
            check_vma=False,
        )

        def whole(*xs):
            xs = [_sharding.replicated(x) for x in xs]
            outs = region(jax.numpy.zeros((), jax.numpy.int8), *xs)[1:]
            outs = [_sharding.resharded(o, a) for o, a in zip(outs, ctx.avals_out, strict=True)]
            return list(outs) if primitive.multiple_results else outs[0]

        _regions.append(axis_context.num_devices)
        try:
            return mlir.lower_fun(whole, multiple_results=primitive.multiple_results)(ctx, *args)
        finally:
            _regions.pop()

    return rule


def _from_first_device(value):
    """The calling device's ``value`` on every device of the region, the others holding zeros.

    A sum over the region's devices; floats are summed as unsigned integers of their width,
    so the result is bit-exact (-0.0 and NaN payloads included).
    """
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    dtype = np.dtype(value.dtype)
    if dtype == np.bool_:
        return jax.lax.psum(value.astype(np.uint8), PROCESS_AXIS).astype(np.bool_)
    if dtype.kind == "f" or dtype.name in ("bfloat16",) or "float8" in dtype.name:
        bits = np.dtype(f"uint{dtype.itemsize * 8}")
        summed = jax.lax.psum(jax.lax.bitcast_convert_type(value, bits), PROCESS_AXIS)
        return jax.lax.bitcast_convert_type(summed, dtype)
    return jax.lax.psum(value, PROCESS_AXIS)


def _holds_mpi(jaxpr) -> bool:
    return any(
        eqn.primitive in _primitives
        or any(_holds_mpi(sub) for sub in sub_jaxprs(eqn))
        for eqn in jaxpr.eqns
    )


def _keep_holders(rule):
    """Wraps a higher-order primitive's DCE rule: an equation holding MPI calls stays."""
    rule = rule or _pe._default_dce_rule  # noqa: SLF001

    def dce_rule(used_outputs, eqn):
        if not any(used_outputs) and any(_holds_mpi(j) for j in sub_jaxprs(eqn)):
            return [True] * len(eqn.invars), eqn
        return rule(used_outputs, eqn)

    dce_rule.autoshard_mpi = True
    return dce_rule


_holders_kept = False


def keep_mpi_holders() -> None:
    """Wraps the DCE rules of JAX's higher-order primitives (once, at the first MPI trace).

    The only process-wide change the package makes, and only once MPI operations are used:
    JAX's own DCE rule still decides for every equation that holds no MPI call.
    """
    global _holders_kept
    if _holders_kept:
        return
    _holders_kept = True
    for primitive in _jax.higher_order_primitives:
        rule = _pe.dce_rules.get(primitive)
        if not getattr(rule, "autoshard_mpi", False):
            _pe.dce_rules[primitive] = _keep_holders(rule)


def register(primitive, lowering, *, abstract_eval, batching, jvp=None, transpose=None,
             calls_mpi=lambda params: True) -> None:
    """Registers everything of an MPI primitive, once, in the same order in every file: the
    eager run (jitted), the abstract evaluation, the CPU lowering with the keep-alive DCE rule,
    the batching rule and, where the operation has them, its JVP and transpose.

    ``calls_mpi(params)`` is False for equations whose lowering makes no MPI call.
    """
    primitive.def_impl(partial(apply_primitive, primitive))
    primitive.def_abstract_eval(abstract_eval)
    # Not cacheable: a cached lowering is emitted into a scratch function, out of the block
    # whose token chain it must join.
    mlir.register_lowering(
        primitive, _once_per_process(primitive, lowering, calls_mpi), platform="cpu",
        cacheable=False,
    )
    _pe.dce_rules[primitive] = _keep_dce_rule
    _primitives.add(primitive)
    jax_batching.primitive_batchers[primitive] = batching
    if jvp is not None:
        ad.primitive_jvps[primitive] = jvp
    if transpose is not None:
        ad.primitive_transposes[primitive] = transpose


__all__ = ["emit", "keep_mpi_holders", "register"]
