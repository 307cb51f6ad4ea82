"""The hidden token chain that keeps MPI calls in program order (see _lowering for why).

Within one block every MPI custom call consumes the token the previous one produced. While
and case ops holding MPI calls are tied into the enclosing chain through optimization
barriers. When JAX finishes a module (its lowering event listener, set only while a module
holding an MPI call lowers), calls to functions holding MPI calls are inlined, result-less
conds rebuilt to return the chain, manual regions threaded, and every block re-chained.
"""

from __future__ import annotations

import atexit
import threading
from collections import OrderedDict

from .._compat import lowering_event_listener, mpi_internals, set_lowering_event_listener

_jax = mpi_internals()
_core, _mlir, ir, hlo = _jax.core, _jax.mlir, _jax.ir, _jax.hlo

PROCESS_AXIS = "autoshard_mpi"  # the mesh axis of _lowering's once-per-process manual region

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


def chain_type():
    """The type of the values that order MPI calls: a one-byte scalar, not an XLA token.

    An ordinary array can be threaded wherever data can (optimization barriers, operands
    and results of shard_map regions, see _thread_manual_region) with no special cases in
    XLA or Shardy. The handlers never read it; it costs one byte per call.
    """
    return ir.RankedTensorType.get([], ir.IntegerType.get_signless(8))


def _chain_start():
    return hlo.constant(ir.DenseElementsAttr.get_splat(chain_type(), ir.IntegerAttr.get(
        ir.IntegerType.get_signless(8), 0)))


def _is_mpi_call(op) -> bool:
    if op.name != "stablehlo.custom_call":
        return False
    return ir.StringAttr(op.attributes["call_target_name"]).value.startswith(_PREFIX)


def _is_process_region(op) -> bool:
    """True for the manual region _lowering wraps a multi-device call in (once per process)."""
    return (op.name == "sdy.manual_computation"
            and PROCESS_AXIS in str(op.attributes["manual_axes"]))


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


def current_token(module_context):
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
        new = hlo.CaseOp([chain_type()], case.operands[0], num_branches=len(case.regions))
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
        # The once-per-process region (_lowering): its anchor operand and result carry the chain as
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


__all__ = ["PROCESS_AXIS", "chain_type", "current_token"]
