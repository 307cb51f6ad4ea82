"""A thin ``alpa`` import alias over autoshard, for running Alpa's pipeline tests unmodified.

``install(upstream_root)`` puts ``sys.modules`` entries in place so that ``import alpa`` and
the submodules Alpa's ``tests/pipeline_parallel`` import resolve to autoshard's public objects
or to small views of them. Alpa's own test helpers (``alpa/testing.py``) and model code
(``alpa/model/*.py``) are loaded unmodified from ``upstream_root`` (a copy of Alpa's
repository kept outside this one). Old JAX names those files import (``jax.tree_map``,
``jax.experimental.maps``, ``jax.experimental.pjit.PartitionSpec``, ``jaxlib.xla_extension``)
are given their current equivalents, in this process only.

What the views do:

* ``init(cluster="ray", num_nodes=..., num_devices_per_node=...)``: autoshard's local
  init; the device count Alpa would get (``num_nodes * num_devices_per_node``) is what a
  ``PipeshardParallel`` made afterwards runs on. ``set_global_virtual_physical_mesh`` does the
  same for a ``get_global_cluster().get_virtual_physical_mesh([0], n)``.
* ``AutoShardingOption``: Alpa's positional field order; Alpa-only fields that have no
  counterpart (``enable_auto_sharding``, the ZeRO-3 and combiner thresholds) are accepted at
  their defaults or dropped where they only tune Alpa's XLA passes.
* ``manual_layer_construction``: the identity (autoshard's ``ManualLayerOption`` reads the
  ``mark_pipeline_boundary`` calls wherever they are).
* ``count_communication_primitives``: counts the collectives of an HLO text.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import types

import jax

import autoshard
from autoshard.markers import mark_pipeline_boundary, pipeline_p
from upstream_common import load_file

_state: dict = {"devices": None}


# init and the device set --------------------------------------------------------------------
def init(cluster: str = "ray", num_nodes: int | None = None,
         num_devices_per_node: int | None = None, **_):
    """Alpa's init on one host: autoshard's local cluster, limited to the devices asked for."""
    autoshard.init("local")
    if num_devices_per_node is not None:
        _state["devices"] = jax.devices()[:(num_nodes or 1) * num_devices_per_node]
    else:
        _state["devices"] = None


def shutdown():
    autoshard.clear_executable_cache()
    _state["devices"] = None


class _VirtualMesh:
    def __init__(self, devices):
        self.devices = list(devices)
        self.num_devices = len(self.devices)


class _Cluster:
    def get_virtual_physical_mesh(self, host_ids=None, num_devices_per_host=None):
        n = num_devices_per_host or len(jax.devices())
        return _VirtualMesh(jax.devices()[:len(host_ids or [0]) * n])


def get_global_cluster():
    return _Cluster()


def set_global_virtual_physical_mesh(mesh):
    _state["devices"] = list(mesh.devices)


def get_global_virtual_physical_mesh():
    return _VirtualMesh(_state["devices"] or jax.devices())


class PipeshardParallel(autoshard.PipeshardParallel):
    """autoshard's PipeshardParallel on the devices ``init`` (or the virtual mesh) gave."""

    def __post_init__(self):
        if self.devices is None and _state["devices"] is not None:
            object.__setattr__(self, "devices", list(_state["devices"]))
        super().__post_init__()


class LocalPipelineParallel:
    """Alpa's single-device debugging runtime has no counterpart here."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("LocalPipelineParallel (Alpa's single-device debugging "
                                  "runtime) has no autoshard counterpart; use "
                                  "PipeshardParallel.")


_ALPA_AS_FIELDS = ("enable_auto_sharding", "allow_all_gather", "allow_all_to_all",
                   "allow_replicated_parameters", "force_data_parallel",
                   "force_batch_dim_to_mesh_dim", "force_zero_stage_3",
                   "force_zero_stage_3_all_gather_threshold", "prefer_reduce_scatter",
                   "allow_mixed_mesh_shape", "allow_recompute_heavy_op",
                   "force_simple_heuristic", "all_reduce_threshold")
_ALPA_ONLY = {"enable_auto_sharding", "force_zero_stage_3",
              "force_zero_stage_3_all_gather_threshold", "allow_mixed_mesh_shape",
              "allow_recompute_heavy_op", "force_simple_heuristic", "all_reduce_threshold"}


def AutoShardingOption(*args, **kwargs):  # noqa: N802 (Alpa's class name)
    """autoshard's AutoShardingOption from Alpa's arguments (Alpa's positional order)."""
    if len(args) > len(_ALPA_AS_FIELDS):
        raise TypeError(f"AutoShardingOption takes at most {len(_ALPA_AS_FIELDS)} positional "
                        "arguments.")
    given = dict(zip(_ALPA_AS_FIELDS, args, strict=False))
    given.update(kwargs)
    ours = {f.name for f in dataclasses.fields(autoshard.AutoShardingOption)}
    return autoshard.AutoShardingOption(
        **{k: v for k, v in given.items() if k in ours and k not in _ALPA_ONLY})


def xla_custom_call(*args, **kwargs):
    raise NotImplementedError("autoshard's pipeline marker lowers to nothing; there is no "
                              "'pipeline_marker' XLA custom call.")


def ManualShardingOption(mesh_axis_names=None, submesh_axis_names=None,  # noqa: N802
                         in_axis_resources=None, out_axis_resources=None,
                         pipeline_intermediate_axes=None):
    """autoshard's ManualShardingOption from Alpa's arguments (Alpa's positional order)."""
    given = dict(mesh_axis_names=mesh_axis_names, submesh_axis_names=submesh_axis_names,
                 in_axis_resources=in_axis_resources, out_axis_resources=out_axis_resources,
                 pipeline_intermediate_axes=pipeline_intermediate_axes)
    return autoshard.ManualShardingOption(**{k: v for k, v in given.items() if v is not None})


def manual_layer_construction(fun=None, *, static_argnums=(), remat_layer=False):
    return (lambda f: f) if fun is None else fun


# alpa.util ------------------------------------------------------------------------------------
_COLLECTIVE = re.compile(
    r"=\s*(.+?)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(-start)?\(")
_SCALAR = re.compile(r"\(?[a-z0-9]+\[\](\{\})?\)?")


def count_communication_primitives(hlo_ir: str, ignore_scalar_all_reduce: bool = False):
    """(total, all-reduce, all-gather, reduce-scatter, all-to-all) instructions in HLO text
    (a combined all-reduce of several arrays counts once)."""
    counts = dict.fromkeys(("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                            "collective-permute"), 0)
    for line in hlo_ir.splitlines():
        m = _COLLECTIVE.search(line)
        if m is None:
            continue
        shape, op = m.group(1), m.group(2)
        if ignore_scalar_all_reduce and op == "all-reduce" and _SCALAR.fullmatch(shape):
            continue
        counts[op] += 1
    return (sum(counts.values()), counts["all-reduce"], counts["all-gather"],
            counts["reduce-scatter"], counts["all-to-all"])


# install ---------------------------------------------------------------------------------------
def _module(name: str, **attrs) -> types.ModuleType:
    mod = sys.modules.get(name)
    if mod is None:
        mod = types.ModuleType(name)
        mod.__path__ = []  # a package, so that its submodules import
        sys.modules[name] = mod
    for k, v in attrs.items():
        setattr(mod, k, v)
    if "." in name:
        parent, _, child = name.rpartition(".")
        setattr(_module(parent), child, mod)
    return mod


def _old_jax_names():
    """Names Alpa's files import from JAX 0.3, as today's equivalents (this process only)."""
    from flax.core import FrozenDict
    from flax.training import dynamic_scale

    for name in ("device_count", "local_device_count"):  # no GPU backend: 0 GPUs, as Alpa's
        count = getattr(jax, name)                       # skipIf decorators expect

        def counted(backend=None, _count=count):
            try:
                return _count(backend)
            except RuntimeError:
                return 0
        setattr(jax, name, counted)
    if not hasattr(jax, "tree_map"):
        jax.tree_map = jax.tree.map
    _module("jax.experimental.maps", FrozenDict=FrozenDict)
    import jax.experimental.pjit as pjit
    if not hasattr(pjit, "PartitionSpec"):
        pjit.PartitionSpec = jax.sharding.PartitionSpec
    if "jaxlib.xla_extension" not in sys.modules:
        _module("jaxlib.xla_extension", DeviceArray=jax.Array)
    import jax.lib as jax_lib
    from jax._src import xla_bridge
    from jax._src.lib import xla_client
    if not hasattr(jax_lib, "xla_client"):
        # XlaBuilder's ``ops`` is gone; only the GPU test that builds one uses it
        view = types.ModuleType("jax.lib.xla_client")
        view.__getattr__ = lambda name: getattr(xla_client, name)
        view.ops = types.SimpleNamespace()
        jax_lib.xla_client = view
        jax_lib.xla_bridge = xla_bridge
    if not hasattr(dynamic_scale, "DynamicScaleResult"):
        dynamic_scale.DynamicScaleResult = tuple


def install(upstream_root: str) -> types.ModuleType:
    """Install the ``alpa`` alias; ``upstream_root`` holds Alpa's ``alpa/testing.py`` and
    ``alpa/model/``. Returns the ``alpa`` module."""
    try:  # absent before autoshard had Alpa's schedule and DP views (baseline runs)
        from autoshard.pipeline import alpa_compat
    except ImportError:
        alpa_compat = types.SimpleNamespace()
    from autoshard.pipeline.stages import StageOption

    _old_jax_names()
    global_config = types.SimpleNamespace(nccl_mode="cupy", backend="cpu")
    common = dict(
        init=init, shutdown=shutdown, parallelize=autoshard.parallelize, grad=autoshard.grad,
        value_and_grad=autoshard.value_and_grad)
    alpa = _module(
        "alpa", **common, PipeshardParallel=PipeshardParallel,
        AutoShardingOption=AutoShardingOption,
        ManualShardingOption=ManualShardingOption,
        ManualStageOption=autoshard.ManualStageOption, AutoStageOption=autoshard.AutoStageOption,
        UniformStageOption=autoshard.UniformStageOption,
        AutoLayerOption=autoshard.AutoLayerOption, ManualLayerOption=autoshard.ManualLayerOption,
        mark_pipeline_boundary=mark_pipeline_boundary, global_config=global_config,
        get_global_cluster=get_global_cluster,
        set_global_virtual_physical_mesh=set_global_virtual_physical_mesh,
        get_global_virtual_physical_mesh=get_global_virtual_physical_mesh)
    _module("alpa.api", **common)
    _module("alpa.global_env", global_config=global_config)
    _module("alpa.util", count_communication_primitives=count_communication_primitives,
            _DISABLE_NUMBA=True)
    _module("alpa.parallel_method", PipeshardParallel=PipeshardParallel,
            LocalPipelineParallel=LocalPipelineParallel)
    _module("alpa.device_mesh", get_global_cluster=get_global_cluster,
            set_global_virtual_physical_mesh=set_global_virtual_physical_mesh,
            get_global_virtual_physical_mesh=get_global_virtual_physical_mesh)
    _module("alpa.shard_parallel")
    _module("alpa.shard_parallel.auto_sharding", AutoShardingOption=AutoShardingOption)
    _module("alpa.pipeline_parallel")
    _module("alpa.pipeline_parallel.primitive_def", pipeline_p=pipeline_p,
            xla_custom_call=xla_custom_call,
            mark_pipeline_boundary=mark_pipeline_boundary)
    _module("alpa.pipeline_parallel.layer_construction",
            AutoLayerOption=autoshard.AutoLayerOption,
            ManualLayerOption=autoshard.ManualLayerOption,
            manual_layer_construction=manual_layer_construction)
    def compat(*names):  # the views autoshard has (all of them since issue 22)
        return {k: getattr(alpa_compat, k) for k in names if hasattr(alpa_compat, k)}
    _module("alpa.pipeline_parallel.stage_construction",
            AutoStageOption=autoshard.AutoStageOption,
            ManualStageOption=autoshard.ManualStageOption,
            UniformStageOption=autoshard.UniformStageOption, StageOption=StageOption,
            **compat("training_dp", "training_dp_2", "get_submesh_choices"))
    _module("alpa.pipeline_parallel.schedules",
            **compat("gen_linear_pipeline_dependency", "GpipeSchedule", "PipeDreamFlush",
                     "InferenceSchedule"))
    _module("alpa.model")
    load_file("alpa.model.model_util", f"{upstream_root}/alpa/model/model_util.py")
    load_file("alpa.model.bert_model", f"{upstream_root}/alpa/model/bert_model.py")
    load_file("alpa.testing", f"{upstream_root}/alpa/testing.py")
    return alpa
