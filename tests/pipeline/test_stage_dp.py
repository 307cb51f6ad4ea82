"""The stage dynamic program against an exhaustive search on synthetic layer costs."""

import math
import random

import pytest

from autoshard.pipeline.stages import (
    AutoStageOption,
    ManualStageOption,
    UniformStageOption,
    stage_dp,
    stage_exhaustive,
    submesh_choices,
)


@pytest.mark.parametrize("seed", range(12))
def test_stage_dp_equals_exhaustive_search(seed):
    rng = random.Random(seed)
    num_layers = rng.randint(1, 6)
    num_devices = rng.choice([2, 4, 8])
    sizes = [n for n in (1, 2, 4, 8) if n <= num_devices]
    layer = [rng.uniform(0.5, 3.0) for _ in range(num_layers)]
    mem = [rng.uniform(0.5, 2.0) for _ in range(num_layers)]
    budget = rng.choice([math.inf, 3.0])
    k = rng.choice([1, 4, 8])

    def cost(i, j, s):
        n = sizes[s]
        if sum(mem[i:j]) / n > budget:
            return math.inf
        return sum(layer[i:j]) / n * (1 + 0.1 * (n - 1))

    dp = stage_dp(num_layers, num_devices, sizes, cost, k)
    ex = stage_exhaustive(num_layers, num_devices, sizes, cost, k)
    assert dp[0] == pytest.approx(ex[0])
    if dp[1]:
        times = [cost(*s) for s in dp[1]]
        assert sum(times) + (k - 1) * max(times) == pytest.approx(dp[0])
        assert sum(sizes[s[2]] for s in dp[1]) == num_devices


def test_submesh_spaces_and_option_errors():
    assert submesh_choices(AutoStageOption(), 8) == [(1, 1), (1, 2), (1, 4), (1, 8)]
    assert submesh_choices(AutoStageOption(submesh_physical_shape_space="small_power_of_two"),
                           8) == [(1, 1), (1, 2), (1, 4)]
    with pytest.raises(ValueError, match="manually_specified_submeshes"):
        AutoStageOption(submesh_physical_shape_space="manual")
    with pytest.raises(ValueError, match="num_stages"):
        UniformStageOption(num_stages=0)
    with pytest.raises(ValueError, match="every layer once"):
        ManualStageOption([[0], [2]], [(1, 4), (1, 4)], [(4,), (4,)], [{}, {}])
    with pytest.raises(ValueError, match="equal device counts"):
        ManualStageOption([[0], [1]], [(1, 4), (1, 4)], [(2,), (4,)], [{}, {}])
