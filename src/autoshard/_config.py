"""Configuration read from the environment, in one place, validated."""

from __future__ import annotations

import os
from typing import Literal

Cluster = Literal["local", "distributed", "ray"]
CLUSTERS = ("local", "distributed", "ray")


def required_cluster() -> Cluster:
    """The cluster a launcher told this process to join (AUTOSHARD_CLUSTER), default local."""
    value = os.environ.get("AUTOSHARD_CLUSTER", "local")
    if value not in CLUSTERS:
        raise ValueError(
            f"The environment variable AUTOSHARD_CLUSTER ({value!r}) must be one of {CLUSTERS}.")
    return value


DEFAULT_MAX_EXECUTABLES = 32
"""Executables a parallelized function keeps (least recently used ones are dropped)."""

RECOMPILE_WARNING_AFTER = 3
"""Warn when a function recompiles more than this many times only because a static value changed."""


def max_executables() -> int:
    """Per-function executable cache size: AUTOSHARD_MAX_EXECUTABLES, default 32."""
    value = os.environ.get("AUTOSHARD_MAX_EXECUTABLES", str(DEFAULT_MAX_EXECUTABLES))
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise ValueError(
            f"The environment variable AUTOSHARD_MAX_EXECUTABLES ({value!r}) must be a positive "
            "integer (executables kept per parallelized function).")
    return size
