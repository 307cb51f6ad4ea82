"""One plan for every process: planned once on process 0, shared through JAX's key-value store.

Multi-controller SPMD needs every process to compile the same program with the same shardings,
or the collectives of one process wait for a peer that runs something else. Before a function
runs, every process publishes a fingerprint of the program it traced; process 0 publishes the
plan. A process whose program differs raises an error naming itself and process 0 (and process
0 names the first process that differs); the others receive process 0's plan instead of planning.
With one process this module does nothing.
"""

from __future__ import annotations

import hashlib
import pickle
import re
from collections.abc import Callable
from typing import Any

import jax

from ..ir import _compat

_TIMEOUT_MS = 300_000
_counter = {"next": 0}


class PlanMismatchError(RuntimeError):
    """Two processes traced different programs (or planned differently) for the same call."""


def program_fingerprint(program) -> str:
    """A digest of a traced program, equal in every process that traced the same step.

    Covers the jaxpr text (object addresses removed), the abstract inputs and outputs with their
    paths, and the batch, donation and micro-batch roles.
    """
    return hashlib.sha256(_program_text(program).encode()).hexdigest()[:16]


def program_summary(program) -> str:
    """A readable description to publish next to a fingerprint: one ``path:aval`` per input."""
    ins = ";".join(f"{p}:{_aval(a)}" for p, a in zip(program.in_paths, program.in_avals,
                                                     strict=True))
    return (f"{len(program.closed.jaxpr.eqns)} equations, num_micro_batches="
            f"{program.num_micro_batches}|{ins}")


def agree_on_plan(name: str, program, plan: Any | Callable[[], Any]) -> Any:
    """The plan every process runs: process 0's, after checking that all traced ``program``.

    ``plan``: the plan this process computed, or a function computing it (then only process 0
    calls it: planned once). With one process, returns ``plan`` (called if a function). Raises
    ``PlanMismatchError`` when this process's program fingerprint differs from process 0's, or
    when a plan computed here differs from process 0's. Every process must call this for the same
    functions in the same order (as it compiles them).
    """
    client = _compat.distributed_client()
    if client is None or jax.process_count() == 1:
        return plan() if callable(plan) else plan
    rank, n = jax.process_index(), jax.process_count()
    seq = _counter["next"]
    _counter["next"] += 1
    key = f"autoshard/plan/{seq}"
    fingerprint = program_fingerprint(program)
    mine = f"{fingerprint} {name}: {program_summary(program)}"
    client.key_value_set(f"{key}/program/{rank}", mine)
    if rank == 0:
        chosen = plan() if callable(plan) else plan
        client.key_value_set_bytes(f"{key}/plan", pickle.dumps(chosen))
        for other in range(1, n):
            theirs = client.blocking_key_value_get(f"{key}/program/{other}", _TIMEOUT_MS)
            if theirs.split(" ", 1)[0] != fingerprint:
                raise _mismatch(name, 0, mine, other, theirs)
        return chosen
    first = client.blocking_key_value_get(f"{key}/program/0", _TIMEOUT_MS)
    if first.split(" ", 1)[0] != fingerprint:
        raise _mismatch(name, rank, mine, 0, first)
    chosen = pickle.loads(client.blocking_key_value_get_bytes(f"{key}/plan", _TIMEOUT_MS))
    if not callable(plan) and _what_runs(plan) != _what_runs(chosen):
        raise PlanMismatchError(
            f"{name}: process {rank} planned differently from process 0 for the same program "
            f"(fingerprint {fingerprint}): {_first_difference(plan, chosen)}. Planning is "
            "deterministic for the same program, devices and options, so the processes differ "
            "in devices, method options or AUTOSHARD_* settings; give them the same, or let "
            "process 0 plan alone (pass a function as plan).")
    return chosen


def shared(name: str, text: str, compute: Callable[[], Any]) -> Any:
    """``compute()`` run once, on process 0, its result (or exception) received by every process.

    ``text`` describes what is computed (a jaxpr's text, the options): a process whose ``text``
    differs from process 0's raises ``PlanMismatchError`` naming both. An exception raised by ``compute`` on
    process 0 is raised on every process. Every process must call this for the same things in
    the same order. With one process, returns ``compute()``.
    """
    client = _compat.distributed_client()
    if client is None or jax.process_count() == 1:
        return compute()
    rank, n = jax.process_index(), jax.process_count()
    seq = _counter["next"]
    _counter["next"] += 1
    key = f"autoshard/plan/{seq}"
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    client.key_value_set(f"{key}/program/{rank}", digest)
    if rank == 0:
        try:
            outcome = ("ok", compute())
        except Exception as e:
            outcome = ("error", e)
        try:
            data = pickle.dumps(outcome)
        except Exception:  # an unpicklable exception still reaches the others
            outcome = ("error", RuntimeError(f"{type(outcome[1]).__name__}: {outcome[1]}"))
            data = pickle.dumps(outcome)
        client.key_value_set_bytes(f"{key}/plan", data)
        for other in range(1, n):
            if client.blocking_key_value_get(f"{key}/program/{other}", _TIMEOUT_MS) != digest:
                raise _text_mismatch(name, 0, other)
    else:
        if client.blocking_key_value_get(f"{key}/program/0", _TIMEOUT_MS) != digest:
            raise _text_mismatch(name, rank, 0)
        outcome = pickle.loads(client.blocking_key_value_get_bytes(f"{key}/plan", _TIMEOUT_MS))
    if outcome[0] == "error":
        raise outcome[1]
    return outcome[1]


def jaxpr_text(closed) -> str:
    """A closed jaxpr's text without object addresses (equal in every process that traced it)."""
    return "\n".join([_ADDRESS.sub("", str(closed.jaxpr)),
                      repr([_aval(a) for a in closed.in_avals])])


def _text_mismatch(name, rank, other) -> PlanMismatchError:
    return PlanMismatchError(
        f"{name}: process {rank} and process {other} would plan different things for it (what "
        "they traced, or the devices and options they plan it for, differ), so they would run "
        "different collectives and hang. Every process must call the parallelized function with "
        "arguments of the same shapes, dtypes and static values, the same code and the same "
        "method options.")


def _what_runs(plan):
    """The parts of a plan that decide the compiled program (not its costs or solver notes)."""
    fields = ("mesh_shape", "axis_names", "in_specs", "out_specs", "intermediates",
              "operand_specs")
    if not all(hasattr(plan, f) for f in fields):
        return plan
    return tuple(getattr(plan, f) for f in fields)


def reset() -> None:
    """Restart the call sequence (after ``shutdown``: a new job numbers its plans from 0)."""
    _counter["next"] = 0


def _mismatch(name, rank, mine, other, theirs) -> PlanMismatchError:
    return PlanMismatchError(
        f"{name}: process {rank} and process {other} traced different programs, so they would "
        f"run different collectives and hang: {_describe_difference(mine, rank, theirs, other)}. "
        "Every process must call the parallelized function with arguments of the same shapes, "
        "dtypes and static values, and the same code (a global batch is assembled by "
        "autoshard.DataLoader from each process's local rows).")


def _describe_difference(mine: str, rank: int, theirs: str, other: int) -> str:
    head_a, _, ins_a = mine.partition("|")
    head_b, _, ins_b = theirs.partition("|")
    a, b = ins_a.split(";"), ins_b.split(";")
    if len(a) != len(b):
        return f"process {rank} has {len(a)} inputs, process {other} has {len(b)}"
    for x, y in zip(a, b, strict=True):
        if x != y:
            return f"input {x} on process {rank}, {y.rpartition(':')[2]} on process {other}"
    return (f"the inputs agree but the computations differ (process {rank}: {head_a.split(' ', 1)[1]}; "
            f"process {other}: {head_b.split(' ', 1)[1]})")


def _first_difference(a, b) -> str:
    for field in ("mesh_shape", "axis_names"):
        if getattr(a, field, None) != getattr(b, field, None):
            return f"{field} {getattr(a, field, None)} here, {getattr(b, field, None)} on process 0"
    for kind in ("inputs", "outputs"):
        for x, y in zip(getattr(a, kind, ()), getattr(b, kind, ()), strict=False):
            if x != y:
                return f"{kind[:-1]} {getattr(x, 'path', '?')}: {x} here, {y} on process 0"
    return "the plans differ"


def _aval(a) -> str:
    return f"{getattr(a.dtype, 'name', a.dtype)}[{','.join(map(str, a.shape))}]"  # key<fry> too


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _program_text(program) -> str:
    parts = [_ADDRESS.sub("", str(program.closed.jaxpr)),
             repr([_aval(a) for a in program.in_avals]),
             repr([_aval(a) for a in program.out_avals]),
             repr(program.in_paths), repr(program.out_paths), repr(program.batch_invars),
             repr(program.donated_invars), repr(program.num_micro_batches)]
    return "\n".join(parts)
