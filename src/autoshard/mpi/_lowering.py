"""Lowering shared by all operations: an MPI custom call ordered by a hidden token chain.

The "token" here is a one-byte scalar threaded through the calls (see _chain_type).

Why no JAX effect: any effect on a jitted function takes JAX off its C++ dispatch fast
path (measured here: 10 us for an effect-free jitted call, 125 us with an unordered
effect, 350 us with an ordered one). The operations are therefore effect-free JAX
primitives, and ordering is established while lowering to StableHLO instead:

* Within one block, every MPI custom call consumes the token produced by the previous one
  (a data dependency XLA must respect).
* Control flow (while, case) that contains MPI calls is tied into the enclosing block's
  chain: its first operand is routed through an optimization barrier together with the
  current token (it cannot start before earlier MPI calls finish), and the chain continues
  from a barrier over its first result (later MPI calls wait for it). XLA runs a while or
  conditional as one instruction, so this orders everything inside.
* Function calls (nested jits, cached lowerings) are different: XLA inlines them, after
  which only data dependencies order their contents. When the module is complete (see
  ``_finish``), every call to a function that holds MPI calls is therefore inlined here and
  the chain is rebuilt over the result, so the inlined calls join the caller's chain. That
  final pass also ties in whatever came last in the program, after which no further MPI
  call would have triggered the tying. JAX reports the finished module through its lowering
  event listener; the first MPI call lowered into a module sets that listener (chained to
  any listener already set) and it is restored as soon as that module is finished, so the
  lowering of every program without MPI calls is untouched (see _listen). A result-less cond
  holding MPI calls is rebuilt there to return the chain.
* In a jit over several devices each call runs inside a manual (shard_map) region, on its
  first device only (one MPI call per process, see _once_per_process); the chain is
  threaded through such regions (and through a user's shard_map) by data dependencies, as
  Shardy inlines them.
* A DCE rule keeps every MPI equation even when its results are unused (send, barrier). An
  equation of a higher-order primitive (cond, while, scan, jit, ...) that holds MPI calls but
  has no used output would still be removed by that primitive's DCE rule; those rules are
  therefore wrapped when the first MPI operation is traced (never at import, see _keep_holders).
  The wrapper returns exactly what the original rule returns for equations without MPI calls.
"""

from __future__ import annotations

import atexit
import threading
from collections import OrderedDict

from jax.interpreters import mlir

from .._compat import lowering_event_listener, mpi_internals, set_lowering_event_listener
from ._native import target_name

_jax = mpi_internals()
_core, _mlir, _pe, ir, hlo = _jax.core, _jax.mlir, _jax.pe, _jax.ir, _jax.hlo
SdyArray, SdyArrayList, SdyDim = _jax.SdyArray, _jax.SdyArrayList, _jax.SdyDim
ShardingContext, SPMDAxisContext = _jax.ShardingContext, _jax.SPMDAxisContext

_PREFIX = "autoshard_mpi_"


class _ModuleState:
    """Token-chain bookkeeping for one module being lowered."""

    def __init__(self):
        self.containers: set = set()  # ops with regions (while, case) that hold MPI calls
        self.funcs: set[str] = set()  # non-main functions that hold MPI calls
        self.folds: dict = {}  # container op -> the token that follows it in its block


_states: OrderedDict[int, tuple[object, _ModuleState]] = OrderedDict()
# Drop the held modules before interpreter teardown destroys their MLIR context.
atexit.register(_states.clear)


def _state(module_context) -> _ModuleState:
    # Holding the ir.Module keeps its id (and the addresses of its ops) from being reused
    # while the state refers to them.
    module = module_context.module
    entry = _states.get(id(module))
    if entry is None or entry[0] is not module:
        entry = _states[id(module)] = (module, _ModuleState())
        while len(_states) > 8:  # lowered modules are not revisited
            _states.popitem(last=False)
        _listen(module)
    return entry[1]


# Modules holding MPI calls whose lowering is under way: id -> (module, lowering thread).
_pending: dict[int, tuple[object, int]] = {}
_previous_listener = None


def _listen(module) -> None:
    """Has ``_finish`` run on ``module`` once JAX has lowered it completely.

    Sets JAX's lowering event listener (chained to the one already set) until every pending
    module is finished; the lowering of a program without MPI calls never sees it.
    """
    global _previous_listener
    if not _pending:
        _previous_listener = lowering_event_listener()
        set_lowering_event_listener(_on_lowering_event)
    _pending[id(module)] = (module, threading.get_ident())


def _on_lowering_event(name, *args) -> None:
    if name == "mlir.collect_lowered_jaxprs":
        module = args[1]
        entry = _pending.pop(id(module), None)
        if entry is not None and entry[0] is module:
            with module.context, ir.Location.unknown():
                _finish(module)
    elif name == "lower_jaxpr_to_module":
        # A new lowering on this thread: a module still pending here failed to lower.
        thread = threading.get_ident()
        for key in [k for k, (_, t) in _pending.items() if t == thread]:
            del _pending[key]
    previous = _previous_listener
    if not _pending and lowering_event_listener() is _on_lowering_event:
        set_lowering_event_listener(previous)
    if previous is not None:
        previous(name, *args)


def _chain_type():
    """The type of the values that order MPI calls: a one-byte scalar, not an XLA token.

    An ordinary array can be threaded wherever data can (optimization barriers, operands
    and results of shard_map regions, see _thread_manual_region) with no special cases in
    XLA or Shardy. The handlers never read it; it costs one byte per call.
    """
    return ir.RankedTensorType.get([], ir.IntegerType.get_signless(8))


def _chain_start():
    return hlo.constant(ir.DenseElementsAttr.get_splat(_chain_type(), ir.IntegerAttr.get(
        ir.IntegerType.get_signless(8), 0)))


def _is_mpi_call(op) -> bool:
    if op.name != "stablehlo.custom_call":
        return False
    return ir.StringAttr(op.attributes["call_target_name"]).value.startswith(_PREFIX)


def _is_process_region(op) -> bool:
    """True for the manual region _once_per_process wraps a multi-device call in."""
    return (op.name == "sdy.manual_computation"
            and _PROCESS_AXIS in str(op.attributes["manual_axes"]))


def _callee(op) -> str | None:
    if op.name != "func.call":
        return None
    return ir.FlatSymbolRefAttr(op.attributes["callee"]).value


def _walk(op, visit) -> None:
    """Calls ``visit(op)`` on every operation nested in ``op`` (pre-order)."""
    for region in op.regions:
        for block in region:
            for child in block.operations:
                visit(child.operation)
                _walk(child.operation, visit)


def _mark(state: _ModuleState, module_op) -> None:
    """Marks every region op and function that (transitively) holds an MPI call."""
    changed = True
    while changed:
        changed = False

        def visit(op):
            nonlocal changed
            if not (_is_mpi_call(op) or _callee(op) in state.funcs):
                return
            parent = op.parent
            while parent is not None:
                if parent.name == "func.func":
                    name = ir.StringAttr(parent.attributes["sym_name"]).value
                    if name != "main" and name not in state.funcs:
                        state.funcs.add(name)
                        changed = True
                    break
                if parent not in state.containers:
                    state.containers.add(parent)
                parent = parent.parent

        _walk(module_op, visit)


def _insert_after(block, op):
    ops = [o.operation for o in block.operations]
    i = ops.index(op)
    return ir.InsertionPoint(ops[i + 1]) if i + 1 < len(ops) else ir.InsertionPoint(block)


def _chain(state: _ModuleState, block, token=None):
    """Walks ``block`` in order, tying new MPI-holding ops into its token chain.

    Returns the token after the last MPI-related op of the block (None if there is none).
    """
    for child in list(block.operations):
        op = child.operation
        if _is_mpi_call(op):
            if token is not None:
                op.operands[0] = token  # a call inlined by _finish joins this chain
            token = op.results[len(op.results) - 1]
        elif _is_process_region(op):
            # Its first operand and result are the chain itself (see _thread_manual_region).
            if token is not None:
                op.operands[0] = token
            token = op.results[0]
        elif op in state.folds:
            token = state.folds[op]
        elif (op in state.containers or _callee(op) in state.funcs) and len(op.results):
            if token is not None and len(op.operands):
                with ir.InsertionPoint(op):
                    before = hlo.OptimizationBarrierOp([token, op.operands[0]])
                op.operands[0] = before.results[1]
            with _insert_after(block, op):
                if token is None:
                    token = _chain_start()
                after = hlo.OptimizationBarrierOp([token, op.results[0]])
            token = state.folds[op] = after.results[0]
    return token


def _blocks_outside_in(block):
    """The blocks enclosing ``block`` up to its function, outermost first, then ``block``."""
    path = [block]
    owner = block.owner
    while owner is not None and owner.operation.name != "func.func":
        block = owner.operation.block
        path.append(block)
        owner = block.owner
    return path[::-1]


def _current_token(module_context):
    """The token the next MPI call at the current insertion point must consume."""
    state = _state(module_context)
    module_op = module_context.module.operation
    _mark(state, module_op)
    # Tie MPI-holding ops everywhere (function calls are only visible after their callee
    # is lowered), outer blocks before inner ones.
    for block in _all_blocks(module_op):
        _chain(state, block)
    token = None
    for block in _blocks_outside_in(ir.InsertionPoint.current.block):
        token = _chain(state, block)
    if token is None:
        token = _chain_start()
    return token


def _all_blocks(module_op) -> list:
    blocks = []

    def collect(op):
        for region in op.regions:
            for block in region:
                blocks.append(block)

    collect(module_op)
    _walk(module_op, collect)
    return blocks


def _inline(call, callee) -> None:
    """Replaces ``call`` by a copy of ``callee``'s body (a single block ending in a return)."""
    (block,) = callee.regions[0]
    mapping = dict(zip(block.arguments, call.operands, strict=True))

    def remap(op):
        for i, operand in enumerate(op.operands):
            new = mapping.get(operand)
            if new is not None:
                op.operands[i] = new

    ops = [child.operation for child in block.operations]
    with ir.InsertionPoint(call):
        for op in ops[:-1]:
            clone = op.clone()
            remap(clone)
            _walk(clone, remap)  # values captured by nested regions
            mapping.update(zip(op.results, clone.results, strict=True))
    for result, returned in zip(call.results, ops[-1].operands, strict=True):
        result.replace_all_uses_with(mapping.get(returned, returned))
    call.erase()


def _add_token_result(state: _ModuleState, case) -> None:
    """Rebuilds a result-less ``case`` holding MPI calls to return its branches' last token.

    Without a result nothing can depend on it, so later MPI calls could overtake it.
    """
    with ir.InsertionPoint(case), case.location:
        new = hlo.CaseOp([_chain_type()], case.operands[0], num_branches=len(case.regions))
    for old_region, new_region in zip(case.regions, new.regions, strict=True):
        (old_block,) = old_region
        token = _chain(state, old_block)
        new_block = new_region.blocks.append()
        ops = [child.operation for child in old_block.operations]
        with ir.InsertionPoint(new_block), case.location:
            if token is None:
                token = _chain_start()
            end = hlo.ReturnOp([token]).operation
        for op in ops[:-1]:
            op.move_before(end)
    state.containers.discard(case)
    state.folds.pop(case, None)
    case.erase()


def _thread_manual_region(state: _ModuleState, region_op) -> None:
    """Threads the chain through a shard_map region (``sdy.manual_computation``).

    Shardy inlines the region's body when it exports the module, so, as for a function
    call, only data dependencies order its MPI calls after that: the first one waits for
    the region's first operand (which _chain gates with the outer token) and the region's
    first result waits for the last one (which _chain's barrier after the region consumes).
    """
    (block,) = region_op.regions[0]
    ops = [child.operation for child in block.operations]
    if not len(block.arguments) or not len(ops[-1].operands):
        return
    if _is_process_region(region_op):
        # _once_per_process's own region: its anchor operand and result carry the chain as
        # plain data (barriers over constants do not survive XLA's simplifications).
        token = _chain(state, block, block.arguments[0])
        ops[-1].operands[0] = token
        return
    with ir.InsertionPoint(ops[0]):
        start = hlo.OptimizationBarrierOp([_chain_start(), block.arguments[0]]).results[0]
    token = _chain(state, block, start)
    with ir.InsertionPoint(ops[-1]):
        end = hlo.OptimizationBarrierOp([token, ops[-1].operands[0]])
    ops[-1].operands[0] = end.results[1]


def _finish(module) -> None:
    """Inlines the calls to functions holding MPI calls, then rebuilds the chain everywhere."""
    entry = _states.get(id(module))
    if entry is None or entry[0] is not module:
        return  # evicted by more than 8 modules lowering at once (see _state)
    state = entry[1]
    module_op = module.operation
    _mark(state, module_op)
    funcs = {ir.StringAttr(op.attributes["sym_name"]).value: op
             for op in (o.operation for o in module.body.operations) if op.name == "func.func"}
    calls: list = []

    def find_calls(op):
        if _callee(op) in state.funcs:
            calls.append(op)

    while True:  # an inlined body may hold further calls
        calls.clear()
        _walk(module_op, find_calls)
        if not calls:
            break
        for call in calls:
            state.folds.pop(call, None)
            _inline(call, funcs[_callee(call)])
    for name in state.funcs:
        funcs[name].erase()
    state.funcs.clear()
    _mark(state, module_op)
    cases = []
    _walk(module_op, lambda op: cases.append(op) if op.name == "stablehlo.case"
          and op in state.containers and not len(op.results) else None)
    for case in reversed(cases):  # inner ones first
        _add_token_result(state, case)
    _mark(state, module_op)
    regions = []
    _walk(module_op, lambda op: regions.append(op) if op.name == "sdy.manual_computation"
          and op in state.containers else None)
    for region in reversed(regions):
        _thread_manual_region(state, region)
    for block in _all_blocks(module_op):
        _chain(state, block)


def _layout(aval):
    return tuple(range(len(aval.shape) - 1, -1, -1))


def _attr(value):
    if isinstance(value, tuple):
        return ir.DenseI64ArrayAttr.get([int(v) for v in value])
    return mlir.i64_attr(int(value))


def emit(ctx: mlir.LoweringRuleContext, op: str, operands, *,
         attrs: dict[str, int | tuple[int, ...]], aliases: dict[int, int] | None = None):
    """Emits the custom call for ``op``; returns its array results (the token is chained).

    ``attrs`` are int64 scalars or tuples (int64 arrays). ``aliases`` maps an array operand
    index to the array result index it is donated to.
    """
    token = _current_token(ctx.module_context)
    attrs = {**attrs, "comm": _comm_table(ctx, attrs["comm"])}
    result_types = [mlir.aval_to_ir_type(ctx.module_context, a) for a in ctx.avals_out]
    call = _mlir.custom_call(
        target_name(op),
        result_types=[*result_types, _chain_type()],
        operands=[token, *operands],
        backend_config={k: _attr(v) for k, v in attrs.items()},
        has_side_effect=True,
        api_version=4,
        operand_layouts=[(), *(_layout(a) for a in ctx.avals_in)],
        result_layouts=[*(_layout(a) for a in ctx.avals_out), ()],
        operand_output_aliases={i + 1: o for i, o in (aliases or {}).items()},
    )
    _mlir.set_sharding(ctx.module_context, call, _sharding(ctx))
    return list(call.results)[:-1]


_PROCESS_AXIS = "autoshard_mpi"  # the mesh axis of _once_per_process's manual region
_leaders: list[int] = []  # the leader device of the _once_per_process region being lowered
_table_makers: dict[int, object] = {}  # device-table id -> its communicator's make_table
_tables: dict[tuple[int, int | None], int] = {}  # (device table, leader) -> table id


def pair_comm_tables(device_table: int, make_table) -> None:
    """Records how to build the other tables of a communicator whose device table is given.

    ``make_table(None)`` maps every device to the communicator, ``make_table(d)`` only
    device ``d`` (the others skip their calls); both return the table's id.
    """
    _table_makers[device_table] = make_table


def _comm_table(ctx: mlir.LoweringRuleContext, device_table: int) -> int:
    """The table the call looks its communicator up in (see _comm.py, _once_per_process).

    Inside a user's shard_map each device calls through its own communicator (the device
    table); everywhere else the process makes one call, through the communicator itself.
    """
    axis_context = ctx.module_context.axis_context
    if (isinstance(axis_context, SPMDAxisContext)
            and _PROCESS_AXIS not in axis_context.mesh.axis_names):
        return device_table
    leader = _leaders[-1] if isinstance(axis_context, SPMDAxisContext) else None
    key = (device_table, leader)
    if key not in _tables:
        _tables[key] = _table_makers[device_table](leader)
    return _tables[key]


def _sharding(ctx: mlir.LoweringRuleContext) -> SdyArrayList:
    """A replicated placeholder sharding for the call.

    Calls only reach the SPMD partitioner inside manual regions (a user's shard_map, or the
    one _once_per_process wraps them in); see _once_per_process.
    """
    ndims = [len(a.shape) for a in ctx.avals_out] + [0]
    return SdyArrayList(tuple(
        SdyArray(mesh_shape=(), dim_shardings=(SdyDim(axes=(), is_open=False),) * n,
                 logical_device_ids=())
        for n in ndims))


def _keep_dce_rule(used_outputs, eqn):
    """MPI equations are never removed: their effect is the communication itself."""
    return [True] * len(eqn.invars), eqn


_primitives: set = set()


def _once_per_process(primitive, lowering):
    """Lowers ``primitive`` so that a process makes one MPI call, however many devices it has.

    In a jit over several local devices the operands are the process's whole arrays (the
    local devices' shards together form the buffer each rank contributes), and every device
    gets the whole result. XLA rejects a side-effecting custom call without a sharding
    there, and a replicated one ("side-effect HLO cannot have a replicated sharding"); the
    maximal sharding that would run it on one device is dropped by Shardy, which keeps
    shardings only on the custom calls it knows. So the call runs in a manual region
    (``shard_map``) over the jit's devices, on the replicated operands. Every device runs
    the custom call, but only the first one (the leader) finds the communicator in its
    table entry and calls MPI; the others find MPI_COMM_NULL and return zeros (a
    conditional around the call would be simpler, but XLA then drops the ordering
    barriers around it). A sum over the devices (bit-exact, see _from_first_device) then
    hands every device the result.
    Inside a user's shard_map, by contrast, each device makes its own call, through its own
    communicator (see _comm.py).
    """
    def rule(ctx, *args, **params):
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

        mesh = AbstractMesh((axis_context.num_devices,), (_PROCESS_AXIS,))
        spec = PartitionSpec()
        assignment = axis_context.device_assignment
        leader = assignment[0].id if assignment else 0

        def body(anchor, *xs):
            # The anchor gives the region an operand and a result even for send and barrier:
            # without them Shardy does not keep the call in the manual region.
            out = primitive.bind(*xs, **params)
            outs = out if primitive.multiple_results else [out]
            return anchor, *(_from_first_device(o) for o in outs)

        region = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * (len(args) + 1),
                               out_specs=(spec,) * (len(ctx.avals_out) + 1), check_vma=False)

        def whole(*xs):
            outs = region(jax.numpy.zeros((), jax.numpy.int8), *xs)[1:]
            return list(outs) if primitive.multiple_results else outs[0]

        _leaders.append(leader)
        try:
            return mlir.lower_fun(whole, multiple_results=primitive.multiple_results)(ctx, *args)
        finally:
            _leaders.pop()

    return rule


def _from_first_device(value):
    """The first device's ``value`` on every device of the region, the others holding zeros.

    A sum over the region's devices; floats are summed as unsigned integers of their width,
    so the result is bit-exact (-0.0 and NaN payloads included).
    """
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    dtype = np.dtype(value.dtype)
    if dtype == np.bool_:
        return jax.lax.psum(value.astype(np.uint8), _PROCESS_AXIS).astype(np.bool_)
    if dtype.kind == "f" or dtype.name in ("bfloat16",) or "float8" in dtype.name:
        bits = np.dtype(f"uint{dtype.itemsize * 8}")
        summed = jax.lax.psum(jax.lax.bitcast_convert_type(value, bits), _PROCESS_AXIS)
        return jax.lax.bitcast_convert_type(summed, dtype)
    return jax.lax.psum(value, _PROCESS_AXIS)


def _holds_mpi(jaxpr) -> bool:
    return any(eqn.primitive in _primitives
               or any(_holds_mpi(sub) for sub in _core.jaxprs_in_params(eqn.params))
               for eqn in jaxpr.eqns)


def _keep_holders(rule):
    """Wraps a higher-order primitive's DCE rule: an equation holding MPI calls stays."""
    rule = rule or _pe._default_dce_rule  # noqa: SLF001

    def dce_rule(used_outputs, eqn):
        if not any(used_outputs) and any(_holds_mpi(j) for j in _core.jaxprs_in_params(eqn.params)):
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


def register(primitive, lowering) -> None:
    """Registers the CPU lowering and the keep-alive DCE rule of an MPI primitive."""
    # Not cacheable: a cached lowering is emitted into a scratch function, out of the block
    # whose token chain it must join.
    mlir.register_lowering(primitive, _once_per_process(primitive, lowering), platform="cpu",
                           cacheable=False)
    _pe.dce_rules[primitive] = _keep_dce_rule
    _primitives.add(primitive)


__all__ = ["emit", "keep_mpi_holders", "register"]
