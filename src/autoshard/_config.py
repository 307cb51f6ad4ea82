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
