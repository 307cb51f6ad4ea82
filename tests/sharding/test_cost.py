

# Costs from where the devices are -------------------------------------------------------------
def test_axes_of_one_host_cost_the_same_and_crossing_axes_cost_more():
    from autoshard.sharding.cost import (
        DEFAULT_BETA_S_PER_BYTE,
        INTER_HOST_BETA_S_PER_BYTE,
        CostModel,
        axis_crosses_hosts,
    )
    from autoshard.sharding.options import AutoShardingOption

    one_host = CostModel.from_option((2, 4), AutoShardingOption(), devices_per_host=None)
    assert one_host.beta == (DEFAULT_BETA_S_PER_BYTE,) * 2  # no invented hierarchy
    # 2 hosts of 4: axis 0 (stride 4) crosses hosts, axis 1 stays inside one.
    two_hosts = CostModel.from_option((2, 4), AutoShardingOption(), devices_per_host=4)
    assert two_hosts.beta == (INTER_HOST_BETA_S_PER_BYTE, DEFAULT_BETA_S_PER_BYTE)
    # An 8-wide axis over two 4-device hosts straddles them: priced by its slowest hop.
    assert axis_crosses_hosts((8,), 0, 4)
    assert not axis_crosses_hosts((4, 2), 1, 4) and axis_crosses_hosts((4, 2), 0, 4)
    assert not axis_crosses_hosts((2, 2, 2), 2, 4) and not axis_crosses_hosts((2, 2, 2), 1, 4)
    given = CostModel.from_option((2, 4), AutoShardingOption(mesh_beta=(1.0, 2.0)), 4)
    assert given.beta == (1.0, 2.0)  # explicit values win
