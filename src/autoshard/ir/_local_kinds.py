"""The kinds of a value evaluated on each device's own batch rows (``_local.LocalEval``).

* ``R`` replicated: every device holds the whole value;
* ``("S", d)`` split: every device holds its own block of rows along dim ``d``;
* ``P`` partial: the value is the sum over devices of what each device holds.
"""

from __future__ import annotations

R = "R"
P = "P"


def split(d: int):
    return ("S", d)


def is_split(kind) -> bool:
    return isinstance(kind, tuple)


def one_split(ks):
    """The one split kind among ``ks`` (others replicated), or None."""
    splits = {k for k in ks if is_split(k)}
    if len(splits) != 1 or any(k != R and not is_split(k) for k in ks):
        return None
    return next(iter(splits))
