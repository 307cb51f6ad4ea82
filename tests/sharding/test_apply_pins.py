"""``apply``'s pins bind the sharding-constraint primitive directly (``_compat.sharding_pinner``):
the lowered step must be the one ``lax.with_sharding_constraint`` gives, equation for equation."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import jax

import autoshard
from autoshard.sharding import apply

sys.path.insert(0, str(Path(__file__).parent.parent))
from models import dense_adam_step  # noqa: E402


def _lowered_text(step, state, batch) -> str:
    autoshard.clear_executable_cache()
    option = autoshard.AutoShardingOption(logical_mesh_shape=(2, 4), show_progress=False)
    f = autoshard.parallelize(step, method=autoshard.ShardParallel(
        devices=jax.devices()[:8], auto_sharding_option=option))
    text = f.get_executable(state, batch)._lowered.as_text()
    return re.sub(r"loc\([^)]*\)|#loc\d*", "", text)   # where each pin was written from


def test_direct_pins_lower_to_the_public_constraints_module(monkeypatch):
    step, state, batch = dense_adam_step((64, 64, 8), 32, 16)
    direct = _lowered_text(step, state, batch)
    monkeypatch.setattr(apply, "sharding_pinner",
                        lambda: lambda x, sharding: jax.lax.with_sharding_constraint(x, sharding))
    public = _lowered_text(step, state, batch)
    assert direct == public
    assert direct.count("sharding_constraint") >= 10   # the step's values are pinned
