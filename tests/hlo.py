"""Reading compiled HLO text in tests: computations, loops, collectives, dots."""

from __future__ import annotations

import re

_HEADER = re.compile(r"^(?:ENTRY )?%(?P<name>[\w.\-]+) ", re.M)
_CALLS = re.compile(r"(?:body|condition|calls|to_apply|branch_computations)=\{?%?([\w.\-, %]+)")
COLLECTIVE = re.compile(
    r"= (?P<shape>[^=]*?) (?P<kind>all-reduce|all-gather|reduce-scatter|all-to-all|"
    r"collective-permute)(?:-start)?\(")


def computations(text: str) -> dict[str, str]:
    """Computation name -> its body text."""
    starts = [(m.start(), m.group("name")) for m in _HEADER.finditer(text)
              if text[m.start():text.find("\n", m.start())].rstrip().endswith("{")]
    out = {}
    for (pos, name), nxt in zip(starts, starts[1:] + [(len(text), None)], strict=True):
        out[name] = text[pos:nxt[0]]
    return out


def loop_computations(text: str) -> set[str]:
    """Names of every computation run inside a while loop (bodies and what they call)."""
    comps = computations(text)
    todo = [m.group(1) for body in comps.values()
            for m in re.finditer(r"while\(.*?body=%?([\w.\-]+)", body)]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for m in _CALLS.finditer(comps[name]):
            todo += [n.strip().lstrip("%") for n in m.group(1).split(",")]
    return seen


def collectives(text: str, inside: set[str] | None = None, outside: set[str] | None = None):
    """(kind, result shape) of every collective, optionally only in / not in some computations."""
    found = []
    for name, body in computations(text).items():
        if inside is not None and name not in inside:
            continue
        if outside is not None and name in outside:
            continue
        found += [(m.group("kind"), m.group("shape")) for m in COLLECTIVE.finditer(body)]
    return found


def dot_shapes(text: str, names: set[str]) -> list[str]:
    """Result shapes of dot instructions in the named computations (fusions included)."""
    comps = computations(text)
    reach, todo = set(), list(names)
    while todo:
        n = todo.pop()
        if n in reach or n not in comps:
            continue
        reach.add(n)
        todo += [c.strip().lstrip("%") for m in _CALLS.finditer(comps[n])
                 for c in m.group(1).split(",")]
    return [m.group(1) for n in reach
            for m in re.finditer(r"= (\w+\[[\d,]*\])\{?[\d,]*\}? dot\(", comps[n])]
