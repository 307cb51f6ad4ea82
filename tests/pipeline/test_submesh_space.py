"""Sub-mesh spaces of the stage search (issue 26, item 4): ``divisors`` tries host counts that
divide the cluster (6 hosts of 384, as Megatron-LM's 1T stages), not only powers of two."""

import pytest

import autoshard
from autoshard.pipeline.placement import submesh_shapes
from autoshard.pipeline.stages import AutoStageOption, submesh_choices


def test_divisors_space_has_every_host_count_that_divides_the_cluster():
    cluster = autoshard.Cluster.a100_80gb(num_hosts=12)
    got = submesh_shapes(AutoStageOption(submesh_physical_shape_space="divisors"), cluster)
    assert got == [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (3, 8), (4, 8), (6, 8), (12, 8)]
    powers = submesh_shapes(AutoStageOption(), cluster)
    assert powers == [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (4, 8), (8, 8)]
    assert (6, 8) not in powers
    assert submesh_choices(AutoStageOption(submesh_physical_shape_space="divisors"), 6) == [
        (1, 1), (1, 2), (1, 3), (1, 6)]


def test_an_unknown_space_is_refused_by_name():
    with pytest.raises(ValueError, match=r"submesh_physical_shape_space \('power_of_2'\) must "
                                         r"be one of \('power_of_two', 'small_power_of_two', "
                                         r"'divisors', 'manual'\)"):
        AutoStageOption(submesh_physical_shape_space="power_of_2")
