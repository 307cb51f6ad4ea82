"""Where a pipeline's stages sit on a described cluster: sub-meshes as slices of its hosts.

Devices are numbered host by host (``Cluster``); a stage's sub-mesh is a run of consecutive
devices that lies inside one host or covers whole hosts, and is priced as a ``Cluster`` of
its own (same links and devices, its hosts only). Used by ``price.py``.
"""

from __future__ import annotations

import dataclasses
import math

from ..cluster import Cluster
from ..sharding.options import AutoShardingOption
from .build import manual_stages
from .stages import AutoStageOption, ManualStageOption, UniformStageOption, divisors


def axis_names(shape) -> tuple[str, ...]:
    """The runtime's sub-mesh axis names (``compile.make_submeshes``)."""
    return ("x",) if len(shape) == 1 else tuple(f"x{i}" for i in range(len(shape)))


def renumber(stage_of_layer):
    ids = {s: i for i, s in enumerate(dict.fromkeys(stage_of_layer))}
    return [ids[s] for s in stage_of_layer]


def stage_layers(stage_of_layer, s) -> tuple[int, ...]:
    return tuple(i for i, x in enumerate(stage_of_layer) if x == s)


def sub_cluster_of(cluster: Cluster, first: int, n: int) -> tuple[Cluster, tuple[int, int]]:
    """The cluster of devices ``[first, first + n)``: inside one host, or whole hosts."""
    dph = cluster.devices_per_host
    if n <= dph and first // dph == (first + n - 1) // dph:
        return shape_cluster(cluster, (1, n)), (1, n)
    if n % dph == 0 and first % dph == 0:
        return shape_cluster(cluster, (n // dph, dph)), (n // dph, dph)
    raise ValueError(
        f"A sub-mesh of {n} devices starting at device {first} straddles hosts of {dph} devices "
        f"({cluster.name}): a stage's sub-mesh must lie inside one host or be whole hosts. "
        f"Choose stage device counts that divide {dph} or are multiples of it.")


def shape_cluster(cluster: Cluster, shape) -> Cluster:
    hosts, dph = shape
    return dataclasses.replace(cluster, num_hosts=hosts, devices_per_host=dph,
                               name=f"{cluster.name} [sub-mesh {hosts} x {dph}]")


def submesh_shapes(option: AutoStageOption, cluster: Cluster) -> list[tuple[int, int]]:
    dph, hosts = cluster.devices_per_host, cluster.num_hosts
    if option.submesh_physical_shape_space == "manual":
        shapes = [tuple(s) for s in option.manually_specified_submeshes]
        for h, d in shapes:
            if not (h == 1 and d <= dph or d == dph and h <= hosts):
                raise ValueError(
                    f"manually_specified_submeshes entry {(h, d)} does not fit {cluster.name}: "
                    f"give (1, d) with d <= {dph} or (h, {dph}) with h <= {hosts}.")
        return shapes
    if option.submesh_physical_shape_space == "divisors":
        return [(1, d) for d in divisors(dph)] + [(h, dph) for h in divisors(hosts)[1:]]
    shapes = [(1, 2 ** e) for e in range(int(math.log2(dph)) + 1)]
    shapes += [(2 ** e, dph) for e in range(1, int(math.log2(hosts)) + 1)]
    if option.submesh_physical_shape_space == "small_power_of_two":
        shapes = [s for s in shapes if math.prod(s) <= 4]
    return shapes


def given_stages(option, num_layers: int, cluster: Cluster):
    """(stage of each layer, ((first, n), physical shape) per stage, logical shape per stage
    or None) for a uniform or manual stage option."""
    if isinstance(option, ManualStageOption):
        stage_of_layer, sizes, shapes = manual_stages(option, num_layers)
    else:
        opt = option or UniformStageOption()
        n = opt.num_stages or num_layers
        if num_layers < n:
            raise ValueError(
                f"The step has {num_layers} layer(s) but UniformStageOption(num_stages={n}) "
                f"asks for {n} stages; a stage needs at least one layer. Add "
                "autoshard.mark_pipeline_boundary() calls, use layer_option=AutoLayerOption("
                f"layer_num={n}), or fewer stages.")
        if cluster.num_devices % n:
            raise ValueError(
                f"The cluster's {cluster.num_devices} devices cannot be split evenly into {n} "
                "stages (UniformStageOption). Choose a num_stages that divides the device "
                "count.")
        per = (math.prod(opt.submesh_physical_shape) if opt.submesh_physical_shape
               else cluster.num_devices // n)
        sizes = [per] * n
        shapes = [tuple(opt.submesh_logical_shape) if opt.submesh_logical_shape else None] * n
        stage_of_layer = [layer * n // num_layers for layer in range(num_layers)]
    if sum(sizes) != cluster.num_devices:
        raise ValueError(
            f"The stages' sub-meshes use {sum(sizes)} devices in all but the cluster has "
            f"{cluster.num_devices} ({cluster.name}): they must cover it exactly. Choose "
            f"sub-mesh shapes whose device counts add up to {cluster.num_devices}.")
    placement, first = [], 0
    for s, n in enumerate(sizes):
        _, phys = sub_cluster_of(cluster, first, n)
        if isinstance(option, ManualStageOption) and tuple(
                option.submesh_physical_shapes[s]) != phys:
            raise ValueError(
                f"ManualStageOption.submesh_physical_shapes[{s}] is "
                f"{tuple(option.submesh_physical_shapes[s])} but {n} devices from device "
                f"{first} on {cluster.name} are {phys} (hosts, devices per host).")
        if shapes[s] is not None and math.prod(shapes[s]) != n:
            raise ValueError(f"Stage {s}: logical shape {shapes[s]} has "
                             f"{math.prod(shapes[s])} devices but its sub-mesh has {n}.")
        placement.append(((first, n), phys))
        first += n
    return stage_of_layer, placement, shapes


def stage_overrides(option, s) -> dict:
    if isinstance(option, ManualStageOption):
        d = dict(option.submesh_autosharding_option_dicts[s] or {})
    elif isinstance(option, UniformStageOption):
        d = dict(option.submesh_autosharding_option or {})
    else:
        d = {}
    fields = {f.name for f in dataclasses.fields(AutoShardingOption)}
    unknown = sorted(set(d) - fields)
    if unknown:
        raise ValueError(f"Stage {s}: planner options {d} name {unknown}, which are not "
                         "AutoShardingOption fields.")
    d.pop("logical_mesh_shape", None)
    return d


__all__ = ["axis_names", "given_stages", "renumber", "shape_cluster", "stage_layers",
           "stage_overrides", "sub_cluster_of", "submesh_shapes"]
