"""A pipeline whose sub-meshes belong to different processes (multi-controller JAX).

Every process builds the same executable and walks the same global action list. A task whose
sub-mesh has no device of this process is not compiled there (``RemoteTask``): calling it
dispatches nothing and hands back its outputs as arrays with no local shards, so every process
holds the same values, in the same shardings, in the same order. Values move between sub-meshes
with ``jax.device_put``; between processes it is JAX's cross-host transfer, which both ends
must issue, in the same order (the order of the action list), and which needs the two layouts
to match shard for shard (the mover lays the value out on the source first). On CPU the
transfer goes through the socket address that ``autoshard.init`` sets per process
(``jax_cross_host_transfer_socket_address``).

What else differs from one process:

* Copies between sub-meshes of different sizes go as single-device pieces: each process issues
  the pieces it sends or receives, and the ones between two devices of another process are
  left to that process (``copy_replicated``).
* On XLA:CPU a process waits for the arrays it receives from another process (``settle``,
  which says what was observed without it).
* Sums over several stages (a tied parameter's gradient, the global norm) are no transfers:
  one jit over a mesh of every stage's devices (``span.SpanReduce``), a collective across the
  processes (gloo on CPU, NCCL on GPU) that every process runs at the same point of the apply
  list.
* Outputs that do not replace a step input (the loss, metrics) are replicated over every device
  of the pipeline, so each process can read them (``readable_outputs``); the new train state
  stays on the stages that hold it for the next step.
* Every process checks that it traced the same step and cut it into the same stages as
  process 0 (``agree_on_stages``) before planning; each task is planned once, on process 0,
  and its plan shared (``planned_once``); every process checks that it laid out every task as
  process 0 did (``agree``) before the first step runs.
"""

from __future__ import annotations

import dataclasses
import functools
import pickle

import jax
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from ..distributed import plan_sync
from ..distributed._runtime import TRANSFER_FLAG
from ..ir import _compat


def multi_process() -> bool:
    return jax.process_count() > 1


def placeholder(shape, dtype, sharding):
    """An array of ``sharding`` with none of its shards here (this process owns none)."""
    return jax.make_array_from_single_device_arrays(shape, sharding, [], dtype=dtype)


def process_local(x, target):
    """A first placement's input as ``jax.device_put`` takes it in every process.

    An array committed to devices of this process only (``jax.device_put(x, device)``) is this
    process's own copy of the value, like a numpy array: each process holds one on a different
    device, so it is placed from the host (each process gives the shards on its devices).
    """
    if (
        multi_process()
        and isinstance(x, jax.Array)
        and getattr(x, "committed", False)
        and x.is_fully_addressable
        and not target.is_fully_addressable
    ):
        return np.asarray(x)
    return x


def copy_replicated(x, mesh):
    """``x`` (replicated over its ``NamedSharding``'s mesh) replicated over ``mesh``.

    Destination device i gets a copy from a source device of its own process when there is one,
    else from source device ``i mod n``. The copies go in one batched ``jax.device_put``: the
    ones within this process, and every one between two processes (both ends issue those).
    """
    me = jax.process_index()
    src = list(x.sharding.mesh.devices.flat)
    dst = list(mesh.devices.flat)
    local = {s.device: s.data for s in x.addressable_shards}
    pieces, targets, received = [], [], []
    for i, d in enumerate(dst):
        near = [s for s in src if s.process_index == d.process_index]
        s = near[i % len(near)] if near else src[i % len(src)]
        if s.process_index == d.process_index != me:
            continue  # a copy inside another process
        piece = local.get(s)
        if piece is None:
            piece = placeholder(x.shape, x.dtype, SingleDeviceSharding(s))
        pieces.append(piece)
        targets.append(d)
        received.append(d.process_index == me != s.process_index)
    moved = jax.device_put(pieces, [SingleDeviceSharding(d) for d in targets]) if pieces else []
    settle([p for p, r in zip(moved, received, strict=True) if r])
    mine = [p for p, d in zip(moved, targets, strict=True) if d.process_index == me]
    return jax.make_array_from_single_device_arrays(
        x.shape, NamedSharding(mesh, P()), mine, dtype=x.dtype
    )


def crosses(src, target) -> bool:
    """Whether a move from sharding ``src`` to ``target`` goes between processes."""
    return multi_process() and (
        {d.process_index for d in src.device_set} != {d.process_index for d in target.device_set}
    )


def settle(received) -> None:
    """Wait until arrays this process receives from another process have arrived (XLA:CPU).

    On XLA:CPU (jaxlib 0.10.2) dispatching work on a buffer that is still arriving from another
    process can stall both processes for good. Observed without this wait, 2 processes x 2 CPU
    devices, tied GPT step of ``tests/distributed/pipeline_workers.py``, machine loaded: the
    2+2 layout hung in 2 of 3 runs of 3 steps and in 3 of 9 runs of 1 step (so not XLA's
    32-computation in-flight limit); the 2+1 layout, which hung before cross-stage sums became
    one all-reduce, finished 3 of 3. Stacks of hung runs: once process 0's Python thread was
    inside the call of a 2-device task of the action loop (the call never returned) while
    process 1 waited for the loss; once process 0 waited for the loss with its compute threads
    and its transfer server's send and recv threads all idle. XLA:CPU runs an executable with
    several local devices by enqueuing one ExecuteHelper per device and blocking the calling
    thread until they return, collectives gang-scheduled behind the previous collective launch
    (``cpu_client.cc``); the likely cycle is such a call waiting on an arriving input while the
    blocked thread cannot issue the transfer the other process needs first. Not proven: the
    other process's native stack could not be captured. Waiting for arrivals breaks the cycle
    (nothing is dispatched on a buffer in flight). The sender does not wait, so sending stays
    asynchronous. Only the CPU waits: on GPU (NCCL transfers, and cross-stage sums as NCCL
    all-reduces, ``span.py``) nothing here blocks.
    """
    arrays = [a for a in received if a.addressable_shards]
    if arrays and arrays[0].addressable_shards[0].device.platform == "cpu":
        jax.block_until_ready(arrays)


class RemoteTask:
    """A compiled task whose sub-mesh has no device of this process (another one runs it).

    Calling it dispatches nothing and returns the outputs as arrays with no shards here, as
    calling the compiled executable would, without compiling it: each process compiles only
    the tasks of its own stages. Anything else (``as_text``, ``memory_analysis``) compiles it
    on first use.
    """

    def __init__(self, lowered):
        self._lowered, self._compiled = lowered, None
        self._outs = jax.tree.leaves(lowered.out_info)

    def __call__(self, *args):
        return [placeholder(o.shape, o.dtype, o.sharding) for o in self._outs]

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if self._compiled is None:
            self._compiled = self._lowered.compile()
        return getattr(self._compiled, name)


def compile_task(lowered, mesh):
    """``lowered.compile()``, or a ``RemoteTask`` when no device of ``mesh`` is this process's."""
    me = jax.process_index()
    if multi_process() and all(d.process_index != me for d in mesh.devices.flat):
        return RemoteTask(lowered)
    return lowered.compile()


@functools.lru_cache(maxsize=32)
def job_mesh(meshes: tuple):
    """A 1-D mesh over every device of the pipeline's sub-meshes, in stage order."""
    devices = list(dict.fromkeys(d for m in meshes for d in m.devices.flat))
    return _compat.make_auto_mesh(np.array(devices, dtype=object), ("x",))


def everywhere(x, meshes, move):
    """``x`` replicated over every device of ``meshes`` (each process can read it)."""
    full = job_mesh(tuple(meshes))
    rep = NamedSharding(full, P())
    if x.sharding.device_set == rep.device_set and x.sharding.is_fully_replicated:
        return x
    copies = []
    for m in meshes:
        target = NamedSharding(m, P())
        if x.sharding.device_set == target.device_set:
            copies.append(move.reshard(x, target) if not x.sharding.is_fully_replicated else x)
    if not copies:  # x is elsewhere: first replicated on the first sub-mesh
        copies.append(move(x, NamedSharding(meshes[0], P())))
    held = copies[0]
    for m in meshes:
        if not held.sharding.device_set & set(m.devices.flat):
            copies.append(move(held, NamedSharding(m, P())))
    shards = [s.data for c in copies for s in c.addressable_shards]
    return jax.make_array_from_single_device_arrays(x.shape, rep, shards, dtype=x.dtype)


def readable_outputs(executable, out: list) -> list:
    """The step's outputs with every one that is not new state replicated over all stages."""
    if not multi_process():
        return out
    kept = {o for _, o in executable.program.aliases}
    meshes = executable.rank_meshes
    every = {d for m in meshes for d in m.devices.flat}
    result = []
    for i, x in enumerate(out):
        sh = getattr(x, "sharding", None)
        if (
            i not in kept
            and isinstance(sh, NamedSharding)
            and not (sh.device_set == every and sh.is_fully_replicated)
        ):
            x = everywhere(x, meshes, executable.move)
        result.append(x)
    return result


def planned_once(name: str, closed, mesh, option, plan):
    """``plan()`` (the plan of task ``name``) run on process 0 only, as a function that returns
    its result or raises its exception (on every process alike).

    The other processes receive the outcome through the distributed runtime's key-value store,
    after checking that they would plan the same thing (the task's jaxpr, its sub-mesh's shape,
    the planner options); a difference raises ``PlanMismatchError`` here, not from the function.
    With one process, ``plan()`` runs here.
    """

    def attempt():
        try:
            return "ok", plan()
        except Exception as e:
            if multi_process():
                try:
                    pickle.dumps(e)
                except Exception:  # it must reach the other processes
                    e = RuntimeError(f"{type(e).__name__}: {e}")
            return "error", e

    if multi_process():
        what = "\n".join(
            [
                plan_sync.jaxpr_text(closed),
                repr(tuple(mesh.devices.shape)),
                repr(tuple(mesh.axis_names)),
                repr(option),
            ]
        )
        kind, value = plan_sync.shared(name, what, attempt)
    else:
        kind, value = attempt()

    def result():
        if kind == "error":
            raise value
        return value

    return result


def agree_on_stages(name: str, program, plan, agree) -> None:
    """Check that this process traced the same step as process 0 and cut it into the same
    stages (``agree``: ``Call.agree``); raises ``PlanMismatchError`` naming both processes
    otherwise."""
    if multi_process():
        _check_transport(name, plan)
    mine = _stages(plan)
    first = agree(program, lambda: mine)
    if first != mine:
        field = next(f for f in mine if mine[f] != first[f])
        raise plan_sync.PlanMismatchError(
            f"{name}: process {jax.process_index()} cut the pipeline differently from process 0 "
            f"for the same program: {field} {mine[field]} here, {first[field]} on process 0. "
            "Stage choices that measure time (AutoStageOption(profile=True)) can differ between "
            "processes; pass the stages process 0 chose as a ManualStageOption."
        )


def _check_transport(name: str, plan) -> None:
    """On CPU, stages of several processes need the transfer address ``autoshard.init`` sets."""
    by_id = {d.id: d for d in jax.devices()}
    devices = [by_id[i] for ids in plan.stage_devices for i in ids]
    if len({d.process_index for d in devices}) < 2 or devices[0].platform != "cpu":
        return
    if not jax.config.read(TRANSFER_FLAG):
        raise RuntimeError(
            f"{name}: the pipeline's stages are on devices of several processes, which exchange "
            f"arrays through JAX's cross-host transfers, but {TRANSFER_FLAG} is not set in "
            f"process {jax.process_index()}, so the CPU backend has no transfer server. Join the "
            "job with autoshard.init(cluster='distributed') (it sets one per process), or set "
            f"jax.config.update('{TRANSFER_FLAG}', 'this-host:free-port') before "
            "jax.distributed.initialize."
        )


def agree(executable, agree_on) -> None:
    """Check that this process laid out every task of ``executable`` as process 0 did (the
    input and output layouts, which decide every transfer; ``agree_on``: ``Call.agree``);
    raises ``PlanMismatchError`` naming both processes otherwise: they would wait on each
    other's transfers for ever."""
    mine = {
        t.task.name: ([str(s.spec) for s in t.in_shardings], [str(s.spec) for s in t.out_shardings])
        for t in executable._ordered_tasks()
    }
    first = agree_on(executable.program, lambda: mine)
    if first == mine:
        return
    task = next(t for t in mine if mine[t] != first.get(t))
    raise plan_sync.PlanMismatchError(
        f"{executable.name}: process {jax.process_index()} laid out task {task} differently "
        f"from process 0: input/output specs {mine[task]} here, {first.get(task)} on process 0. "
        "Give every process the same devices, method options and AUTOSHARD_* settings."
    )


def _stages(plan) -> dict:
    keep = (
        "num_layers",
        "stage_layer_ids",
        "submesh_shapes",
        "stage_devices",
        "schedule",
        "num_micro_batches",
    )
    return {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if f.name in keep}


__all__ = [
    "RemoteTask",
    "agree",
    "agree_on_stages",
    "compile_task",
    "copy_replicated",
    "crosses",
    "multi_process",
    "planned_once",
    "process_local",
    "readable_outputs",
    "settle",
]
