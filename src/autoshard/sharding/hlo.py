"""Reading compiled HLO text: computations, loop trip counts, collectives and their mesh axes;
a step with gradient accumulation cut into Alpa's two modules (``accumulate_apply_modules``).

XLA's optimized HLO is the ground truth of what a plan costs. This module turns its text into
``CompiledCollective`` records: the kind, the bytes one device receives (from the result
shapes), how many times it runs per step (trip counts of the ``while`` loops around it), the
mesh axes its replica groups span, and the bytes it puts on the links.

Result bytes alone do not compare plans whose collectives run over groups of different sizes:
an all-reduce of 1 MB moves 1 MB per device over 2 devices but 1.75 MB over 8. ``wire_bytes``
is what each device sends under the bandwidth-optimal (ring) algorithms, the ``VOLUME``
factors of the cost model: all-reduce ``2(n-1)/n`` of the array, all-gather and all-to-all
``(n-1)/n`` of the result, reduce-scatter ``(n-1)`` times its result (the shard), and a
collective-permute its whole result.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
          "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_HEADER = re.compile(r"^(?:ENTRY )?%(?P<name>[\w.\-]+) ", re.M)
_CALLS = re.compile(r"(?:body|condition|calls|to_apply|branch_computations)=(\{[^}]*\}|%?[\w.\-]+)")
_INSTR = re.compile(
    r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = (?P<shape>.*?) (?P<kind>all-reduce|all-gather|"
    r"reduce-scatter|all-to-all|collective-permute)(?P<start>-start)?\((?P<rest>.*)$", re.M)
_SHAPE = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")


@dataclass(frozen=True)
class CompiledCollective:
    """One collective instruction of the compiled program."""

    kind: str
    """all-reduce, all-gather, reduce-scatter, all-to-all or collective-permute."""
    num_bytes: int
    """Bytes of its result on one device, per execution."""
    count: int
    """Executions per step (product of the trip counts of enclosing while loops)."""
    axes: tuple[str, ...] | None
    """Mesh axes its groups span, or None when they match no set of axes."""
    shape: str
    """The result shape as printed in the HLO."""
    in_loop: bool
    """Whether it runs inside a while loop."""
    group_size: int = 1
    """Devices in each of its replica groups (1 when the HLO names none)."""

    @property
    def wire_bytes(self) -> float:
        """Bytes one device sends per execution under ring algorithms (see the module doc)."""
        n, b = self.group_size, self.num_bytes
        if self.kind == "collective-permute":
            return float(b)
        if n <= 1:
            return 0.0
        factor = {"all-reduce": 2.0 * (n - 1) / n, "all-gather": (n - 1) / n,
                  "all-to-all": (n - 1) / n, "reduce-scatter": float(n - 1)}[self.kind]
        return factor * b


def shape_bytes(shape: str) -> int:
    return sum(_BYTES.get(t, 4) * math.prod(int(d) for d in dims.split(",") if d)
               for t, dims in _SHAPE.findall(shape))


def computations(text: str) -> dict[str, str]:
    """Computation name -> its text."""
    starts = [(m.start(), m.group("name")) for m in _HEADER.finditer(text)
              if text[m.start():text.find("\n", m.start())].rstrip().endswith("{")]
    ends = [s for s, _ in starts[1:]] + [len(text)]
    return {name: text[pos:end] for (pos, name), end in zip(starts, ends, strict=True)}


def _callees(body: str) -> list[str]:
    return [n.strip().lstrip("%") for m in _CALLS.finditer(body)
            for n in m.group(1).strip("{}").split(",") if n.strip()]


def execution_counts(text: str) -> dict[str, int]:
    """Computation name -> how many times it runs per step (while trip counts multiply)."""
    comps = computations(text)
    counts: dict[str, int] = {}

    def visit(name: str, times: int):
        if name not in comps or counts.get(name, 0) >= times:
            return
        counts[name] = times
        for line in comps[name].splitlines():
            if " while(" in line:
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                n = int(trips.group(1)) if trips else 1
                for callee in _callees(line):
                    visit(callee, times * n)
            else:
                for callee in _callees(line):
                    visit(callee, times)

    for name, body in comps.items():  # every module's entry (Alpa's view holds two)
        if body.startswith("ENTRY"):
            visit(name, 1)
    return counts


def collectives(text: str, axis_names=(), mesh_shape=()) -> list[CompiledCollective]:
    """Every collective of the compiled program, with its trips and mesh axes."""
    counts = execution_counts(text)
    groups_of = _axis_groups(tuple(axis_names), tuple(mesh_shape))
    found = []
    for name, body in computations(text).items():
        times = counts.get(name, 0)
        if not times:
            continue
        for m in _INSTR.finditer(body):
            kind, shape, rest = m.group("kind"), m.group("shape"), m.group("rest")
            if m.group("start") and kind in ("all-gather", "all-to-all", "collective-permute"):
                shape = shape.split("}, ")[-1] if shape.startswith("(") else shape
            groups = _replica_groups(rest)
            axes = groups_of.get(groups) if groups is not None else None
            if kind == "collective-permute":
                axes = None
            size = len(next(iter(groups))) if groups else 1
            if "replica_groups={}" in rest:   # one group of every device
                size = math.prod(mesh_shape) if mesh_shape else 1
            found.append(CompiledCollective(kind=kind, num_bytes=shape_bytes(shape), count=times,
                                            axes=axes, shape=shape, in_loop=times > 1,
                                            group_size=size))
    return found


ACCUMULATE_SCOPE = "autoshard_accumulate_grad"
"""The name scope (``jax.named_scope``) gradient accumulation traces its micro-batch loop and
the reduction after it under: the op names of their compiled instructions hold it."""

_ENTRY_INSTR = re.compile(r"^\s*(?P<root>ROOT )?%(?P<name>[\w.\-]+) = (?P<shape>.*?) "
                          r"(?P<op>[a-z][\w\-]*)\((?P<rest>.*)$")
_CALL_ATTRS = re.compile(
    r"(?:body|condition|calls|to_apply|branch_computations)=(?:\{[^}]*\}|%?[\w.\-]+)")
_LEAVES = ("constant", "partition-id", "replica-id", "iota")


def accumulate_apply_modules(text: str) -> tuple[str, str] | None:
    """A compiled step with gradient accumulation cut into Alpa's two modules, or None.

    Alpa compiles such a step as two executables, ``accumulate_grad`` (a micro-batch's
    gradients added to the accumulators, then reduced over the devices) and ``apply_grad``
    (the update). autoshard compiles one module: the micro-batch loop (a ``while``), the one
    reduction after it, the update. This cuts that module's entry computation after the
    reduction: the first module holds what the loop and the reduction (both traced under
    ``ACCUMULATE_SCOPE``) need and returns the values the rest reads; the second holds the
    rest and takes the entry parameters it reads and those values as its parameters. Every
    instruction of the compiled entry is in exactly one module (a constant or partition id in
    each that reads it), each with the computations it calls. A view of one compiled program,
    not two: the step still runs as one executable. None when the entry has no loop traced
    under ``ACCUMULATE_SCOPE`` or nothing runs after it.
    """
    if not text.startswith("HloModule"):
        return None
    comps = computations(text)
    entry = next((n for n, body in comps.items() if body.startswith("ENTRY")), None)
    if entry is None:
        return None
    instrs = {m["name"]: m for m in map(_ENTRY_INSTR.match, comps[entry].splitlines()[1:]) if m}
    ops = {n: [u for u in dict.fromkeys(re.findall(r"%([\w.\-]+)", _CALL_ATTRS.sub("", m["rest"])))
               if u in instrs and u != n] for n, m in instrs.items()}
    tagged = [n for n, m in instrs.items()
              if m["op"] != "parameter" and ACCUMULATE_SCOPE in m["rest"]]
    if not any(instrs[n]["op"] == "while" for n in tagged):
        return None
    acc, todo = set(), list(tagged)
    while todo:  # the loop, the reduction and everything they read
        n = todo.pop()
        if n not in acc:
            acc.add(n)
            todo += ops[n]
    root = next(n for n, m in instrs.items() if m["root"])
    if root in acc:
        return None

    def free(n):  # read where needed rather than passed: parameters, constants, ids
        return instrs[n]["op"] == "parameter" or (instrs[n]["op"] in _LEAVES and not ops[n])

    acc_own = [n for n in instrs if n in acc and not free(n)]
    apply_own = [n for n in instrs if n not in acc and not free(n)]
    apply_reads = {u for n in apply_own for u in ops[n]}
    outs = [n for n in acc_own if n in apply_reads]
    acc_reads = {u for n in acc_own for u in ops[n]}
    unused = [n for n in instrs if instrs[n]["op"] == "parameter" and n not in acc_reads]
    acc_part = [n for n in instrs if n in acc_own or (free(n) and n in acc_reads)]
    apply_part = [n for n in instrs if n in apply_own or (free(n) and (
        n in apply_reads or n in unused))]
    out_shapes = [instrs[n]["shape"] for n in outs]
    acc_root = (f"  ROOT %{entry}_accumulate_grad_outputs = ({', '.join(out_shapes)}) "
                f"tuple({', '.join('%' + n for n in outs)})")
    first = _module_text(text, comps, entry, instrs, acc_part, [], acc_root,
                         f"({', '.join(out_shapes)})", "accumulate_grad")
    second = _module_text(text, comps, entry, instrs, apply_part, outs, None,
                          instrs[root]["shape"], "apply_grad")
    return first, second


def _module_text(text, comps, entry, instrs, part, passed, root_line, root_shape, kind) -> str:
    """One module of ``accumulate_apply_modules``: ``part`` (entry instruction names, in
    order) with its parameters renumbered, ``passed`` (values of the other module) as
    parameters after them, and the computations the part calls."""
    numbered = {n: int(re.match(r"\d+", instrs[n]["rest"]).group(0))
                for n in part if instrs[n]["op"] == "parameter"}
    params = sorted(numbered, key=numbered.get)
    number = {n: i for i, n in enumerate(params + passed)}
    lines = [f"  %{n} = {instrs[n]['shape']} parameter({number[n]})" for n in passed]
    for n in part:
        line = instrs[n].group(0)
        if n in number:
            line = re.sub(r" parameter\(\d+\)", f" parameter({number[n]})", line, count=1)
        lines.append(line)
    if root_line is not None:
        lines.append(root_line)
    shapes = [instrs[n]["shape"] for n in params + passed]
    signature = ", ".join(f"{n}: {_without_layout(s)}" for n, s in zip(
        params + passed, shapes, strict=True))
    body = (f"ENTRY %{entry}_{kind} ({signature}) -> {_without_layout(root_shape)} {{\n"
            + "\n".join(lines) + "\n}\n")
    called, todo = [], _callees("\n".join(lines))
    while todo:
        c = todo.pop()
        if c in comps and c not in called and c != entry:
            called.append(c)
            todo += _callees(comps[c])
    listed = "".join(comps[c].rstrip("\n") + "\n\n" for c in comps if c in called)
    renumber = {old: number[n] for n, old in numbered.items()}
    header = _header(text, kind, f"({', '.join(shapes)})->{root_shape}",
                     renumber if root_line is None else None)
    first = min((text.find(comps[c]) for c in comps), default=len(text))
    prelude = text[text.find("\n") + 1:first].strip("\n")  # the stack frames metadata names
    return header + "\n\n" + (prelude + "\n\n" if prelude else "") + listed + body


def _header(text: str, kind: str, layout: str, renumber: dict | None) -> str:
    """The module's header line: ``_{kind}`` added to its name, another entry computation
    layout, the donations (``input_output_alias``) kept with parameters renumbered by
    ``renumber`` (dropped when it is None: new outputs), attributes sized by the old
    signature dropped."""
    line = text[:text.find("\n")]
    attrs, depth, at = [], 0, line.find(",")
    for i in range(at + 1, len(line) + 1) if at >= 0 else ():
        if i == len(line) or (line[i] == "," and depth == 0):
            attrs.append(line[at + 1:i].strip())
            at = i
        elif i < len(line):
            depth += {"{": 1, "}": -1}.get(line[i], 0)
    kept = []
    for attr in attrs:
        key, _, value = attr.partition("=")
        if key == "entry_computation_layout":
            value = "{" + layout + "}"
        elif key == "input_output_alias":
            if renumber is None:
                continue
            pairs = [f"{{{o}}}: ({renumber[int(p)]}, {{{i}}}, {kind})" for o, p, i, kind in
                     re.findall(r"\{([\d,]*)\}: \((\d+), \{([\d,]*)\}, ([\w\-]+)\)", value)
                     if int(p) in renumber]
            if not pairs:
                continue
            value = "{ " + ", ".join(pairs) + " }"
        elif key.startswith("allow_spmd_sharding_propagation"):
            continue
        kept.append(f"{key}={value}")
    name = line.split()[1].rstrip(",")
    return ", ".join([f"HloModule {name}_{kind}"] + kept)


def _without_layout(shape: str) -> str:
    return re.sub(r"\{[^{}]*\}", "", shape)


def _axis_groups(names: tuple[str, ...], shape: tuple[int, ...]) -> dict:
    """Frozen set of device groups -> the mesh axes (a subset) that form exactly those groups."""
    if not names:
        return {}
    ids = np.arange(math.prod(shape)).reshape(shape)
    out = {}
    for r in range(1, len(names) + 1):
        for subset in itertools.combinations(range(len(names)), r):
            rest = [d for d in range(len(names)) if d not in subset]
            moved = np.transpose(ids, rest + list(subset)).reshape(-1, math.prod(
                shape[d] for d in subset))
            key = frozenset(frozenset(int(i) for i in row) for row in moved)
            out.setdefault(key, tuple(names[d] for d in subset if shape[d] > 1))
    return out


def _replica_groups(rest: str):
    """The device groups of one instruction, from any of HLO's three spellings."""
    m = re.search(r"replica_groups=\{(\{[\d,{} ]*\})\}", rest)
    if m:
        return frozenset(frozenset(int(x) for x in g.split(",") if x.strip())
                         for g in re.findall(r"\{([\d, ]*)\}", m.group(1)))
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
    if m:
        groups = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = np.transpose(ids, [int(x) for x in m.group(3).split(",")])
        rows = ids.reshape(groups[0], -1)
        return frozenset(frozenset(int(i) for i in row) for row in rows)
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=(\S+))? \{([^}]*)\}",
                  rest)
    if m:
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names = [a for a, _ in axes]
        shape = [int(s) for _, s in axes]
        used = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(3))]
        ids = _device_ids(m.group(2), math.prod(shape)).reshape(shape)
        rest_dims = [d for d in range(len(shape)) if d not in used]
        rows = np.transpose(ids, rest_dims + used).reshape(-1, math.prod(shape[d] for d in used))
        return frozenset(frozenset(int(i) for i in row) for row in rows)
    return None


def _device_ids(text: str | None, count: int) -> np.ndarray:
    """The device order of a named-axes mesh: ``None`` (iota), ``([2,4]T(1,0))`` or a list."""
    if not text:
        return np.arange(count)
    m = re.fullmatch(r"\(?\[([\d,]+)\](?:T\(([\d,]+)\))?\)?,?", text)
    if m:
        ids = np.arange(count).reshape([int(x) for x in m.group(1).split(",")])
        if m.group(2):
            ids = np.transpose(ids, [int(x) for x in m.group(2).split(",")])
        return ids.reshape(-1)
    return np.array([int(x) for x in re.findall(r"\d+", text)][:count])
