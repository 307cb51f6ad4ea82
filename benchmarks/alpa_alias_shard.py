"""A thin ``alpa`` import alias over autoshard, for running Alpa's shard-parallel tests unmodified.

``install(upstream_root)`` puts ``sys.modules`` entries in place so that ``import alpa`` and the
submodules Alpa's ``tests/shard_parallel`` import resolve to autoshard's public objects or to
small views of them. Alpa's test helpers (``alpa/testing.py``, ``alpa/test_install.py``) and
model code (``alpa/model/*.py``) are loaded unmodified from ``upstream_root`` (a copy of Alpa's
repository kept outside this one). The old JAX names those files use (``jax.tree_map``,
``jax.experimental.maps``, ``jax.experimental.pjit.PartitionSpec``, ``jaxlib.xla_extension``,
``jax.interpreters.pxla``'s ``ShardingSpec`` family and an array's ``sharding_spec``) are given
their current equivalents, in this process only.

What the views translate (everything else is autoshard's own object):

* ``AutoShardingOption``: Alpa's mutable option (tests set fields after construction). It
  becomes an ``autoshard.AutoShardingOption`` when a step is compiled. Alpa-only fields that
  tune Alpa's own XLA passes (``allow_mixed_mesh_shape``, ``allow_recompute_heavy_op``,
  ``all_reduce_threshold``, ``force_simple_heuristic``, the ZeRO-3 all-gather threshold) have
  no counterpart and are dropped; ``force_zero_stage_3`` becomes ``prefer_reduce_scatter``
  with parameters kept sharded (``autoshard.Zero3Parallel``'s plan). ``memory_tradeoff`` is 0:
  Alpa takes the fastest plan whatever its memory.
* ``LocalPhysicalDeviceMesh(devices).get_logical_mesh(shape, alpha, beta)``: a logical mesh
  with Alpa's cost parameters. ``ShardParallel(devices=logical_mesh)`` runs on a
  ``jax.sharding.Mesh`` of that shape with ``mesh_alpha``/``mesh_beta`` set, so the objective
  is in Alpa's units. A list of devices (or None) is Alpa's default logical mesh: ``(1, n)``,
  alpha ``(1, 1)``, beta ``(1, 0.1)``, as in Alpa.
* ``ShardParallel``, ``Zero2Parallel``, ``Zero3Parallel``: Alpa's mutable methods (``devices``
  and ``as_option`` are reassigned by the tests); Alpa defines ZeRO-2/3 as ``ShardParallel``
  with ``prefer_reduce_scatter`` / ``force_zero_stage_3``, and so does the view.
* ``count_communication_primitives``: the collectives of an HLO text, read with autoshard's
  HLO reader. On the CPU, XLA lowers a reduce-scatter as an all-reduce whose result is sliced
  per device (``dynamic-slice`` at the partition's offset); such a pair counts as the
  reduce-scatter it is, and a combined all-reduce holding such sliced results beside whole
  ones counts as one reduce-scatter and one all-reduce (what a GPU build's combiners keep).
* An executable's ``get_hlo_text()`` is autoshard's, printed with operand shapes inline as
  Alpa's XLA printed them (the tests match ``gather(f32[64,32]``): the compiled module, or for
  a step with gradient accumulation Alpa's two modules (accumulate_grad, apply_grad) cut from
  it as autoshard's ``get_hlo_text()`` cuts them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import sys
import types
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import autoshard
from autoshard.sharding import hlo as hlo_reader
from upstream_common import load_file

ALPA_DEFAULT_ALPHA = (1.0, 1.0)
ALPA_DEFAULT_BETA = (1.0, 0.1)


# Old JAX names ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class NoSharding:
    pass


@dataclasses.dataclass(frozen=True)
class Chunked:
    chunks: tuple

    def __init__(self, chunks):
        object.__setattr__(self, "chunks", tuple(chunks))


@dataclasses.dataclass(frozen=True)
class ShardedAxis:
    axis: int


@dataclasses.dataclass(frozen=True)
class Replicated:
    replicas: int


@dataclasses.dataclass(frozen=True)
class ShardingSpec:
    sharding: tuple
    mesh_mapping: tuple

    def __init__(self, sharding, mesh_mapping):
        object.__setattr__(self, "sharding", tuple(sharding))
        object.__setattr__(self, "mesh_mapping", tuple(mesh_mapping))


def sharding_spec_of(x) -> ShardingSpec:
    """The old ``ShardingSpec`` of an array placed with a NamedSharding (Alpa's reading of it).

    Mesh axes of size 1 are dropped; each split dim is ``Chunked`` over the product of its
    axes and maps a ``ShardedAxis``; the devices left over form one ``Replicated``; the
    mapping lists them from the most major mesh axis down, as Alpa orders them.
    """
    s = x.sharding
    ndim = len(x.shape)
    if not isinstance(s, NamedSharding):
        n = len(s.device_set)
        return ShardingSpec((NoSharding(),) * ndim, (Replicated(n),))
    sizes = dict(s.mesh.shape)
    order = {name: i for i, name in enumerate(s.mesh.axis_names)}
    spec = tuple(s.spec) + (None,) * (ndim - len(s.spec))
    sharding, entries, used = [], [], set()
    for entry in spec:
        axes = [a for a in ((entry,) if isinstance(entry, str) else (entry or ()))
                if sizes[a] > 1]
        if not axes:
            sharding.append(NoSharding())
            continue
        sharding.append(Chunked([math.prod(sizes[a] for a in axes)]))
        entries.append((min(order[a] for a in axes), ShardedAxis(len(entries))))
        used.update(axes)
    rest = [a for a in s.mesh.axis_names if sizes[a] > 1 and a not in used]
    if not entries:
        return ShardingSpec(sharding, (Replicated(len(s.device_set)),))
    if rest:
        entries.append((min(order[a] for a in rest),
                        Replicated(math.prod(sizes[a] for a in rest))))
    return ShardingSpec(sharding, [m for _, m in sorted(entries, key=lambda e: e[0])])


def _install_old_jax_names() -> None:
    from flax.core.frozen_dict import FrozenDict
    from jaxlib import _jax

    jax.tree_map = jax.tree_util.tree_map
    pxla = importlib.import_module("jax.interpreters.pxla")
    for cls in (NoSharding, Chunked, ShardedAxis, Replicated, ShardingSpec):
        setattr(pxla, cls.__name__, cls)
    pxla.ShardedDeviceArray = jax.Array
    _jax.ArrayImpl.sharding_spec = property(sharding_spec_of)
    maps = types.ModuleType("jax.experimental.maps")
    maps.FrozenDict = FrozenDict
    sys.modules["jax.experimental.maps"] = maps
    pjit = types.ModuleType("jax.experimental.pjit")
    pjit.PartitionSpec = PartitionSpec
    pjit.pjit = jax.jit
    sys.modules["jax.experimental.pjit"] = pjit
    xla_extension = types.ModuleType("jaxlib.xla_extension")
    xla_extension.DeviceArray = jax.Array
    sys.modules["jaxlib.xla_extension"] = xla_extension


# Options and meshes ----------------------------------------------------------------------------
@dataclasses.dataclass
class AutoShardingOption:
    """Alpa's option, mutable as in Alpa; ``to_autoshard()`` makes autoshard's."""

    enable_auto_sharding: bool = True
    allow_all_gather: bool = True
    allow_all_to_all: bool = True
    allow_replicated_parameters: bool = True
    force_data_parallel: bool = False
    force_batch_dim_to_mesh_dim: int | None = None
    force_zero_stage_3: bool = False
    force_zero_stage_3_all_gather_threshold: int = 1 << 25
    prefer_reduce_scatter: bool = False
    allow_mixed_mesh_shape: bool = False
    allow_recompute_heavy_op: bool = False
    force_simple_heuristic: str = ""
    all_reduce_threshold: int = 1 << 60

    def to_autoshard(self, **extra) -> autoshard.AutoShardingOption:
        return autoshard.AutoShardingOption(
            allow_all_gather=self.allow_all_gather, allow_all_to_all=self.allow_all_to_all,
            allow_replicated_parameters=(self.allow_replicated_parameters
                                         and not self.force_zero_stage_3),
            force_data_parallel=self.force_data_parallel,
            force_batch_dim_to_mesh_dim=self.force_batch_dim_to_mesh_dim,
            prefer_reduce_scatter=self.prefer_reduce_scatter or self.force_zero_stage_3,
            memory_tradeoff=0.0, **extra)


class LogicalDeviceMesh:
    """Alpa's logical mesh: device ids in a shape, with per-axis alpha and beta."""

    def __init__(self, devices, shape, mesh_alpha=None, mesh_beta=None):
        self.devices = list(devices)
        self.id_mesh = np.arange(len(self.devices)).reshape(shape)
        rank = len(self.id_mesh.shape)
        self.mesh_alpha = tuple(mesh_alpha) if mesh_alpha is not None else (1.0,) * rank
        self.mesh_beta = tuple(mesh_beta) if mesh_beta is not None else (1.0,) * rank

    @property
    def shape(self):
        return self.id_mesh.shape

    @property
    def num_devices(self):
        return int(np.prod(self.id_mesh.shape))

    def flatten(self):
        return LogicalDeviceMesh(self.devices, (self.num_devices, 1),
                                 [max(self.mesh_alpha)] * 2, [min(self.mesh_beta)] * 2)

    # Alpa's cost formulas, as the tests compute expected objectives with them.
    def _n(self, mesh_dim):
        return self.id_mesh.shape[mesh_dim]

    def all_gather_cost(self, num_bytes, mesh_dim):
        from autoshard.sharding.cost import alpa_collective_cost
        return alpa_collective_cost("all-gather", self._n(mesh_dim), num_bytes,
                                    self.mesh_alpha[mesh_dim], self.mesh_beta[mesh_dim])

    def all_reduce_cost(self, num_bytes, mesh_dim):
        from autoshard.sharding.cost import alpa_collective_cost
        return alpa_collective_cost("all-reduce", self._n(mesh_dim), num_bytes,
                                    self.mesh_alpha[mesh_dim], self.mesh_beta[mesh_dim])

    def reduce_scatter_cost(self, num_bytes, mesh_dim):
        from autoshard.sharding.cost import alpa_collective_cost
        return alpa_collective_cost("reduce-scatter", self._n(mesh_dim), num_bytes,
                                    self.mesh_alpha[mesh_dim], self.mesh_beta[mesh_dim])

    def all_to_all_cost(self, num_bytes, mesh_dim):
        from autoshard.sharding.cost import alpa_collective_cost
        return alpa_collective_cost("all-to-all", self._n(mesh_dim), num_bytes,
                                    self.mesh_alpha[mesh_dim], self.mesh_beta[mesh_dim])

    def jax_mesh(self) -> Mesh:
        names = ("x", "y", "z")[:len(self.shape)]
        return Mesh(np.array(self.devices, dtype=object).reshape(self.shape), names)


class LocalPhysicalDeviceMesh:
    """Alpa's single-host physical mesh: a device list and its logical views."""

    def __init__(self, devices=None):
        self.devices = list(devices) if devices is not None else jax.local_devices()
        self.num_hosts = 1
        self.num_devices_per_host = len(self.devices)
        self.num_devices = len(self.devices)

    def get_logical_mesh(self, mesh_shape=None, mesh_alpha=None, mesh_beta=None):
        shape = tuple(mesh_shape) if mesh_shape is not None else (1, self.num_devices)
        return LogicalDeviceMesh(self.devices, shape, mesh_alpha or ALPA_DEFAULT_ALPHA,
                                 mesh_beta or ALPA_DEFAULT_BETA)


# Methods ---------------------------------------------------------------------------------------
class ShardParallel(autoshard.ParallelMethod):
    """Alpa's ShardParallel (mutable); compiles through ``autoshard.ShardParallel``."""

    def __init__(self, devices=None, num_micro_batches=None, auto_sharding_option=None,
                 manual_sharding_option=None):
        self.devices = devices
        self.num_micro_batches = num_micro_batches
        self.as_option = auto_sharding_option or AutoShardingOption()
        self.ms_option = manual_sharding_option

    def to_autoshard(self) -> autoshard.ShardParallel:
        devices = self.devices
        if devices is None or isinstance(devices, list | tuple):
            devices = LocalPhysicalDeviceMesh(devices).get_logical_mesh()
        elif isinstance(devices, LocalPhysicalDeviceMesh):
            devices = devices.get_logical_mesh()
        assert isinstance(devices, LogicalDeviceMesh), devices
        mesh = devices.jax_mesh()
        ms = self.ms_option
        if ms is not None:
            mesh = Mesh(mesh.devices, tuple(ms.mesh_axis_names))
        return autoshard.ShardParallel(
            devices=mesh, num_micro_batches=self.num_micro_batches,
            auto_sharding_option=self.as_option.to_autoshard(
                mesh_alpha=devices.mesh_alpha, mesh_beta=devices.mesh_beta),
            manual_sharding_option=ms)

    def compile_executable(self, program, call):
        return self.to_autoshard().compile_executable(program, call)


class Zero2Parallel(ShardParallel):
    """Alpa's ZeRO-2: ShardParallel preferring reduce-scatter."""

    def __init__(self, devices=None, num_micro_batches=None):
        super().__init__(devices, num_micro_batches,
                         AutoShardingOption(prefer_reduce_scatter=True))


class Zero3Parallel(ShardParallel):
    """Alpa's ZeRO-3: ShardParallel with stage-3 sharding forced."""

    def __init__(self, devices=None, num_micro_batches=None):
        super().__init__(devices, num_micro_batches, AutoShardingOption(force_zero_stage_3=True))


class _Executable:
    """autoshard's Executable with the attributes Alpa's tests read."""

    def __init__(self, ex):
        self._ex = ex

    def __getattr__(self, name):
        return getattr(self._ex, name)

    def get_hlo_text(self) -> str:
        """autoshard's ``get_hlo_text`` printed as Alpa's XLA printed it: operand shapes
        inline (``gather(f32[64,32]{1,0} %x, ...)``; autoshard's omits them); a step with
        gradient accumulation as Alpa's two modules, accumulate_grad then apply_grad
        (``autoshard.sharding.hlo.accumulate_apply_modules``)."""
        from jaxlib import _hlo

        options = _hlo.HloPrintOptions()
        options.print_operand_shape = True
        modules = self._ex.compiled.runtime_executable().hlo_modules()
        text = "\n".join(m.to_string(options) for m in modules)
        parts = hlo_reader.accumulate_apply_modules(text)
        return text if parts is None else "".join(p.rstrip("\n") + "\n\n" for p in parts)

    @property
    def grad_sync_channel_ids(self) -> str:
        """Alpa's string of the channel ids of the all-reduces that synchronise accumulated
        gradients (``.3.`` for one): here, the all-reduces after the micro-batch loop."""
        ids = [cid for kind, cid, in_loop in _collective_channels(self.get_hlo_text())
               if kind == "all-reduce" and not in_loop]
        return "." + "".join(f"{i}." for i in ids)

    def __call__(self, *args):
        return self._ex(*args)


class _Parallelized:
    """Alpa's parallelized function. Alpa ignores ``batch_argnums`` entries past the last
    argument (its tests pass ``(1,)`` to one-argument functions); so does this view."""

    def __init__(self, fun, **kwargs):
        if kwargs.get("method") is None:
            kwargs["method"] = ShardParallel()
        self._fun, self._kwargs = fun, kwargs
        self._by_arity: dict = {}
        self._last = None

    def _for(self, args):
        batch = self._kwargs.get("batch_argnums")
        key = None if batch is None else tuple(i for i in batch if i < len(args))
        if key not in self._by_arity:
            kwargs = dict(self._kwargs)
            if key is not None:
                kwargs["batch_argnums"] = key
            self._by_arity[key] = autoshard.parallelize(self._fun, **kwargs)
        self._last = self._by_arity[key]
        return self._last

    def __call__(self, *args):
        return self._for(args)(*args)

    def get_executable(self, *args):
        return _Executable(self._for(args).get_executable(*args))

    def get_last_executable(self):
        return _Executable(self._last.get_last_executable())

    def preshard_dynamic_args(self, *args):
        return self._for(args).preshard_dynamic_args(*args)


def parallelize(fun=None, *, static_argnums="auto", donate_argnums="auto", batch_argnums=None,
                method=None):
    """Alpa's parallelize; its default batch_argnums (1,) is autoshard's default too (a
    one-argument function then has no batch, as in Alpa)."""
    given = {} if batch_argnums is None else {"batch_argnums": batch_argnums}

    def wrap(f):
        return _Parallelized(f, static_argnums=static_argnums, donate_argnums=donate_argnums,
                             method=method, **given)
    return wrap if fun is None else wrap(fun)


def init(cluster="local", **_):
    if cluster == "ray":
        raise RuntimeError("this alias runs on local devices only (no Ray)")
    autoshard.init("local")


def shutdown():
    autoshard.clear_executable_cache()


# Counting collectives --------------------------------------------------------------------------
_SCALAR = re.compile(r"^(f16|f32|bf16)\[\]")


def count_communication_primitives(hlo_ir: str, ignore_scalar_all_reduce: bool = False):
    """(total, all-reduce, all-gather, reduce-scatter, all-to-all) instructions of ``hlo_ir``.

    An all-reduce every use of which takes this device's slice (a ``dynamic-slice`` at the
    partition's offset, alone or fused: XLA:CPU's lowering of a reduce-scatter) counts as a
    reduce-scatter.
    """
    counts = {k: 0 for k in hlo_reader.KINDS}
    for kind, shape, name, body in _collectives(hlo_ir):
        if ignore_scalar_all_reduce and kind == "all-reduce" and _SCALAR.match(shape):
            continue
        if kind == "all-reduce":
            sliced, whole = _sliced_per_device(name, body)
            counts["reduce-scatter"] += sliced
            counts["all-reduce"] += whole
            continue
        counts[kind] += 1
    total = sum(counts.values())
    return (total, counts["all-reduce"], counts["all-gather"], counts["reduce-scatter"],
            counts["all-to-all"])


_COLL = re.compile(r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = (?P<shape>.*?) (?P<kind>all-reduce|"
                   r"all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(",
                   re.M)


def _collectives(text: str):
    for body in hlo_reader.computations(text).values():
        for m in _COLL.finditer(body):
            yield m.group("kind"), m.group("shape"), m.group("name"), body


def _uses(name: str, body: str) -> list[str]:
    return [line for line in body.splitlines()
            if re.search(rf"%{re.escape(name)}(?![\w.\-])", line)
                and not line.lstrip().startswith(
                (f"%{name} ", f"ROOT %{name} "))]


def _slices_per_device(line: str) -> bool:
    """A dynamic-slice at the partition's offset, alone or fused (a fusion that reads the
    partition id: the offset of this device's slice)."""
    return "%partition-id" in line or " dynamic-slice(" in line


def _sliced_per_device(name: str, body: str) -> tuple[int, int]:
    """(reduce-scatters, all-reduces) the all-reduce ``name`` stands for on XLA:CPU.

    (1, 0) when every use keeps only this device's slice of the result (XLA:CPU's
    reduce-scatter; an update of several optimizer states slices it once per state);
    for a combined (tuple) all-reduce, (1, 0), (0, 1) or (1, 1) after whether its non-scalar
    elements are sliced, kept whole, or both (XLA:CPU merges the all-reduces it lowered
    reduce-scatters to with plain ones; a GPU build keeps one of each kind).
    """
    uses = _uses(name, body)
    if uses and all(_slices_per_device(u) for u in uses):
        return 1, 0
    elements = [u for u in uses if " get-tuple-element(" in u]
    if not elements or len(elements) != len(uses):
        return 0, 1
    sliced = whole = 0
    for line in elements:
        m = re.match(r"\s*%([\w.\-]+) = (\S+)", line)
        if _SCALAR.match(m.group(2)):
            continue
        inner = _uses(m.group(1), body)
        if inner and all(_slices_per_device(u) for u in inner):
            sliced += 1
        else:
            whole += 1
    if not sliced:
        return 0, 1
    return 1, int(whole > 0)


def _collective_channels(text: str):
    """(kind, channel id, inside a while loop) of each collective of a compiled module."""
    comps = hlo_reader.computations(text)
    looped = set()
    for body in comps.values():
        for m in re.finditer(r"\bwhile\(.*?body=%?([\w.\-]+)", body):
            looped.add(m.group(1))
    changed = True
    while changed:  # computations called from a loop body run in the loop too
        changed = False
        for name in list(looped):
            for callee in re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)",
                                     comps.get(name, "")):
                if callee not in looped:
                    looped.add(callee)
                    changed = True
    for name, body in comps.items():
        for m in _COLL.finditer(body):
            line = body[m.start():body.find("\n", m.start())]
            cid = re.search(r"channel_id=(\d+)", line)
            yield m.group("kind"), int(cid.group(1)) if cid else 0, name in looped


def map_to_shape(tree):
    return jax.tree_util.tree_map(lambda x: getattr(x, "shape", None), tree)


# sys.modules -----------------------------------------------------------------------------------
def _module(name: str, **attrs) -> types.ModuleType:
    mod = sys.modules.get(name) or types.ModuleType(name)
    for k, v in attrs.items():
        setattr(mod, k, v)
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, mod)
    return mod


def _no_ray(*_, **__):
    raise RuntimeError("needs Ray (a multi-host Alpa cluster); this alias runs on local devices")


def install(upstream_root: str) -> types.ModuleType:
    """Make ``import alpa`` resolve to this alias; Alpa's helper files load from upstream."""
    _install_old_jax_names()
    common: dict[str, Any] = dict(
        init=init, shutdown=shutdown, parallelize=parallelize, grad=autoshard.grad,
        value_and_grad=autoshard.value_and_grad, ShardParallel=ShardParallel,
        Zero2Parallel=Zero2Parallel, Zero3Parallel=Zero3Parallel,
        DataParallel=autoshard.DataParallel, PipeshardParallel=autoshard.PipeshardParallel,
        LocalPhysicalDeviceMesh=LocalPhysicalDeviceMesh, AutoShardingOption=AutoShardingOption,
        ManualShardingOption=autoshard.ManualShardingOption,
        mark_pipeline_boundary=autoshard.mark_pipeline_boundary,
        AutoLayerOption=autoshard.AutoLayerOption, ManualLayerOption=autoshard.ManualLayerOption,
        UniformStageOption=autoshard.UniformStageOption, prefetch=jax.block_until_ready)
    alpa = _module("alpa", **common)
    alpa.__path__ = [os.path.join(upstream_root, "alpa")]
    _module("alpa.api", **common)
    _module("alpa.parallel_method", **common)
    _module("alpa.util", count_communication_primitives=count_communication_primitives,
            map_to_shape=map_to_shape)
    _module("alpa.device_mesh", LocalPhysicalDeviceMesh=LocalPhysicalDeviceMesh,
            get_global_cluster=_no_ray, get_global_physical_mesh=lambda: None,
            set_global_physical_mesh=_no_ray)
    _module("alpa.shard_parallel")
    _module("alpa.shard_parallel.auto_sharding", AutoShardingOption=AutoShardingOption,
            LogicalDeviceMesh=LogicalDeviceMesh)
    _module("alpa.pipeline_parallel")
    _module("alpa.pipeline_parallel.layer_construction",
            AutoLayerOption=autoshard.AutoLayerOption,
            ManualLayerOption=autoshard.ManualLayerOption)
    _module("alpa.pipeline_parallel.primitive_def",
            mark_pipeline_boundary=autoshard.mark_pipeline_boundary)
    _module("alpa.pipeline_parallel.stage_construction",
            UniformStageOption=autoshard.UniformStageOption, StageOption=object)
    model = _module("alpa.model")
    model.__path__ = [os.path.join(upstream_root, "alpa", "model")]
    for name in ("model_util", "bert_model", "moe"):
        load_file(f"alpa.model.{name}", os.path.join(upstream_root, "alpa", "model", f"{name}.py"))
    load_file("alpa.testing", os.path.join(upstream_root, "alpa", "testing.py"))
    load_file("alpa.test_install", os.path.join(upstream_root, "alpa", "test_install.py"))
    return alpa
