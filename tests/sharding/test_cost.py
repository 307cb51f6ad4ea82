

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


def test_mirror_meshes_on_links_no_faster_are_dominated():
    from autoshard.sharding.cost import dominated_meshes

    intra, inter = (5e-6, 1e-10), (2e-5, 1e-9)

    def costs(*links):
        return (tuple(link[0] for link in links), tuple(link[1] for link in links))

    # One host: (2, 4) and (4, 2) cost the same; the first is kept.
    assert dominated_meshes([(8,), (2, 4), (4, 2)],
                            [costs(intra), costs(intra, intra), costs(intra, intra)]) == {2: 1}
    # 4 hosts of 8: (16, 2) keeps its 2-wide axis in a host; (2, 16) crosses hosts on both.
    assert dominated_meshes([(2, 16), (16, 2)],
                            [costs(inter, inter), costs(inter, intra)]) == {0: 1}
    # (4, 8) and (8, 4) put different sizes on the slow link: neither can be dropped.
    assert dominated_meshes([(4, 8), (8, 4)],
                            [costs(inter, intra), costs(inter, intra)]) == {}


def test_device_speed_prices_the_compute_term_inside_its_block():
    from autoshard.sharding.cost import FLOP_COST_S, byte_cost, device_speed, flop_cost

    assert flop_cost(1e12, 2) == FLOP_COST_S * 5e11
    with device_speed(1e-15, 1e-13):
        assert flop_cost(1e12, 2) == 1e-15 * 5e11 and byte_cost(1e9, 1) == 1e-13 * 1e9
    assert flop_cost(1e12, 2) == FLOP_COST_S * 5e11
