"""Where and when the apply-grad (optimizer) equations run: a stage and a level each.

Tasks of one level run before those of the next; a task reads other stages' values of earlier
levels only, so the runtime can run the apply tasks in (level, stage) order.
"""

from __future__ import annotations

from ..ir._compat import Var
from ..ir._jaxpr import draws_random
from .sums import SMALL


def assign_apply(post, free, home, first_use, sums=(), constant=frozenset()) -> tuple:
    """(level, stage) -> equations, and the ids of equations every reader computes itself; a
    level reads other stages' values of earlier levels.

    An equation goes to the stage holding its largest input. One that reads no value with a
    stage (only step inputs no task reads, such as optimizer moments, and values computed from
    those alone) waits: it joins the first equation that reads its result, on that one's stage
    and level. Adam's ``b1 * mu`` thus runs where the gradient it is added to lives, instead of
    on stage 0 with its result copied to the parameter's stage every step. What nothing placed
    reads runs on stage 0.

    The result of a ``CrossStageSum`` in ``sums`` is on every stage after its reduction, which
    runs after the level of its last term: its readers go to a later level. Small values
    computed from such results and ``constant`` values alone (the clipping factor from the
    global norm) are computed by every task that reads them (returned ids) instead of copied.
    """
    level: dict = {}
    groups: dict = {}
    waiting: dict = {}  # var -> the waiting equations that compute it (itself included)
    spread: dict = {}  # var -> the level after which every stage holds it
    root = {id(s.eqns[0]): s for s in sums}
    in_sum = {id(x) for s in sums for x in s.eqns}
    terms = {t for s in sums for t in s.terms if isinstance(t, Var)}
    dup: set = set()
    order: dict = {}  # equation id -> its first position: waiting chains in program order
    for i, e in enumerate(post):
        order.setdefault(id(e), i)

    def position(e) -> int:
        return order[id(e)]

    def place(eqns, lv, stage):
        for e in eqns:
            for v in e.outvars:
                level[v] = (lv, stage)
                home[v] = stage
                waiting.pop(v, None)
        groups.setdefault((lv, stage), []).extend(eqns)

    for e in post:
        if id(e) in free:
            continue
        ins = [v for v in e.invars if isinstance(v, Var)]
        if id(e) in in_sum:
            s = root.get(id(e))
            if s is not None:
                late = [t for t in s.terms if isinstance(t, Var) and t in waiting]
                if late:  # terms from step inputs alone: computed on stage 0
                    place(sorted({id(x): x for t in late for x in waiting[t]}.values(),
                                 key=position), 0, 0)
                s.level = max((level[t][0] for t in s.terms
                               if isinstance(t, Var) and t in level), default=-1)
                spread[s.out] = s.level
                home[s.out] = min(home[t] for t in s.terms if isinstance(t, Var) and t in home)
            continue
        if (ins and any(v in spread for v in ins)
                and all(v in spread or v in constant for v in ins)
                and all(getattr(o.aval, "size", SMALL + 1) <= SMALL and o not in terms
                        for o in e.outvars)
                and not draws_random(e)):
            dup.add(id(e))
            first = next(v for v in ins if v in spread)
            for o in e.outvars:
                spread[o] = max(spread[v] for v in ins if v in spread)
                home[o] = home[first]
            continue
        pulled = list(dict.fromkeys(x for v in ins if v in waiting for x in waiting[v]))
        where = [
            (-1 if v in spread else _nbytes(v), -i, home.get(v, first_use.get(v)))
            for i, v in enumerate(ins)
            if v not in waiting
        ]
        where = [w for w in where if w[2] is not None]
        if not where:
            chain = list(dict.fromkeys(pulled + [e]))
            for v in e.outvars:
                waiting[v] = chain
            continue
        stage = max(where)[2]
        lv = 0
        for v in ins:
            if v in spread:
                lv = max(lv, spread[v] + 1)
            elif v in level:
                lv = max(lv, level[v][0] + (level[v][1] != stage))
        place(sorted(pulled, key=position) + [e], lv, stage)
    rest = list(dict.fromkeys(x for chain in waiting.values() for x in chain))
    if rest:
        place(sorted(rest, key=position), 0, 0)
    return groups, dup


def _nbytes(v) -> int:
    aval = v.aval
    size = 1
    for d in getattr(aval, "shape", ()):
        size *= d
    return size * getattr(getattr(aval, "dtype", None), "itemsize", 1)


__all__ = ["assign_apply"]
