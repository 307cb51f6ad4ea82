"""The hidden token chain that keeps MPI calls in program order (see _lowering for why).

While a module lowers, each MPI call consumes the token of the previous call in its block.
When JAX has finished the module (its lowering event listener, set only while a module
holding an MPI call lowers), calls to functions holding MPI calls are inlined and the chain
is threaded through the whole program as data: every while, case and shard_map region that
holds MPI calls is rebuilt to take the chain in and hand it out (a loop-carried value, a
captured value and an extra result, an extra operand and result). No ordering rests on
optimization barriers, which XLA's CPU pipeline removes before it schedules.
"""

from __future__ import annotations

import atexit
import threading
from collections import OrderedDict

from jax.extend.mlir.dialects import sdy

from ..ir._compat import lowering_event_listener, mpi_internals, set_lowering_event_listener

_jax = mpi_internals()
_core, _mlir, ir, hlo = _jax.core, _jax.mlir, _jax.ir, _jax.hlo

PROCESS_AXIS = "autoshard_mpi"  # the mesh axis of _lowering's once-per-process manual region

_PREFIX = "autoshard_mpi_"


class _ModuleState:
    """Token-chain bookkeeping for one module being lowered."""

    def __init__(self):
        self.containers: set = set()  # ops with regions (while, case, shard_map) holding MPI calls
        self.funcs: set[str] = set()  # non-main functions that hold MPI calls


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

    An ordinary array can be threaded wherever data can (loop-carried values, results of
    branches, operands and results of shard_map regions, see _thread_op) with no special
    cases in XLA or Shardy. The handlers never read it; it costs one byte per call.
    """
    return ir.RankedTensorType.get([], ir.IntegerType.get_signless(8))


def _chain_start():
    return hlo.constant(
        ir.DenseElementsAttr.get_splat(
            chain_type(), ir.IntegerAttr.get(ir.IntegerType.get_signless(8), 0)
        )
    )


def _is_mpi_call(op) -> bool:
    if op.name != "stablehlo.custom_call":
        return False
    return ir.StringAttr(op.attributes["call_target_name"]).value.startswith(_PREFIX)


def _is_process_region(op) -> bool:
    """True for the manual region _lowering wraps a multi-device call in (once per process)."""
    return op.name == "sdy.manual_computation" and PROCESS_AXIS in str(op.attributes["manual_axes"])


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


def current_token(module_context):
    """The token the next MPI call at the current insertion point consumes while lowering.

    The previous MPI call's token if the current block has one, else a fresh start. This
    provisional chain only orders calls within one block; once the module is complete,
    ``_finish`` threads the chain through every block and control-flow op.
    """
    _state(module_context)  # has _finish run on this module once it is lowered
    point = ir.InsertionPoint.current
    token = None
    for child in point.block.operations:
        op = child.operation
        if point.ref_operation is not None and op == point.ref_operation:
            break
        if _is_mpi_call(op):
            token = op.results[len(op.results) - 1]
        elif _is_process_region(op):
            token = op.results[0]
    return token if token is not None else _chain_start()


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


def _thread(state: _ModuleState, block, token):
    """Threads the chain through ``block`` in program order, starting from ``token``.

    Every MPI call consumes the token the previous one produced. An op with regions that
    holds MPI calls is rebuilt to carry the chain as data, in and out (see _thread_op), so
    that no XLA pass can reorder or drop the ordering: the optimization barriers a chain
    could also pass through are removed by XLA's CPU pipeline before scheduling. Returns
    the token after the block's last MPI-related op (``token`` itself if there is none).
    """
    for child in list(block.operations):
        op = child.operation
        if _is_mpi_call(op):
            op.operands[0] = token = _start_if_none(token, op)
            token = op.results[len(op.results) - 1]
        elif op in state.containers:
            token = _thread_op(state, op, _start_if_none(token, op))
    return token


def _start_if_none(token, op):
    if token is not None:
        return token
    with ir.InsertionPoint(op), op.location:
        return _chain_start()


def _thread_op(state: _ModuleState, op, token):
    """Rebuilds ``op`` (a while, case or shard_map region holding MPI calls) to carry the chain.

    * while: the token becomes one more loop-carried value; the calls of the condition and
      of the body continue the chain from it and the body returns its last token.
    * case: every branch continues the chain from ``token`` (regions see the values of the
      enclosing block) and returns its last token as one more result.
    * shard_map region (``sdy.manual_computation``): the token is one more operand and
      result (replicated), as the once-per-process region of _lowering carries it from the
      start (its first operand and result).

    Returns the op's token result, which the enclosing block's chain continues from.
    """
    if _is_process_region(op):
        op.operands[0] = token
        (body,) = op.regions[0]
        _set_return(body, _thread(state, body, body.arguments[0]), index=0)
        return op.results[0]
    if op.name == "stablehlo.while":
        cond, body = (region.blocks[0] for region in op.regions)
        # Calls in the condition run between iterations; it cannot hand a token on (it
        # returns the predicate alone), which XLA's strict cond-body alternation makes moot.
        _thread(state, cond, cond.add_argument(chain_type(), op.location))
        _set_return(body, _thread(state, body, body.add_argument(chain_type(), op.location)))
        return _rebuild(op, [*op.operands, token])
    if op.name == "stablehlo.case":
        for region in op.regions:
            (branch,) = region
            _set_return(branch, _thread(state, branch, token))
        return _rebuild(op, list(op.operands))
    if op.name == "sdy.manual_computation":
        (body,) = op.regions[0]
        _set_return(body, _thread(state, body, body.add_argument(chain_type(), op.location)))
        attributes = {
            name: _with_replicated_scalar(op.attributes[name], module_op=_module_of(op))
            for name in ("in_shardings", "out_shardings")
        }
        return _rebuild(op, [*op.operands, token], attributes)
    raise NotImplementedError(
        f"autoshard.mpi: MPI calls inside a {op.name} op cannot be ordered (only while, case "
        f"and shard_map regions can hold them). Move the MPI calls out of it."
    )


def _set_return(block, token, index=None) -> None:
    """Makes ``block``'s terminator return ``token`` too (last, or in place of ``index``)."""
    end = [child.operation for child in block.operations][-1]
    if index is not None:
        end.operands[index] = token
        return
    with ir.InsertionPoint(end), end.location:
        ir.Operation.create(end.name, operands=[*end.operands, token])
    end.erase()


def _rebuild(op, operands, attributes=None):
    """Replaces ``op`` by a copy with ``operands`` and one more result (the chain), moving its
    regions' blocks over; returns that result."""
    types = [result.type for result in op.results]
    merged = {name: op.attributes[name] for name in op.attributes}
    merged.update(attributes or {})
    if "sdy.sharding" in merged:  # per-result shardings (set by sharding rules)
        merged["sdy.sharding"] = _with_replicated_scalar(merged["sdy.sharding"], _module_of(op))
    with ir.InsertionPoint(op), op.location:
        new = ir.Operation.create(
            op.name,
            results=[*types, chain_type()],
            operands=operands,
            attributes=merged,
            regions=len(op.regions),
        )
    for old_region, new_region in zip(op.regions, new.regions, strict=True):
        for block in list(old_region.blocks):
            block.append_to(new_region)
    for old, result in zip(op.results, list(new.results)[:-1], strict=True):
        old.replace_all_uses_with(result)
    op.erase()
    return new.results[len(types)]


def _module_of(op):
    while op.parent is not None:
        op = op.parent
    return op


def _with_replicated_scalar(shardings, module_op):
    """``shardings`` (a per-value sharding list) with a replicated scalar's sharding appended."""
    values = list(sdy.TensorShardingPerValueAttr(shardings).shardings)
    meshes = [sdy.TensorShardingAttr(v).mesh_or_ref for v in values]
    if not meshes:  # no value to take the mesh from: the module's only mesh
        meshes = [
            ir.FlatSymbolRefAttr.get(ir.StringAttr(o.attributes["sym_name"]).value)
            for o in (c.operation for c in module_op.regions[0].blocks[0].operations)
            if o.name == "sdy.mesh"
        ][:1]
    assert meshes, "a shard_map region without a mesh"
    return sdy.TensorShardingPerValueAttr.get([*values, sdy.TensorShardingAttr.get(meshes[0], [])])


def _finish(module) -> None:
    """Inlines the calls to functions holding MPI calls, then threads the chain everywhere."""
    entry = _states.get(id(module))
    if entry is None or entry[0] is not module:
        return  # evicted by more than 8 modules lowering at once (see _state)
    state = entry[1]
    module_op = module.operation
    _mark(state, module_op)
    funcs = {
        ir.StringAttr(op.attributes["sym_name"]).value: op
        for op in (o.operation for o in module.body.operations)
        if op.name == "func.func"
    }
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
            _inline(call, funcs[_callee(call)])
    for name in state.funcs:
        funcs[name].erase()
    state.funcs.clear()
    state.containers.clear()
    _mark(state, module_op)
    for func in (o.operation for o in module.body.operations):
        if func.name == "func.func":
            (block,) = func.regions[0]
            _thread(state, block, None)


__all__ = ["PROCESS_AXIS", "chain_type", "current_token"]
