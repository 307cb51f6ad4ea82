"""The stage dynamic program against an exhaustive search on synthetic layer costs."""

import math
import random

import pytest

from autoshard.pipeline.stages import (
    AutoStageOption,
    ManualStageOption,
    UniformStageOption,
    cost_table,
    cut_seconds,
    stage_dp,
    stage_dp_counts,
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


def _exhaustive_placed(num_layers, num_devices, sizes, cost, k, placeable):
    """Every cut and sub-mesh choice whose stages ``placeable`` allows where they start."""
    best = (math.inf, [])

    def rec(i, first, stages):
        nonlocal best
        if i == num_layers:
            if first == num_devices:
                times = [cost(*st) for st in stages]
                obj = sum(times) + (k - 1) * max(times)
                best = min(best, (obj, list(stages)), key=lambda b: b[0])
            return
        for j in range(i + 1, num_layers + 1):
            for c, n in enumerate(sizes):
                if first + n <= num_devices and placeable(n, first) and cost(i, j, c) < math.inf:
                    rec(j, first + n, stages + [(i, j, c)])
    rec(0, 0, [])
    return best


@pytest.mark.parametrize("seed", range(8))
def test_stage_dp_counts_devices_in_units_of_the_sizes_divisor(seed):
    """Sub-mesh sizes that share a divisor (whole hosts: Table 1's 529.6B row has 2,520 GPUs
    in sub-meshes of 9-45 hosts) are searched in units of it: the same optimum as the
    exhaustive search, with and without a placement rule, and with cut costs."""
    rng = random.Random(300 + seed)
    num_layers = rng.randint(1, 5)
    unit = rng.choice([3, 8])
    num_devices = unit * rng.choice([4, 6])
    sizes = [unit * m for m in (1, 2, 3, 4, 6) if unit * m <= num_devices] + [num_devices + unit]
    layer = [rng.uniform(0.5, 3.0) for _ in range(num_layers)]
    mem = [rng.uniform(0.5, 2.0) for _ in range(num_layers)]
    k = rng.choice([1, 4, 8])

    def cost(i, j, s):
        n = sizes[s]
        if sum(mem[i:j]) / n > 2.0 / unit:
            return math.inf
        return sum(layer[i:j]) / n * (1 + 0.1 * (n - 1))

    def placeable(n, first):  # within one host of 2 units, or whole hosts
        host = 2 * unit
        return n <= host and first // host == (first + n - 1) // host or (
            n % host == 0 and first % host == 0)

    dp = stage_dp(num_layers, num_devices, sizes, cost, k)
    assert dp[0] == pytest.approx(stage_exhaustive(num_layers, num_devices, sizes, cost, k)[0])
    placed = stage_dp(num_layers, num_devices, sizes, cost, k, placeable=placeable)
    brute = _exhaustive_placed(num_layers, num_devices, sizes, cost, k, placeable)
    assert placed[0] == pytest.approx(brute[0])
    if placed[1]:
        assert sum(sizes[s[2]] for s in placed[1]) == num_devices
        first = 0
        for _, _, c in placed[1]:
            assert placeable(sizes[c], first)
            first += sizes[c]

    def boundary(j, a, b):
        return 2 * cut_seconds(1e9 * (j % 2), sizes[a], sizes[b])
    cuts = stage_dp(num_layers, num_devices, sizes, cost, k, boundary)
    ex = stage_exhaustive(num_layers, num_devices, sizes, cost, k, boundary)
    assert cuts[0] == pytest.approx(ex[0])


@pytest.mark.parametrize("seed", range(8))
def test_one_dp_gives_the_best_cut_of_every_stage_count(seed):
    """``stage_dp_counts`` (one DP for every count, as ``AutoParallel`` asks) equals the
    exhaustive search restricted to each number of stages, and says which counts have no cut."""
    rng = random.Random(500 + seed)
    num_layers = rng.randint(2, 6)
    num_devices = rng.choice([4, 8])
    sizes = [n for n in (1, 2, 4, 8) if n <= num_devices]
    layer = [rng.uniform(0.5, 3.0) for _ in range(num_layers)]
    mem = [rng.uniform(0.5, 2.0) for _ in range(num_layers)]
    k = rng.choice([1, 4, 8])

    def cost(i, j, c):
        if sum(mem[i:j]) / sizes[c] > 1.5:
            return math.inf
        return sum(layer[i:j]) / sizes[c] * (1 + 0.1 * (sizes[c] - 1))

    counts = [None, *range(1, num_layers + 2)]
    every = stage_dp_counts(cost_table(num_layers, len(sizes), cost), sizes, num_devices, k,
                            counts=counts)
    by_count: dict = {}

    def rec(i, d, stages):
        if i == num_layers:
            if d == 0:
                times = [cost(*st) for st in stages]
                obj = sum(times) + (k - 1) * max(times)
                by_count[len(stages)] = min(by_count.get(len(stages), math.inf), obj)
            return
        for j in range(i + 1, num_layers + 1):
            for c, n in enumerate(sizes):
                if n <= d and cost(i, j, c) < math.inf:
                    rec(j, d - n, stages + [(i, j, c)])
    rec(0, num_devices, [])
    for count in counts[1:]:
        assert every[count][0] == pytest.approx(by_count.get(count, math.inf))
        assert len(every[count][1]) == (count if count in by_count else 0)
    assert every[None][0] == pytest.approx(min(by_count.values(), default=math.inf))


@pytest.mark.parametrize("seed", range(10))
def test_stage_dp_with_cut_costs_equals_exhaustive_search(seed):
    """A stage's time includes the values it sends across its cut, priced by the device
    counts on both sides (``cut_seconds``): the DP still finds the exhaustive optimum."""
    rng = random.Random(100 + seed)
    num_layers = rng.randint(1, 5)
    num_devices = rng.choice([2, 4, 8])
    sizes = [n for n in (1, 2, 4, 8) if n <= num_devices]
    layer = [rng.uniform(0.5, 3.0) for _ in range(num_layers)]
    cut_bytes = [rng.choice([0.0, 1e9, 1e10]) for _ in range(num_layers + 1)]
    k = rng.choice([1, 4, 8])

    def cost(i, j, s):
        return sum(layer[i:j]) / sizes[s] * (1 + 0.1 * (sizes[s] - 1))

    def boundary(j, a, b):
        return 2 * cut_seconds(cut_bytes[j], sizes[a], sizes[b])

    dp = stage_dp(num_layers, num_devices, sizes, cost, k, boundary)
    ex = stage_exhaustive(num_layers, num_devices, sizes, cost, k, boundary)
    assert dp[0] == pytest.approx(ex[0])
    assert sum(sizes[s[2]] for s in dp[1]) == num_devices


def test_stage_dp_avoids_a_resharding_cut_when_cheaper():
    """A heavy layer then a light one on 4 devices: compute alone puts them on 3 + 1 devices,
    but then the activation between them is gathered on the 3 and copied whole to the 1;
    priced, the DP keeps 2 + 2 devices, whose copy is shard for shard."""
    sizes = [1, 2, 3]
    flops = [10.0, 1.0]

    def cost(i, j, s):
        return sum(flops[i:j]) / sizes[s]

    assert stage_dp(2, 4, sizes, cost, 4)[1] == [(0, 1, 2), (1, 2, 0)]
    big = 3e10  # bytes crossing the cut: 1.5 s shard for shard over 2 devices at 1e-10 s/B
    assert cut_seconds(big, 2, 2) == pytest.approx(5e-6 + 1.5)
    assert cut_seconds(big, 3, 1) == pytest.approx(2 * 5e-6 + 2.0 + 3.0)
    assert cut_seconds(0, 3, 1) == 0.0

    def boundary(j, a, b):
        return cut_seconds(big, sizes[a], sizes[b])

    obj, stages = stage_dp(2, 4, sizes, cost, 4, boundary)
    assert stages == [(0, 1, 1), (1, 2, 1)]
    assert obj == pytest.approx(5 + cut_seconds(big, 2, 2) + 0.5 + 3 * (5 + cut_seconds(big, 2, 2)))
    assert stage_exhaustive(2, 4, sizes, cost, 4, boundary) == (obj, stages)


def test_submesh_spaces_and_option_errors():
    assert submesh_choices(AutoStageOption(), 8) == [(1, 1), (1, 2), (1, 4), (1, 8)]
    assert submesh_choices(
        AutoStageOption(submesh_physical_shape_space="small_power_of_two"), 8
    ) == [(1, 1), (1, 2), (1, 4)]
    with pytest.raises(ValueError, match="manually_specified_submeshes"):
        AutoStageOption(submesh_physical_shape_space="manual")
    with pytest.raises(ValueError, match="num_stages"):
        UniformStageOption(num_stages=0)
    with pytest.raises(ValueError, match="every layer once"):
        ManualStageOption([[0], [2]], [(1, 4), (1, 4)], [(4,), (4,)], [{}, {}])
    with pytest.raises(ValueError, match="equal device counts"):
        ManualStageOption([[0], [1]], [(1, 4), (1, 4)], [(2,), (4,)], [{}, {}])
