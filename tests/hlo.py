"""Reading compiled HLO in tests, on top of ``autoshard.sharding.hlo``."""

from __future__ import annotations

import re

from autoshard.sharding.hlo import collectives, computations, execution_counts

__all__ = ["collectives", "dot_shapes", "loop_computations"]


def loop_computations(text: str) -> set[str]:
    """Names of every computation run more than once per step (loop bodies and their calls)."""
    return {name for name, times in execution_counts(text).items() if times > 1}


def dot_shapes(text: str, names: set[str]) -> list[str]:
    """Result shapes of dot instructions in the named computations."""
    comps = computations(text)
    return [m.group(1) for n in names if n in comps
            for m in re.finditer(r"= (\w+\[[\d,]*\])\{?[\d,]*\}? dot\(", comps[n])]
