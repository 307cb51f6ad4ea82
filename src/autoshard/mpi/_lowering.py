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
  call would have triggered the tying. It runs from a wrapper around JAX's
  ``mlir.lower_jaxpr_to_module`` (installed once; a no-op for modules without MPI calls).
  A result-less cond holding MPI calls is rebuilt there to return the chain.
* In a jit over several devices each call runs inside a manual (shard_map) region, once per
  device (see _per_device); the chain is threaded through such regions (and through a
  user's shard_map) by data dependencies, as Shardy inlines them.
* A DCE rule keeps every MPI equation even when its results are unused (send, barrier), and
  the DCE rules of JAX's higher-order primitives (cond, while, scan, jit, ...) are wrapped
  so that an equation holding MPI equations is kept even when its outputs are unused.
"""

from __future__ import annotations

import atexit
from collections import OrderedDict

from jax.interpreters import mlir

from .._compat import mpi_internals
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
    return entry[1]


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
        return  # no MPI call in this module
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


def _lower_jaxpr_to_module(*args, **kwargs):
    result = _lower_jaxpr_to_module_jax(*args, **kwargs)
    with result.module.context, ir.Location.unknown():
        _finish(result.module)
    return result


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


def _sharding(ctx: mlir.LoweringRuleContext) -> SdyArrayList:
    """A replicated placeholder sharding for the call.

    Calls only reach the SPMD partitioner inside manual regions (a user's shard_map, or the
    one _per_device wraps them in), where each device runs its own call; see _per_device.
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


def _per_device(primitive, lowering):
    """Lowers ``primitive`` in a jit over several devices as one call per device.

    XLA rejects a side-effecting custom call without a sharding there, and a replicated one
    ("side-effect HLO cannot have a replicated sharding"); the maximal sharding that would
    run it once, on one device, is dropped by Shardy, which keeps shardings only on the
    custom calls it knows (its Sharding and X64Combine calls and JAX's Python callbacks;
    XLA's SdyRoundTripImportShardyAttrsPass). So the call runs in a manual region
    (``shard_map``) over all the jit's devices, on the whole (replicated) operands: each
    device makes the MPI call through its own communicator (see _comm.py) with the same
    data and gets the same result. Inside a user's shard_map the call is already per device.
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

        mesh = AbstractMesh((axis_context.num_devices,), ("autoshard_mpi",))
        spec = PartitionSpec()

        def body(anchor, *xs):
            # The anchor gives the region an operand and a result even for send and barrier:
            # without them Shardy does not keep the call in the manual region.
            out = primitive.bind(*xs, **params)
            return anchor, *(out if primitive.multiple_results else [out])

        num_out = len(ctx.avals_out)
        region = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * (len(args) + 1),
                               out_specs=(spec,) * (num_out + 1), check_vma=False)

        def call(*xs):
            outs = region(jax.numpy.zeros((), jax.numpy.int8), *xs)[1:]
            return list(outs) if primitive.multiple_results else outs[0]

        return mlir.lower_fun(call, multiple_results=primitive.multiple_results)(ctx, *args)

    return rule


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


def _install_hooks() -> None:
    """Wraps the DCE rules of JAX's higher-order primitives and the module lowering (once)."""
    global _lower_jaxpr_to_module_jax
    if _lower_jaxpr_to_module_jax is not None:
        return
    for primitive in _jax.higher_order_primitives:
        rule = _pe.dce_rules.get(primitive)
        if not getattr(rule, "autoshard_mpi", False):
            _pe.dce_rules[primitive] = _keep_holders(rule)
    _lower_jaxpr_to_module_jax = _mlir.lower_jaxpr_to_module
    _mlir.lower_jaxpr_to_module = _lower_jaxpr_to_module


_lower_jaxpr_to_module_jax = None


def register(primitive, lowering) -> None:
    """Registers the CPU lowering and the keep-alive DCE rule of an MPI primitive."""
    # Not cacheable: a cached lowering is emitted into a scratch function, out of the block
    # whose token chain it must join.
    mlir.register_lowering(primitive, _per_device(primitive, lowering), platform="cpu",
                           cacheable=False)
    _pe.dce_rules[primitive] = _keep_dce_rule
    _primitives.add(primitive)
    _install_hooks()


__all__ = ["emit", "register"]
